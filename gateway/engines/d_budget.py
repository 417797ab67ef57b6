"""How many blocks each D may keep pinned for conversations waiting for their next turn: a number
the operator gives (`--pinned-blocks N`), or a budget from what D itself reports.

What D reports (vLLM 0.33.0): its capacity in blocks, `num_gpu_blocks` in `vllm:cache_config_info`
(`config/cache.py` ~L333, ~L440-443; set once its cache is allocated, `v1/engine/core.py` ~L335),
and its KV cache in use, `vllm:kv_cache_usage_perc`: `1 - free blocks / (num_gpu_blocks - 1)`
(`v1/core/block_pool.py` ~L921-932). Blocks D keeps for a next turn are not free, so the usage
counts them beside the running requests' (prefix-cached blocks nobody holds are free).

The rule:

- **A cap.** The pins never take more than `HIGH_WATER` of D's capacity.
- **A cut at each report** (every `--engine-metrics-interval`, once per host): where D's usage is
  above `HIGH_WATER`, the least recently active conversations are released until the pins are
  that excess smaller (`(usage - HIGH_WATER) x capacity` blocks), once for that report.

So D's running requests always find room: as soon as they fill D beyond the mark, pins give way,
the report after shows what that freed, and no more is released than D was over. Pins grow back
as far as the cap while D has room. The cut is made once a report, not held as a budget until the
next one: a conversation's blocks are running while its turn decodes and pinned while it
thinks, the same blocks, so when a turn ends its pin takes no room it did not hold already. A
budget held between reports (tried: what is pinned plus the room the report showed) read the
room at a moment when many turns ran and few were pinned, then released the pins those very
turns left as they ended; on bench.reuse's 64-conversation rows, whose turns come in waves, it
computed 1.8-2.4x the prompt tokens of the seed, which pins everything (docs/d-memory.md).

Why 0.9: vLLM admits a waiting request only when blocks are free for all of it
(`v1/core/sched/scheduler.py` ~L1454-1461) and preempts running ones once its cache is full; the
tenth the pins never take is room for the requests that arrive between two reports and for the
releases to land, and it stays below `--engine-kv-full` (0.95), so pins alone never make a D look
busy. While D's usage is not known (its reports stale), no cut is made and the cap holds; a D that
reports no capacity (not vLLM, or reads off) gets `FALLBACK` blocks, the fixed default this
replaces.

Each worker of a local store keeps its own pins: its share of the cap and of each cut (the whole
over the workers; conversations spread evenly over them, gateway.front.owners). A shared Redis
store keeps one count per D for every host, and a cut is made against it as Redis holds it then;
each of a host's workers makes its share. Releases a worker queued for a D and has not sent yet
count as made. Several hosts each make the whole cut: they over-release by their number, which
the next report shows, and no cut follows.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import NamedTuple

from gateway.engines.engine_load import EngineLoad
from gateway.engines.instances import Instance, public_url
from gateway.support import metrics

log = logging.getLogger(__name__)

HIGH_WATER = 0.9  # of D's capacity: what its pins may bring its KV cache usage up to
FALLBACK = 8192  # blocks, for a D that does not report its capacity
LOOK_AGAIN = 0.25  # seconds a D's cap is kept before the engine's table is read again


class Limit(NamedTuple):
    """A D's pinned budget now: at most `cap` blocks (0: no budget), and `cut` blocks fewer than
    are pinned there now, once (a report found D over the mark)."""

    cap: int
    cut: int = 0

    def at(self, pinned: int) -> int:
        """The budget for a store that holds `pinned` blocks on the D (0: none)."""
        if not self.cut:
            return self.cap
        return max(1, min(self.cap, pinned - self.cut))


class _Known:
    """One D as last looked at: its cap until `until`, and the report last acted on."""

    def __init__(self) -> None:
        self.until = float("-inf")
        self.cap = 0
        self.instance: Instance | None = None
        self.capacity = 0
        self.ranks = 1
        self.read_at: float | None = None


class DBudget:
    """`budget(decode_url)`: the `Limit` of the blocks this store may keep pinned on that D.
    The store releases what is beyond it at once: at a put, or at its sweep (each second)."""

    def __init__(
        self,
        given: int | None,
        load: EngineLoad,
        find: Callable[[str], Instance | None],
        shares: int = 1,
        workers: int = 1,
        pending: Callable[[str], int] = lambda decode_url: 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.given = given  # --pinned-blocks: a number for every D, or None (derived)
        self.load = load
        self.find = find  # the D instance at a URL, if it is in a pool
        # Workers each keeping their own pins (a local store's) share the cap; every worker
        # makes its share of a cut, whatever the store; each publishes its part of the whole.
        self.shares = max(1, shares)
        self.workers = max(1, workers)
        self._part = self.shares / self.workers
        self.pending = pending  # blocks this worker's releases queued for a D still hold
        self.clock = clock
        self._known: dict[str, _Known] = {}
        self._published: dict[str, float] = {}

    def __call__(self, decode_url: str) -> Limit:
        if self.given is not None:
            return self._publish(
                decode_url, Limit(max(1, self.given // self.shares) if self.given else 0)
            )
        known = self._look(decode_url)
        if not known.capacity or known.instance is None:  # (a capacity came from an instance)
            return self._publish(decode_url, Limit(known.cap))
        report = self.load.reported(known.instance)
        if report is None or known.read_at == report.read_at:
            return self._publish(decode_url, Limit(known.cap))
        known.read_at = report.read_at
        # Usage is the fullest data-parallel rank's; its share of the capacity is what is over.
        over = (report.kv_usage - HIGH_WATER) * known.capacity / known.ranks
        cut = round(over / self.workers) - self.pending(decode_url)
        # D is fuller than the mark: once, this many fewer (releases still queued count as
        # made); the next calls answer the cap again.
        return self._publish(decode_url, Limit(known.cap, max(0, cut)))

    def _look(self, decode_url: str) -> _Known:
        """The D's cap, from what it reported (looked at again every LOOK_AGAIN seconds)."""
        known = self._known.get(decode_url)
        now = self.clock()
        if known is not None and now < known.until:
            return known
        if known is None:
            known = self._known[decode_url] = _Known()
            if len(self._known) > 4096:  # Ds come and go: forget those long gone
                self._known = {decode_url: known}
        known.until = now + LOOK_AGAIN
        instance = self.find(decode_url)
        facts = self.load.facts(instance) if instance is not None else None
        capacity = facts.capacity if facts is not None else 0
        if capacity and capacity != known.capacity and instance is not None:
            log.info(
                "%s reports %d blocks of KV cache: its pins are kept within %d of them, "
                "and cut where its usage passes %d%%",
                instance.name,
                capacity,
                int(HIGH_WATER * capacity),
                HIGH_WATER * 100,
            )
        known.instance, known.capacity = instance, capacity
        known.ranks = facts.ranks if facts is not None else 1
        known.cap = max(1, int((HIGH_WATER * capacity if capacity else FALLBACK) / self.shares))
        return known

    def _publish(self, decode_url: str, limit: Limit) -> Limit:
        """Each worker its part of the D's cap (the gauge sums the workers); written when it
        changes."""
        part = limit.cap * self._part
        if self._published.get(decode_url) != part:
            self._published[decode_url] = part
            metrics.PINNED_BUDGET.labels(public_url(decode_url)).set(part)
        return limit
