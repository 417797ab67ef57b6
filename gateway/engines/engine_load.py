"""What each engine reports of its own load, for the choice of P and D.

A worker's in-flight counts see its own share of an engine's load only: with several workers and
several gateway hosts, none sees the whole, and none sees what vLLM itself knows. vLLM's
`/metrics` says it (vLLM 0.33.0, `vllm/v1/metrics/loggers.py` ~L520-560): requests waiting to be
scheduled (`vllm:num_requests_waiting`: no room in the batch or no KV memory for them) and the KV
cache in use (`vllm:kv_cache_usage_perc`: blocks held by running requests and by those kept for a
remote read, 1.0 full). llm-d's scheduler scores engines on the same two.

An engine is **busy** when more than `--engine-queue-limit` requests wait there for capacity
(`vllm:num_requests_waiting_by_reason{reason="capacity"}` where it exists: the total also counts
requests loading remote KV, which a D always has; an engine without that label gives no
queue signal, only its KV cache's), or its KV cache
is at least `--engine-kv-full` used: a new conversation goes to another engine, and a
conversation leaves the D that holds it (one miss) rather than queue there. Reports older than
three intervals, or missing, count as nothing: the choice is in-flight counts alone, as without.

The same page says what the engine is (`vllm:cache_config_info`, every CacheConfig field a label:
vLLM 0.33.0 `config/cache.py` ~L440-443, `v1/metrics/loggers.py` ~L1114-1136): its KV block size,
its capacity in blocks (`num_gpu_blocks`) and whether prefix caching is on. These `Facts` stay
known however old the read (an engine's cache does not change while it runs); the gateway cuts
partial reuse at that block size and sizes each D's pinned budget from that capacity
(gateway.engines.d_budget).

Each engine's `/metrics` is read once per interval per host, not per worker: the rows live in
memory the gunicorn master shares with its workers (gateway.slots.LOAD_*), and a worker reads an
engine only when no other worker has claimed it within the interval. Outside gunicorn the table
is the process's own.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

from gateway.engines.instances import Instance, Pool
from gateway.slots import LOAD_KEYS, LOAD_ROWS, LOAD_VALUES
from gateway.support import metrics
from gateway.support.fanout import Fanout

log = logging.getLogger(__name__)

FIELDS = (
    "waiting",
    "running",
    "kv_usage",
    "block_size",
    "capacity",
    "prefix_caching",
    "ranks",
    "read_at",
    "claimed_at",
)
(_WAITING, _RUNNING, _KV, _BLOCK, _CAPACITY, _CACHING, _RANKS, _READ_AT, _CLAIMED_AT) = range(
    len(FIELDS)
)
_WIDTH = len(FIELDS)
assert len(LOAD_VALUES) == LOAD_ROWS * _WIDTH, "gateway.slots.LOAD_VALUES: a row per FIELDS"
_PROBES = 16  # rows looked at from a key's own before the table counts as full
RECLAIM = 60.0  # seconds unclaimed after which a row's engine counts as gone
CONCURRENT = 8  # engines read at once
# The three gauges, by the name each sample line starts with.
_GAUGES = {
    b"vllm:num_requests_waiting": _WAITING,
    b"vllm:num_requests_running": _RUNNING,
    b"vllm:kv_cache_usage_perc": _KV,
}
_BY_REASON = b"vllm:num_requests_waiting_by_reason"
_CACHE_CONFIG = b"vllm:cache_config_info"
_LABEL = re.compile(rb'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Reported:
    waiting: float
    running: float
    kv_usage: float
    age: float  # seconds since it was read
    read_at: float = 0.0  # when, on the table's clock: a new read is a new value


@dataclass(frozen=True)
class Facts:
    """What an engine says of its KV cache (vllm:cache_config_info), 0 or None where it did
    not say: fixed while it runs."""

    block_size: int  # tokens a block
    capacity: int  # blocks (num_gpu_blocks): every data-parallel rank's together
    prefix_caching: bool | None
    ranks: int = 1  # its data-parallel engines, each with its share of the capacity

    def said(self) -> str:
        """As a log line or a report says them."""
        on = {True: "on", False: "off", None: "not said"}[self.prefix_caching]
        return (
            f"KV block size {self.block_size or 'not said'}, "
            f"{self.capacity or 'not said'} blocks, prefix caching {on}"
        )


class Page(NamedTuple):
    """What one /metrics page says: the load gauges, and the cache's facts (0: not said;
    prefix_caching 1 off, 2 on)."""

    waiting: float
    running: float
    kv_usage: float
    block_size: float = 0.0
    capacity: float = 0.0
    prefix_caching: float = 0.0
    ranks: float = 0.0

    def facts(self) -> Facts | None:
        """The cache's facts, if the page says any."""
        if not (self.block_size or self.capacity or self.prefix_caching):
            return None
        return Facts(
            int(self.block_size),
            int(self.capacity),
            None if not self.prefix_caching else self.prefix_caching == 2.0,
            max(1, int(self.ranks)),
        )


def _cache_config(line: bytes) -> tuple[float, float, float]:
    """(block size, blocks, prefix caching) out of one vllm:cache_config_info sample: each
    CacheConfig field a label, its value `str()` of the field (vLLM 0.33.0 `config/cache.py`
    ~L440-443), so "16", "None", "True"."""
    labels = dict(_LABEL.findall(line.split(b"{", 1)[1].rsplit(b"}", 1)[0])) if b"{" in line else {}

    def number(name: bytes) -> float:
        value = labels.get(name, b"")
        return float(value) if value.isdigit() else 0.0

    caching = {b"True": 2.0, b"False": 1.0}.get(labels.get(b"enable_prefix_caching", b""), 0.0)
    return number(b"block_size"), number(b"num_gpu_blocks"), caching


def parse(text: bytes) -> Page | None:
    """The load gauges out of a /metrics page, summed over the engine's label sets
    (data-parallel ranks), KV usage the highest, and its cache's facts; None if a gauge is
    missing. Waiting is those waiting for capacity
    (`vllm:num_requests_waiting_by_reason{reason="capacity"}`) where the engine says: its total
    also counts requests loading remote KV ("deferred"), which every D has while P's blocks
    arrive (vLLM 0.33.0 `v1/metrics/loggers.py` ~L1150-1160).

    Hand-written: a vLLM page is tens of KB of histograms, and prometheus_client's parser
    parses every sample of it; these are a few lines, found by their names."""
    found = [0.0, 0.0, 0.0]
    seen = set()
    capacity = None
    block, blocks, caching, ranks = 0.0, 0.0, 0.0, 0
    for line in text.splitlines():
        if not line.startswith(b"vllm:"):
            continue
        name = line.split(b"{", 1)[0].split(b" ", 1)[0]
        index = _GAUGES.get(name)
        by_reason = name == _BY_REASON and b'reason="capacity"' in line
        if name == _CACHE_CONFIG:
            # One line per data-parallel rank, each with the ranks' blocks together (vLLM's
            # front end sums them before it logs: v1/engine/core_client.py ~L874-877,
            # v1/metrics/loggers.py ~L1133-1136); ranks that disagree on the block size (they
            # never should) leave it unknown.
            size, count, on = _cache_config(line)
            block = size if not block or block == size else -1.0
            blocks = max(blocks, count)
            caching = caching or on
            ranks += 1
            continue
        if index is None and not by_reason:
            continue
        try:
            value = float(line.rsplit(b" ", 1)[1])
        except (IndexError, ValueError):
            return None
        if by_reason:
            capacity = (capacity or 0.0) + value
        elif index == _KV:
            found[index] = max(found[index], value)
        elif index is not None:  # always, past the `continue` above: mypy's narrowing
            found[index] += value
        seen.add(index)
    if len(seen - {None}) < len(found):
        return None
    # Without the reason label (vLLM before it) the total counts every remote-KV load a D
    # has in flight: no queue signal then, only the KV cache's (-1: unknown).
    found[_WAITING] = capacity if capacity is not None else -1.0
    return Page(found[0], found[1], found[2], max(block, 0.0), blocks, caching, float(ranks))


class LoadTable:
    """The rows of engine reports, by engine URL (shared memory under gunicorn's hooks)."""

    def __init__(self, keys=LOAD_KEYS, values=LOAD_VALUES, rows: int = LOAD_ROWS) -> None:
        self.keys, self.values, self.rows = keys, values, rows
        self._found: dict[str, tuple[int, int]] = {}  # url -> (key, row), checked each read

    @staticmethod
    def key(url: str) -> int:
        return (
            int.from_bytes(
                hashlib.blake2b(url.encode(), digest_size=8).digest(), "little", signed=True
            )
            or 1
        )

    def row(
        self, url: str, make: bool = False, now: float | None = None, interval: float = 0.0
    ) -> int | None:
        """The row of `url` (taken if `make` and it has none); None if it has none. With `now`,
        a row no worker has claimed for RECLAIM seconds, or three intervals if that is longer
        (its engine gone from every pool), is taken when no other is free: engines come and go,
        and the table must not fill with those gone."""
        found = self._found.get(url)
        if found is not None and self.keys[found[1]] == found[0]:
            return found[1]
        key = self.key(url)
        start = key % self.rows
        rows = [(start + step) % self.rows for step in range(_PROBES)]
        for row in rows:
            held = self.keys[row]
            if held == 0:
                if not make:
                    return None
                self.keys[row] = key  # two workers taking one row: the next read mends it
            elif held != key:
                continue
            return self._found_at(url, key, row)
        if make and now is not None:
            for row in rows:
                base = row * _WIDTH
                if now - self.values[base + _CLAIMED_AT] >= max(RECLAIM, 3 * interval):
                    self.values[base : base + _WIDTH] = [0.0] * _WIDTH
                    self.keys[row] = key
                    return self._found_at(url, key, row)
        return None

    def _found_at(self, url: str, key: int, row: int) -> int:
        if len(self._found) >= self.rows:  # engines come and go: start the cache again
            self._found.clear()
        self._found[url] = (key, row)
        return row

    def claim(self, url: str, now: float, interval: float) -> int | None:
        """The row to read `url` into, unless another worker claimed it within `interval`."""
        row = self.row(url, make=True, now=now, interval=interval)
        if row is None:
            return None
        base = row * _WIDTH
        if now - self.values[base + _CLAIMED_AT] < interval * 0.9:
            return None
        self.values[base + _CLAIMED_AT] = now
        return row

    def write(self, url: str, row: int, page: Page, now: float) -> None:
        if self.keys[row] != self.key(url):  # another worker took the row meanwhile
            return
        base = row * _WIDTH
        self.values[base + _WAITING : base + _RANKS + 1] = list(page)
        self.values[base + _READ_AT] = now

    def read(self, url: str, now: float, stale: float) -> Reported | None:
        row = self.row(url)
        if row is None:
            return None
        base = row * _WIDTH
        waiting, running, kv = self.values[base : base + _KV + 1]
        read_at = self.values[base + _READ_AT]
        if read_at <= 0 or now - read_at > stale:
            return None
        return Reported(waiting, running, kv, now - read_at, read_at)

    def facts(self, url: str) -> Facts | None:
        """What the engine last said of its cache, however long ago; None if never."""
        row = self.row(url)
        if row is None:
            return None
        base = row * _WIDTH
        if self.values[base + _READ_AT] <= 0:
            return None
        return Page(0.0, 0.0, 0.0, *self.values[base + _BLOCK : base + _RANKS + 1]).facts()


class EngineLoad:
    """Reads every engine's /metrics on an interval (a background thread, a greenlet under
    gevent) and tells a pool which engines are busy."""

    def __init__(
        self,
        get: Callable[[Instance, float], bytes],
        pools: Iterable[Pool],
        interval: float,
        queue_limit: int,
        kv_full: float,
        table: LoadTable | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.get = get  # GET instance's /metrics within a timeout: its body
        self.pools = list(pools)
        self.interval = interval
        self.queue_limit = queue_limit
        self.kv_full = kv_full
        self.table = table or LoadTable()
        self.clock = clock  # CLOCK_MONOTONIC: one clock for every process of the host
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._readers = Fanout(CONCURRENT)

    @property
    def enabled(self) -> bool:
        return self.interval > 0

    def start(self) -> None:
        if self.enabled and self._thread is None:
            for pool in self.pools:
                pool.busy, pool.reported, pool.load = self.busy, self.report, self.reported
            self._thread = threading.Thread(
                target=self._run, name="pd-gateway-engine-load", daemon=True
            )
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.interval + 2)
        self._readers.close()

    def reported(self, instance: Instance) -> Reported | None:
        return self.table.read(instance.url, self.clock(), 3 * self.interval)

    def facts(self, instance: Instance) -> Facts | None:
        """What the engine says of its KV cache, once any worker of the host has read it."""
        return self.table.facts(instance.url) if self.enabled else None

    def report(self, instance: Instance) -> dict | None:
        """What /admin/status shows: the engine's last report, if fresh."""
        found = self.reported(instance)
        return (
            None
            if found is None
            else {
                "waiting": found.waiting,
                "running": found.running,
                "kv_cache_usage": round(found.kv_usage, 4),
                "age_seconds": round(found.age, 2),
                "busy": self.busy(instance),
            }
        )

    def busy(self, instance: Instance) -> bool:
        """Queueing or full by its own report (a stale or missing report: not busy)."""
        report = self.reported(instance)
        return report is not None and (
            report.waiting > self.queue_limit or report.kv_usage >= self.kv_full
        )

    def read_all(self) -> None:
        """One round: each engine no other worker has read within the interval, `CONCURRENT`
        at once (an engine that answers slowly, or trickles its page, costs its own read's
        time, at most its timeout, not the others' turn)."""
        self._readers.run(
            lambda job: self.read_one(*job),
            [(pool, instance) for pool in self.pools for instance in pool.instances],
        )

    def read_one(self, pool: Pool, instance: Instance) -> None:
        if self._stop.is_set():
            return
        row = self.table.claim(instance.url, self.clock(), self.interval)
        if row is None:
            return
        try:
            # Bounded in time and size (Upstream.get_bytes): a page that trickles is cut.
            page = parse(self.get(instance, min(self.interval, 2.0)))
        except Exception as exc:  # down, slow, too large, not vLLM: its report goes stale
            log.debug("%s /metrics: %r", instance.name, exc)
            page = None
        if page is None:
            metrics.ENGINE_METRICS_READS.labels(pool.role, "failed").inc()
            return
        before = self.table.facts(instance.url)
        self.table.write(instance.url, row, page, self.clock())
        self._tell(instance, before)
        metrics.ENGINE_METRICS_READS.labels(pool.role, "read").inc()

    def _tell(self, instance: Instance, before: Facts | None) -> None:
        """Log what an engine says of its KV cache, the first time and when it changes (a
        restart with other settings), once per host."""
        facts = self.table.facts(instance.url)
        if facts is None or facts == before:
            return
        log.info("%s (%s): %s", instance.name, instance.public_url, facts.said())

    def _run(self) -> None:
        while not self._stop.is_set():
            started = self.clock()
            try:
                self.read_all()
            except Exception:  # a bug must not end the loop
                log.exception("reading the engines' /metrics failed")
            self._stop.wait(max(0.05, self.interval - (self.clock() - started)))


# vLLM's block size when nothing says otherwise (vllm/config/cache.py ~L185, DEFAULT_BLOCK_SIZE).
DEFAULT_BLOCK_SIZE = 16


class BlockSize:
    """The KV block size of one model's engines, which partial reuse cuts D's block lists at:
    `given` (--kv-block-size) if set; else the size every engine of the model reports
    (vllm:cache_config_info), None while none has (no partial reuse yet) or when they disagree
    (none then: a warning says so); vLLM's default where reports are off. Looked at again
    once a second (five times while unknown), not per turn."""

    def __init__(
        self,
        given: int | None,
        pools: Iterable[Pool],
        load: EngineLoad,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.given = given
        self.pools = list(pools)
        self.load = load
        self.clock = clock
        self._value: int | None = None
        self._at = float("-inf")
        self._warned: frozenset[int] = frozenset()

    def __call__(self) -> int | None:
        if self.given:
            return self.given
        if not self.load.enabled:
            return DEFAULT_BLOCK_SIZE
        now = self.clock()
        # Known: looked at again once a second; not (yet) known, five times a second.
        if now - self._at >= (1.0 if self._value is not None else 0.2):
            self._value, self._at = self._read(), now
        return self._value

    def _read(self) -> int | None:
        sizes = {
            facts.block_size
            for pool in self.pools
            for instance in pool.instances
            if (facts := self.load.facts(instance)) is not None and facts.block_size
        }
        if len(sizes) > 1:
            if sizes != self._warned:
                self._warned = frozenset(sizes)
                model = self.pools[0].model if self.pools else ""
                log.warning(
                    "the engines%s report different KV block sizes (%s): no partial "
                    "reuse (with bidirectional transfer each side reads the other's "
                    "blocks, so vLLM needs them equal: `pd-gateway check`)",
                    f" of model {model!r}" if model else "",
                    ", ".join(map(str, sorted(sizes))),
                )
            return None
        return next(iter(sizes), None)
