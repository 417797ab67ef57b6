"""The one `Settings` object: defaults < GATEWAY_* environment < command-line flags."""

from __future__ import annotations

import argparse
import ipaddress
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar
from urllib.parse import urlsplit

from gateway import __version__, redis_url
from gateway.options import (
    ArgumentParser,
    SettingsError,
    add_arguments,
    auto_or,
    boolean,
    bounded,
    check,
    given,
    option,
    options,
    positive,
    read_env,
)

# a plain `port` would be shadowed by the field of that name
from gateway.options import port as _port

ENV_PREFIX = "GATEWAY_"
CONFIG_PREFIX = "PD_GATEWAY_"  # keys of a host Flask app's app.config (gateway.extension)


def _url_list(value: Any) -> list[str]:
    # Space or comma separated, in a variable or in each value of a flag (`--prefill a:1,b:2`).
    given = [value] if isinstance(value, str) else list(value)
    items = [item for each in given for item in str(each).replace(",", " ").split()]
    urls = []
    for item in items:
        url = item if "://" in item else f"http://{item}"
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
            raise ValueError(f"{item!r} is not an http://host:port URL")
        urls.append(url.rstrip("/"))
    return urls


def _key_list(value: Any) -> list[str]:
    items = [value] if isinstance(value, str) else [str(k) for k in value]
    keys = [k for item in items for k in item.replace(",", " ").split()]
    if any(not k.isprintable() for k in keys):
        raise ValueError("a key has characters an Authorization header cannot carry")
    return keys


def split_host_port(item: str) -> tuple[str, int | None]:
    """An allowlist entry's host part and its port, if it names one: "10.0.0.0/8",
    "10.0.0.0/8:8100", "*.internal:8100", "[fd00::/8]:8100" (an IPv6 network with a port in
    brackets; without one, as it is)."""
    if item.startswith("["):
        host, _, rest = item[1:].partition("]")
        if rest and not rest.startswith(":"):
            raise ValueError(f"{item!r}: after ] comes :port or nothing")
        return host, (_port(rest[1:]) if rest else None)
    if item.count(":") == 1:
        host, _, number = item.partition(":")
        return host, _port(number)
    return item, None


def _host_list(value: Any) -> list[str]:
    """Networks (10.0.0.0/8, 127.0.0.1) and host names (vllm-3.internal, *.internal), each with a
    port or not (10.0.0.0/8:8100: only that port)."""
    items = value.replace(",", " ").split() if isinstance(value, str) else list(value)
    hosts = []
    for item in items:
        host, number = split_host_port(str(item))
        suffix = "" if number is None else f":{number}"
        try:
            network = ipaddress.ip_network(host, strict=False)
        except ValueError:
            name = host.lower().removeprefix("*.")
            if not name or not all(
                part.isascii() and part.replace("-", "").isalnum() for part in name.split(".")
            ):
                raise ValueError(f"{item!r} is neither a network nor a host name") from None
            hosts.append(host.lower() + suffix)
            continue
        hosts.append((f"[{network}]" if suffix and network.version == 6 else str(network)) + suffix)
    return hosts


def _port_or_off(value: Any) -> int:
    return 0 if int(value) == 0 else _port(value)


def _keys_file(value: Any) -> str:
    path = str(value)
    if path and not os.access(path, os.R_OK):
        raise ValueError(f"{path!r} is not a readable file")
    return path


@dataclass(frozen=True)
class ModelSpec:
    """One model's engines: clients name it `name` (vLLM's --served-model-name), one of
    `aliases` (sent to the engines as `name`) or one of `adapters` (LoRA adapters the engines
    serve, sent as they are). The single pool of --prefill/--decode has the name "" and serves
    whatever model a request names."""

    name: str
    prefill: list[str]
    decode: list[str]
    aliases: list[str] = field(default_factory=list)
    adapters: list[str] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        return [self.name, *self.aliases, *self.adapters]


_SPEC_KEYS = ("prefill", "decode", "aliases", "adapters")


def _model_spec(spec: Mapping[str, Any], where: str) -> ModelSpec:
    unknown = sorted(set(spec) - {"name", *_SPEC_KEYS})
    if unknown:
        raise ValueError(
            f"{where}: unknown key(s) {', '.join(unknown)} (name, {', '.join(_SPEC_KEYS)})"
        )
    name = spec.get("name")
    if not isinstance(name, str) or not name.strip() or name != name.strip():
        raise ValueError(f"{where}: a model needs a name (a string without surrounding spaces)")
    lists = {}
    for key in _SPEC_KEYS:
        value = spec.get(key, [])
        if isinstance(value, str):
            value = value.replace(",", " ").split()
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise ValueError(f"{where}: {key} must be a list of strings")
        lists[key] = _url_list(value) if key in ("prefill", "decode") else list(value)
        if key in ("prefill", "decode") and not lists[key]:
            raise ValueError(f"{where}: model {name!r} needs at least one {key} URL")
    return ModelSpec(name, **lists)


def _model_list(value: Any) -> list[str]:
    """Models as flags: 'NAME;prefill=URL,URL;decode=URL[;aliases=A,B][;adapters=L]', one
    argument each (space separated in GATEWAY_MODELS)."""
    items = value.split() if isinstance(value, str) else [str(v) for v in value]
    for item in items:
        parse_model_flag(item)
    return items


def parse_model_flag(item: str) -> ModelSpec:
    name, *pairs = item.split(";")
    spec: dict[str, Any] = {"name": name}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq:
            raise ValueError(f"{item!r}: {pair!r} is not key=value")
        spec[key.strip()] = value
    return _model_spec(spec, f"model {name!r}")


def read_models_file(path: str) -> list[ModelSpec]:
    """A TOML file of [[model]] tables (docs/operating.md, "Several models")."""
    with open(path, "rb") as f:
        try:
            data = tomllib.load(f)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{path}: {exc}") from exc
    models = data.get("model", [])
    unknown = sorted(set(data) - {"model"})
    if unknown or not isinstance(models, list) or not all(isinstance(m, dict) for m in models):
        raise ValueError(
            f"{path}: expected [[model]] tables only"
            + (f" (found {', '.join(unknown)})" if unknown else "")
        )
    return [_model_spec(m, f"{path}, model {i + 1}") for i, m in enumerate(models)]


def _store_url(value: Any) -> str:
    if value != "local":
        try:
            redis_url.parse(str(value))
        except ValueError:
            raise ValueError(
                f"{value!r} is neither 'local' nor a Redis URL "
                f"({', '.join(s + ':' for s in redis_url.SCHEMES)})"
            ) from None
    return str(value)


def split_nameserver(value: str) -> tuple[str, int]:
    """A DNS server as "address" or "address:port" ("[v6]:port"): (address, port)."""
    value = value.strip()
    if value.startswith("["):
        address, _, port = value[1:].partition("]")
        port = port.removeprefix(":")
    elif value.count(":") == 1:
        address, _, port = value.partition(":")
    else:
        address, port = value, ""
    ipaddress.ip_address(address)  # a DNS server is given by its address
    number = _port(port) if port else 53
    return address, number


def _nameserver(value: Any) -> str:
    if value:
        split_nameserver(str(value))
    return str(value)


# Every setting, documented once: each field is a flag (--name-with-dashes), a GATEWAY_*
# variable and a row of README's settings table, which is generated from this class.
@dataclass
class Settings:
    """Validated gateway settings; build with `from_env`, `from_args` or keyword overrides."""

    env_prefix: ClassVar[str] = ENV_PREFIX

    host: str = option("0.0.0.0", str, "Address the gateway listens on.")
    port: int = option(8000, _port, "Port the gateway listens on.")
    metrics_port: int = option(
        0,
        _port_or_off,
        "A listener of its own for GET /metrics and "
        "/health (as vllm-router's --prometheus-port): open, no client "
        "key or admin token, for Prometheus and probes; everything else "
        "there is 404. One per gunicorn master (any worker answers, "
        "/metrics summed over workers, /health as on --port). 0: none; "
        "/metrics is on --port, behind the admin token when client keys "
        "are on.",
    )
    metrics_host: str = option(
        "", str, "Address the --metrics-port listener binds; empty: --host's.", show="--host"
    )
    prefill: list[str] = option(
        ["http://127.0.0.1:8100"],
        _url_list,
        "Prefill (P) instance URLs, space or comma separated; the flag given again adds more.",
        nargs="+",
    )
    decode: list[str] = option(
        ["http://127.0.0.1:8200"],
        _url_list,
        "Decode (D) instance URLs, space or comma separated; the flag given again adds more.",
        nargs="+",
    )
    models: list[str] = option(
        [],
        _model_list,
        "Several models, each with its own engines: "
        "'NAME;prefill=URL,URL;decode=URL[;aliases=A,B][;adapters=L]', "
        "one argument per model (GATEWAY_MODELS: space separated). A "
        "request names its model; an unknown one gets 404. Replaces "
        '--prefill and --decode (docs/operating.md, "Several models").',
        nargs="+",
        show="empty: one pool, --prefill and --decode",
    )
    models_file: str = option(
        "",
        _keys_file,
        "A TOML file of [[model]] tables (name, "
        "prefill, decode, aliases, adapters), read at start; with "
        "--models, both are served.",
    )
    workers: int = option(1, positive(int), "Number of gunicorn worker processes.")
    worker_class: str = option(
        "gevent",
        str,
        "gunicorn worker class; never sync, which kills long streams.",
        choices=("gevent", "gthread"),
    )
    threads: int = option(
        128,
        positive(int),
        "Threads per worker with gthread: the number of concurrent streams a worker serves.",
    )
    worker_connections: int = option(
        2000, positive(int), "Concurrent connections per worker with gevent."
    )
    store: str = option(
        "local",
        _store_url,
        "Where conversation entries live: 'local' (each "
        "worker's memory; affinity forwards a conversation to its worker) or a "
        "Redis URL shared by every worker and gateway host, forwarding off "
        "(Redis 6.2+ or Valkey): redis://host:6379/0 (one primary), "
        "redis+cluster://host:port,host:port (a cluster, any nodes as seeds), "
        "redis+sentinel://host:26379,host:26379/primary-name[/db] (Sentinel); "
        "rediss+... for TLS, user:password@ for an ACL user (docs/operating.md).",
    )
    store_timeout: float = option(
        0.5,
        positive(float),
        "Seconds one call to a Redis store may take; a failed call makes the turn a miss.",
    )
    store_ttl: float = option(
        450.0,
        positive(float),
        "Seconds a conversation entry is kept; keep it below D's KV block TTL (480 s).",
    )
    store_size: int = option(
        100_000,
        positive(int),
        "Conversation entries kept per worker "
        "before the least recently used are evicted (with client keys, the "
        "key with the most entries first; local store; bound a Redis store "
        "with its maxmemory).",
    )
    responses_ttl: float = option(
        3600.0,
        positive(float),
        "Seconds a stored response "
        "(/v1/responses with store) is kept for previous_response_id "
        "and GET, in --store; its KV blocks go at --store-ttl.",
    )
    responses_bytes: int = option(
        256 << 20,
        positive(int),
        "Bytes of stored responses kept "
        "per worker before the least recently used go (local store; "
        "bound a Redis store with its maxmemory).",
    )
    pinned_blocks: int | None = option(
        None,
        auto_or(bounded(int, 0)),
        "Blocks each D may keep "
        "pinned for conversations waiting for their next turn: "
        "auto, from what each D reports (vllm:cache_config_info's "
        "capacity: at most 0.9 of it; and its KV cache usage: "
        "past 0.9, the pins are cut by the excess; "
        "docs/d-memory.md); or a number for every D (each worker "
        "of a local store keeps its share; a Redis store one "
        "budget for every host). Beyond it the least recently "
        "active are released (with client keys, the key holding "
        "the most first: keys share it equally); 0: no budget.",
        show="auto",
    )
    release_rate: float = option(
        50.0,
        bounded(float, 0.0),
        "Releases per second per worker: an "
        "entry dropped unread (refused, used by a decode-only turn, "
        "evicted, replaced, expired, over budget) has a P tell its D to "
        "free the blocks; 0: they stay pinned until D's TTL.",
    )
    affinity: bool = option(
        True,
        boolean,
        "Forward each conversation to the worker that holds "
        "its cache (on/off); off by itself with one worker.",
    )
    private_host: str = option(
        "127.0.0.1", str, "Address of the per-worker private listeners used for forwarding."
    )
    private_base_port: int = option(
        0,
        _port_or_off,
        "Worker slot N listens privately on this port + N; 0 means the gateway port + 1.",
    )
    owner_wait: float = option(
        3.0,
        bounded(float, 0.0),
        "Seconds a request waits for "
        "its owner worker to come back (a restart) before this worker "
        "serves it itself, as a miss.",
    )
    verify_reuse: str = option(
        "auto",
        str,
        "How the gateway proves that a turn's prompt tokens "
        "extend the tokens D kept (docs/exactness.md): auto checks each "
        "chat template once and token-verifies only turns a digest cannot "
        "prove (reasoning, tool calls, templates that rewrite); always "
        "token-verifies every reuse; off trusts digests and never reuses "
        "reasoning or tool-call turns.",
        choices=("auto", "always", "off"),
    )
    partial_reuse_tokens: int = option(
        64,
        bounded(int, 0),
        "Partial reuse: where a turn's "
        "prompt tokens share only a prefix of what D holds "
        "(templates that drop reasoning or rewrite earlier text; "
        "token-verified turns), P reads that prefix, cut to whole "
        "blocks, when it is at least this many tokens (vLLM's "
        "kv_recompute_threshold, 64); 0 turns it off "
        "(docs/exactness.md).",
    )
    kv_block_size: int | None = option(
        None,
        auto_or(bounded(int, 1, 65535)),
        "The engines' KV "
        "block size, which partial reuse cuts D's block lists at: "
        "auto, what every engine of the model reports "
        "(vllm:cache_config_info; engines that disagree get no "
        "partial reuse, with a warning; vLLM's 16 where "
        "--engine-metrics-interval is 0); a number overrides it.",
        show="auto",
    )
    fast_path_tokens: int = option(
        0,
        bounded(int, 0),
        "Decode-only fast path: a follow-up turn "
        "whose D holds its history (a stored entry; D up and not "
        "overloaded) and that adds fewer new prompt tokens than this "
        "goes to that D alone, no P call (docs/fast-path.md); 0 turns "
        "it off.",
    )
    access_log: bool = option(
        False,
        boolean,
        "Log one line per turn (logger gateway.access): "
        "request id, model, cache (hit, partial, miss: were D's blocks "
        "sent), kv (what P did with them, as X-Gateway-KV), path "
        "(two-stage or decode-only) and why, P and D instance names, "
        "P's time (until P answered), TTFT, reply chunks, finish, outcome.",
    )
    routing: str = option(
        "affinity",
        str,
        "How P and D are chosen: per conversation, the "
        "cheapest by an explicit cost (the work and pulls a turn brings each, "
        "and its queue; rendezvous order of the conversation breaks ties, "
        "docs/routing.md), or round robin.",
        choices=("affinity", "round_robin"),
    )
    overload_factor: float = option(
        2.0,
        positive(float),
        "An instance is overloaded when its "
        "in-flight count exceeds this factor times (the least "
        "loaded's + 1); affinity then yields to load.",
    )
    route_pull_cost: float = option(
        0.1,
        bounded(float, 0.0),
        "Affinity: what pulling one "
        "token's KV from another engine costs against computing "
        "it, in the cost P and D are chosen by (docs/routing.md): "
        "a P that does not hold a conversation's history is chosen "
        "once the one that does has more queued than another P by "
        "this times what D holds of it.",
    )
    route_request_tokens: int = option(
        512,
        bounded(int, 0),
        "Affinity: the prefill tokens a "
        "request an engine reports waiting or running stands "
        "for in P's queue (vllm:num_requests_waiting_by_reason"
        '{reason="capacity"}, or vllm:num_requests_waiting where an engine '
        "has no reasons, and vllm:num_requests_running; docs/routing.md).",
    )
    prefill_on_decode: bool = option(
        False,
        boolean,
        "Affinity: a D may prefill a "
        "turn without an entry (on/off) where that costs less than every P, the "
        "turn's work charged once more for each stream the D runs; "
        "another D decodes it, pulling from that D. Needs 2 Ds that "
        "serve prefill requests (docs/routing.md).",
    )
    route_move_streams: float = option(
        4.0,
        bounded(float, 0.0),
        "Affinity: streams a D "
        "holding a conversation may run beyond another D's "
        "before a turn decodes on the other (which then pulls "
        "the whole prompt from P; docs/routing.md).",
    )
    engine_metrics_interval: float = option(
        1.0,
        bounded(float, 0.0),
        "Seconds between reads "
        "of each engine's /metrics (vLLM's "
        "num_requests_waiting and kv_cache_usage_perc), once "
        "per host for all its workers; the choice of P and D "
        "passes over engines busy by their own report. 0: "
        "in-flight counts alone (docs/operating.md).",
    )
    engine_queue_limit: int = option(
        0,
        bounded(int, 0),
        "An engine with more requests waiting "
        "than this (vllm:num_requests_waiting_by_reason capacity, "
        "or vllm:num_requests_waiting) is busy: new conversations "
        "go elsewhere, and a conversation's decode leaves the D "
        "that holds it (P still reads that D's blocks) rather than "
        "queue there.",
    )
    engine_kv_full: float = option(
        0.95,
        bounded(float, 0.0, 1.0),
        "KV cache usage (vllm:kv_cache_usage_perc) from which an engine is busy too.",
    )
    attempts: int = option(
        2,
        positive(int),
        "Instances tried per stage for one request (failures before the first byte).",
    )
    breaker_failures: int = option(
        3, positive(int), "Consecutive failures that open an instance's breaker."
    )
    breaker_cooldown: float = option(
        10.0, positive(float), "Seconds an open breaker skips its instance before trying it again."
    )
    probe_interval: float = option(
        2.0,
        bounded(float, 0.0),
        "Seconds between probes of every "
        "engine (GET /health; /v1/models once it answers), the first "
        "at start: the gateway's /health is 503 until a P and a D of "
        "some model answer, a turn no D answers for fails with 503 "
        "before P is called, and an engine that stops answering is "
        "skipped until it answers again. 0: no probes (engines taken "
        "as ready until a request to one fails).",
    )
    resolve_interval: float = option(
        10.0,
        lambda v: max(0.0, float(v)),
        "Seconds between "
        "lookups of instance URLs whose host is a DNS name (http; "
        "IP addresses and localhost are used as given): each address "
        "is an instance (a Kubernetes headless Service has one per "
        "pod), new ones are added, vanished ones removed (their "
        "streams finish); a failed lookup keeps the last set. 0: "
        "names are used as given, never expanded.",
    )
    resolve_nameserver: str = option(
        "",
        _nameserver,
        "DNS server (address or address:port) "
        "asked for those names; empty: the system resolver "
        "(/etc/hosts, resolv.conf and its search domains).",
    )
    connect_timeout: float = option(5.0, positive(float), "Seconds to connect to an engine.")
    read_timeout: float = option(
        600.0,
        positive(float),
        "Longest silence, in seconds, between bytes from an engine (prefill included).",
    )
    total_timeout: float = option(
        900.0,
        bounded(float, 0.0),
        "Deadline, in seconds, for a whole request, stream included; 0 for none.",
    )
    client_timeout: float = option(
        60.0,
        positive(float),
        "Seconds a client may stall while "
        "it is served: send nothing more of its request (headers, "
        "body: 408) or take nothing of its reply (the turn ends, its "
        "place and D's stream released). Idle keep-alive "
        "connections wait --keepalive.",
    )
    request_timeout: float = option(
        60.0,
        positive(float),
        "Seconds a request's head and "
        "body may take to arrive in all, from its first byte: a "
        "client that trickles them (each read within "
        "--client-timeout) is cut there (408 for a body, the "
        "connection closed for a head). With gthread, a "
        "request's head (and a body of up to 1 MiB) is read by the "
        "worker's own loop before a pool thread takes it (not TLS "
        "or HTTP/2 connections).",
    )
    max_body_bytes: int = option(
        32 * 1024 * 1024, positive(int), "Largest request body accepted; larger ones get 413."
    )
    max_bodies_bytes: int = option(
        64 * 1024 * 1024,
        positive(int),
        "Bytes of request bodies "
        "one worker holds at once, each counted as it arrives and "
        "held until its turn ends (memory: ~15 times that); beyond, "
        "429 with Retry-After before the body is parsed. One body "
        "always fits.",
    )
    # Read once, at import. Help and README show where it comes from, never the key itself.
    upstream_api_key: str = option(
        os.environ.get("OPENAI_API_KEY") or "",
        str,
        "Bearer key sent to the engines (default $OPENAI_API_KEY); "
        "empty forwards the client's Authorization header (none "
        "when client API keys are on).",
        show="$OPENAI_API_KEY or empty",
    )
    graceful_timeout: float = option(
        120.0, positive(float), "Seconds in-flight streams may run after SIGTERM."
    )
    keepalive: int = option(
        75,
        positive(int),
        "Seconds an idle client connection is kept open; "
        "above a fronting proxy's idle timeout. After SIGTERM, idle "
        "connections are closed within 2 s.",
    )
    max_turns: int = option(
        0,
        bounded(int, 0),
        "Admission control: turns one worker runs at "
        "once (a stream holds its place until its last byte; with gthread, "
        "turns it relays to the worker that owns their conversation count "
        "too, as they hold a thread, and with gevent they have as many "
        "places of their own); more wait "
        "briefly, then get 429 with Retry-After before any engine is called. "
        "0: three quarters of the threads with gthread (the rest answer "
        "refusals and probes; never more than threads - 1), a quarter of the "
        "worker connections with gevent.",
    )
    admission_queue: int = option(
        32,
        bounded(int, 0),
        "Turns that may wait for a place when a "
        "worker is at --max-turns; beyond them a turn is refused at "
        "once.",
    )
    admission_wait: float = option(
        0.01,
        bounded(float, 0.0),
        "Seconds a waiting turn may wait "
        "for a place before it is refused (keep it short: a refusal "
        "should come fast, the client retries).",
    )
    admission_fair_wait: float = option(
        30.0,
        bounded(float, 0.0),
        "Seconds a turn of a "
        "client key under its share of --max-turns may wait "
        "for the next freed place (ahead of keys over theirs) "
        "before it is refused: a key back after a pause finds "
        "every place held by another's long turns, and a short "
        "wait and its client's retries may all end before one "
        "frees. One turn of a key at a time, within "
        "--admission-queue (with gthread at most half the "
        "threads --max-turns leaves free).",
    )
    retry_after: int = option(
        1, positive(int), "Seconds a refused turn's Retry-After header asks the client to wait."
    )
    api_keys: list[str] = option(
        [],
        _key_list,
        "Client API keys (space or comma separated): a "
        "completion or /v1/models request needs Authorization: Bearer "
        "<one of them>, else 401. Empty (and no --api-keys-file): no "
        "client authentication. Each key is its own tenant.",
        nargs="+",
        show="empty",
    )
    api_keys_file: str = option(
        "",
        _keys_file,
        "A file of client API keys, one a line (# starts "
        "a comment); re-read within a second when it changes, caches "
        "kept.",
    )
    key_rpm: int = option(
        0,
        bounded(int, 0),
        "Requests per minute per client API key, unless "
        "its line in --api-keys-file sets its own (KEY rpm=N tpm=N turns=N "
        "weight=W); beyond, 429 with OpenAI's x-ratelimit-* and retry-after "
        "headers. Counted in the store's Redis when it is one (every host "
        "shares one budget), else in each worker's memory (each worker "
        "enforces the whole limit). 0: no limit.",
    )
    key_tpm: int = option(
        0,
        bounded(int, 0),
        "Tokens per minute per client API key (the prompt "
        "estimated before a turn, corrected by what the engines report after "
        "it), as --key-rpm. 0: no limit.",
    )
    key_turns: int = option(
        0,
        bounded(int, 0),
        "Turns at once per client API key in one worker, "
        "unless its line sets its own; beyond, 429. 0: no limit (fair "
        "admission still shares --max-turns between keys by weight).",
    )
    tenant_cache_salt: str = option(
        "auto",
        str,
        "Keep tenants apart in the engines' prefix "
        "caches too: each request gets a cache_salt derived from its "
        "credential (and the client's own cache_salt, if any), so "
        "one tenant's cached prompt never speeds up (or reveals "
        "itself to) another's. auto: on with client API keys. The "
        "cost: tenants no longer share cached prompts such as a "
        "common system prompt.",
        choices=("auto", "on", "off"),
    )
    admin_instance_hosts: list[str] = option(
        [],
        _host_list,
        "Where engines added through "
        "/admin/instances may be: networks (10.0.0.0/8) "
        "and host names (*.internal: any name under it), "
        "each on any port or on one (10.0.0.0/8:8100). "
        "Empty: only the hosts --prefill and --decode name. "
        "Others get 403: the admin token cannot point the "
        "gateway at any address it reaches. An added URL "
        "is scheme://host:port, nothing more (no "
        "user:password, path or query: 400).",
        nargs="+",
        show="hosts of --prefill, --decode",
    )
    admin_token: str = option(
        "",
        str,
        "Bearer token for GET /admin/status, the detailed report "
        "(engine URLs, in-flight counts, breakers, store, worker); empty "
        "turns the report off. /health shows status only. The same token "
        "guards /admin/instances (adding and removing engines).",
    )
    log_format: str = option(
        "text",
        str,
        "Log lines as text or as one JSON object each; "
        "either way every line of a request carries its request id.",
        choices=("text", "json"),
    )
    log_level: str = option(
        "info", str, "Log level.", choices=("debug", "info", "warning", "error")
    )

    def __post_init__(self) -> None:
        check(self)
        # Read once: every part of the gateway sees the same models, whatever the file
        # becomes later (names unique, no engine in two models).
        object.__setattr__(self, "_specs", self._read_specs())
        if self.metrics_port and self.metrics_port == self.port:
            raise SettingsError(
                f"--metrics-port {self.metrics_port} is --port: the metrics "
                "listener needs a port of its own (or 0 for none)"
            )
        if (
            self.worker_class == "gthread"
            and self.workers > 1
            and self.forwards
            and self.threads < 2
        ):
            # A relay holds the worker's only thread while its owner's request waits for one.
            raise SettingsError(
                "--threads must be 2 or more with gthread, several workers and "
                "affinity (a relayed turn holds a thread while its owner's "
                "request needs one)"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Defaults, then GATEWAY_* variables, then explicit overrides."""
        env = os.environ if environ is None else environ
        return cls(**{**read_env(cls, env), **overrides})

    @classmethod
    def from_args(
        cls, argv: list[str] | None = None, environ: dict[str, str] | None = None
    ) -> Settings:
        """Parse the `pd-gateway` command line over the environment."""
        parser = build_parser()
        args = parser.parse_args(argv)
        overrides = given(args, cls)
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

    def model_specs(self) -> list[ModelSpec]:
        """The models and their engines: --models-file's, then --models', or the one pool of
        --prefill and --decode (named "": any model); as read when the settings were made."""
        # why the ignore: `_specs` is set by __post_init__ (object.__setattr__ on a frozen
        # dataclass), not declared as a field: mypy does not see it.
        return list(self._specs)  # type: ignore[attr-defined]

    def _read_specs(self) -> list[ModelSpec]:
        try:
            from_file = read_models_file(self.models_file) if self.models_file else []
        except (OSError, ValueError) as exc:
            raise SettingsError(f"--models-file: {exc}") from exc
        specs = [*from_file, *(parse_model_flag(item) for item in self.models)]
        if not specs:
            return [ModelSpec("", self.prefill, self.decode)]
        names: dict[str, str] = {}
        engines: dict[str, str] = {}
        for spec in specs:
            for name in spec.names:
                if name in names:
                    raise SettingsError(
                        f"the model name {name!r} is given twice "
                        f"({names[name]!r} and {spec.name!r})"
                    )
                names[name] = spec.name
            for url in {*spec.prefill, *spec.decode}:
                if engines.setdefault(url, spec.name) != spec.name:
                    raise SettingsError(
                        f"{url} serves two models ({engines[url]!r} and "
                        f"{spec.name!r}): an engine serves one model"
                    )
        return specs

    def engine_urls(self) -> list[str]:
        """Every engine URL the settings name, whichever model."""
        return [url for spec in self.model_specs() for url in (*spec.prefill, *spec.decode)]

    def turn_limit(self, worker_threads: int = 0) -> int:
        """Turns in flight per worker (--max-turns, or what the worker can serve at once).
        `worker_threads`: the threads of the threaded worker gunicorn really runs (a host's
        config may choose it, whatever these settings say); 0 for gevent, or unknown."""
        threads = worker_threads or (self.threads if self.worker_class == "gthread" else 0)
        if not threads:
            return self.max_turns or max(1, self.worker_connections // 4)
        # Beyond its threads gunicorn queues requests itself, unseen; a quarter of them stays
        # free to answer refusals, /health and forwarded requests at once, and one at least
        # whatever --max-turns says: a relayed turn holds a thread while the turn it waits for
        # may need one (a 429 if no place, never a deadlock).
        return max(1, min(self.max_turns or threads * 3 // 4, threads - 1))

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        """Where the metrics listener binds (--metrics-host, else --host), or None: none."""
        return (self.metrics_host or self.host, self.metrics_port) if self.metrics_port else None

    @property
    def forwards(self) -> bool:
        """May workers forward conversations to their owner? Only workers with stores of their
        own need to, and only when gunicorn runs several (gunicorn_conf gives each a private
        listener then)."""
        return self.affinity and self.store == "local"

    def to_env(self) -> dict[str, str]:
        """The GATEWAY_* variables that reproduce these settings in another process."""
        out: dict[str, str] = {}
        for s in SETTINGS:
            assert s.env is not None  # every setting has its variable (env_prefix)
            value = getattr(self, s.name)
            out[s.env] = (
                " ".join(value)
                if isinstance(value, list)
                else "auto"
                if value is None
                else str(value)
            )
        return out

    @classmethod
    def from_mapping(
        cls, config: Mapping[str, Any], environ: dict[str, str] | None = None, **overrides: Any
    ) -> Settings:
        """Defaults, then GATEWAY_* variables, then a Flask app's PD_GATEWAY_* config keys (the
        extension's way in), then explicit overrides."""
        return cls.from_env(environ, **{**read_env(cls, config, CONFIG_PREFIX), **overrides})


SETTINGS = options(Settings)  # each with .name, .flag, .env, .default, .convert, .help, .shown


def _seed_instances(args: argparse.Namespace) -> dict[str, list[str]]:
    """Translate the seed proxy's --prefiller-host/--prefiller-port style flags into URLs."""
    out = {}
    for role, hosts, ports in (
        ("prefill", args.prefiller_hosts, args.prefiller_ports),
        ("decode", args.decoder_hosts, args.decoder_ports),
    ):
        if hosts is None and ports is None:
            continue
        hosts = hosts or ["localhost"]
        ports = ports or [8100 if role == "prefill" else 8200]
        if len(hosts) == 1 and len(ports) > 1:
            hosts = hosts * len(ports)
        if len(hosts) != len(ports):
            raise SettingsError(
                f"--{'prefiller' if role == 'prefill' else 'decoder'}-hosts and "
                f"-ports must have the same number of values"
            )
        out[role] = [f"http://{h}:{p}" for h, p in zip(hosts, ports, strict=True)]
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="pd-gateway",
        description="Gateway for vLLM disaggregated prefill/decode with multi-turn KV reuse. "
        f"Every flag also reads from a {ENV_PREFIX}* environment variable.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    add_arguments(parser, Settings)
    seed = parser.add_argument_group("seed-proxy compatible flags")
    # Each given again adds more, as the gateway's own list flags (gateway.options.add_arguments).
    seed.add_argument(
        "--prefiller-host", "--prefiller-hosts", dest="prefiller_hosts", nargs="+", action="extend"
    )
    seed.add_argument(
        "--prefiller-port",
        "--prefiller-ports",
        dest="prefiller_ports",
        nargs="+",
        action="extend",
        type=int,
    )
    seed.add_argument(
        "--decoder-host", "--decoder-hosts", dest="decoder_hosts", nargs="+", action="extend"
    )
    seed.add_argument(
        "--decoder-port",
        "--decoder-ports",
        dest="decoder_ports",
        nargs="+",
        action="extend",
        type=int,
    )
    return parser


def settings_markdown() -> str:
    """The settings table README.md carries (a test keeps the two equal)."""
    rows = ["| flag | environment | default | meaning |", "|---|---|---|---|"]
    for s in SETTINGS:
        rows.append(f"| `{s.flag}` | `{s.env}` | `{s.shown}` | {s.help} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(settings_markdown())
