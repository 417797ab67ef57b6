"""Engine counters served on GET /stats, and a bounded log of recent requests for benchmarks."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, fields

GAUGES = (
    "streams_in_flight",
    "leases_expired_unread",
)  # describe the present, so a reset keeps them


@dataclass
class Stats:
    """Cumulative since start or the last POST /stats/reset (single-threaded under gevent: no
    lock)."""

    requests: int = 0  # completion requests received, including bad and faulted ones
    completed: int = 0  # answered in full (non-stream body sent, or stream reached [DONE])
    bad_requests: int = 0  # 400/404 for client input
    fault_responses: int = 0  # requests answered by an injected fault
    hits: int = 0  # P: turns whose prompt prefix was pulled from D and reused
    reused_prompt_tokens: int = 0  # P: prompt tokens taken from D's blocks
    computed_prompt_tokens: int = 0  # prompt tokens this engine computed itself
    local_prefix_tokens: int = 0  # prompt tokens found in the local prefix cache
    pulled_tokens: int = 0  # tokens read from another engine's KV port
    pulled_blocks: int = 0
    wrong_reuse: int = 0  # pulled tokens were not a prefix of the prompt (a real engine: garbage)
    stale_pulls: int = 0  # the owner said the blocks are gone (already read, released or expired)
    failed_pulls: int = 0  # the owner could not be reached, or refused (wrong engine / block ids)
    declined_pulls: int = 0  # remote blocks near expiry, or fewer tokens than --recompute-threshold
    kv_load_errors: int = 0  # requests failed by --kv-load-failure-policy fail
    aborted_streams: int = 0  # the client went away mid-stream
    tokenize_requests: int = 0  # POST /tokenize
    other_requests: int = 0  # the routes of other_routes.py: /detokenize, embeddings, audio, ...
    # D, which path each request took: remote_prefill (pulled the prompt from P: two-stage),
    # decode_only (params without a pull: prefilled here, from its prefix cache and compute),
    # plain (no kv_transfer_params: vLLM keeps nothing for a next turn); prefill (a P's
    # request: do_remote_decode, another D to pull from here).
    remote_prefill_requests: int = 0
    prefill_requests: int = 0
    decode_only_requests: int = 0
    plain_requests: int = 0
    decode_stall_seconds: float = 0.0  # D: time its streams emitted nothing while it prefilled
    kv_wait_seconds: float = 0.0  # time requests waited for KV memory before their prefill
    # vLLM's prefix cache counters, in tokens: queries are prompt tokens looked up, hits the
    # local cache's share; external ones what a request tried and managed to load from another
    # engine (v1/metrics/loggers.py ~L662-704).
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    leases_expired_unread: int = (
        0  # kept for a pull that never came, freed at their TTL (since start)
    )
    generated_tokens: int = 0
    prefill_seconds: float = 0.0  # emulated compute + pull time before the first token
    first_token_seconds: float = 0.0  # arrival to first byte, as the engine saw it
    streams_in_flight: int = 0
    peak_streams_in_flight: int = 0
    recent: deque = field(default_factory=lambda: deque(maxlen=10_000), repr=False)

    def stream_opened(self) -> None:
        self.streams_in_flight += 1
        self.peak_streams_in_flight = max(self.peak_streams_in_flight, self.streams_in_flight)

    def snapshot(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "recent"}

    def reset(self) -> None:
        for f in fields(self):
            if f.name not in GAUGES and f.name != "recent":
                setattr(self, f.name, f.default)
        self.recent.clear()
        self.peak_streams_in_flight = self.streams_in_flight
