"""KV memory as vLLM 0.33.0 keeps it: a bounded pool of blocks shared by running requests, leases
(a finished request's blocks kept for one read) and the prefix cache, with LRU eviction.

vLLM's rules followed here (paths under vllm/, `nixl/` is
distributed/kv_transfer/kv_connector/v1/nixl/; docs/emulator.md lists them all):
- a block is referenced (by a running request or a delayed free) or free; a free block that
  holds a full block's hash stays findable by the prefix cache until it is handed out again,
  the least recently freed first, a sequence's tail before its head (v1/core/block_pool.py
  `get_new_blocks`, `free_blocks`, `touch`);
- usage is the referenced share of the pool; cached free blocks count as free
  (block_pool.py `get_usage`);
- a finished request's blocks stay referenced until its one reader notifies (or its TTL passes)
  only if the connector tracks it (`nixl/pull_scheduler.py` ~L119-125, `nixl/pull_worker.py`
  ~L97-121 and ~L670-681); an untracked lease is never freed.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from cachetools import TLRUCache


@dataclass
class Blocks:
    """One request's blocks: the full ones known to the prefix cache by hash, and the rest."""

    hashed: list[int] = field(default_factory=list)
    private: int = 0

    def __len__(self) -> int:
        return len(self.hashed) + self.private


class BlockPool:
    """`capacity` blocks of `block_size` tokens. Not thread-safe: the engine runs on one gevent
    hub."""

    def __init__(self, block_size: int, capacity: int, caching: bool = True) -> None:
        self.block_size = block_size
        self.capacity = capacity
        self.caching = caching
        self._refs: dict[int, int] = {}  # hashed blocks in use: hash -> references
        self._free: OrderedDict[int, None] = (
            OrderedDict()
        )  # hashed free blocks, first evicted first
        self._private = 0  # unhashed blocks in use

    def hashes(self, tokens, salt: str | None = None) -> list[int]:
        """Chained hashes of the full blocks of `tokens`; vLLM mixes cache_salt into the first."""
        previous = hash(salt) if salt else 0
        out = []
        bs = self.block_size
        for start in range(0, len(tokens) - bs + 1, bs):
            previous = hash((previous, tuple(tokens[start : start + bs])))
            out.append(previous)
        return out

    def match(self, hashes: list[int], limit: int) -> int:
        """How many of the leading `hashes` (at most `limit`) the prefix cache holds."""
        if not self.caching:
            return 0
        found = 0
        for block_hash in hashes[:limit]:
            if block_hash not in self._refs and block_hash not in self._free:
                break
            found += 1
        return found

    @property
    def used(self) -> int:
        return len(self._refs) + self._private

    @property
    def cached(self) -> int:
        return len(self._refs) + len(self._free)

    def usage(self) -> float:
        return self.used / self.capacity

    def allocate(self, hit: list[int], new: int) -> Blocks | None:
        """Reference the cached blocks `hit` and take `new` fresh ones, evicting free cached
        blocks as needed; None (nothing changed) if the pool cannot hold them."""
        reused = sum(1 for h in hit if h not in self._refs)
        if self.used + reused + new > self.capacity:
            return None
        for block_hash in hit:
            self._touch(block_hash)
        empty = self.capacity - self.used - len(self._free)
        for _ in range(max(0, new - empty)):
            self._free.popitem(last=False)  # evicted: no longer found by the cache
        self._private += new
        return Blocks(list(hit), new)

    def commit(self, blocks: Blocks, hashes: list[int]) -> None:
        """The request's first len(hashes) blocks are now full and computed: cache them. A hash
        another block already holds leaves this copy unhashed, as vLLM keeps duplicates."""
        if not self.caching:
            return
        for block_hash in hashes[len(blocks.hashed) : len(blocks)]:
            if blocks.private == 0 or block_hash in self._refs or block_hash in self._free:
                break
            blocks.private -= 1
            self._private -= 1
            self._refs[block_hash] = 1
            blocks.hashed.append(block_hash)

    def free(self, blocks: Blocks) -> None:
        """Drop the request's references: its hashed blocks become evictable, tail first."""
        for block_hash in reversed(blocks.hashed):
            left = self._refs[block_hash] - 1
            if left:
                self._refs[block_hash] = left
            else:
                del self._refs[block_hash]
                self._free[block_hash] = None
        self._private -= blocks.private
        blocks.hashed, blocks.private = [], 0

    def _touch(self, block_hash: int) -> None:
        if block_hash in self._refs:
            self._refs[block_hash] += 1
        else:
            del self._free[block_hash]
            self._refs[block_hash] = 1


@dataclass(frozen=True)
class Lease:
    """A finished request's blocks kept for one read: the tokens they hold and their ids."""

    request_id: str
    tokens: tuple[str, ...]
    block_ids: tuple[int, ...]
    expires_at: float | None  # None: untracked, never freed (see `LeaseStore.put`)
    salt: str | None = None  # the request's cache_salt
    blocks: Blocks = field(default_factory=Blocks, compare=False, repr=False)
    # A hybrid model's sliding-window group: its ids for the sequence's last blocks only (the
    # window's exports are clipped to them, nixl/base_scheduler.py ~L270-286). Their memory is
    # not counted apart: the pool counts the full-attention group's blocks.
    window_ids: tuple[int, ...] = ()

    @property
    def groups(self) -> list[list[int]]:
        """The block ids per KV-cache group, as the params export them."""
        return [list(self.block_ids)] + ([list(self.window_ids)] if self.window_ids else [])

    def read_blocks(self, block_ids: list[int], block_size: int) -> list[list[str]]:
        """The tokens each of the given blocks (of any group) holds, in the order asked."""
        index = {block_id: i for i, block_id in enumerate(self.block_ids)}
        first_windowed = len(self.block_ids) - len(self.window_ids)
        index.update((block_id, first_windowed + j) for j, block_id in enumerate(self.window_ids))
        out: list[list[str]] = []
        for block_id in block_ids:
            if block_id not in index:
                raise LeaseMismatch(f"{self.request_id} holds no block {block_id}")
            i = index[block_id]
            out.append(list(self.tokens[i * block_size : (i + 1) * block_size]))
        return out

    def read(self, block_ids: list[int], block_size: int) -> list[str]:
        """The tokens the given blocks of this lease hold, in the order asked."""
        return [t for block in self.read_blocks(block_ids, block_size) for t in block]


def _distinct(leases: list[Lease]) -> int:
    """Blocks the leases hold, each once: a conversation's next turn on the same D references
    the blocks its previous turn keeps (a prefix cache hit), so two leases may share blocks."""
    hashed: set[int] = set()
    for lease in leases:
        hashed.update(lease.blocks.hashed)
    return len(hashed) + sum(lease.blocks.private for lease in leases)


class LeaseGone(LookupError):
    """Unknown, already read and notified, or expired: the reader counts a stale pull."""


class LeaseMismatch(ValueError):
    """The reader named block ids this lease does not hold; the lease stays for its real owner."""


class _FreeingCache(TLRUCache):
    """Leases until their own expiry; what expires goes to `on_expire` (the cache also expires
    on every insert, where the expired items would otherwise be dropped unseen)."""

    def __init__(self, timer: Callable[[], float], on_expire: Callable[[Lease], None]) -> None:
        super().__init__(math.inf, lambda _key, lease, _now: lease.expires_at, timer=timer)
        self._on_expire = on_expire

    def expire(self, time=None):
        gone = super().expire(time)
        for _, lease in gone:
            self._on_expire(lease)
        return gone


class LeaseStore:
    """Leases by internal request id. A tracked lease is freed by its reader's notification or
    when its TTL passes on `clock`; an untracked one stays until the engine stops (vLLM's leak)."""

    def __init__(
        self,
        block_size: int,
        clock: Callable[[], float] = time.monotonic,
        on_free: Callable[[Lease], None] = lambda lease: None,
    ) -> None:
        self.block_size = block_size
        self._clock = clock
        self._on_free = on_free
        self.expired = 0  # freed at their TTL, unread (since start)
        # The blocks tracked leases hold, each once (as `held` counts them), kept as leases
        # come and go, and the most they held at once since start or `reset_peak`.
        self._refs: dict[int, int] = {}
        self._private = 0
        self.peak_blocks = 0
        self._leases = _FreeingCache(clock, self._expired)
        self._untracked: dict[str, Lease] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # the KV port and the API share it (one gevent hub)

    def _expired(self, lease: Lease) -> None:
        self.expired += 1
        self._uncount(lease)
        self._on_free(lease)

    def _count(self, lease: Lease) -> None:
        for block in lease.blocks.hashed:
            self._refs[block] = self._refs.get(block, 0) + 1
        self._private += lease.blocks.private
        self.peak_blocks = max(self.peak_blocks, self.blocks())

    def _uncount(self, lease: Lease) -> None:
        for block in lease.blocks.hashed:
            left = self._refs.pop(block) - 1
            if left:
                self._refs[block] = left
        self._private -= lease.blocks.private

    def blocks(self) -> int:
        """Blocks the tracked leases hold now, each once."""
        return len(self._refs) + self._private

    def reset_peak(self) -> None:
        self.peak_blocks = self.blocks()

    def put(
        self,
        request_id: str,
        tokens: tuple[str, ...],
        ttl: float | None,
        salt: str | None = None,
        blocks: Blocks | None = None,
        window: int = 0,
    ) -> Lease:
        """Keep `blocks` for one read of `tokens`: for `ttl` seconds, or for good when None;
        `window`: the last blocks a sliding-window group exports (0: no such group). Ids start
        at 1: 0 is vLLM's null block."""
        count = -(-len(tokens) // self.block_size)
        with self._lock:
            ids = tuple(next(self._ids) for _ in range(count))
            windowed = tuple(next(self._ids) for _ in range(min(window, count)))
            expires = None if ttl is None else self._clock() + ttl
            lease = Lease(request_id, tokens, ids, expires, salt, blocks or Blocks(), windowed)
            if ttl is None:
                self._untracked[request_id] = lease
                return lease
            replaced = self._leases.pop(request_id, None)
            if replaced is not None:
                self._uncount(replaced)
            self._leases[request_id] = lease
            self._count(lease)
        return lease

    def get(self, request_id: str) -> Lease:
        """The lease, to read from (a read frees nothing: the reader's notification does)."""
        with self._lock:
            self._leases.expire()
            lease = self._leases.get(request_id) or self._untracked.get(request_id)
        if lease is None:
            raise LeaseGone(request_id)
        return lease

    def holds(self, request_id: str) -> bool:
        """Is a lease (tracked or not) still kept for this request? Nothing changes."""
        with self._lock:
            self._leases.expire()
            return request_id in self._leases or request_id in self._untracked

    def notify(self, request_id: str) -> Lease | None:
        """A reader is done (read, or declined): free a tracked lease. An untracked one is
        ignored, as vLLM's worker ignores notifications for requests it never saw in a batch
        ("Potentially invalid KV blocks for unrecognized request")."""
        with self._lock:
            self._leases.expire()
            lease = self._leases.pop(request_id, None)
            if lease is not None:
                self._uncount(lease)
        if lease is not None:
            self._on_free(lease)
        return lease

    def expire(self) -> None:
        with self._lock:
            self._leases.expire()

    def next_expiry(self) -> float | None:
        with self._lock:
            return min((lease.expires_at for lease in self._leases.values()), default=None)

    def held(self) -> dict:
        """What leases hold now: tracked and untracked (leaked), in leases and blocks."""
        with self._lock:
            self._leases.expire()
            tracked = list(self._leases.values())
            leaked = list(self._untracked.values())
        return {
            "kv_leases": len(tracked),
            "kv_lease_blocks": _distinct(tracked),
            "kv_lease_blocks_peak": self.peak_blocks,
            "leaked_leases": len(leaked),
            "leaked_blocks": _distinct(leaked),
            "leases_expired_unread": self.expired,
        }

    def __len__(self) -> int:
        with self._lock:
            self._leases.expire()
            return len(self._leases) + len(self._untracked)
