"""LocalStore: single-use take, TTL on an injected clock, a size bound."""
from __future__ import annotations

from gateway.store import Entry, LocalStore


def entry(n=0):
    return Entry(params={"remote_request_id": f"r{n}"}, decode_url="http://d", history_digest="h",
                 history_len=2)


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
