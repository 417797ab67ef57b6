"""How many blocks each D may keep pinned for conversations waiting for their next turn: a number
the operator gives (`--pinned-blocks N`), or a budget from what D itself reports.

What D reports (vLLM 0.33.0): its capacity in blocks, `num_gpu_blocks` in `vllm:cache_config_info`
(`config/cache.py` ~L333, ~L440-443; set once its cache is allocated, `v1/engine/core.py` ~L335),
and its KV cache in use, `vllm:kv_cache_usage_perc`: `1 - free blocks / (num_gpu_blocks - 1)`
(`v1/core/block_pool.py` ~L921-932). Blocks D keeps for a next turn are not free, so the usage
counts them beside the running requests' (prefix-cached blocks nobody holds are free).

The rule, at each new report (every `--engine-metrics-interval`, once per host):

    running = usage x capacity - pinned            (what D's requests hold now)
    budget  = min(HIGH_WATER x capacity - the most `running` was over the last WINDOW,
                  pinned + (HIGH_WATER - usage) x capacity)        within 0 .. HIGH_WATER x capacity

The pins may bring D's usage up to `HIGH_WATER` of its capacity and no further, beside as much as
its running requests took at their peak of the last minute: so the budget shrinks as soon as D
fills with running requests (conversations beyond it, the least recently active first, are
released), and grows back a minute after they are gone. The second term holds even where the
gateway's count of what is pinned is off (each worker of a local store sees its own share): usage
above the mark always shrinks the budget. Between reports the budget holds.

Why 0.9: vLLM admits a waiting request only when blocks are free for all of it
(`v1/core/sched/scheduler.py` ~L1454-1461) and preempts running ones once its cache is full; the
tenth the pins never take is room for requests beyond the last minute's peak and for releases to
land, and it stays below `--engine-kv-full` (0.95), so pins alone never make a D look busy. While
D's usage is not known (its reports stale), the budget is half its capacity (`BLIND_SHARE`); a D
that reports no capacity (not vLLM, or reads off) gets `FALLBACK` blocks, the static default this
replaces.

A local store keeps one budget per worker (each worker's pins are its own): its share, the whole
over the workers (conversations spread evenly over them: gateway.front.owners), so `pinned` above
is this worker's times the workers. A shared Redis store keeps one budget per D for every host:
`pinned` is the total the store counted.
"""
from __future__ import annotations

import logging
from collections import deque
from typing import Callable

from gateway.engines.engine_load import EngineLoad
from gateway.engines.instances import Instance, public_url
from gateway.support import metrics

log = logging.getLogger(__name__)

HIGH_WATER = 0.9        # of D's capacity: what its pins may bring its KV cache usage up to
WINDOW = 60.0           # seconds over which D's running requests' peak is remembered
BLIND_SHARE = 0.5       # of D's capacity, while its usage is not known
FALLBACK = 8192         # blocks, for a D that does not report its capacity


class _Seen:
    """One D's recent reports: when the last was read, its running blocks over the window,
    and the budget derived from them."""

    def __init__(self) -> None:
        self.read_at = float("-inf")
        self.running: deque[tuple[float, float]] = deque()
        self.budget = 0


class DBudget:
    """`budget(decode_url, pinned)`: the blocks this store may keep pinned on that D (0: no
    budget), where `pinned` is what the store holds there now."""

    def __init__(self, given: int | None, load: EngineLoad,
                 find: Callable[[str], Instance | None], shares: int = 1,
                 workers: int = 1) -> None:
        self.given = given          # --pinned-blocks: a number for every D, or None (derived)
        self.load = load
        self.find = find            # the D instance at a URL, if it is in a pool
        self.shares = max(1, shares)    # workers each keeping their own share (local stores)
        # Each worker publishes its part of the D's whole budget (the gauge sums them): its
        # share, or (one budget for all, a shared store) the whole over the workers.
        self._part = self.shares / max(1, workers)
        self._seen: dict[str, _Seen] = {}
        self._said: dict[str, int] = {}     # each D's capacity, once logged

    def __call__(self, decode_url: str, pinned: int) -> int:
        if self.given is not None:
            return self._publish(decode_url, max(1, self.given // self.shares)
                                 if self.given else 0)
        instance = self.find(decode_url)
        facts = self.load.facts(instance) if instance is not None else None
        if facts is None or not facts.capacity:
            return self._publish(decode_url, max(1, FALLBACK // self.shares))
        report = self.load.reported(instance)
        if report is None:
            return self._publish(decode_url, max(1, int(BLIND_SHARE * facts.capacity
                                                        / self.shares)))
        seen = self._seen.setdefault(decode_url, _Seen())
        if seen.read_at != report.read_at:
            seen.read_at = report.read_at
            seen.budget = self._derive(seen, facts.capacity, report.kv_usage,
                                       pinned * self.shares, report.read_at)
            if self._said.get(decode_url) != facts.capacity:
                self._said[decode_url] = facts.capacity
                log.info("%s reports %d blocks of KV cache: its pinned budget is derived from "
                         "them (at most %d%% in use with the pins): %d blocks now",
                         instance.name, facts.capacity, HIGH_WATER * 100, seen.budget)
        # At least 1 (0 would be no budget at all): a D with no room keeps only the
        # conversation just stored, its latest turn.
        return self._publish(decode_url, max(1, seen.budget // self.shares))

    @staticmethod
    def _derive(seen: _Seen, capacity: int, usage: float, pinned: float, now: float) -> int:
        """D's whole budget from one report (the module's rule)."""
        running = max(0.0, usage * capacity - pinned)
        seen.running.append((now, running))
        while seen.running[0][0] < now - WINDOW:
            seen.running.popleft()
        peak = max(r for _, r in seen.running)
        mark = HIGH_WATER * capacity
        budget = min(mark - peak, pinned + (HIGH_WATER - usage) * capacity)
        return int(min(max(budget, 0.0), mark))

    def _publish(self, decode_url: str, budget: int) -> int:
        metrics.PINNED_BUDGET.labels(public_url(decode_url)).set(budget * self._part)
        return budget
