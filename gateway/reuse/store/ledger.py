"""The Lua ledger of the blocks each D keeps for a Redis store's entries: the functions both
Redis stores' scripts are built on (one primary's, a Cluster's)."""

from __future__ import annotations

# The blocks each D keeps for a Redis store's entries, shared by every gateway host: per D (an
# id of its URL) a sorted set of entry keys by expiry, their blocks and the total, each tenant's
# blocks (a sorted set) and entries (a sorted set by expiry, named after D's) and each entry's
# tenant, all expiring after its last entry; and per entry, which D it is on (expiring with the
# entry). Every loop is bounded, and a ledger that lost pieces (keys deleted by hand, an
# allkeys-* eviction) mends itself.
#
# The ledger's functions take its keys: D's sorted set, blocks, total, tenants' blocks, entries'
# tenants (a Redis Cluster passes them, in D's hash slot; one primary names them).
LEDGER = """
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
    local due = redis.call('ZRANGEBYSCORE', keys[1], '-inf', '(' .. now, 'LIMIT', 0, 64)
    for _, gone in ipairs(due) do
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
-- The next member to give way (gateway.reuse.store.local.Pinned.over): while several tenants hold
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
