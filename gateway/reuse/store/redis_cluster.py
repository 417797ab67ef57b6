"""`RedisClusterStore`: conversation entries in a Redis or Valkey Cluster, a conversation's keys
in one hash slot, each D's ledger of pinned blocks in its own."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from gateway.engines.d_budget import Limit
from gateway.reuse.store.base import Budget, Entry, decode, encode, pinned_blocks
from gateway.reuse.store.ledger import LEDGER
from gateway.reuse.store.redis_primary import RedisStore, id_in_redis

# Redis Cluster: a script's keys must share a hash slot. A conversation's entry keys (and the
# key naming each one's D) carry its root as a hash tag; each D's ledger carries its own. So
# the take and the put are one script on the conversation's slot and one on its D's: the pieces
# the single-primary scripts (redis_primary.py) do in one.
_C_TAKE = """
local prefix = ARGV[1]
for i, key in ipairs(KEYS) do
    local value = redis.call('GETDEL', key)
    if value then
        local owner = prefix .. 'pinned-of:' .. string.sub(key, #prefix + 1)
        local d = redis.call('GET', owner)
        redis.call('DEL', owner)
        return {i, value, d or false}
    end
end
return false
"""
_C_UNPIN = LEDGER + "return unpin(KEYS, ARGV[1])"
# KEYS: the entry, its owner key; ARGV: packed entry, expiry (ms), D id.
_C_PUT_ENTRY = """
local old = redis.call('SET', KEYS[1], ARGV[1], 'PXAT', ARGV[2], 'GET')
local owner = redis.call('GET', KEYS[2])
redis.call('SET', KEYS[2], ARGV[3], 'PXAT', ARGV[2])
return {old or false, owner or false}
"""
# KEYS: D's ledger (RedisClusterStore._ledger); ARGV: member, blocks, expiry (ms), now (ms),
# budget's cap, 1 if the member was on this D already, budget's cut, tenant. Returns the
# members over budget (never this one while its tenant is alone on D; the caller takes their
# entries) and D's total after.
_C_PUTLEDGER = (
    LEDGER
    + """
local member, expiry, now, tenant = ARGV[1], tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[8]
if ARGV[6] == '1' then unpin(KEYS, member) end
expired(KEYS, now)
local total = pin(KEYS, member, ARGV[2], expiry, tenant)
local over
over, total = trim(KEYS, member, budget_at(tonumber(ARGV[5]), tonumber(ARGV[7]), total), total,
                   tonumber(ARGV[2]))
keep_ledger(KEYS, tenant, now, expiry)
return {over, total}
"""
)
# KEYS: D's ledger; ARGV: its budget's cap and cut. Returns the members over it (the caller
# takes their entries) and D's total after.
_C_TRIM = (
    LEDGER
    + """
local total = tonumber(redis.call('GET', KEYS[3]) or '0')
local over
over, total = trim(KEYS, false, budget_at(tonumber(ARGV[1]), tonumber(ARGV[2]), total), total, 0)
return {over, total}
"""
)
# KEYS: an entry over its D's budget, its owner key; ARGV: the D id.
_C_DROP = """
local value = redis.call('GETDEL', KEYS[1])
if redis.call('GET', KEYS[2]) == ARGV[1] then redis.call('DEL', KEYS[2]) end
return value or false
"""


def _text(value: bytes | str) -> str:
    """A name Redis gave back (a foreign value under our key must not raise)."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class RedisClusterStore(RedisStore):
    """Entries in a Redis or Valkey Cluster: a conversation's keys in its root's hash slot, each
    D's ledger of pinned blocks in its own. A take is one script (two on a hit: its D's ledger),
    a put two (more only to drop entries over a D's budget)."""

    def __init__(
        self,
        url: str,
        ttl: float,
        timeout: float,
        client=None,
        pinned_budget: int | Budget = 0,
        timer: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(url, ttl, timeout, client, pinned_budget, timer)
        from redis.commands.core import Script

        def register(text: str) -> Script:
            return Script(self._redis, text)

        self._take_first = register(_C_TAKE)
        self._unpin = register(_C_UNPIN)
        self._put_entry = register(_C_PUT_ENTRY)
        self._put_ledger = register(_C_PUTLEDGER)
        self._c_trim = register(_C_TRIM)
        self._drop = register(_C_DROP)

    @staticmethod
    def member(key: str, tag: str) -> str:
        """The key's name in Redis (after the prefix), hash-tagged by its conversation."""
        return f"{{{tag or key}}}:{key}"

    def _ledger(self, decode_id: str) -> list[str]:
        base = f"{self.PREFIX}{{d:{decode_id}}}:"
        return [
            base + "pinned",
            base + "pinned-blocks",
            base + "pinned-total",
            base + "pinned-held",
            base + "pinned-tenant",
        ]

    def take_first(self, keys: Sequence[str], tag: str = "") -> tuple[str, Entry] | None:
        if not tag and len(keys) > 1:  # untagged keys live in slots of their own
            return next(filter(None, (self.take_first([key]) for key in keys)), None)
        if not keys:
            return None
        try:
            found = self._take_first(
                keys=[self.PREFIX + self.member(k, tag) for k in keys], args=[self.PREFIX]
            )
            if not found:
                return None
            index, packed, decode_id = found
            taken = keys[index - 1], decode(packed)
        except self._errors as exc:
            self._failed("take", exc)
            return None
        if decode_id:
            self._unpin_on(_text(decode_id), self.member(taken[0], tag))
        return taken

    def _unpin_on(self, decode_id: str, member: str) -> None:
        """Uncount a member on its D's ledger, which may live on another node: if that node is
        failing over, the entry still goes its way (the ledger mends at the member's expiry)."""
        try:
            self._unpin(keys=self._ledger(decode_id), args=[member])
        except self._errors as exc:
            self._failed("ledger", exc)

    def put(self, key: str, entry: Entry, tag: str = "", tenant: str = "") -> None:
        stamp = self._stamp(entry)
        if stamp is None:
            return
        entry, now, expires_ms, decode_id = stamp
        member = self.member(key, tag)
        packed = encode(entry)
        try:
            old, owner = self._put_entry(
                keys=[self.PREFIX + member, self.PREFIX + "pinned-of:" + member],
                args=[packed, expires_ms, decode_id],
            )
        except self._errors as exc:
            self._failed("put", exc)
            return
        owner = _text(owner) if owner else None
        if owner and owner != decode_id:  # the entry it replaced was on another D
            self._unpin_on(owner, member)
        # Its own entry back is not a replaced one (a script run twice): never released.
        self._dropped([old] if old and old != packed else [], "replaced")
        # The entry is stored; its D's ledger (on another node, perhaps failing over) is
        # counted on the way, and entries over D's budget taken out of their own slots.
        limit = self.budget(entry.decode_url)
        try:
            over, total = self._put_ledger(
                keys=self._ledger(decode_id),
                args=[
                    member,
                    pinned_blocks(entry),
                    expires_ms,
                    int(now * 1000),
                    limit.cap,
                    1 if owner == decode_id else 0,
                    limit.cut,
                    tenant,
                ],
            )
        except self._errors as exc:
            self._failed("ledger", exc)
            return
        self._counted(entry.decode_url, total)
        self._dropped(self._take_members(over, decode_id), "budget")

    def _trim_to(self, decode_url: str, limit: Limit) -> None:
        decode_id = id_in_redis(decode_url)
        try:
            over, total = self._c_trim(keys=self._ledger(decode_id), args=list(limit))
        except self._errors as exc:
            self._failed("ledger", exc)
            return
        self._counted(decode_url, total)
        self._dropped(self._take_members(over, decode_id), "budget")

    def _take_members(self, members: list, decode_id: str) -> list:
        """The entries of members uncounted from D's ledger, each taken out of its own slot."""
        values = []
        for gone in map(_text, members):
            try:
                value = self._drop(
                    keys=[self.PREFIX + gone, self.PREFIX + "pinned-of:" + gone], args=[decode_id]
                )
            except self._errors as exc:
                self._failed("ledger", exc)
                continue
            if value:
                values.append(value)
        return values

    def report(self) -> dict:
        from redis.cluster import RedisCluster

        try:  # the primaries (a failed replica is not the store failing)
            return {
                "store": "redis-cluster",
                "reachable": bool(self._redis.ping(target_nodes=RedisCluster.PRIMARIES)),
            }
        except self._errors:
            return {"store": "redis-cluster", "reachable": False}
