"""Prometheus metrics; under gunicorn in multiprocess mode so /metrics sums every worker.

gunicorn_conf sets PROMETHEUS_MULTIPROC_DIR before anything imports prometheus_client, and
marks dead workers' files; outside gunicorn the metrics live in the default registry.
"""
from __future__ import annotations

import os

import prometheus_client
from prometheus_client import (CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest,
                               multiprocess)


class _Children:
    """`labels(...)` found once per label values, then from a plain dict: prometheus_client's
    own checks the values and takes a lock on every call (measured: about 6 us a call, some
    ten calls a turn). No child is ever removed here, so none goes stale."""

    def labels(self, *values: str, **by_name: str):  # type: ignore[no-untyped-def]
        if by_name:
            return super().labels(*values, **by_name)  # type: ignore[misc]
        children = self.__dict__.setdefault("_pd_children", {})
        child = children.get(values)
        if child is None:
            child = children[values] = super().labels(*values)  # type: ignore[misc]
        return child


class Counter(_Children, prometheus_client.Counter):
    pass


class Gauge(_Children, prometheus_client.Gauge):
    pass


class Histogram(_Children, prometheus_client.Histogram):
    pass


MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

REQUESTS = Counter("pd_gateway_requests", "Completion requests served by this gateway",
                   ["endpoint", "cache"])
ERRORS = Counter("pd_gateway_errors", "Requests that ended in an error, by where it happened",
                 ["stage", "status"])
ENTRIES = Counter("pd_gateway_entries", "Conversation store events: stored; found (an entry "
                  "whose history the request extends; reuse_checks says if it was read); "
                  "mismatch (an entry whose history the request does not extend); absent (no "
                  "entry for the id or any history prefix); rejected (malformed D params); gone (an entry "
                  "whose D has left the pool: a miss)",
                  ["event"])
REUSE_CHECKS = Counter("pd_gateway_reuse_checks", "Found entries, by the proof of reuse: digest "
                       "(plain turn, template keeps the prefix) and verified (tokens match) are "
                       "read whole; partial (the prompt shares a block-aligned prefix of D's "
                       "tokens: P reads that prefix); mismatch (tokens differ), unverifiable (no token ids from D, or a "
                       "request /tokenize cannot render), unproven (reasoning, tool calls; "
                       "verify_reuse off) and error (/tokenize failed) are misses", ["result"])
TEMPLATE_PROBES = Counter("pd_gateway_template_probes", "Chat template checks (3 /tokenize calls "
                          "each): safe (keeps the prefix property), unsafe, error", ["result"])
TURN_PATHS = Counter("pd_gateway_turn_paths", "Turns by path and why: decode-only (short, D holds "
                     "the history: no P call) or two-stage (no_entry, off, long, unproven, "
                     "decode_down, decode_overloaded, decode_gone, decode_failed, tokenize_failed)",
                     ["path", "reason"])
ENGINE_METRICS_READS = Counter("pd_gateway_engine_metrics_reads", "Reads of engines' /metrics "
                               "(--engine-metrics-interval), once per host: read, or failed "
                               "(down, slow, no vLLM gauges)", ["role", "result"])
RETRIES = Counter("pd_gateway_retries", "Requests retried on another instance", ["role"])
FORWARDED = Counter("pd_gateway_forwarded", "Requests forwarded to the owner worker",
                    ["result"])
STORE_ERRORS = Counter("pd_gateway_store_errors", "Calls to a Redis store that failed (a take "
                       "becomes a miss, a put leaves no entry; ledger: a Redis Cluster's count "
                       "of a D's pinned blocks, on another node, missed one change; limits: a "
                       "key's request was admitted uncounted)",
                       ["operation"])
RATE_LIMITED = Counter("pd_gateway_rate_limited", "Requests refused (429) for a client key's "
                       "requests or tokens per minute (--key-rpm, --key-tpm, the keys file)",
                       ["limit"])
ADMISSIONS = Counter("pd_gateway_admissions", "Turns by admission (--max-turns): admitted at "
                     "once, queued (waited for a place, then admitted), rejected_queue_full and "
                     "rejected_waited (429 with Retry-After, no engine called), rejected_bodies "
                     "(429 before the body was parsed: --max-bodies-bytes), rejected_client_gone (its client "
                     "left while it waited for its share)", ["result"])
RESOLUTIONS = Counter("pd_gateway_resolutions", "Lookups of instance DNS names (--resolve-"
                      "interval): ok, or failed (an error or no address: the last set is kept)",
                      ["result"])
INSTANCE_CHANGES = Counter("pd_gateway_instance_changes", "Instances added to or removed from a "
                           "pool at run time, by source (dns, admin); each worker counts its own",
                           ["role", "change", "source"])
RELEASES = Counter("pd_gateway_releases", "Entries dropped unread whose D blocks the gateway "
                   "asked a P to free, by why they were dropped (unproven, mismatch, decode_only, "
                   "decode_failed, decode_gone, prefill_failed, unstored, replaced, evicted, "
                   "expired, budget) and result (released; failed: D frees them at its TTL; "
                   "skipped: too many waiting)", ["reason", "result"])
PINNED_BLOCKS = Gauge("pd_gateway_pinned_blocks", "Blocks each D keeps for the conversations this "
                      "gateway's local stores hold (their entries' remote_block_ids), summed over "
                      "live workers", ["decode"], multiprocess_mode="livesum")
SHARED_PINNED_BLOCKS = Gauge("pd_gateway_shared_pinned_blocks", "Blocks each D keeps for the "
                             "conversations of a shared (Redis) store, every host's, as the "
                             "last put on that D counted them", ["decode"],
                             multiprocess_mode="mostrecent")
PINNED_BUDGET = Gauge("pd_gateway_pinned_blocks_budget", "Blocks each D may keep pinned for "
                      "conversations between turns (--pinned-blocks, or derived from D's "
                      "reported capacity and usage; 0: no budget), summed over live workers",
                      ["decode"], multiprocess_mode="livesum")
ENGINE_UP = Gauge("pd_gateway_engine_up", "1 while an engine may be chosen, 0 while it is marked "
                  "down or its breaker is open (the lowest of the live workers' views)",
                  ["role", "engine"], multiprocess_mode="livemin")
DECODE_KEPT_NOTHING = Counter("pd_gateway_decode_kept_nothing", "Turns a D loaded from P and "
                              "finished without kv_transfer_params: it keeps no blocks for the "
                              "next turn (bidirectional KV transfer off; streamed: or a vLLM "
                              "whose streams carry no params), so nothing was stored",
                              ["engine"])
ENGINE_KV_BLOCKS = Gauge("pd_gateway_engine_kv_blocks", "Each engine's KV cache in blocks, as it "
                         "reports it (vllm:cache_config_info num_gpu_blocks; absent until it "
                         "said)", ["role", "engine"], multiprocess_mode="livemax")
ENGINE_BLOCK_SIZE = Gauge("pd_gateway_engine_block_size", "Each engine's KV block size in tokens, "
                          "as it reports it (vllm:cache_config_info block_size)",
                          ["role", "engine"], multiprocess_mode="livemax")
ENGINE_INFLIGHT = Gauge("pd_gateway_engine_inflight", "Requests in flight on each engine, summed "
                        "over live workers", ["role", "engine"], multiprocess_mode="livesum")
KV_READS = Counter("pd_gateway_kv_reads", "Turns whose P was sent D's params, by what P reports "
                   "(kv_transfer_params.remote_prefill_cached_tokens, or usage.prompt_tokens_"
                   "details.cached_tokens) against min(remote_num_tokens, prompt): read (equal: "
                   "P had every token D held for it, read from D or, when that count is a whole "
                   "number of blocks, possibly its own cache), recomputed (fewer: under "
                   "kv_recompute_threshold), own_cache (more: its own cache held them all), "
                   "unreported (P said nothing)", ["result"])
PARTIAL_TOKENS = Counter("pd_gateway_partial_reuse_tokens", "Partial reuse (reuse_checks "
                         "result partial): offered, the tokens of D's sequence P was sent to "
                         "read (the shared prefix, whole blocks); cached, of those, what P "
                         "reported not computing (read from D, or its own cache)", ["kind"])
PREFILL_TOKENS = Counter("pd_gateway_prefill_tokens", "P's prompt tokens as P reports them: "
                         "prompt (usage.prompt_tokens) and cached (what P did not compute: its "
                         "own prefix cache plus what it read from D; only where P reports it)",
                         ["kind"])
DISCONNECTS = Counter("pd_gateway_client_disconnects", "Clients gone before the end")
PREFILL_SECONDS = Histogram("pd_gateway_prefill_seconds", "Time of the prefill call to P",
                            buckets=_LATENCY)
FIRST_BYTE_SECONDS = Histogram("pd_gateway_time_to_first_byte_seconds",
                         "From request arrival to the first response byte of a stream",
                         buckets=_LATENCY)


def initialize() -> None:
    """Series the alert rules and the dashboard select, at zero until something happens
    (Prometheus' advice: a series that appears only at its first event makes a rate over it
    empty, not 0; https://prometheus.io/docs/practices/instrumentation/#avoid-missing-metrics)."""
    for endpoint in ("/v1/chat/completions", "/v1/completions"):
        for cache in ("hit", "partial", "miss"):
            REQUESTS.labels(endpoint, cache)
    for stage in ("request", "stream"):
        for status in ("502", "503", "504"):
            ERRORS.labels(stage, status)
    for result in ("admitted", "queued", "rejected_queue_full", "rejected_waited",
                   "rejected_key_turns", "rejected_bodies", "rejected_client_gone"):
        ADMISSIONS.labels(result)
    for operation in ("take", "put", "ledger", "limits"):
        STORE_ERRORS.labels(operation)
    for limit in ("requests", "tokens"):
        RATE_LIMITED.labels(limit)
    for role in ("prefill", "decode"):
        RETRIES.labels(role)
    for result in ("sent", "away", "failed"):
        FORWARDED.labels(result)
    for reason in ("unproven", "mismatch", "decode_only", "decode_failed", "decode_gone",
                   "prefill_failed", "unstored", "replaced", "evicted", "expired", "budget"):
        for result in ("released", "failed", "skipped"):
            RELEASES.labels(reason, result)


def exposition() -> tuple[bytes, str]:
    """The text format of every metric, summed over workers when under gunicorn."""
    if os.environ.get(MULTIPROC_ENV):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
