"""GET /metrics in vLLM's names: the gauges and counters routers and autoscalers read
(v1/metrics/loggers.py ~L520-704, labels model_name and engine), beside a few of the emulator's own."""

from __future__ import annotations

from typing import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

LABELS = ("model_name", "engine")

# (name, help, key in Engine.snapshot())
GAUGES = (
    ("vllm:num_requests_running", "Number of requests in model execution batches.",
     "requests_running"),
    ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
     "requests_waiting"),
    ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "kv_cache_usage"),
    ("emulator_kv_lease_blocks", "Blocks kept for a read (tracked leases).", "kv_lease_blocks"),
    ("emulator_leaked_blocks", "Blocks kept for good: params that set neither flag.",
     "leaked_blocks"),
)
COUNTERS = (
    ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
     "prefix_cache_queries"),
    ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
     "prefix_cache_hits"),
    ("vllm:external_prefix_cache_queries", "External prefix cache queries from KV connector "
     "cross-instance cache sharing, in terms of number of queried tokens.",
     "external_prefix_cache_queries"),
    ("vllm:external_prefix_cache_hits", "External prefix cache hits from KV connector "
     "cross-instance cache sharing, in terms of number of cached tokens.",
     "external_prefix_cache_hits"),
)


class _Collector:
    def __init__(self, snapshot, model: str) -> None:
        self._snapshot = snapshot
        self._labels = [model, "0"]

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        for family, specs in ((GaugeMetricFamily, GAUGES), (CounterMetricFamily, COUNTERS)):
            for name, text, key in specs:
                metric = family(name, text, labels=LABELS)
                metric.add_metric(self._labels, snap[key])
                yield metric
        # The two reasons sum to vllm:num_requests_waiting (loggers.py ~L547-560, ~L1150-1160):
        # capacity (no room: here, no KV memory) and deferred (here, loading remote KV).
        by_reason = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason", "Number of waiting requests by reason. "
            "Reason labels: 'capacity' = waiting for scheduling capacity; 'deferred' = deferred "
            "by transient constraints (LoRA budget, KV transfer, blocked status). Sum of all "
            "reasons equals vllm:num_requests_waiting.", labels=(*LABELS, "reason"))
        for reason in ("capacity", "deferred"):
            by_reason.add_metric([*self._labels, reason], snap["requests_waiting_" + reason])
        yield by_reason


def exposition(snapshot, model: str) -> bytes:
    """The Prometheus text of one engine's snapshot (a callable returning Engine.snapshot())."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(snapshot, model))
    return generate_latest(registry)
