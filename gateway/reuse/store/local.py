"""`LocalStore`: each worker's own conversation store, in its memory, within a size and each D's
pinned budget, shared fairly by tenants."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence

from cachetools import TLRUCache

from gateway.engines.instances import public_url
from gateway.reuse.packing import digest_bytes, expiry
from gateway.reuse.store.base import (
    Budget,
    Entry,
    decode,
    encode,
    fixed,
    ignore,
    pinned_blocks,
    stamped,
)
from gateway.support import metrics

log = logging.getLogger(__name__)


def _key(key: str) -> bytes:
    """A store key in 16 bytes (49 as an object) where it is a digest in hex (every key the
    gateway makes), instead of 32 characters (81)."""
    return digest_bytes(key) or key.encode()


class _LeavingCache(TLRUCache):
    """Packed entries until their own expiry (an entry put back keeps the one its first put
    stamped: D frees the blocks then, whatever the gateway does), least recently used evicted
    first; `on_leave(key, value, why)` hears what leaves unasked: evicted for room, or expired
    (the cache also expires on every write, where expired items would leave unseen)."""

    def __init__(
        self,
        maxsize: int,
        timer: Callable[[], float],
        on_leave: Callable[[bytes, bytes, str], None],
        evictee: Callable[[], bytes | None] = lambda: None,
    ) -> None:
        super().__init__(
            maxsize=maxsize, ttu=lambda _key, packed, _now: expiry(packed), timer=timer
        )
        self._on_leave = on_leave
        self._evictee = evictee

    def popitem(self):
        """Room for a new entry: `evictee()`'s (the tenant holding the most entries gives way,
        its oldest first), else the least recently used."""
        key = self._evictee()
        if key is not None and key in self:
            value = self.pop(key)
        else:
            key, value = super().popitem()
        self._on_leave(key, value, "evicted")
        return key, value

    def expire(self, time=None):
        gone = super().expire(time)
        for key, value in gone:
            self._on_leave(key, value, "expired")
        return gone


class Pinned:
    """The blocks each D keeps for one store's entries, by tenant (client key), oldest entry
    first; past its budget on one D (`budget(decode)`, a Limit; 0: none) entries are to be
    dropped. Each tenant with entries on a D is entitled to an equal share of its budget: the
    tenant holding the most gives way first, its own oldest entries first (its newest too: one
    tenant's long turn may not release every other tenant's conversations). One tenant alone
    gives way oldest first, never the entry just added. Not thread-safe: the store's lock
    covers it."""

    def __init__(self, budget: int | Budget = 0) -> None:
        self.budget: Budget = budget if callable(budget) else fixed(budget)
        self._totals: dict[str, int] = {}
        # Per D, per tenant: its entries' blocks, oldest first, and their sum.
        self._order: dict[str, dict[str, OrderedDict[bytes, int]]] = {}
        self._held: dict[str, dict[str, int]] = {}
        self._tenant: dict[bytes, str] = {}
        # Every entry of each tenant, oldest first (the store's size is shared by tenant too).
        self._entries: dict[str, OrderedDict[bytes, None]] = {}

    def add(self, decode: str, key: bytes, blocks: int, tenant: str = "") -> list[bytes]:
        """Count the entry's blocks; the keys of the entries of `decode` beyond the budget.
        Never the entry just added while its tenant is alone on D: a conversation longer than
        the budget keeps its latest turn (alone on its D then)."""
        self._totals[decode] = self._totals.get(decode, 0) + blocks
        self._order.setdefault(decode, {}).setdefault(tenant, OrderedDict())[key] = blocks
        held = self._held.setdefault(decode, {})
        held[tenant] = held.get(tenant, 0) + blocks
        self._tenant[key] = tenant
        self._entries.setdefault(tenant, OrderedDict())[key] = None
        return self.over(decode, keep=key)

    def over(self, decode: str, keep: bytes | None = None) -> list[bytes]:
        """The keys of `decode`'s entries beyond its budget now: the largest holder's oldest
        first (never `keep` while one tenant holds them all)."""
        total = self._totals.get(decode, 0)
        budget = self.budget(decode).at(total)
        over: list[bytes] = []
        if not budget or total <= budget:
            return over
        held = dict(self._held.get(decode, {}))
        alone = len(held) == 1
        orders = self._order.get(decode, {})
        oldest: dict[str, Iterator[tuple[bytes, int]]] = {}
        while total > budget and held:
            tenant = max(held, key=held.__getitem__)
            if tenant not in oldest:
                oldest[tenant] = iter(orders.get(tenant, {}).items())
            old_key, old_blocks = next(oldest[tenant], (None, 0))
            if old_key is None or (old_key == keep and alone):
                break
            over.append(old_key)
            total -= old_blocks
            held[tenant] -= old_blocks
            if held[tenant] <= 0:
                del held[tenant]
        return over

    def remove(self, decode: str, key: bytes, blocks: int) -> None:
        left = self._totals.get(decode, 0) - blocks
        if left > 0:
            self._totals[decode] = left
        else:
            self._totals.pop(decode, None)
        tenant = self._tenant.pop(key, None)
        entries = self._entries.get(tenant) if tenant is not None else None
        if tenant is not None and entries is not None:
            entries.pop(key, None)
            if not entries:
                del self._entries[tenant]
        orders = self._order.get(decode)
        if (
            tenant is None
            or orders is None
            or orders.get(tenant, OrderedDict()).pop(key, None) is None
        ):
            return
        held = self._held[decode]
        held[tenant] -= blocks
        if not orders[tenant]:
            del orders[tenant], held[tenant]
            if not orders:
                del self._order[decode], self._held[decode]

    def evictee(self) -> bytes | None:
        """The entry to make room with in a full store, tenants sharing it equally: the oldest
        of the tenant with the most entries; None with one tenant (the least recently used
        goes, as before)."""
        if len(self._entries) < 2:
            return None
        most = max(self._entries.values(), key=len)
        return next(iter(most))

    def total(self, decode: str) -> int:
        return self._totals.get(decode, 0)

    def decodes(self) -> list[str]:
        return list(self._totals)

    def totals(self) -> dict[str, int]:
        return dict(self._totals)


class LocalStore:
    """A per-process store: a TTL-bounded LRU cache behind one lock, entries kept encoded
    (the store holds up to `store_size` of them in every worker), and the blocks each D keeps
    for them, within `pinned_budget` blocks per D when one is set."""

    def __init__(
        self,
        maxsize: int,
        ttl: float,
        timer: Callable[[], float] = time.monotonic,
        pinned_budget: int | Budget = 0,
    ) -> None:
        # The cache is not thread-safe (even a read reorders its LRU links), so every
        # operation holds the lock; none does I/O while holding it.
        self._pinned = Pinned(pinned_budget)
        self._cache = _LeavingCache(maxsize, timer, self._left, self._pinned.evictee)
        self._lock = threading.Lock()
        self._timer = timer
        self._ttl = ttl
        self._dropped: list[tuple[Entry, str]] = []  # under the lock; handed out after it
        self.on_drop: Callable[[Entry, str], None] = ignore

    def take_first(self, keys: Sequence[str], tag: str = "") -> tuple[str, Entry] | None:
        for key in keys:
            k = _key(key)
            with self._lock:  # one section: the ledger never counts an entry already gone
                packed = self._cache.pop(k, None)
                entry = None if packed is None else decode(packed)
                if entry is not None:
                    self._pinned.remove(entry.decode_url, k, pinned_blocks(entry))
            if entry is not None:
                self._publish(entry.decode_url)
                return key, entry
        return None

    def put(self, key: str, entry: Entry, tag: str = "", tenant: str = "") -> None:
        now = self._timer()
        entry = stamped(entry, now, self._ttl)
        assert entry.expires_at is not None  # stamped set it
        if entry.expires_at <= now:
            return
        try:
            packed = encode(entry)
        except (ValueError, TypeError) as exc:  # params clean_params would not have let by
            log.warning("entry not stored: %s", exc)
            return
        k = _key(key)
        with self._lock:
            old = self._cache.pop(k, None)
            if old is not None:
                self._left(k, old, "replaced")
            self._cache[k] = packed
            self._drop_over(self._pinned.add(entry.decode_url, k, pinned_blocks(entry), tenant))
        self._publish(entry.decode_url)

    @property
    def budget(self) -> Budget:
        return self._pinned.budget

    @budget.setter
    def budget(self, budget: Budget) -> None:
        """Each D's budget, as it is now (gateway.engines.d_budget): asked at every put, and at
        every sweep, where a budget that shrank releases what is beyond it."""
        self._pinned.budget = budget

    def sweep(self) -> None:
        with self._lock:
            self._cache.expire()
            for decode in self._pinned.decodes():
                self._drop_over(self._pinned.over(decode))
        self._publish()

    def _drop_over(self, keys: list[bytes]) -> None:
        """Entries beyond their D's budget leave (under the lock)."""
        for over in keys:
            value = self._cache.pop(over, None)
            if value is not None:
                self._left(over, value, "budget")

    def _left(self, key: bytes, packed: bytes, why: str) -> None:
        """An entry left unread (under the lock): uncount its blocks, drop it after the lock."""
        try:
            entry = decode(packed)
        except ValueError:
            return
        self._pinned.remove(entry.decode_url, key, pinned_blocks(entry))
        self._dropped.append((entry, why))

    def _publish(self, decode_url: str | None = None) -> None:
        """Hand dropped entries to `on_drop`, and the pinned counts of the Ds that changed to
        /metrics, outside the lock."""
        with self._lock:
            dropped, self._dropped = self._dropped, []
            changed = {entry.decode_url for entry, _ in dropped}
            if decode_url is not None:
                changed.add(decode_url)
            counts = {url: self._pinned.total(url) for url in changed}
        for entry, why in dropped:
            self.on_drop(entry, why)
        for url, count in counts.items():
            metrics.PINNED_BLOCKS.labels(public_url(url)).set(count)

    def pinned(self) -> dict[str, int]:
        """Blocks each D keeps for this store's entries, by D's URL without credentials."""
        with self._lock:
            return {public_url(url): count for url, count in self._pinned.totals().items()}

    def __len__(self) -> int:
        with self._lock:
            return len(self._cache)

    def report(self) -> dict:
        return {"store": "local", "conversations": len(self), "pinned_blocks": self.pinned()}
