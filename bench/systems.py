"""The systems under test (gateway configurations, the seed proxy, vllm-router, an nginx relay,
a bare Flask relay) and the engines."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from importlib.metadata import version
from urllib.parse import urlsplit

import requests

from bench import venvs
from devtools import ROOT
from devtools.processes import GatewayProcess, RedisClusterProcesses, RedisProcess
from emulator.process import EmulatorProcess, free_port, wait_until

PROXY_HOST = "127.0.0.1"
PREFILL_HOST = "127.0.0.2"
DECODE_HOST = "127.0.0.3"
NGINX_CONF = """daemon off;
worker_processes 1;
pid {dir}/nginx.pid;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    # Bodies stay in memory: the workers (user nobody) can't write to our temp directory.
    client_body_buffer_size 4m;
    client_max_body_size 32m;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    upstream decode {{ server {decode}; keepalive 512; }}
    server {{
        listen {listen};
        location / {{
            proxy_pass http://decode;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 600s;
        }}
    }}
}}
"""


# Small fixed engine timings, so the figures are about the proxies: 8 ms between tokens,
# 0.02 ms per computed prompt token (a 1,000-token miss costs 20 ms), 0.05 ms per pulled block.
ENGINE_TIMING = {"itl_ms": 8, "prefill_ms_per_token": 0.02, "pull_ms_per_block": 0.05}


@dataclass(frozen=True)
class Engines:
    """One emulated P and one emulated D, shared by every system in a run."""

    prefill: EmulatorProcess
    decode: EmulatorProcess

    @classmethod
    def start(cls, **timing: object) -> Engines:
        # Each advertises its own address as remote_host: vllm-router passes kv_transfer_params
        # through as the engines write them (the gateway and the seed overwrite the field).
        # Not vLLM's defaults: bidirectional transfer on (what the gateway and the seed need),
        # and a KV cache far larger than a GPU's. One P and one D serve every system of a run,
        # and the blocks a stopped system's conversations left on D (their last turns) stay
        # pinned until D's 480 s TTL: with a real cache's size the later systems would wait for
        # memory. These runs measure the proxies' CPU; D's memory is bench.reuse's and
        # bench.d_memory's subject.
        flags = {"bidirectional_kv_xfer": True, "kv_capacity_blocks": 4_000_000, **timing}
        return cls(
            EmulatorProcess("prefill", host=PREFILL_HOST, advertise_host=PREFILL_HOST, **flags),
            EmulatorProcess("decode", host=DECODE_HOST, advertise_host=DECODE_HOST, **flags),
        )

    def __iter__(self):
        return iter((self.prefill, self.decode))

    def pids(self) -> list[int]:
        # EmulatorProcess has no public pid; the bench only reads its CPU time.
        return [engine._proc.pid for engine in self if engine._proc is not None]

    def stop(self) -> None:
        for engine in self:
            engine.stop()


@dataclass(frozen=True)
class System:
    """One configuration to measure; `ids` says whether the client sends conversation ids."""

    label: str
    kind: str  # gateway | seed | router | nginx | flask
    ids: bool = True
    # gateway flags; vllm-router: extra "argv"; flask: "worker_connections", and "prefill"
    # (true: the P/D relay, P's call before D's)
    options: dict = field(default_factory=dict)


class Running:
    """A started system: where to send turns, which process tree to charge CPU to, how to stop."""

    def __init__(
        self, url: str, process: subprocess.Popen, stop=None, helpers: tuple[int, ...] = ()
    ) -> None:
        self.url = url
        self.process = process
        self.stop = stop or (lambda: stop_process(process))
        self.helpers = helpers  # processes outside its tree that it needs (a Redis store)

    @property
    def pid(self) -> int:
        return self.process.pid


def stop_process(process: subprocess.Popen, timeout: float = 15) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


def start(system: System, engines: Engines, log_dir: str) -> Running:
    starters = {
        "gateway": _gateway,
        "seed": _seed,
        "router": _router,
        "nginx": _nginx,
        "flask": _flask,
    }
    return starters[system.kind](system, engines, log_dir)


def quiet_ports(count: int) -> int:
    return free_port(PROXY_HOST, count)


def _gateway(system: System, engines: Engines, log_dir: str) -> Running:
    options = dict(system.options)
    # A Redis (one server, or a cluster of 3 primaries and 3 replicas) of its own.
    redis = (
        {"redis": RedisProcess, "redis-cluster": RedisClusterProcesses}[options["store"]](
            PROXY_HOST
        )
        if options.get("store") in ("redis", "redis-cluster")
        else None
    )
    if redis is not None:
        options["store"] = redis.url
    port = quiet_ports(1 + options.get("workers", 1))
    gateway = GatewayProcess(
        [engines.prefill.url], [engines.decode.url], host=PROXY_HOST, port=port, **options
    )

    def stop() -> None:
        gateway.stop()
        if redis is not None:
            redis.stop()
        shutil.copy(gateway.log_path, os.path.join(log_dir, f"{slug(system.label)}.log"))

    helpers = (
        ()
        if redis is None
        else tuple(node.process.pid for node in getattr(redis, "nodes", {0: redis}).values())
    )
    return Running(gateway.url, gateway.process, stop, helpers=helpers)


def slug(label: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in label).strip("-")


def _spawn(
    argv: list[str], log_path: str, url: str, ready_path: str, env: dict | None = None
) -> subprocess.Popen:
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
        )
    try:
        wait_until(
            lambda: requests.get(url + ready_path, timeout=2).status_code < 500,
            30,
            argv[0],
            process,
            log_path,
        )
    except RuntimeError:
        stop_process(process)  # timed out: don't leave it running behind the next system
        raise
    return process


def _seed(system: System, engines: Engines, log_dir: str) -> Running:
    url = f"http://{PROXY_HOST}:{quiet_ports(1)}"
    p, d = urlsplit(engines.prefill.url), urlsplit(engines.decode.url)
    argv = [
        venvs.SEED.python(),
        venvs.seed_script(),
        "--host",
        PROXY_HOST,
        "--port",
        url.rsplit(":", 1)[1],
        "--prefiller-host",
        p.hostname,
        "--prefiller-port",
        str(p.port),
        "--decoder-host",
        d.hostname,
        "--decoder-port",
        str(d.port),
    ]
    return Running(url, _spawn(argv, os.path.join(log_dir, "seed.log"), url, "/health"))


def _router(system: System, engines: Engines, log_dir: str) -> Running:
    """vllm-router in vLLM P/D mode over NIXL (P first with max_tokens 1, then D with P's
    kv_transfer_params), its default policy unless options["argv"] says otherwise; its Prometheus
    listener moved off the fixed default port 29000."""
    port = quiet_ports(2)
    url = f"http://{PROXY_HOST}:{port}"
    argv = [
        venvs.ROUTER.bin("vllm-router"),
        "--host",
        PROXY_HOST,
        "--port",
        str(port),
        "--vllm-pd-disaggregation",
        "--kv-connector",
        "nixl",
        "--prefill",
        engines.prefill.url,
        "--decode",
        engines.decode.url,
        "--prometheus-host",
        PROXY_HOST,
        "--prometheus-port",
        str(port + 1),
        "--worker-startup-timeout-secs",
        "20",
        *system.options.get("argv", ()),
    ]
    # One process (a Python launcher, the Rust router in it on tokio threads): /proc sees it all.
    return Running(
        url, _spawn(argv, os.path.join(log_dir, f"{slug(system.label)}.log"), url, "/health")
    )


def _which_nginx() -> str | None:
    return shutil.which("nginx") or (
        "/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None
    )


def nginx_binary() -> str | None:
    """Debian's nginx, installed on first use where we may (root, apt); None where it can't be."""
    found = _which_nginx()
    if found or os.geteuid() != 0 or not shutil.which("apt-get"):
        return found
    # RUNLEVEL=1: the package must not start a system-wide nginx on port 80.
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive", "RUNLEVEL": "1"}

    def apt(*args: str) -> bool:
        return (
            subprocess.run(
                ["apt-get", *args, "-q"],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=600,
            ).returncode
            == 0
        )

    if not apt("install", "-y", "nginx"):
        apt("update") and apt("install", "-y", "nginx")
    return _which_nginx()


def _nginx(system: System, engines: Engines, log_dir: str) -> Running:
    work = tempfile.mkdtemp(prefix="bench-nginx-")
    url = f"http://{PROXY_HOST}:{quiet_ports(1)}"
    conf = os.path.join(work, "nginx.conf")
    with open(conf, "w") as f:
        f.write(
            NGINX_CONF.format(
                dir=work, decode=urlsplit(engines.decode.url).netloc, listen=urlsplit(url).netloc
            )
        )
    argv = [
        nginx_binary() or "nginx",
        "-p",
        work,
        "-c",
        conf,
        "-e",
        os.path.join(log_dir, "nginx-error.log"),
    ]
    process = _spawn(argv, os.path.join(log_dir, "nginx.log"), url, "/health")

    def stop() -> None:
        stop_process(process)
        shutil.rmtree(work, ignore_errors=True)

    return Running(url, process, stop)


# The gateway's default --worker-connections, which its benchmark workers keep.
WORKER_CONNECTIONS = 2000


def _flask(system: System, engines: Engines, log_dir: str) -> Running:
    """bench.flask_relay, the bare Flask relay to D alone (no P step, no KV parameters, like the
    nginx relay), under gunicorn with the gateway's benchmark worker settings: one gevent worker
    (gunicorn's own), the same worker connections, keep-alive and heartbeat timeout."""
    url = f"http://{PROXY_HOST}:{quiet_ports(1)}"
    connections = int(system.options.get("worker_connections", WORKER_CONNECTIONS))
    argv = [
        sys.executable,
        "-m",
        "gunicorn",
        "--bind",
        urlsplit(url).netloc,
        "--worker-class",
        "gevent",
        "--workers",
        "1",
        "--worker-connections",
        str(connections),
        "--keep-alive",
        "75",
        "--timeout",
        "60",
        "--chdir",
        ROOT,
    ]
    if _gunicorn_version() >= (25, 1):  # one control socket per user: not for several servers
        argv.append("--no-control-socket")
    env = {
        **os.environ,
        "FLASK_RELAY_UPSTREAM": engines.decode.url,
        "FLASK_RELAY_POOL": str(connections),
    }
    if system.options.get("prefill"):
        env["FLASK_RELAY_PREFILL"] = engines.prefill.url
    return Running(
        url,
        _spawn(
            [*argv, "bench.flask_relay:app"],
            os.path.join(log_dir, f"{slug(system.label)}.log"),
            url,
            "/health",
            env,
        ),
    )


def _gunicorn_version() -> tuple[int, ...]:
    return tuple(int(part) for part in version("gunicorn").split(".")[:2] if part.isdigit())
