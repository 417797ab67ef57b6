"""`ConversationStore`: where each conversation's latest decode KV params wait for the next turn."""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from cachetools import TTLCache


@dataclass(frozen=True)
class Entry:
    """What one finished turn leaves for the next: D's params and where they live."""

    params: dict
    decode_url: str          # the D instance holding the blocks (and its local prefix cache)
    history_digest: str      # digest of the history the blocks hold (conversation.Identity)
    history_len: int         # its length: messages for chat, characters for a prompt


class ConversationStore(Protocol):
    def take(self, key: str) -> Entry | None:
        """Remove and return the entry: D hands its blocks over once, so an entry is single use."""

    def put(self, key: str, entry: Entry) -> None:
        """Store the entry, replacing any older one for the key."""

    def __len__(self) -> int: ...


class LocalStore:
    """A per-process store: a TTL-bounded LRU cache behind one lock.

    D's params are kept as compact JSON: a block-id list as Python ints costs 36 bytes an id,
    as JSON about 6, and the store holds up to `store_size` entries in every worker.
    """

    def __init__(self, maxsize: int, ttl: float,
                 timer: Callable[[], float] = time.monotonic) -> None:
        # TTLCache is not thread-safe (even a read reorders its LRU links), so every
        # operation holds the lock; none does I/O while holding it.
        self._cache: TTLCache[str, tuple] = TTLCache(maxsize=maxsize, ttl=ttl, timer=timer)
        self._lock = threading.Lock()

    def take(self, key: str) -> Entry | None:
        with self._lock:
            packed = self._cache.pop(key, None)
        return None if packed is None else unpack(packed)

    def put(self, key: str, entry: Entry) -> None:
        packed = pack(entry)
        with self._lock:
            self._cache[key] = packed

    def __len__(self) -> int:
        with self._lock:
            return len(self._cache)


def pack(entry: Entry) -> tuple:
    return (json.dumps(entry.params, separators=(",", ":")).encode(),
            entry.decode_url, entry.history_digest, entry.history_len)


def unpack(packed: tuple) -> Entry:
    params, *rest = packed
    return Entry(json.loads(params), *rest)
