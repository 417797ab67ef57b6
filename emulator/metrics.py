"""GET /metrics in vLLM's names: the gauges and counters routers and autoscalers read
(v1/metrics/loggers.py ~L520-704, labels model_name and engine), `vllm:cache_config_info` (every
CacheConfig field a label), beside a few of the emulator's own."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

LABELS = ("model_name", "engine")

# (name, help, key in Engine.snapshot())
GAUGES = (
    (
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        "requests_running",
    ),
    (
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        "requests_waiting",
    ),
    ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "kv_cache_usage"),
    ("emulator_kv_lease_blocks", "Blocks kept for a read (tracked leases).", "kv_lease_blocks"),
    (
        "emulator_leaked_blocks",
        "Blocks kept for good: params that set neither flag.",
        "leaked_blocks",
    ),
)
COUNTERS = (
    (
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        "prefix_cache_queries",
    ),
    (
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
        "prefix_cache_hits",
    ),
    (
        "vllm:external_prefix_cache_queries",
        "External prefix cache queries from KV connector "
        "cross-instance cache sharing, in terms of number of queried tokens.",
        "external_prefix_cache_queries",
    ),
    (
        "vllm:external_prefix_cache_hits",
        "External prefix cache hits from KV connector "
        "cross-instance cache sharing, in terms of number of cached tokens.",
        "external_prefix_cache_hits",
    ),
)


def cache_config(config) -> dict[str, str]:
    """`vllm:cache_config_info`'s labels for an engine of these settings (`EngineConfig`): vLLM
    0.33.0 logs CacheConfig's `metrics_info()`, `{key: str(value)}` of its `__dict__` in field
    order (`config/cache.py` ~L440-443), plus `engine` (`v1/metrics/loggers.py` ~L1114-1136,
    once the engine is initialized, ~L1354-1355). Values as vLLM's defaults stringify them
    (`config/cache.py` ~L182-395); the emulator's own where it has a flag."""
    block, blocks = config.block_size, config.kv_capacity_blocks
    return {
        "block_size": str(block),
        "user_specified_block_size": str(block != 16),
        "kv_cache_layout": "LBNHC",
        "prefix_match_unit": str(block),
        "gpu_memory_utilization": "0.92",
        "cache_dtype": "auto",
        "is_attention_free": "False",
        "num_gpu_blocks_override": "None",
        "sliding_window": str(config.sliding_window or None),
        "enable_prefix_caching": str(bool(config.enable_prefix_caching)),
        "prefix_caching_hash_algo": "sha256",
        "prefix_cache_retention_interval": "0",
        "kv_cache_dtype_skip_layers": "[]",
        "mamba_page_size_padded": "None",
        "skip_page_size_padded": "None",
        "mamba_block_size": "None",
        "mamba_cache_dtype": "auto",
        "mamba_ssm_cache_dtype": "auto",
        "mamba_cache_mode": "none",
        "enable_mamba_shared_prefix_checkpoint": "False",
        "replayssm_buffer_len": "16",
        "use_replayssm": "False",
        "use_kda_recoverssm": "False",
        "num_gpu_blocks": str(blocks),
        "num_cpu_blocks": "None",
        "simple_cpu_offload_num_blocks": "None",
        "effective_attention_block_size": str(block),
        "kv_cache_size_tokens": str(blocks * block),
        "kv_cache_max_concurrency": str(round(blocks * block / config.max_model_len, 2)),
        "hash_block_size": str(block),
        "cache_hit_alignment_tokens": str(block),
        "kv_sharing_fast_prefill": "False",
        "swa_bounded_replay": "True",
        "kv_cache_memory_bytes": "None",
        "kv_offloading_size": "None",
        "kv_offloading_backend": "native",
        "_block_size_resolved": "True",
        "engine": "0",
    }


class _Collector:
    def __init__(self, snapshot, model: str, config=None) -> None:
        self._snapshot = snapshot
        self._labels = [model, "0"]
        self._config = cache_config(config) if config is not None else None

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
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. "
            "Reason labels: 'capacity' = waiting for scheduling capacity; 'deferred' = deferred "
            "by transient constraints (LoRA budget, KV transfer, blocked status). Sum of all "
            "reasons equals vllm:num_requests_waiting.",
            labels=(*LABELS, "reason"),
        )
        for reason in ("capacity", "deferred"):
            by_reason.add_metric([*self._labels, reason], snap["requests_waiting_" + reason])
        yield by_reason
        if self._config is not None:
            # An info metric as vLLM writes one: a gauge permanently 1 (loggers.py ~L1123-1136).
            info = GaugeMetricFamily(
                "vllm:cache_config_info",
                "Information of the LLMEngine CacheConfig",
                labels=list(self._config),
            )
            info.add_metric(list(self._config.values()), 1.0)
            yield info


def exposition(snapshot, model: str, config=None) -> bytes:
    """The Prometheus text of one engine's snapshot (a callable returning Engine.snapshot()),
    with `vllm:cache_config_info` for `config` (its EngineConfig) when given."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(snapshot, model, config))
    return generate_latest(registry)
