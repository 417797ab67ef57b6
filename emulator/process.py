"""EmulatorProcess: run one emulated engine as a child process for tests and benchmarks, and drive
it.

With the two helpers every child process of the tooling needs, here because EmulatorProcess is
their lowest user: a free port (`free_port`) and a bounded wait until it answers (`wait_until`).
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import requests

from gateway.options import options

from .config import EngineConfig

# Every port free_port has handed out in this process. A picked port is free only until someone
# binds it, and its caller binds it later (a child process, after its own startup): without this
# record, two picks made before the first child is up (tests start several engines at once)
# could return the same port. A port is never handed out twice; the range is far larger than
# what a test session or a benchmark run takes.
_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()


def free_port(host: str = "127.0.0.1", run: int = 1, low: int = 20000, high: int = 32000) -> int:
    """The first of `run` consecutive free ports on `host`, below the kernel's ephemeral range.

    A port from the ephemeral range (what binding port 0 gives) can be taken a moment later as
    the local end of some outgoing connection; a gateway's private listeners, bound after fork
    at port + 1 .. port + workers, then fail with EADDRINUSE under load.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with _handed_out_lock:
        for _ in range(200):
            base = random.randrange(low, high - run)
            ports = range(base, base + run)
            if _handed_out.intersection(ports):
                continue
            try:
                for port in ports:
                    with socket.socket(family) as sock:
                        sock.bind((host, port))
            except OSError:
                continue
            _handed_out.update(ports)
            return base
    raise RuntimeError(f"no {run} consecutive free ports in {low}..{high} on {host}")


# The emulator is not installed (it stays out of the gateway's wheel): it runs from the
# checkout it is in.
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def wait_until(
    ready,
    timeout: float,
    what: str,
    process: subprocess.Popen | None = None,
    log_path: str | None = None,
):
    """Poll `ready()` until it returns something true, and return that.

    A `requests` error counts as not ready yet. Raises RuntimeError, with the tail of
    `log_path`, when `process` exits first or `timeout` seconds pass.
    """
    deadline = time.monotonic() + timeout
    failure = f"{what} did not become ready in {timeout} s"
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            failure = f"{what} exited with {process.returncode}"
            break
        try:
            value = ready()
        except requests.RequestException:
            value = None
        if value:
            return value
        time.sleep(0.05)
    tail = ""
    if log_path and os.path.exists(log_path):
        with open(log_path, "rb") as log:
            tail = log.read()[-4000:].decode(errors="replace")
    raise RuntimeError(f"{failure}:\n{tail}")


def _argv(flags: dict) -> list[str]:
    """Keyword flags as the CLI takes them: a store_true flag bare, other booleans on/off."""
    declared = {o.name: o for o in options(EngineConfig)}
    argv: list[str] = []
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        if value is None:
            continue
        if name in declared and declared[name].action == "store_true":
            argv += [flag] if value else []
        elif isinstance(value, bool):
            argv += [flag, "on" if value else "off"]
        else:
            argv += [flag, str(value)]
    return argv


class EmulatorProcess:
    """One engine: ``EmulatorProcess("decode", host="127.0.0.3", itl_ms=1)``; started on creation.

    Extra keyword flags become CLI flags (``itl_ms=1`` -> ``--itl-ms 1``, ``access_log=True`` ->
    ``--access-log``). Output goes to ``log_path``, never to a pipe that could fill up.
    """

    def __init__(
        self,
        role: str,
        host: str = "127.0.0.1",
        port: int | None = None,
        kv_port: int | None = None,
        *,
        startup_timeout: float = 20.0,
        log_path: str | None = None,
        **flags: object,
    ) -> None:
        self.role = role
        self.host = host
        if port is None or kv_port is None:
            base = free_port(host, 2)
            port, kv_port = port or base, kv_port or base + 1
        self.port, self.kv_port = port, kv_port
        url_host = f"[{host}]" if ":" in host else host
        self.url = f"http://{url_host}:{port}"
        self.startup_timeout = startup_timeout
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix=f"emulator-{role}-{port}-", suffix=".log")
            os.close(fd)
        self.log_path = log_path
        self.argv = [
            sys.executable,
            "-m",
            "emulator.cli",
            "--role",
            role,
            "--host",
            host,
            "--port",
            str(port),
            "--kv-port",
            str(kv_port),
        ]
        self.argv += _argv(flags)
        self._starts_down = str(flags.get("fault") or "").split(",")[0] == "down"
        self._http = requests.Session()
        self._proc: subprocess.Popen | None = None
        self.start()

    def __enter__(self) -> EmulatorProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"EmulatorProcess({self.role!r}, url={self.url!r}, kv_port={self.kv_port})"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Spawn the engine (again, on the same ports, after stop) and wait until it answers."""
        if self.running:
            return
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={
                    **os.environ,
                    "PYTHONUNBUFFERED": "1",
                    "PYTHONPATH": _CHECKOUT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                },
            )
        # An engine started with --fault down answers /health with 503; /faults shows it is up.
        probe = "/faults" if self._starts_down else "/health"
        try:
            wait_until(
                lambda: self._http.get(self.url + probe, timeout=0.5).status_code == 200,
                self.startup_timeout,
                repr(self),
                self._proc,
                self.log_path,
            )
        except RuntimeError:
            self.kill()
            raise

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self._http.request(method, self.url + path, timeout=10, **kwargs)
        response.raise_for_status()
        return response.json()

    def stats(self) -> dict:
        return self._call("GET", "/stats")

    def reset_stats(self) -> dict:
        return self._call("POST", "/stats/reset")

    def holds(self, request_id: str) -> bool:
        """Does this engine still keep blocks for the internal request id (remote_request_id)?"""
        return self._call("GET", f"/stats/leases/{request_id}")["held"]

    def recent_requests(self) -> list[dict]:
        return self._call("GET", "/stats/requests")

    def set_fault(self, mode: str, **opts: object) -> dict:
        """Switch the fault at run time, e.g. ``set_fault("die_after", tokens=3)``; "none" clears
        it."""
        return self._call("POST", "/faults", json={"mode": mode, **opts})

    def fault(self) -> dict:
        return self._call("GET", "/faults")

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL if it has not exited within `timeout` seconds."""
        if self._proc is None or self._proc.poll() is not None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(5)
