"""EmulatorProcess: run one emulated engine as a child process for tests and benchmarks, and drive it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

import requests


def free_ports(host: str, count: int) -> list[int]:
    """Ports the kernel considers free on `host`; held together so two calls cannot return the same one."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
            sock.bind((host, 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


class EmulatorProcess:
    """One engine: ``EmulatorProcess("decode", host="127.0.0.3", itl_ms=1)``; started on creation.

    Extra keyword flags become CLI flags (``itl_ms=1`` -> ``--itl-ms 1``, ``access_log=True`` ->
    ``--access-log``). Output goes to ``log_path``, never to a pipe that could fill up.
    """

    def __init__(self, role: str, host: str = "127.0.0.1", port: int | None = None,
                 kv_port: int | None = None, *, startup_timeout: float = 20.0,
                 log_path: str | None = None, **flags: object) -> None:
        self.role = role
        self.host = host
        if port is None or kv_port is None:
            picked = free_ports(host, 2)
            port, kv_port = port or picked[0], kv_port or picked[1]
        self.port, self.kv_port = port, kv_port
        url_host = f"[{host}]" if ":" in host else host
        self.url = f"http://{url_host}:{port}"
        self.startup_timeout = startup_timeout
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix=f"emulator-{role}-{port}-", suffix=".log")
            os.close(fd)
        self.log_path = log_path
        self.argv = [sys.executable, "-m", "gateway.emulator.cli", "--role", role, "--host", host,
                     "--port", str(port), "--kv-port", str(kv_port)]
        for name, value in flags.items():
            option = "--" + name.replace("_", "-")
            if value is True:
                self.argv.append(option)
            elif value is not None and value is not False:
                self.argv += [option, str(value)]
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
            self._proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT,
                                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
        # An engine started with --fault down answers /health with 503; /faults shows it is up.
        probe, ok = ("/faults", 200) if self._starts_down else ("/health", 200)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"{self!r} exited with {self._proc.returncode}:\n{self.log_tail()}")
            try:
                if self._http.get(self.url + probe, timeout=0.5).status_code == ok:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"{self!r} not healthy after {self.startup_timeout} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        with open(self.log_path, "rb") as log:
            return log.read()[-chars:].decode(errors="replace")

    def _call(self, method: str, path: str, **kwargs: object) -> dict:
        response = self._http.request(method, self.url + path, timeout=10, **kwargs)
        response.raise_for_status()
        return response.json()

    def stats(self) -> dict:
        return self._call("GET", "/stats")

    def reset_stats(self) -> dict:
        return self._call("POST", "/stats/reset")

    def recent_requests(self) -> list[dict]:
        return self._call("GET", "/stats/requests")  # type: ignore[return-value]

    def set_fault(self, mode: str, **opts: object) -> dict:
        """Switch the fault at run time, e.g. ``set_fault("die_after", tokens=3)``; "none" clears it."""
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
