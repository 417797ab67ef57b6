"""`ConversationStore`: where each conversation's latest decode KV params wait for the next turn."""
from __future__ import annotations

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
    """A per-process store: a TTL-bounded LRU cache behind one lock."""

    def __init__(self, maxsize: int, ttl: float,
                 timer: Callable[[], float] = time.monotonic) -> None:
        # TTLCache is not thread-safe (even a read reorders its LRU links), so every
        # operation holds the lock; none does I/O while holding it.
        self._cache: TTLCache[str, Entry] = TTLCache(maxsize=maxsize, ttl=ttl, timer=timer)
        self._lock = threading.Lock()

    def take(self, key: str) -> Entry | None:
        with self._lock:
            return self._cache.pop(key, None)

    def put(self, key: str, entry: Entry) -> None:
        with self._lock:
            self._cache[key] = entry

    def __len__(self) -> int:
        with self._lock:
            return len(self._cache)
