"""`ConversationStore`: where each conversation's latest decode KV params wait for the next turn."""
from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Protocol, Sequence

from cachetools import TLRUCache

from gateway import redis_url
from gateway.engines.d_budget import Limit
from gateway.engines.instances import public_url
from gateway.redis_url import redis_client
from gateway.reuse.packing import digest_bytes, expiry, pack, unpack
from gateway.support import metrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Entry:
    """What one finished turn leaves for the next: D's params and where they live."""

    params: dict
    decode_url: str          # the D instance holding the blocks (and its local prefix cache)
    history_digest: str      # digest of the history the blocks hold (conversation.Identity)
    history_len: int         # its length: messages for chat, characters for a prompt
    plain: bool = False      # a reply the digest can vouch for (gateway.reuse.exactness.plain_reply)
    token_digest: str | None = None   # digest of the tokens D holds, if D reported its ids
    # When D's blocks are gone, on the store's clock; set by the first put. D frees them at its
    # TTL whatever the gateway does, so an entry put back keeps it.
    expires_at: float | None = None
    # Digests of D's tokens at a few block boundaries, to find how much of them a prompt that
    # does not extend them all still shares (gateway.reuse.partial); only where D reported its ids.
    prefixes: bytes | None = None


Budget = Callable[[str], Limit]     # D's URL -> its pinned budget now (gateway.engines.d_budget)


def fixed(budget: int) -> Budget:
    """The same budget for every D (0: none)."""
    limit = Limit(budget)
    return lambda decode: limit


class ConversationStore(Protocol):
    def take_first(self, keys: Sequence[str], tag: str = "") -> tuple[str, Entry] | None:
        """Remove and return the entry under the first of `keys` that has one (keys are tried
        in order, longest history first). D hands its blocks over once: entries are single use.
        `tag` is the same for every key of one conversation (its root): a Redis Cluster keeps
        them in one hash slot."""

    def take(self, key: str, tag: str = "") -> Entry | None: ...

    def put(self, key: str, entry: Entry, tag: str = "", tenant: str = "") -> None:
        """Store the entry, replacing any older one for the key. `tenant` (the client key's
        id): tenants share each D's pinned budget (and a local store's size) equally, the one
        holding the most giving way first."""

    def report(self) -> dict:
        """What /health shows of the store."""

    # Called with (entry, reason) for each entry that leaves the store unread: replaced by a
    # newer one for its key, evicted for room, expired, or over its D's pinned budget.
    on_drop: Callable[[Entry, str], None]
    # Each D's pinned budget now (gateway.engines.d_budget; 0: none).
    budget: Budget

    def sweep(self) -> None:
        """Expire what is due now, and release what is beyond a D's budget that shrank (each
        entry goes to `on_drop`)."""


class _Takes:
    def take(self, key: str, tag: str = "") -> Entry | None:
        found = self.take_first([key], tag)
        return None if found is None else found[1]


def encode(entry: Entry) -> bytes:
    """The entry in a few hundred bytes (gateway.reuse.packing): Python objects would take kilobytes."""
    return pack(entry.params, entry.decode_url, entry.history_digest, entry.history_len,
                entry.plain, entry.token_digest, entry.expires_at, entry.prefixes)


def decode(packed: bytes) -> Entry:
    """The entry `encode` packed; ValueError for anything else (a foreign value in Redis)."""
    return Entry(**unpack(packed))


def _key(key: str) -> bytes:
    """A store key in 16 bytes (49 as an object) where it is a digest in hex (every key the
    gateway makes), instead of 32 characters (81)."""
    return digest_bytes(key) or key.encode()


def pinned_blocks(entry: Entry) -> int:
    """The blocks D keeps for the entry (its exported remote_block_ids, every group)."""
    return sum(len(group) for group in entry.params.get("remote_block_ids") or ())


def _ignore(entry: Entry, reason: str) -> None:
    pass


def stamped(entry: Entry, now: float, ttl: float) -> Entry:
    """The entry with its expiry: now + ttl on the first put, unchanged after."""
    return entry if entry.expires_at is not None else replace(entry, expires_at=now + ttl)


class _LeavingCache(TLRUCache):
    """Packed entries until their own expiry (an entry put back keeps the one its first put
    stamped: D frees the blocks then, whatever the gateway does), least recently used evicted
    first; `on_leave(key, value, why)` hears what leaves unasked: evicted for room, or expired
    (the cache also expires on every write, where expired items would leave unseen)."""

    def __init__(self, maxsize: int, timer: Callable[[], float],
                 on_leave: Callable[[bytes, bytes, str], None],
                 evictee: Callable[[], bytes | None] = lambda: None) -> None:
        super().__init__(maxsize=maxsize, ttu=lambda _key, packed, _now: expiry(packed),
                         timer=timer)
        self._on_leave = on_leave
        self._evictee = evictee

    def popitem(self):  # type: ignore[no-untyped-def]
        """Room for a new entry: `evictee()`'s (the tenant holding the most entries gives way,
        its oldest first), else the least recently used."""
        key = self._evictee()
        if key is not None and key in self:
            value = self.pop(key)
        else:
            key, value = super().popitem()
        self._on_leave(key, value, "evicted")
        return key, value

    def expire(self, time=None):  # type: ignore[no-untyped-def]
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
        entries = self._entries.get(tenant)
        if entries is not None:
            entries.pop(key, None)
            if not entries:
                del self._entries[tenant]
        orders = self._order.get(decode)
        if tenant is None or orders is None or orders.get(tenant, {}).pop(key, None) is None:
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


class LocalStore(_Takes):
    """A per-process store: a TTL-bounded LRU cache behind one lock, entries kept encoded
    (the store holds up to `store_size` of them in every worker), and the blocks each D keeps
    for them, within `pinned_budget` blocks per D when one is set."""

    def __init__(self, maxsize: int, ttl: float,
                 timer: Callable[[], float] = time.monotonic,
                 pinned_budget: int | Budget = 0) -> None:
        # The cache is not thread-safe (even a read reorders its LRU links), so every
        # operation holds the lock; none does I/O while holding it.
        self._pinned = Pinned(pinned_budget)
        self._cache = _LeavingCache(maxsize, timer, self._left, self._pinned.evictee)
        self._lock = threading.Lock()
        self._timer = timer
        self._ttl = ttl
        self._dropped: list[tuple[Entry, str]] = []   # under the lock; handed out after it
        self.on_drop: Callable[[Entry, str], None] = _ignore

    def take_first(self, keys: Sequence[str], tag: str = "") -> tuple[str, Entry] | None:
        for key in keys:
            k = _key(key)
            with self._lock:       # one section: the ledger never counts an entry already gone
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
        if entry.expires_at <= now:
            return
        try:
            packed = encode(entry)
        except (ValueError, TypeError) as exc:   # params clean_params would not have let by
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
            changed = {decode_url} | {entry.decode_url for entry, _ in dropped}
            changed.discard(None)
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


# The blocks each D keeps for a Redis store's entries, shared by every gateway host: per D (an
# id of its URL) a sorted set of entry keys by expiry, their blocks and the total, each tenant's
# blocks (a sorted set) and entries (a sorted set by expiry, named after D's) and each entry's
# tenant, all expiring after its last entry; and per entry, which D it is on (expiring with the
# entry). Every loop is bounded, and a ledger that lost pieces (keys deleted by hand, an
# allkeys-* eviction) mends itself.
#
# The ledger's functions take its keys: D's sorted set, blocks, total, tenants' blocks, entries'
# tenants (a Redis Cluster passes them, in D's hash slot; one primary names them).
_LEDGER = """
local function unpin(keys, member)
    local n = tonumber(redis.call('HGET', keys[2], member) or '0')
    if n > 0 then redis.call('DECRBY', keys[3], n) end
    redis.call('HDEL', keys[2], member)
    redis.call('ZREM', keys[1], member)
    local tenant = redis.call('HGET', keys[5], member)
    if tenant then
        redis.call('HDEL', keys[5], member)
        redis.call('ZREM', keys[1] .. ':' .. tenant, member)
        if tonumber(redis.call('ZINCRBY', keys[4], -n, tenant)) <= 0 then
            redis.call('ZREM', keys[4], tenant)
        end
    end
    return n
end
-- Count an entry on D (an older count of it, one whose entry and owner key expired before
-- the ledger heard, taken out first); D's total after.
local function pin(keys, member, blocks, expiry, tenant)
    if redis.call('HEXISTS', keys[2], member) == 1 then unpin(keys, member) end
    redis.call('ZADD', keys[1], expiry, member)
    redis.call('HSET', keys[2], member, blocks)
    redis.call('HSET', keys[5], member, tenant)
    redis.call('ZADD', keys[1] .. ':' .. tenant, expiry, member)
    redis.call('ZINCRBY', keys[4], blocks, tenant)
    return redis.call('INCRBY', keys[3], blocks)
end
-- Uncount D's members that expired (D has freed their blocks too), at most 64 a call.
local function expired(keys, now)
    for _, gone in ipairs(redis.call('ZRANGEBYSCORE', keys[1], '-inf', '(' .. now, 'LIMIT', 0, 64)) do
        unpin(keys, gone)
    end
end
-- The ledger's keys outlive its last entry by a minute at most.
local function keep_ledger(keys, tenant, now, expiry)
    local keep_until = expiry + 60000
    local all = {keys[1], keys[2], keys[3], keys[4], keys[5], keys[1] .. ':' .. tenant}
    for _, key in ipairs(all) do
        local left = redis.call('PTTL', key)
        if left < 0 or now + left < keep_until then
            redis.call('PEXPIREAT', key, keep_until)
        end
    end
end
-- A D's budget for its total now: `cap` (0: none), or `cut` fewer than the total, once
-- (gateway.engines.d_budget.Limit.at).
local function budget_at(cap, cut, total)
    if cut <= 0 then return cap end
    return math.max(1, math.min(cap, total - cut))
end
-- The next member to give way (gateway.reuse.store.Pinned.over): while several tenants hold
-- blocks on D, the oldest of the one holding the most (`keep` too); else the oldest but `keep`.
local function next_over(keys, keep, alone)
    if not alone then
        local most = redis.call('ZREVRANGE', keys[4], 0, 0)[1]
        if most then
            local own = keys[1] .. ':' .. most
            local oldest = redis.call('ZRANGE', own, 0, 0)[1]
            if oldest then
                redis.call('ZREM', own, oldest)   -- gone from a ledger that lost pieces too
                return oldest
            end
        end
    end
    for _, m in ipairs(redis.call('ZRANGE', keys[1], 0, 1)) do
        if m ~= keep then return m end
    end
    return nil
end
-- D's members taken out while its total is over its budget: the members (their entries are
-- the caller's to take) and D's total after. `alone`: the total when `keep` is all that is left.
local function trim(keys, keep, budget, total, alone)
    local over = {}
    local one_tenant = redis.call('ZCARD', keys[4]) < 2
    for _ = 1, 256 do                         -- bounded: a call never holds Redis long
        if budget <= 0 or total <= budget then break end
        local oldest = next_over(keys, keep, one_tenant)
        if not oldest then                    -- `keep` alone (or nothing): the total is known
            total = alone
            redis.call('SET', keys[3], total, 'KEEPTTL')
            break
        end
        if oldest == keep then alone = 0 end  -- gone too: nothing of it is left
        total = total - unpin(keys, oldest)
        table.insert(over, oldest)
    end
    return over, total
end
"""

# One primary: the scripts name the ledger's keys themselves, and take the entries over budget.
_UNPIN = _LEDGER + """
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

_TAKE_FIRST = _UNPIN + """
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

# KEYS[1] the entry; ARGV: packed entry, expiry (ms), now (ms), member, blocks, budget's cap, D
# id, prefix, budget's cut, tenant. Returns the entry it replaced (or false), the entries
# dropped over D's budget (never this one while its tenant is alone on D), and D's total after.
_PUT = _UNPIN + """
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

# ARGV: prefix, D id, budget's cap and cut. A D's budget that shrank: its entries beyond it
# taken out. Returns their values and D's total after.
_TRIM = _UNPIN + """
local prefix, d = ARGV[1], ARGV[2]
local total = tonumber(redis.call('GET', prefix .. 'pinned-total:' .. d) or '0')
local over
over, total = trim_entries(prefix, d, false,
                           budget_at(tonumber(ARGV[3]), tonumber(ARGV[4]), total), total, 0)
return {over, total}
"""


def _decode_id(decode_url: str) -> str:
    """A D's name in Redis: its URL's digest (no credentials in Redis)."""
    return hashlib.blake2b(decode_url.encode(), digest_size=8).hexdigest()


class RedisStore(_Takes):
    """Entries in Redis (SET with expiry, GETDEL: Redis 6.2+ or Valkey), shared by every worker
    and gateway host, so any of them can serve any turn: one primary (or one Sentinel follows);
    a Redis Cluster is `RedisClusterStore`.

    Redis failing never fails a request: a take that fails is a miss, a put that fails leaves
    no entry; both are counted and logged.
    """

    PREFIX = "pd-gateway:"

    def __init__(self, url: str, ttl: float, timeout: float, client=None,
                 pinned_budget: int | Budget = 0, timer: Callable[[], float] = time.time) -> None:
        from redis.commands.core import Script  # only a Redis-backed gateway needs the client

        # ValueError and TypeError: a foreign value under our key.
        self._errors = (*redis_url.failures(), ValueError, TypeError)
        self._redis = client if client is not None else redis_client(url, timeout)[0]
        self._ttl_ms = int(ttl * 1000)
        # Each D's budget, across every host sharing the store (gateway.engines.d_budget).
        self.budget: Budget = pinned_budget if callable(pinned_budget) else fixed(pinned_budget)
        self._totals: dict[str, int] = {}   # each D's pinned blocks, as the last call counted
        self._timer = timer              # wall-clock seconds: every host reads the same expiry
        # One round trip however many history prefixes a request tries (a long conversation
        # whose entry expired tries them all), and one a put, the blocks each D keeps counted
        # on the way. Their keys must live on one node: no Cluster.
        self._take_first = Script(self._redis, _TAKE_FIRST)
        self._put = Script(self._redis, _PUT)
        self._trim = Script(self._redis, _TRIM)
        self.on_drop: Callable[[Entry, str], None] = _ignore

    def take_first(self, keys: Sequence[str], tag: str = "") -> tuple[str, Entry] | None:
        if not keys:
            return None
        try:
            found = self._take_first(keys=[self.PREFIX + key for key in keys],
                                     args=[self.PREFIX])
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
        expires_ms = int(entry.expires_at * 1000)
        if expires_ms <= now * 1000:
            return None
        return entry, now, expires_ms, _decode_id(entry.decode_url)


    def _counted(self, decode_url: str, total: int) -> None:
        self._totals[decode_url] = total
        metrics.SHARED_PINNED_BLOCKS.labels(public_url(decode_url)).set(total)

    def _dropped(self, values: list, why: str) -> None:
        """Entries that left unread (their packed values): to `on_drop`."""
        for packed in values:
            try:
                dropped = decode(packed)
            except ValueError:          # a foreign value under our key: nothing to release
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
                args=[packed_entry, expires_ms, int(now * 1000), key, pinned_blocks(entry),
                      limit.cap, decode_id, self.PREFIX, limit.cut, tenant])
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
            over, total = self._trim(args=[self.PREFIX, _decode_id(decode_url), *limit])
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


# Redis Cluster: a script's keys must share a hash slot. A conversation's entry keys (and the
# key naming each one's D) carry its root as a hash tag; each D's ledger carries its own. So
# the take and the put are one script on the conversation's slot and one on its D's: the pieces
# the single-primary scripts above do in one.
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
_C_UNPIN = _LEDGER + "return unpin(KEYS, ARGV[1])"
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
_C_PUT_LEDGER = _LEDGER + """
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
# KEYS: D's ledger; ARGV: its budget's cap and cut. Returns the members over it (the caller
# takes their entries) and D's total after.
_C_TRIM = _LEDGER + """
local total = tonumber(redis.call('GET', KEYS[3]) or '0')
local over
over, total = trim(KEYS, false, budget_at(tonumber(ARGV[1]), tonumber(ARGV[2]), total), total, 0)
return {over, total}
"""
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

    def __init__(self, url: str, ttl: float, timeout: float, client=None,
                 pinned_budget: int | Budget = 0, timer: Callable[[], float] = time.time) -> None:
        super().__init__(url, ttl, timeout, client, pinned_budget, timer)
        from redis.commands.core import Script

        def register(text: str) -> Script:
            return Script(self._redis, text)

        self._take_first = register(_C_TAKE)
        self._unpin = register(_C_UNPIN)
        self._put_entry = register(_C_PUT_ENTRY)
        self._put_ledger = register(_C_PUT_LEDGER)
        self._c_trim = register(_C_TRIM)
        self._drop = register(_C_DROP)

    @staticmethod
    def member(key: str, tag: str) -> str:
        """The key's name in Redis (after the prefix), hash-tagged by its conversation."""
        return "{%s}:%s" % (tag or key, key)

    def _ledger(self, decode_id: str) -> list[str]:
        base = "%s{d:%s}:" % (self.PREFIX, decode_id)
        return [base + "pinned", base + "pinned-blocks", base + "pinned-total",
                base + "pinned-held", base + "pinned-tenant"]

    def take_first(self, keys: Sequence[str], tag: str = "") -> tuple[str, Entry] | None:
        if not tag and len(keys) > 1:       # untagged keys live in slots of their own
            return next(filter(None, (self.take_first([key]) for key in keys)), None)
        if not keys:
            return None
        try:
            found = self._take_first(keys=[self.PREFIX + self.member(k, tag) for k in keys],
                                     args=[self.PREFIX])
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
            old, owner = self._put_entry(keys=[self.PREFIX + member,
                                               self.PREFIX + "pinned-of:" + member],
                                         args=[packed, expires_ms, decode_id])
        except self._errors as exc:
            self._failed("put", exc)
            return
        owner = _text(owner) if owner else None
        if owner and owner != decode_id:          # the entry it replaced was on another D
            self._unpin_on(owner, member)
        # Its own entry back is not a replaced one (a script run twice): never released.
        self._dropped([old] if old and old != packed else [], "replaced")
        # The entry is stored; its D's ledger (on another node, perhaps failing over) is
        # counted on the way, and entries over D's budget taken out of their own slots.
        limit = self.budget(entry.decode_url)
        try:
            over, total = self._put_ledger(
                keys=self._ledger(decode_id),
                args=[member, pinned_blocks(entry), expires_ms, int(now * 1000), limit.cap,
                      1 if owner == decode_id else 0, limit.cut, tenant])
        except self._errors as exc:
            self._failed("ledger", exc)
            return
        self._counted(entry.decode_url, total)
        self._dropped(self._take_members(over, decode_id), "budget")

    def _trim_to(self, decode_url: str, limit: Limit) -> None:
        decode_id = _decode_id(decode_url)
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
                value = self._drop(keys=[self.PREFIX + gone, self.PREFIX + "pinned-of:" + gone],
                                   args=[decode_id])
            except self._errors as exc:
                self._failed("ledger", exc)
                continue
            if value:
                values.append(value)
        return values

    def report(self) -> dict:
        from redis.cluster import RedisCluster
        try:   # the primaries (a failed replica is not the store failing)
            return {"store": "redis-cluster",
                    "reachable": bool(self._redis.ping(target_nodes=RedisCluster.PRIMARIES))}
        except self._errors:
            return {"store": "redis-cluster", "reachable": False}


def create_store(settings) -> ConversationStore:
    """The store the settings name; each D's pinned budget is set on it by its owner
    (`store.budget`, gateway.engines.d_budget)."""
    if settings.store == "local":
        return LocalStore(settings.store_size, settings.store_ttl)
    cluster = redis_url.parse(settings.store).kind == "cluster"
    return (RedisClusterStore if cluster else RedisStore)(
        settings.store, settings.store_ttl, settings.store_timeout)
