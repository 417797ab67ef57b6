"""`RedisStore`: conversation entries in one Redis primary (or the one a Sentinel set names),
shared by every worker and gateway host; each D's pinned blocks counted in Redis on the way."""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Sequence

from gateway import redis_url
from gateway.engines.d_budget import Limit
from gateway.engines.instances import public_url
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
from gateway.reuse.store.ledger import LEDGER
from gateway.support import metrics

log = logging.getLogger(__name__)

# One primary: the scripts name the ledger's keys themselves, and take the entries over budget.
_UNPIN = (
    LEDGER
    + """
local function ledger(prefix, d)
    local base = prefix .. 'pinned'
    return {base .. ':' .. d, base .. '-blocks:' .. d, base .. '-total:' .. d,
            base .. '-held:' .. d, base .. '-tenant:' .. d}
end
-- A member uncounted from D's ledger, and its owner key (which D it is on) gone.
local function unpin_from(prefix, d, member)
    local n = unpin(ledger(prefix, d), member)
    local owner = prefix .. 'pinned-of:' .. member
    if redis.call('GET', owner) == d then redis.call('DEL', owner) end
    return n
end
local function unpin_member(prefix, member)
    local d = redis.call('GET', prefix .. 'pinned-of:' .. member)
    if not d then return 0 end
    return unpin_from(prefix, d, member)
end
-- D's members over its budget taken out, entries and all: their values and D's total after.
local function trim_entries(prefix, d, keep, budget, total, alone)
    local over
    over, total = trim(ledger(prefix, d), keep, budget, total, alone)
    local values = {}
    for _, member in ipairs(over) do
        local owner = prefix .. 'pinned-of:' .. member
        if redis.call('GET', owner) == d then redis.call('DEL', owner) end
        local value = redis.call('GETDEL', prefix .. member)
        if value then table.insert(values, value) end
    end
    return values, total
end
"""
)

_TAKE_FIRST = (
    _UNPIN
    + """
local prefix = ARGV[1]
for i, key in ipairs(KEYS) do
    local value = redis.call('GETDEL', key)
    if value then
        unpin_member(prefix, string.sub(key, #prefix + 1))
        return {i, value}
    end
end
return false
"""
)

# KEYS[1] the entry; ARGV: packed entry, expiry (ms), now (ms), member, blocks, budget's cap, D
# id, prefix, budget's cut, tenant. Returns the entry it replaced (or false), the entries
# dropped over D's budget (never this one while its tenant is alone on D), and D's total after.
_PUT = (
    _UNPIN
    + """
local prefix, member, d, expiry = ARGV[8], ARGV[4], ARGV[7], tonumber(ARGV[2])
local now, tenant = tonumber(ARGV[3]), ARGV[10]
local keys = ledger(prefix, d)
local old = redis.call('SET', KEYS[1], ARGV[1], 'PXAT', ARGV[2], 'GET')
unpin_member(prefix, member)                  -- the entry it replaces, on whichever D
expired(keys, now)
local total = pin(keys, member, ARGV[5], expiry, tenant)
redis.call('SET', prefix .. 'pinned-of:' .. member, d, 'PXAT', ARGV[2])
local over
over, total = trim_entries(prefix, d, member,
                           budget_at(tonumber(ARGV[6]), tonumber(ARGV[9]), total),
                           total, tonumber(ARGV[5]))
keep_ledger(keys, tenant, now, expiry)
return {old or false, over, total}
"""
)

# ARGV: prefix, D id, budget's cap and cut. A D's budget that shrank: its entries beyond it
# taken out. Returns their values and D's total after.
_TRIM = (
    _UNPIN
    + """
local prefix, d = ARGV[1], ARGV[2]
local total = tonumber(redis.call('GET', prefix .. 'pinned-total:' .. d) or '0')
local over
over, total = trim_entries(prefix, d, false,
                           budget_at(tonumber(ARGV[3]), tonumber(ARGV[4]), total), total, 0)
return {over, total}
"""
)


def id_in_redis(decode_url: str) -> str:
    """A D's name in Redis: its URL's digest (no credentials in Redis)."""
    return hashlib.blake2b(decode_url.encode(), digest_size=8).hexdigest()


class RedisStore:
    """Entries in Redis (SET with expiry, GETDEL: Redis 6.2+ or Valkey), shared by every worker
    and gateway host, so any of them can serve any turn: one primary (or one Sentinel follows);
    a Redis Cluster is `RedisClusterStore`.

    Redis failing never fails a request: a take that fails is a miss, a put that fails leaves
    no entry; both are counted and logged.
    """

    PREFIX = "pd-gateway:"

    def __init__(
        self,
        url: str,
        ttl: float,
        timeout: float,
        client=None,
        pinned_budget: int | Budget = 0,
        timer: Callable[[], float] = time.time,
    ) -> None:
        from redis.commands.core import Script  # only a Redis-backed gateway needs the client

        # ValueError and TypeError: a foreign value under our key.
        self._errors: tuple[type[Exception], ...] = (*redis_url.failures(), ValueError, TypeError)
        self._redis = client if client is not None else redis_url.redis_client(url, timeout)[0]
        self._ttl_ms = int(ttl * 1000)
        # Each D's budget, across every host sharing the store (gateway.engines.d_budget).
        self.budget: Budget = pinned_budget if callable(pinned_budget) else fixed(pinned_budget)
        self._totals: dict[str, int] = {}  # each D's pinned blocks, as the last call counted
        self._timer = timer  # wall-clock seconds: every host reads the same expiry
        # One round trip however many history prefixes a request tries (a long conversation
        # whose entry expired tries them all), and one a put, the blocks each D keeps counted
        # on the way. Their keys must live on one node: no Cluster.
        self._take_first = Script(self._redis, _TAKE_FIRST)
        self._put = Script(self._redis, _PUT)
        self._trim = Script(self._redis, _TRIM)
        self.on_drop: Callable[[Entry, str], None] = ignore

    def take_first(self, keys: Sequence[str], tag: str = "") -> tuple[str, Entry] | None:
        if not keys:
            return None
        try:
            found = self._take_first(keys=[self.PREFIX + key for key in keys], args=[self.PREFIX])
            # `not found`: Lua's false is None over RESP2, False over RESP3.
            return None if not found else (keys[found[0] - 1], decode(found[1]))
        except self._errors as exc:
            self._failed("take", exc)
            return None

    def _stamp(self, entry: Entry) -> tuple[Entry, float, int, str] | None:
        """The entry with its wall-clock expiry (PXAT: every gateway host reads the same one),
        now, that expiry in ms, and its D's id; None if it is already due."""
        now = self._timer()
        entry = stamped(entry, now, self._ttl_ms / 1000)
        assert entry.expires_at is not None  # stamped sets it
        expires_ms = int(entry.expires_at * 1000)
        if expires_ms <= now * 1000:
            return None
        return entry, now, expires_ms, id_in_redis(entry.decode_url)

    def _counted(self, decode_url: str, total: int) -> None:
        self._totals[decode_url] = total
        metrics.SHARED_PINNED_BLOCKS.labels(public_url(decode_url)).set(total)

    def _dropped(self, values: list, why: str) -> None:
        """Entries that left unread (their packed values): to `on_drop`."""
        for packed in values:
            try:
                dropped = decode(packed)
            except ValueError:  # a foreign value under our key: nothing to release
                continue
            self.on_drop(dropped, why)

    def put(self, key: str, entry: Entry, tag: str = "", tenant: str = "") -> None:
        stamp = self._stamp(entry)
        if stamp is None:
            return
        entry, now, expires_ms, decode_id = stamp
        packed_entry = encode(entry)
        limit = self.budget(entry.decode_url)
        try:
            old, over, total = self._put(
                keys=[self.PREFIX + key],
                args=[
                    packed_entry,
                    expires_ms,
                    int(now * 1000),
                    key,
                    pinned_blocks(entry),
                    limit.cap,
                    decode_id,
                    self.PREFIX,
                    limit.cut,
                    tenant,
                ],
            )
        except self._errors as exc:
            self._failed("put", exc)
            return
        self._counted(entry.decode_url, total)
        # The entry this one replaced (a regenerated turn), and those over D's budget: their
        # blocks no P will read.
        # Its own entry back is not a replaced one (a script run twice): never released.
        self._dropped([old] if old and old != packed_entry else [], "replaced")
        self._dropped(over, "budget")

    def sweep(self) -> None:
        """Redis expires entries itself, unseen (the next put on their D uncounts them): their
        blocks are D's to free at its TTL, a few seconds later. A D whose budget shrank below
        what the store holds there (its total as Redis counts it, whatever this worker saw)
        has its oldest entries released now."""
        for decode_url, total in list(self._totals.items()):
            limit = self.budget(decode_url)
            if limit.cut or (limit.cap and total > limit.cap):
                self._trim_to(decode_url, limit)

    def _trim_to(self, decode_url: str, limit: Limit) -> None:
        try:
            over, total = self._trim(args=[self.PREFIX, id_in_redis(decode_url), *limit])
        except self._errors as exc:
            self._failed("ledger", exc)
            return
        self._counted(decode_url, total)
        self._dropped(over, "budget")

    def report(self) -> dict:
        try:
            return {"store": "redis", "reachable": bool(self._redis.ping())}
        except self._errors:
            return {"store": "redis", "reachable": False}

    @staticmethod
    def _failed(operation: str, exc: Exception) -> None:
        log.warning("Redis store %s failed: %r", operation, exc)
        metrics.STORE_ERRORS.labels(operation).inc()
