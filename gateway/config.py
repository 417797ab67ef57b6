"""The one `Settings` object: defaults < GATEWAY_* environment < command-line flags."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field, fields
from typing import Any, Callable
from urllib.parse import urlsplit

ENV_PREFIX = "GATEWAY_"


class SettingsError(ValueError):
    """A setting has a value we cannot use; the message names the flag and variable."""


def _url_list(value: Any) -> list[str]:
    items = value.replace(",", " ").split() if isinstance(value, str) else list(value)
    urls = []
    for item in items:
        url = item if "://" in item else f"http://{item}"
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
            raise ValueError(f"{item!r} is not an http://host:port URL")
        urls.append(url.rstrip("/"))
    return urls


def _positive(kind: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def convert(value: Any) -> Any:
        number = kind(value)
        if number <= 0:
            raise ValueError(f"{value!r} is not positive")
        return number
    return convert


def _choice(*allowed: str) -> Callable[[Any], str]:
    def convert(value: Any) -> str:
        if value not in allowed:
            raise ValueError(f"{value!r} is not one of {', '.join(allowed)}")
        return value
    return convert


def _store_url(value: Any) -> str:
    if value == "local" or str(value).startswith(("redis://", "rediss://", "unix://")):
        return str(value)
    raise ValueError(f"{value!r} is neither 'local' nor a redis://, rediss:// or unix:// URL")


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{value!r} is not on/off")


def _port(value: Any) -> int:
    number = int(value)
    if not 0 < number < 65536:
        raise ValueError(f"{value!r} is not a TCP port")
    return number


@dataclass(frozen=True)
class Setting:
    """One setting: its name, flag, default, converter (which validates) and help text."""

    name: str
    default: Any
    convert: Callable[[Any], Any]
    help: str
    flags: tuple[str, ...] = ()
    nargs: str | None = None

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def flag(self) -> str:
        return self.flags[0] if self.flags else "--" + self.name.replace("_", "-")


# Every setting, documented once. README's settings table is generated from this list.
SETTINGS: tuple[Setting, ...] = (
    Setting("host", "0.0.0.0", str, "Address the gateway listens on."),
    Setting("port", 8000, _port, "Port the gateway listens on."),
    Setting("prefill", ["http://127.0.0.1:8100"], _url_list,
            "Prefill (P) instance URLs, space or comma separated.", nargs="+"),
    Setting("decode", ["http://127.0.0.1:8200"], _url_list,
            "Decode (D) instance URLs, space or comma separated.", nargs="+"),
    Setting("workers", 1, _positive(int), "Number of gunicorn worker processes."),
    Setting("worker_class", "gevent", _choice("gevent", "gthread"),
            "gunicorn worker class; never sync, which kills long streams."),
    Setting("threads", 128, _positive(int),
            "Threads per worker with gthread: the number of concurrent streams a worker serves."),
    Setting("worker_connections", 2000, _positive(int),
            "Concurrent connections per worker with gevent."),
    Setting("store", "local", _store_url,
            "Where conversation entries live: 'local' (each worker's memory; affinity "
            "forwards a conversation to its worker) or a Redis URL (redis://host:6379/0, "
            "Redis 6.2+ or Valkey) shared by every worker and gateway host, forwarding off."),
    Setting("store_timeout", 0.5, _positive(float),
            "Seconds one call to a Redis store may take; a failed call makes the turn a miss."),
    Setting("store_ttl", 450.0, _positive(float),
            "Seconds a conversation entry is kept; keep it below D's KV block TTL (480 s)."),
    Setting("store_size", 100_000, _positive(int),
            "Conversation entries kept per worker before the least recently used are evicted "
            "(local store; bound a Redis store with its maxmemory)."),
    Setting("affinity", True, _bool,
            "Forward each conversation to the worker that holds its cache (on/off); "
            "off by itself with one worker."),
    Setting("private_host", "127.0.0.1", str,
            "Address of the per-worker private listeners used for forwarding."),
    Setting("private_base_port", 0, lambda v: 0 if int(v) == 0 else _port(v),
            "Worker slot N listens privately on this port + N; 0 means the gateway port + 1."),
    Setting("owner_wait", 3.0, lambda v: max(0.0, float(v)),
            "Seconds a request waits for its owner worker to come back (a restart) before "
            "this worker serves it itself, as a miss."),
    Setting("verify_reuse", "auto", _choice("auto", "always", "off"),
            "How the gateway proves that a turn's prompt tokens extend the tokens D kept "
            "(docs/exactness.md): auto checks each chat template once and token-verifies only "
            "turns a digest cannot prove (reasoning, tool calls, templates that rewrite); always "
            "token-verifies every reuse; off trusts digests and never reuses reasoning or "
            "tool-call turns."),
    Setting("routing", "affinity", _choice("affinity", "round_robin"),
            "How P and D are chosen: per conversation (rendezvous hash, D that holds the "
            "entry first, load fallback) or round robin."),
    Setting("overload_factor", 2.0, _positive(float),
            "An instance is overloaded when its in-flight count exceeds this factor times "
            "(the least loaded's + 1); affinity then yields to load."),
    Setting("attempts", 2, _positive(int),
            "Instances tried per stage for one request (failures before the first byte)."),
    Setting("breaker_failures", 3, _positive(int),
            "Consecutive failures that open an instance's breaker."),
    Setting("breaker_cooldown", 10.0, _positive(float),
            "Seconds an open breaker skips its instance before trying it again."),
    Setting("probe_interval", 2.0, _positive(float),
            "Seconds between /health probes of instances marked down."),
    Setting("connect_timeout", 5.0, _positive(float), "Seconds to connect to an engine."),
    Setting("read_timeout", 600.0, _positive(float),
            "Longest silence, in seconds, between bytes from an engine (prefill included)."),
    Setting("total_timeout", 900.0, lambda v: max(0.0, float(v)),
            "Deadline, in seconds, for a whole request, stream included; 0 for none."),
    Setting("max_body_bytes", 32 * 1024 * 1024, _positive(int),
            "Largest request body accepted; larger ones get 413."),
    Setting("upstream_api_key", os.environ.get("OPENAI_API_KEY") or "", str,
            "Bearer key sent to the engines (default $OPENAI_API_KEY); "
            "empty forwards the client's Authorization header."),
    Setting("graceful_timeout", 120.0, _positive(float),
            "Seconds in-flight streams may run after SIGTERM."),
    Setting("keepalive", 75, _positive(int),
            "Seconds an idle client connection is kept open; above a fronting proxy's idle "
            "timeout. After SIGTERM, idle connections are closed within 2 s."),
    Setting("admin_token", "", str,
            "Bearer token for GET /admin/status, the detailed report (engine URLs, in-flight "
            "counts, breakers, store, worker); empty turns the report off. /health shows "
            "status only."),
    Setting("log_level", "info", _choice("debug", "info", "warning", "error"), "Log level."),
)
_BY_NAME = {s.name: s for s in SETTINGS}


def _default(name: str) -> Any:
    value = _BY_NAME[name].default
    return field(default_factory=lambda: list(value)) if isinstance(value, list) else value


def _convert(setting: Setting, value: Any, source: str) -> Any:
    try:
        return setting.convert(value)
    except (TypeError, ValueError) as exc:
        raise SettingsError(f"{source}: {exc}") from exc


@dataclass
class Settings:
    """Validated gateway settings; build with `from_env`, `from_args` or keyword overrides."""

    host: str = _default("host")
    port: int = _default("port")
    prefill: list[str] = _default("prefill")
    decode: list[str] = _default("decode")
    workers: int = _default("workers")
    worker_class: str = _default("worker_class")
    threads: int = _default("threads")
    worker_connections: int = _default("worker_connections")
    store: str = _default("store")
    store_timeout: float = _default("store_timeout")
    store_ttl: float = _default("store_ttl")
    store_size: int = _default("store_size")
    affinity: bool = _default("affinity")
    private_host: str = _default("private_host")
    private_base_port: int = _default("private_base_port")
    owner_wait: float = _default("owner_wait")
    verify_reuse: str = _default("verify_reuse")
    routing: str = _default("routing")
    overload_factor: float = _default("overload_factor")
    attempts: int = _default("attempts")
    breaker_failures: int = _default("breaker_failures")
    breaker_cooldown: float = _default("breaker_cooldown")
    probe_interval: float = _default("probe_interval")
    connect_timeout: float = _default("connect_timeout")
    read_timeout: float = _default("read_timeout")
    total_timeout: float = _default("total_timeout")
    max_body_bytes: int = _default("max_body_bytes")
    upstream_api_key: str = _default("upstream_api_key")
    graceful_timeout: float = _default("graceful_timeout")
    keepalive: int = _default("keepalive")
    admin_token: str = _default("admin_token")
    log_level: str = _default("log_level")

    def __post_init__(self) -> None:
        for f in fields(self):
            setting = _BY_NAME[f.name]
            value = getattr(self, f.name)
            object.__setattr__(self, f.name, _convert(setting, value, setting.flag))

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: Any) -> Settings:
        """Defaults, then GATEWAY_* variables, then explicit overrides."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for s in SETTINGS:
            if s.env in environ:
                values[s.name] = _convert(s, environ[s.env], s.env)
        values.update(overrides)
        return cls(**values)

    @classmethod
    def from_args(cls, argv: list[str] | None = None,
                  environ: dict[str, str] | None = None) -> Settings:
        """Parse the `pd-gateway` command line over the environment."""
        parser = build_parser()
        args = parser.parse_args(argv)
        overrides = {s.name: getattr(args, s.name) for s in SETTINGS
                     if getattr(args, s.name) is not None}
        try:
            seed = _seed_instances(args)
        except SettingsError as exc:
            parser.error(str(exc))
        for role, urls in seed.items():
            overrides.setdefault(role, urls)
        try:
            return cls.from_env(environ, **overrides)
        except SettingsError as exc:
            parser.error(str(exc))
        raise AssertionError("unreachable")

    @property
    def forwards(self) -> bool:
        """Do workers forward conversations to their owner? Only several workers with stores
        of their own need to."""
        return self.affinity and self.workers > 1 and self.store == "local"

    def to_env(self) -> dict[str, str]:
        """The GATEWAY_* variables that reproduce these settings in another process."""
        out = {}
        for s in SETTINGS:
            value = getattr(self, s.name)
            out[s.env] = " ".join(value) if isinstance(value, list) else str(value)
        return out


def _seed_instances(args: argparse.Namespace) -> dict[str, list[str]]:
    """Translate the seed proxy's --prefiller-host/--prefiller-port style flags into URLs."""
    out = {}
    for role, hosts, ports in (("prefill", args.prefiller_hosts, args.prefiller_ports),
                               ("decode", args.decoder_hosts, args.decoder_ports)):
        if hosts is None and ports is None:
            continue
        hosts = hosts or ["localhost"]
        ports = ports or [8100 if role == "prefill" else 8200]
        if len(hosts) == 1 and len(ports) > 1:
            hosts = hosts * len(ports)
        if len(hosts) != len(ports):
            raise SettingsError(f"--{'prefiller' if role == 'prefill' else 'decoder'}-hosts and "
                                f"-ports must have the same number of values")
        out[role] = [f"http://{h}:{p}" for h, p in zip(hosts, ports)]
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pd-gateway",
        description="Gateway for vLLM disaggregated prefill/decode with multi-turn KV reuse. "
                    f"Every flag also reads from a {ENV_PREFIX}* environment variable.")
    for s in SETTINGS:
        parser.add_argument(s.flag, *s.flags[1:], dest=s.name, default=None, nargs=s.nargs,
                            help=f"{s.help} [env {s.env}, default {_show(s.default)}]")
    seed = parser.add_argument_group("seed-proxy compatible flags")
    seed.add_argument("--prefiller-host", "--prefiller-hosts", dest="prefiller_hosts", nargs="+")
    seed.add_argument("--prefiller-port", "--prefiller-ports", dest="prefiller_ports", nargs="+",
                      type=int)
    seed.add_argument("--decoder-host", "--decoder-hosts", dest="decoder_hosts", nargs="+")
    seed.add_argument("--decoder-port", "--decoder-ports", dest="decoder_ports", nargs="+",
                      type=int)
    return parser


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return " ".join(value)
    return repr(value) if value == "" else str(value)


def settings_markdown() -> str:
    """The settings table README.md carries (a test keeps the two equal)."""
    rows = ["| flag | environment | default | meaning |", "|---|---|---|---|"]
    for s in SETTINGS:
        default = "$OPENAI_API_KEY or empty" if s.name == "upstream_api_key" else _show(s.default)
        rows.append(f"| `{s.flag}` | `{s.env}` | `{default}` | {s.help} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(settings_markdown())
