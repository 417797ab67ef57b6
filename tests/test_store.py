"""LocalStore: single-use take, TTL on an injected clock, a size bound."""
from __future__ import annotations

from gateway.store import Entry, LocalStore


def entry(n=0):
    return Entry(params={"remote_request_id": f"r{n}", "remote_block_ids": [[n, 7, 9], [3]],
                         "remote_port": 5600 + n, "remote_blocks_expiry_time": 17.5},
                 decode_url="http://d", history_digest="h", history_len=2)


def test_take_is_single_use(store):
    store.put("k", entry())
    assert store.take("k") == entry()
    assert store.take("k") is None


def test_entries_expire_at_ttl(store, clock):
    store.put("k", entry())
    clock.advance(449.9)
    store.put("k2", entry())
    assert store.take("k") is not None
    store.put("k", entry())
    clock.advance(450)
    assert store.take("k") is None


def test_size_bound_evicts_least_recently_used(clock):
    small = LocalStore(maxsize=3, ttl=450, timer=clock)
    for n in range(5):
        small.put(f"k{n}", entry(n))
    assert len(small) == 3
    assert small.take("k0") is None and small.take("k4") == entry(4)


def test_put_replaces(store):
    store.put("k", entry(1))
    store.put("k", entry(2))
    assert store.take("k") == entry(2) and len(store) == 0


def test_breaker_opens_after_consecutive_failures_then_half_opens(clock):
    from gateway.upstream import Policy, Pool
    pool = Pool("decode", ["http://a:1", "http://b:2"],
                Policy(breaker_failures=3, breaker_cooldown=10), clock=clock)
    a, b = pool.instances
    for _ in range(2):
        pool.failed(a, unreachable=False)
    assert a.state(clock()) == "up" and pool.choose("k", prefer=a.url) is a
    pool.failed(a, unreachable=False)
    assert a.state(clock()) == "open"
    assert all(pool.choose(str(k), prefer=a.url) is b for k in range(20))
    clock.advance(10)
    assert a.state(clock()) == "half-open"          # tried again after the cool-down
    assert pool.choose("k", prefer=a.url) is a
    pool.failed(a, unreachable=False)                # one more failure re-opens it at once
    assert a.state(clock()) == "open"
    clock.advance(10)
    pool.succeeded(a)
    assert a.state(clock()) == "up" and a.failures == 0


def test_unreachable_marks_down_until_success(clock):
    from gateway.upstream import Pool
    pool = Pool("prefill", ["http://a:1", "http://b:2"], clock=clock)
    a, b = pool.instances
    woken = []
    pool.on_down = lambda: woken.append(True)
    pool.failed(a, unreachable=True)
    assert a.state(clock()) == "down" and woken == [True]
    clock.advance(3600)
    assert all(pool.choose(str(k)) is b for k in range(20))
    pool.succeeded(a)                                # what a successful /health probe does
    assert a.state(clock()) == "up"
