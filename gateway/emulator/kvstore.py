"""KV block bookkeeping: single-use leases with a TTL (served on the KV port) and the local prefix cache."""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from cachetools import TTLCache


@dataclass(frozen=True)
class Lease:
    """Blocks a finished request keeps for one pull: the tokens they hold and their ids."""

    request_id: str
    tokens: tuple[str, ...]
    block_ids: tuple[int, ...]
    expires_at: float
    salt: str | None = None   # the request's cache_salt


class LeaseGone(LookupError):
    """Unknown, already pulled, or expired: the reader counts a stale pull."""


class LeaseMismatch(ValueError):
    """The reader named block ids this lease does not hold; the lease stays for its real owner."""


class _ExpiryCountingCache(TTLCache):
    """A TTLCache that counts what it expires (it expires on every insert, not only on ask)."""

    expired = 0

    def expire(self, time=None):  # type: ignore[no-untyped-def]
        gone = super().expire(time)
        self.expired += len(gone)
        return gone


class LeaseStore:
    """Leases by internal request id; `take` hands one over once, expiry after `ttl` seconds of `clock`."""

    def __init__(self, block_size: int, ttl: float, maxsize: int = 100_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.block_size = block_size
        self.ttl = ttl
        self._clock = clock
        self._leases = _ExpiryCountingCache(maxsize, ttl, timer=clock)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # cachetools is not thread-safe; cheap under gevent

    def put(self, request_id: str, tokens: tuple[str, ...], salt: str | None = None) -> Lease:
        blocks = -(-len(tokens) // self.block_size)
        with self._lock:
            lease = Lease(request_id, tokens, tuple(next(self._ids) for _ in range(blocks)),
                          self._clock() + self.ttl, salt)
            self._leases[request_id] = lease
        return lease

    def take(self, request_id: str, block_ids: tuple[int, ...] | None = None) -> Lease:
        """Remove and return the lease; with `block_ids`, only if they are the lease's blocks."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None:
                raise LeaseGone(request_id)
            if block_ids is not None and tuple(block_ids) != lease.block_ids:
                raise LeaseMismatch(f"{request_id} holds blocks {list(lease.block_ids)[:8]}...")
            del self._leases[request_id]
            return lease

    def held(self) -> tuple[int, int, int]:
        """(leases held, blocks held, leases that expired unread so far)."""
        with self._lock:
            self._leases.expire()
            return (len(self._leases), sum(len(v.block_ids) for v in self._leases.values()),
                    self._leases.expired)

    def __len__(self) -> int:
        return self.held()[0]


class PrefixCache:
    """Full blocks this engine has computed, keyed by chained block hashes like vLLM's prefix cache (LRU)."""

    def __init__(self, block_size: int, capacity_blocks: int) -> None:
        self.block_size = block_size
        self.capacity = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def _hashes(self, tokens: list[str] | tuple[str, ...], salt: str | None = None):
        # vLLM mixes cache_salt into the first block's hash: salted prompts share nothing.
        previous = hash(salt) if salt else 0
        bs = self.block_size
        for start in range(0, len(tokens) - bs + 1, bs):
            previous = hash((previous, tuple(tokens[start:start + bs])))
            yield previous

    def match(self, tokens: list[str], limit: int, salt: str | None = None) -> int:
        """Number of leading tokens held locally: whole blocks only, at most `limit`."""
        found = 0
        for block_hash in self._hashes(tokens[:limit], salt):
            if block_hash not in self._blocks:
                break
            self._blocks.move_to_end(block_hash)
            found += self.block_size
        return found

    def insert(self, tokens: list[str] | tuple[str, ...], salt: str | None = None) -> None:
        if not self.capacity:
            return
        for block_hash in self._hashes(tokens, salt):
            self._blocks[block_hash] = None
            self._blocks.move_to_end(block_hash)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)

    def __len__(self) -> int:
        return len(self._blocks)
