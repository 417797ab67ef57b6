"""Prometheus metrics; under gunicorn in multiprocess mode so /metrics sums every worker.

gunicorn_conf sets PROMETHEUS_MULTIPROC_DIR before anything imports prometheus_client, and
marks dead workers' files; outside gunicorn the metrics live in the default registry.

Every metric declares the values each of its labels can take (`values`): a tuple where the code
emits a fixed set, a sentence where the set is open (an engine's name). README's metric table is
made from the declarations (`metrics_markdown`, pinned by tests/test_readme.py), the alert
rules' tests are checked against them, and a value the code emits that its metric does not
declare is logged (raised under $PD_GATEWAY_STRICT_METRICS, as the suite runs).
"""

from __future__ import annotations

import bisect
import logging
import os
from typing import Self

import prometheus_client
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    generate_latest,
    multiprocess,
)
from prometheus_client.metrics import MetricWrapperBase

log = logging.getLogger(__name__)
STRICT_ENV = "PD_GATEWAY_STRICT_METRICS"
_STRICT = os.environ.get(STRICT_ENV) == "1"
DECLARED: list = []  # every metric below, in the order README lists them


class _Children(MetricWrapperBase):
    """`labels(...)` found once per label values, then from a plain dict: prometheus_client's
    own checks the values and takes a lock on every call, some ten calls a turn
    (docs/BENCHMARKS.md, "The cuts since"). No child is ever removed here, so none goes stale.
    A new child's values are checked against the metric's declared ones (once per child: off
    the hot path)."""

    values: dict[str, tuple[str, ...] | str] = {}

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames=(),
        *,
        values: dict[str, tuple[str, ...] | str] | None = None,
        **kwargs,
    ) -> None:
        super().__init__(name, documentation, labelnames, **kwargs)
        if not kwargs.get("_labelvalues"):  # the metric itself, not one of its children
            self.values = values or {}
            missing = set(labelnames) ^ set(self.values)
            assert not missing, f"{name}: declare the values of {sorted(missing)}"
            if kwargs.get("registry", REGISTRY) is REGISTRY:
                DECLARED.append(self)

    def labels(self, *values: object, **by_name: object) -> Self:
        if by_name:  # prometheus_client's own path (and checks), the values checked too
            child = super().labels(*values, **by_name)
            self._undeclared(tuple(str(by_name[name]) for name in self._labelnames))
            return child
        children = self.__dict__.setdefault("_pd_children", {})
        child = children.get(values)
        if child is None:
            self._undeclared(values)
            child = children[values] = super().labels(*values)
        return child

    def _undeclared(self, values: tuple[object, ...]) -> None:
        for name, value in zip(self._labelnames, values, strict=False):
            allowed = self.values.get(name)
            if isinstance(allowed, tuple) and value not in allowed:
                message = f"{self._name}: {name}={value!r} is not declared"
                if _STRICT:
                    raise ValueError(message)
                log.warning("%s (README's metric table does not list it)", message)


class Counter(_Children, prometheus_client.Counter):
    pass


class Gauge(_Children, prometheus_client.Gauge):
    pass


class Histogram(_Children, prometheus_client.Histogram):
    def observe_many(self, counts: list[int], total: float) -> None:
        """Add `counts` (observations per bucket, as `bucket_counts` makes them) and their
        `total` at once. A stream's inter-token gaps, one observe each, would cost a locked
        write to the mmap per value, twice, for every token in multiprocess mode; one write per
        bucket a turn costs a few. prometheus_client has no batch observe: this writes its
        histogram's own values as `observe` does (pinned by tests/test_metrics.py)."""
        for bucket, count in zip(self._buckets, counts, strict=True):
            if count:
                bucket.inc(count)
        self._sum.inc(total)


def bucket_counts(bounds: tuple[float, ...]) -> list[int]:
    return [0] * (len(bounds) + 1)  # the last: +Inf


def count_into(counts: list[int], bounds: tuple[float, ...], value: float) -> None:
    counts[bisect.bisect_left(bounds, value)] += 1  # le: a value on a bound is in its bucket


MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# vLLM 0.33's own buckets for these histograms (vllm/v1/metrics/buckets.py L30-51, L84-104),
# so the gateway's and the engines' histograms read side by side.
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)

# Label values shared by several metrics.
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses")
MODEL = "the model (below the table)"
CACHE = ("hit", "partial", "miss")
# The turn's KV outcome (X-Gateway-KV, with - for _): what P did with what D held.
KV = ("read", "recomputed", "own_cache", "none", "unreported")
ROLE = ("prefill", "decode")
ENGINE = "an engine's name: `prefill[0]`, `decode[1]` (with --models, `<model>/decode[1]`)"
DECODE_URL = "a D's URL (without any user:password)"
STATUS = (
    "the HTTP status: `200`; the gateway's own `400`, `401`, `404`, `408`, `413`, `429`, "
    "`499` (the client left), `500`, `502`, `503`, `504`; or a 4xx an engine answered"
)
ERROR_STATUS = (
    "the status: a 4xx (the request's fault, or an engine's refusal relayed) or "
    "`500`, `502`, `503`, `504`"
)
TURN_REASONS = (
    "short",
    "no_entry",
    "fast_path_off",
    "long",
    "partial",
    "unproven",
    "tokenize_failed",
    "decode_down",
    "decode_overloaded",
    "decode_busy",
    "decode_gone",
    "decode_failed",
)
DROP_REASONS = (
    "unproven",
    "mismatch",
    "decode_only",
    "decode_failed",
    "decode_gone",
    "prefill_failed",
    "unstored",
    "replaced",
    "evicted",
    "expired",
    "budget",
)
# vLLM's other client routes, passed to an engine (gateway.flow.passthrough.ROUTES, the same).
PASSED_ROUTES = (
    "/tokenize",
    "/detokenize",
    "/tokenizer_info",
    "/v1/messages/count_tokens",
    "/version",
    "/v1/embeddings",
    "/v2/embed",
    "/pooling",
    "/classify",
    "/score",
    "/v1/score",
    "/rerank",
    "/v1/rerank",
    "/v2/rerank",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
)
ADMISSION_RESULTS = (
    "admitted",
    "queued",
    "rejected_queue_full",
    "rejected_waited",
    "rejected_key_turns",
    "rejected_bodies",
    "rejected_client_gone",
)


# What the client got.
RESPONSES = Counter(
    "pd_gateway_responses",
    "Completion requests answered, by the status sent (forwarded to "
    "their owner worker: counted once, where the client's connection is). A stream that fails "
    "after its first byte is a 200 here and an error event in pd_gateway_errors_total{stage="
    '"stream"}: the error ratio counts both',
    ["endpoint", "model", "status"],
    values=dict(endpoint=ENDPOINTS, model=MODEL, status=STATUS),
)
REQUESTS = Counter(
    "pd_gateway_requests",
    "Completion requests served (a turn that reached D), by whether "
    "the blocks D kept were used for them: hit (P was sent the whole of what D kept, or a "
    "decode-only turn went to that D), partial (P was sent a block-aligned prefix of it), miss "
    "(none). A hit says what the gateway sent, not what P did with it: "
    "pd_gateway_kv_reads_total and X-Gateway-KV say that",
    ["endpoint", "model", "cache"],
    values=dict(endpoint=ENDPOINTS, model=MODEL, cache=CACHE),
)
ERRORS = Counter(
    "pd_gateway_errors",
    "Requests that ended in an error: stage request (an error reply, its "
    "status; a client gone before its reply is not counted) or stream (an error event after "
    "the first byte, the status it stands for)",
    ["stage", "status", "model"],
    values=dict(stage=("request", "stream"), status=ERROR_STATUS, model=MODEL),
)
TURN_PATHS = Counter(
    "pd_gateway_turn_paths",
    "Turns by path and why (X-Gateway-Path): decode-only with short "
    "(D holds the history and the new part is short: no P call); two-stage with no_entry (no "
    "entry, or one whose history the request does not extend), fast_path_off (an entry, "
    "--fast-path-tokens 0), long (too many new tokens for the fast path), partial (P reads a "
    "shared prefix), unproven (the entry's reuse not "
    "proven), tokenize_failed (D's /tokenize failed), decode_down, decode_overloaded, "
    "decode_busy (the entry's D down, over its share, or reporting a queue or a full KV "
    "cache), decode_gone (the entry's D left the pool), decode_failed (the decode-only turn's "
    "D failed before a byte)",
    ["path", "reason", "model"],
    values=dict(path=("decode-only", "two-stage"), reason=TURN_REASONS, model=MODEL),
)
FIRST_BYTE_SECONDS = Histogram(
    "pd_gateway_time_to_first_byte_seconds",
    "From a turn's start to the first byte of its stream",
    ["model"],
    values=dict(model=MODEL),
    buckets=_LATENCY,
)
E2E_SECONDS = Histogram(
    "pd_gateway_e2e_request_latency_seconds",
    "From a turn's start to its reply's end (a "
    "stream's [DONE], or its JSON body), for turns that completed (vLLM's "
    "vllm:e2e_request_latency_seconds, its buckets, through the "
    "gateway)",
    ["model"],
    values=dict(model=MODEL),
    buckets=E2E_BUCKETS,
)
INTER_TOKEN_SECONDS = Histogram(
    "pd_gateway_inter_token_latency_seconds",
    "Between consecutive chunks of a stream sent to "
    "the client (one chunk: the events of one read from D, mostly one token; vLLM's "
    "vllm:inter_token_latency_seconds, its buckets, as the client sees it), every stream's, "
    "completed or not",
    ["model"],
    values=dict(model=MODEL),
    buckets=ITL_BUCKETS,
)
PREFILL_SECONDS = Histogram(
    "pd_gateway_prefill_seconds",
    "From a turn's start to P's answer (the entry's proof included)",
    ["model"],
    values=dict(model=MODEL),
    buckets=_LATENCY,
)
PASSED = Counter(
    "pd_gateway_passed",
    "Requests of vLLM's other routes, passed to an engine as they came "
    "(docs/routes.md), by the status sent: the engine's own (a 4xx or 501 relayed as it "
    "came), or the gateway's (a refusal before any engine, or 502, 503, 504 when the engines "
    "failed). Not in the completions' responses, errors or error ratio",
    ["route", "model", "status"],
    values=dict(
        route=PASSED_ROUTES,
        model=MODEL,
        status="the HTTP status: the engine's, or the gateway's own as for completions",
    ),
)
DISCONNECTS = Counter("pd_gateway_client_disconnects", "Clients gone before the end")

# What P did with what D kept.
KV_READS = Counter(
    "pd_gateway_kv_reads",
    "Turns whose P was sent D's params, by what P reports (kv_transfer_"
    "params.remote_prefill_cached_tokens, or usage.prompt_tokens_details.cached_tokens) "
    "against min(remote_num_tokens, prompt): read (equal: P had every token D held for it, "
    "read from D or, when that count is a whole number of blocks, possibly its own cache), "
    "recomputed (fewer: vLLM's kv_recompute_threshold, 64 tokens, makes P recompute a short "
    "part), own_cache (more: its own cache held them all), unreported (P said nothing). The "
    "turn's X-Gateway-KV says the same word",
    ["result", "model"],
    values=dict(result=("read", "recomputed", "own_cache", "unreported"), model=MODEL),
)
PREFILL_TOKENS = Counter(
    "pd_gateway_prefill_tokens",
    "P's prompt tokens as P reports them: prompt (usage.prompt_"
    "tokens) and cached (what P did not compute: its own prefix cache plus what it read from D;"
    " only where P reports it)",
    ["kind"],
    values=dict(kind=("prompt", "cached")),
)
CACHED_TOKENS = Counter(
    "pd_gateway_prefill_cached_tokens",
    "Prompt tokens P did not compute, by the turn's KV "
    "outcome (X-Gateway-KV): read (read from D, with what its own cache held), own_cache (its "
    "own prefix cache held more than D's), recomputed (P recomputed D's part: its own cache's "
    "share only), none (no D params sent: its own prefix cache)",
    ["kv", "model"],
    values=dict(kv=("read", "own_cache", "recomputed", "none"), model=MODEL),
)
PARTIAL_TOKENS = Counter(
    "pd_gateway_partial_reuse_tokens",
    "Partial reuse (reuse_checks result partial): offered, "
    "the tokens of D's sequence P was sent to read (the shared prefix, whole blocks); cached, "
    "of those, what P reported not computing (read from D, or its own cache)",
    ["kind"],
    values=dict(kind=("offered", "cached")),
)

# The conversation store and the proof of reuse.
ENTRIES = Counter(
    "pd_gateway_entries",
    "Conversation store events: stored; found (an entry whose history the "
    "request extends; reuse_checks says if it was sent); mismatch (an entry whose history the "
    "request does not extend); absent (no entry for the id or any history prefix); rejected "
    "(malformed D params); gone (an entry whose D has left the pool: a miss)",
    ["event"],
    values=dict(event=("stored", "found", "mismatch", "absent", "rejected", "gone")),
)
REUSE_CHECKS = Counter(
    "pd_gateway_reuse_checks",
    "Found entries, by the proof of reuse: digest (plain turn, the "
    "template keeps the prefix) and verified (tokens match) are sent whole; partial (the "
    "prompt shares a block-aligned prefix of D's tokens: P is sent that prefix); mismatch "
    "(tokens differ), unverifiable (no token ids from D, or a request /tokenize cannot "
    "render), unproven (reasoning, tool calls; verify_reuse off) and error (/tokenize failed) "
    "are misses (docs/exactness.md)",
    ["result"],
    values=dict(
        result=("digest", "verified", "partial", "mismatch", "unverifiable", "unproven", "error")
    ),
)
TEMPLATE_PROBES = Counter(
    "pd_gateway_template_probes",
    "Chat template checks (3 /tokenize calls each, once per "
    "template, tenant and worker, again after an hour): safe (keeps the prefix property), "
    "unsafe, error",
    ["result"],
    values=dict(result=("safe", "unsafe", "error")),
)
RELEASES = Counter(
    "pd_gateway_releases",
    "Entries dropped unread whose D blocks the gateway asked a P to free, "
    "by why they were dropped and the result (released; failed: D frees them at its TTL; "
    "skipped: too many waiting) (docs/d-memory.md)",
    ["reason", "result"],
    values=dict(reason=DROP_REASONS, result=("released", "failed", "skipped")),
)
STORE_ERRORS = Counter(
    "pd_gateway_store_errors",
    "Calls to a Redis store that failed (take: a miss; put: no "
    "entry; ledger: a count of a D's pinned blocks missed a change: a Redis Cluster's, on "
    "another node, or a failed trim to the budget; limits: a key's request was admitted uncounted; "
    "responses: a stored response's get, put or delete)",
    ["operation"],
    values=dict(operation=("take", "put", "ledger", "limits", "responses")),
)
PINNED_BLOCKS = Gauge(
    "pd_gateway_pinned_blocks",
    "Blocks each D keeps for the conversations this gateway's local "
    "stores hold (their entries' remote_block_ids), summed over live workers",
    ["decode"],
    values=dict(decode=DECODE_URL),
    multiprocess_mode="livesum",
)
SHARED_PINNED_BLOCKS = Gauge(
    "pd_gateway_shared_pinned_blocks",
    "Blocks each D keeps for the conversations of a shared "
    "(Redis) store, every host's, as the last put on that D counted them",
    ["decode"],
    values=dict(decode=DECODE_URL),
    multiprocess_mode="mostrecent",
)
PINNED_BUDGET = Gauge(
    "pd_gateway_pinned_blocks_budget",
    "Blocks each D may keep pinned for conversations between "
    "turns (--pinned-blocks, or derived from D's reported capacity and usage; 0: no budget), "
    "summed over live workers",
    ["decode"],
    values=dict(decode=DECODE_URL),
    multiprocess_mode="livesum",
)

# Admission and the keys' limits.
ADMISSIONS = Counter(
    "pd_gateway_admissions",
    "Turns (and requests of vLLM's other routes: pd_gateway_passed_"
    "total) by admission (--max-turns): admitted at once, queued "
    "(waited for a place, then admitted), rejected_queue_full and rejected_waited (429 with "
    "Retry-After, no engine called), rejected_key_turns (a key at its turns at once), "
    "rejected_bodies (429 before the body was read: --max-bodies-bytes), rejected_client_gone "
    "(its client left while it waited for its share)",
    ["result"],
    values=dict(result=ADMISSION_RESULTS),
)
RATE_LIMITED = Counter(
    "pd_gateway_rate_limited",
    "Requests refused (429) for a client key's requests or tokens "
    "per minute (--key-rpm, --key-tpm, the keys file)",
    ["limit"],
    values=dict(limit=("requests", "tokens")),
)
FORWARDED = Counter(
    "pd_gateway_forwarded",
    "Requests forwarded to the worker that owns their conversation: "
    "sent; away (served here, the owner restarting); failed (the forward failed otherwise, "
    "e.g. the client gone or the deadline passed: not run again here)",
    ["result"],
    values=dict(result=("sent", "away", "failed")),
)
RETRIES = Counter(
    "pd_gateway_retries", "Requests retried on another instance", ["role"], values=dict(role=ROLE)
)

# The engines.
ENGINE_UP = Gauge(
    "pd_gateway_engine_up",
    "1 while an engine may be chosen, 0 until it has answered a probe, "
    "while it is marked down or its breaker is open (the lowest of the live workers' views)",
    ["role", "engine"],
    values=dict(role=ROLE, engine=ENGINE),
    multiprocess_mode="livemin",
)
ENGINE_INFLIGHT = Gauge(
    "pd_gateway_engine_inflight",
    "Requests in flight on each engine, summed over live workers",
    ["role", "engine"],
    values=dict(role=ROLE, engine=ENGINE),
    multiprocess_mode="livesum",
)
ENGINE_KV_BLOCKS = Gauge(
    "pd_gateway_engine_kv_blocks",
    "Each engine's KV cache in blocks, as it reports it "
    "(vllm:cache_config_info num_gpu_blocks; absent until it said)",
    ["role", "engine"],
    values=dict(role=ROLE, engine=ENGINE),
    multiprocess_mode="livemax",
)
ENGINE_BLOCK_SIZE = Gauge(
    "pd_gateway_engine_block_size",
    "Each engine's KV block size in tokens, as it reports it (vllm:cache_config_info block_size)",
    ["role", "engine"],
    values=dict(role=ROLE, engine=ENGINE),
    multiprocess_mode="livemax",
)
DECODE_KEPT_NOTHING = Counter(
    "pd_gateway_decode_kept_nothing",
    "Turns a D loaded from P and finished without "
    "kv_transfer_params: it keeps no blocks for the next turn (bidirectional KV transfer off; "
    "streamed: or a vLLM whose streams carry no params), so nothing was stored",
    ["engine"],
    values=dict(engine=ENGINE),
)
PREFILLS_ON_DECODE = Counter(
    "pd_gateway_prefills_on_decode",
    "Turns a D prefilled, as a P does, where that cost less than every P "
    "(--prefill-on-decode); another D decoded them, pulling from it",
    ["engine"],
    values=dict(engine=ENGINE),
)
ENGINE_METRICS_READS = Counter(
    "pd_gateway_engine_metrics_reads",
    "Reads of engines' /metrics (--engine-metrics-interval), "
    "once per host for all its workers: read, or failed (down, slow, no vLLM gauges)",
    ["role", "result"],
    values=dict(role=ROLE, result=("read", "failed")),
)
RESOLUTIONS = Counter(
    "pd_gateway_resolutions",
    "Lookups of instance DNS names (--resolve-interval): ok, or "
    "failed (an error or no address: the last set is kept)",
    ["result"],
    values=dict(result=("ok", "failed")),
)
INSTANCE_CHANGES = Counter(
    "pd_gateway_instance_changes",
    "Instances added to or removed from a pool at run time, by "
    "source (dns, admin); each worker counts its own",
    ["role", "change", "source"],
    values=dict(role=ROLE, change=("added", "removed"), source=("dns", "admin")),
)


_MODELS: set[str] = set()  # the models whose series are made


def initialize(models: list[str]) -> None:
    """Series the alert rules and the dashboard select, at zero until something happens
    (Prometheus' advice: a series that appears only at its first event makes a rate over it
    empty, not 0; https://prometheus.io/docs/practices/instrumentation/#avoid-missing-metrics).
    `models`: the model labels known at the start (none without --models: `model_seen` makes
    a model's as its first request comes)."""
    for model in models:
        model_seen(model)
    for result in ADMISSION_RESULTS:
        ADMISSIONS.labels(result)
    for operation in STORE_ERRORS.values["operation"]:
        STORE_ERRORS.labels(operation)
    for limit in ("requests", "tokens"):
        RATE_LIMITED.labels(limit)
    for role in ROLE:
        RETRIES.labels(role)
    for result in ("sent", "away", "failed"):
        FORWARDED.labels(result)
    for reason in DROP_REASONS:
        for result in ("released", "failed", "skipped"):
            RELEASES.labels(reason, result)


def model_seen(model: str) -> None:
    """A model's series at zero, the first time it is seen (a set lookup after that)."""
    if model in _MODELS:
        return
    _MODELS.add(model)
    for endpoint in ENDPOINTS:
        for cache in CACHE:
            REQUESTS.labels(endpoint, model, cache)
        for status in ("200", "500", "502", "503", "504"):
            RESPONSES.labels(endpoint, model, status)
    for stage in ("request", "stream"):
        for status in ("502", "503", "504"):
            ERRORS.labels(stage, status, model)
    for result in KV_READS.values["result"]:
        KV_READS.labels(result, model)


def exposition() -> tuple[bytes, str]:
    """The text format of every metric, summed over workers when under gunicorn."""
    if os.environ.get(MULTIPROC_ENV):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST


def metrics_markdown() -> str:
    """README's metric table: every metric, its labels and the values each can take."""
    rows = ["| metric | type | labels: values | what |", "|---|---|---|---|"]
    for metric in DECLARED:
        kind = metric._type
        name = metric._name + ("_total" if kind == "counter" else "")
        labels = "<br>".join(
            f"`{label}`: "
            + (", ".join(f"`{v}`" for v in values) if isinstance(values, tuple) else values)
            for label, values in metric.values.items()
        )
        what = metric._documentation.replace("|", "\\|")
        rows.append(f"| `{name}` | {kind} | {labels} | {what} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(metrics_markdown())
