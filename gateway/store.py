"""`ConversationStore`: where each conversation's latest decode KV params wait for the next turn."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import Callable, Protocol, Sequence

from cachetools import TTLCache

from . import metrics
from .packing import digest_bytes, pack, unpack

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Entry:
    """What one finished turn leaves for the next: D's params and where they live."""

    params: dict
    decode_url: str          # the D instance holding the blocks (and its local prefix cache)
    history_digest: str      # digest of the history the blocks hold (conversation.Identity)
    history_len: int         # its length: messages for chat, characters for a prompt
    plain: bool = False      # a reply the digest can vouch for (gateway.exactness.plain_reply)
    token_digest: str | None = None   # digest of the tokens D holds, if D reported its ids
    # When D's blocks are gone, on the store's clock; set by the first put. D frees them at its
    # TTL whatever the gateway does, so an entry put back keeps it.
    expires_at: float | None = None


class ConversationStore(Protocol):
    def take_first(self, keys: Sequence[str]) -> tuple[str, Entry] | None:
        """Remove and return the entry under the first of `keys` that has one (keys are tried
        in order, longest history first). D hands its blocks over once: entries are single use."""

    def take(self, key: str) -> Entry | None: ...

    def put(self, key: str, entry: Entry) -> None:
        """Store the entry, replacing any older one for the key."""

    def report(self) -> dict:
        """What /health shows of the store."""


class _Takes:
    def take(self, key: str) -> Entry | None:
        found = self.take_first([key])
        return None if found is None else found[1]


def encode(entry: Entry) -> bytes:
    """The entry in a few hundred bytes (gateway.packing): Python objects would take kilobytes."""
    return pack(entry.params, entry.decode_url, entry.history_digest, entry.history_len,
                entry.plain, entry.token_digest, entry.expires_at)


def decode(packed: bytes) -> Entry:
    """The entry `encode` packed; ValueError for anything else (a foreign value in Redis)."""
    return Entry(*unpack(packed))


def _key(key: str) -> bytes:
    """A store key in 16 bytes (49 as an object) where it is a digest in hex (every key the
    gateway makes), instead of 32 characters (81)."""
    return digest_bytes(key) or key.encode()


def stamped(entry: Entry, now: float, ttl: float) -> Entry:
    """The entry with its expiry: now + ttl on the first put, unchanged after."""
    return entry if entry.expires_at is not None else replace(entry, expires_at=now + ttl)


class LocalStore(_Takes):
    """A per-process store: a TTL-bounded LRU cache behind one lock, entries kept encoded
    (the store holds up to `store_size` of them in every worker)."""

    def __init__(self, maxsize: int, ttl: float,
                 timer: Callable[[], float] = time.monotonic) -> None:
        # TTLCache is not thread-safe (even a read reorders its LRU links), so every
        # operation holds the lock; none does I/O while holding it.
        self._cache: TTLCache[bytes, bytes] = TTLCache(maxsize=maxsize, ttl=ttl, timer=timer)
        self._lock = threading.Lock()
        self._timer = timer
        self._ttl = ttl

    def take_first(self, keys: Sequence[str]) -> tuple[str, Entry] | None:
        now = self._timer()
        for key in keys:
            with self._lock:
                packed = self._cache.pop(_key(key), None)
            if packed is not None:
                entry = decode(packed)
                if entry.expires_at > now:     # a put-back entry past its own expiry: gone
                    return key, entry
        return None

    def put(self, key: str, entry: Entry) -> None:
        now = self._timer()
        entry = stamped(entry, now, self._ttl)
        if entry.expires_at <= now:
            return
        try:
            packed = encode(entry)
        except (ValueError, TypeError) as exc:   # params clean_params would not have let by
            log.warning("entry not stored: %s", exc)
            return
        with self._lock:
            self._cache[_key(key)] = packed

    def __len__(self) -> int:
        with self._lock:
            return len(self._cache)

    def report(self) -> dict:
        return {"store": "local", "conversations": len(self)}


_TAKE_FIRST = """
for i, key in ipairs(KEYS) do
    local value = redis.call('GETDEL', key)
    if value then return {i, value} end
end
return false
"""


class RedisStore(_Takes):
    """Entries in Redis (SET with expiry, GETDEL: Redis 6.2+ or Valkey), shared by every worker
    and gateway host, so any of them can serve any turn.

    Redis failing never fails a request: a take that fails is a miss, a put that fails leaves
    no entry; both are counted and logged.
    """

    PREFIX = "pd-gateway:"

    def __init__(self, url: str, ttl: float, timeout: float, client=None) -> None:
        import redis   # only a Redis-backed gateway needs the client

        self._errors = (redis.RedisError, ValueError, TypeError)   # or a foreign value
        self._redis = client if client is not None else redis.Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout)
        self._ttl_ms = int(ttl * 1000)
        # One round trip however many history prefixes a request tries (a long conversation
        # whose entry expired tries them all). Its keys must live on one node: no Cluster.
        self._take_first = self._redis.register_script(_TAKE_FIRST)

    def take_first(self, keys: Sequence[str]) -> tuple[str, Entry] | None:
        if not keys:
            return None
        try:
            found = self._take_first(keys=[self.PREFIX + key for key in keys])
            return None if found is None else (keys[found[0] - 1], decode(found[1]))
        except self._errors as exc:
            self._failed("take", exc)
            return None

    def put(self, key: str, entry: Entry) -> None:
        # Wall-clock expiry (PXAT): every gateway host reads the same entry.
        entry = stamped(entry, time.time(), self._ttl_ms / 1000)
        expires_ms = int(entry.expires_at * 1000)
        if expires_ms <= time.time() * 1000:
            return
        try:
            self._redis.set(self.PREFIX + key, encode(entry), pxat=expires_ms)
        except self._errors as exc:
            self._failed("put", exc)

    def report(self) -> dict:
        try:
            return {"store": "redis", "reachable": bool(self._redis.ping())}
        except self._errors:
            return {"store": "redis", "reachable": False}

    @staticmethod
    def _failed(operation: str, exc: Exception) -> None:
        log.warning("Redis store %s failed: %r", operation, exc)
        metrics.STORE_ERRORS.labels(operation).inc()


def create_store(settings) -> ConversationStore:
    if settings.store == "local":
        return LocalStore(settings.store_size, settings.store_ttl)
    return RedisStore(settings.store, settings.store_ttl, settings.store_timeout)
