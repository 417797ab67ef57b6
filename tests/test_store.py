"""The stores: single-use take, TTL, a size bound (local), atomic take and failures (Redis)."""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.engines.d_budget import Limit
from gateway.reuse.store import Entry, LocalStore, RedisStore
from tests.helpers.stores import take
from tests.helpers.tenant_shares import one_tenants_long_turn_releases_nothing_of_anothers


def bare(found):
    """A taken entry (or take_first's pair) without the expiry its first put stamped."""
    if isinstance(found, tuple):
        return found[0], bare(found[1])
    return None if found is None else replace(found, expires_at=None)


def entry(n=0):
    return Entry(
        params={
            "remote_request_id": f"r{n}",
            "remote_block_ids": [[n, 7, 9], [3]],
            "remote_port": 5600 + n,
            "remote_blocks_expiry_time": 17.5,
        },
        decode_url="http://d",
        history_digest="h",
        history_len=2,
    )


def test_take_is_single_use(store):
    store.put("k", entry())
    assert bare(take(store, "k")) == entry()
    assert take(store, "k") is None


def test_entries_expire_at_ttl(store, clock):
    store.put("k", entry())
    clock.advance(449.9)
    store.put("k2", entry())
    assert take(store, "k") is not None
    store.put("k", entry())
    clock.advance(450)
    assert take(store, "k") is None


def test_size_bound_evicts_least_recently_used(clock):
    small = LocalStore(maxsize=3, ttl=450, timer=clock)
    for n in range(5):
        small.put(f"k{n}", entry(n))
    assert len(small) == 3
    assert take(small, "k0") is None and bare(take(small, "k4")) == entry(4)


def test_put_replaces(store):
    store.put("k", entry(1))
    store.put("k", entry(2))
    assert bare(take(store, "k")) == entry(2) and len(store) == 0


def test_a_put_back_entry_keeps_its_expiry_locally(clock):
    from gateway.reuse.store import Entry, LocalStore

    store = LocalStore(maxsize=10, ttl=450, timer=clock)
    store.put("k", Entry({"a": 1}, "http://d", "h", 1))
    clock.advance(400)
    entry = take(store, "k")
    store.put("k", entry)  # e.g. another history under the same id
    clock.advance(60)  # 460 s after D kept the blocks: they are gone
    assert take(store, "k") is None


# --- RedisStore, against a real redis-server ------------------------------------------------


def redis_store(server, ttl=450.0) -> RedisStore:
    return RedisStore(server.url, ttl=ttl, timeout=2)


def test_redis_take_is_single_use_and_put_replaces(redis_server):
    store = redis_store(redis_server)
    store.put("k", entry(1))
    store.put("k", entry(2))
    assert bare(take(store, "k")) == entry(2)
    assert take(store, "k") is None


def test_redis_entries_expire_at_ttl(redis_server):
    store = redis_store(redis_server, ttl=450)
    store.put("ttl", entry())
    # Redis expires the key itself; what the gateway controls is the expiry it sets.
    assert 449_000 < redis_server.client.pttl(RedisStore.PREFIX + "ttl") <= 450_000


def test_a_put_back_entry_keeps_its_expiry_in_redis(redis_server):
    from gateway.reuse.store import Entry, RedisStore

    store = RedisStore(redis_server.url, ttl=450, timeout=2)
    key = uuid.uuid4().hex
    store.put(key, Entry({"a": 1}, "http://d", "h", 1))
    entry = take(store, key)
    entry = type(entry)(**{**entry.__dict__, "expires_at": time.time() + 5})  # 445 s later
    store.put(key, entry)
    assert 0 < redis_server.client.pttl(RedisStore.PREFIX + key) <= 5000


def test_redis_concurrent_takes_get_the_entry_once(redis_server):
    store = redis_store(redis_server)
    store.put("race", entry())
    barrier = threading.Barrier(8)

    def race(_):
        barrier.wait()
        return take(store, "race")

    with ThreadPoolExecutor(8) as pool:
        taken = [e for e in pool.map(race, range(8)) if e is not None]
    assert [bare(e) for e in taken] == [entry()]


def test_redis_failures_are_misses_not_errors():
    from emulator.process import free_port
    from gateway.support import metrics

    failed = metrics.STORE_ERRORS.labels("take")._value.get()
    store = RedisStore(f"redis://127.0.0.1:{free_port()}/0", ttl=450, timeout=0.5)  # nobody there
    store.put("k", entry())
    assert take(store, "k") is None
    assert store.report() == {"store": "redis", "reachable": False}
    assert metrics.STORE_ERRORS.labels("take")._value.get() == failed + 1


def test_a_foreign_value_under_a_key_is_a_miss(redis_server):
    store = redis_store(redis_server)
    for value in (b"not json", b"[1, 2]", b"7", b'[{}, "u", "d", "two"]'):
        redis_server.client.set(RedisStore.PREFIX + "foreign", value)
        assert take(store, "foreign") is None


# redis_server is asked for only here: its tests are marked by hand.
@pytest.fixture(params=["local", pytest.param("redis", marks=pytest.mark.processes)])
def either_store(request, clock):
    if request.param == "local":
        return LocalStore(maxsize=100, ttl=450, timer=clock)
    server = request.getfixturevalue("redis_server")
    server.client.flushdb()
    return redis_store(server)


def test_take_first_takes_only_the_first_key_that_has_an_entry(either_store):
    either_store.put("b", entry(2))
    either_store.put("c", entry(3))
    assert bare(either_store.take_first(["a", "b", "c"])) == ("b", entry(2))
    assert either_store.take_first(["a", "b"]) is None
    assert either_store.take_first([]) is None
    assert bare(take(either_store, "c")) == entry(3)


# --- what an entry becomes in the store (gateway.reuse.packing)
# -------------------------------------

digests = st.one_of(
    st.none(), st.text(max_size=40), st.binary(min_size=16, max_size=16).map(bytes.hex)
)
block_ids = st.one_of(
    st.lists(st.integers(0, 2**40), max_size=80),  # anything at all
    st.builds(
        lambda start, n, step: list(range(start, start + step * n, step)),  # one run
        st.integers(100, 10**6),
        st.integers(1, 300),
        st.sampled_from([1, -1]),
    ),
)
params = st.fixed_dictionaries(
    {
        "remote_block_ids": st.lists(block_ids, max_size=3),
        "remote_engine_id": st.text(min_size=1, max_size=40),
        "remote_request_id": st.text(min_size=1, max_size=80),
        "remote_port": st.integers(1, 65535),
    },
    optional={
        "remote_host": st.text(min_size=1),
        "tp_size": st.integers(1, 64),
        "remote_num_tokens": st.integers(0, 10**6),
        "remote_blocks_expiry_time": st.one_of(st.none(), st.floats(0, 1e12)),
        "transfer_mode": st.text(min_size=1),
        "some_future_field": st.integers(),
    },
)


@given(
    params=params,
    url=st.text(),
    history=digests.filter(lambda d: d is not None),
    length=st.integers(0, 2**32 - 1),
    plain=st.booleans(),
    tokens=digests,
    expires=st.one_of(st.none(), st.floats(0, 1e10)),
)
def test_an_entry_comes_back_from_the_store_as_it_went_in(
    params, url, history, length, plain, tokens, expires
):
    from gateway.reuse.store import decode, encode

    original = Entry(params, url, history, length, plain, tokens, expires)
    assert decode(encode(original)) == original


def test_every_positional_field_of_an_entry_is_an_allowlisted_param():
    """Entries are read by position: FIELDS is written out (append only), and each is a param
    clean_params keeps (a param added to the allowlist later goes in the trailing object)."""
    from gateway.reuse.kv_params import OPTIONAL_PARAMS, REQUIRED_PARAMS
    from gateway.reuse.packing import BLOCKS, FIELDS

    assert len(set(FIELDS)) == len(FIELDS)
    assert set(FIELDS) <= set(REQUIRED_PARAMS) | set(OPTIONAL_PARAMS) and BLOCKS not in FIELDS


def test_a_benchmark_entry_packs_into_a_fifth_of_its_json():
    import orjson

    from devtools.fill import synthetic_entry
    from gateway.reuse.store import encode

    _, original = synthetic_entry(7, "http://127.0.0.3:8200")
    as_json = orjson.dumps(
        [
            original.params,
            original.decode_url,
            original.history_digest,
            original.history_len,
            original.plain,
            original.token_digest,
            original.expires_at,
        ]
    )
    assert len(encode(original)) * 3 < len(as_json)


@pytest.mark.parametrize("foreign", [b"", b"{}", b"[1,2]", b"\x01\x00" + b"x" * 40, b"\x07" * 60])
def test_a_foreign_value_is_not_an_entry(foreign):
    from gateway.reuse.store import decode

    with pytest.raises(ValueError):
        decode(foreign)


@given(
    flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=4),
    cut=st.integers(0, 10**6),
)
def test_a_damaged_entry_is_a_value_error_or_an_entry(flips, cut):
    """What Redis hands back may be anything: decoding it fails with ValueError (a miss), never
    with another exception (a 500)."""
    from devtools.fill import synthetic_entry
    from gateway.reuse.store import decode, encode

    packed = bytearray(encode(synthetic_entry(3, "http://127.0.0.3:8200")[1]))
    for at, value in flips:
        packed[at % len(packed)] = value
    try:
        assert isinstance(decode(bytes(packed[: max(1, cut % (len(packed) + 1))])), Entry)
    except ValueError:
        pass


# --- what leaves unread, and the blocks each D keeps ---------------------------------------------


def on(d, n=0, blocks=4):
    """An entry on D `d` whose params name `blocks` blocks."""
    return replace(
        entry(n),
        decode_url=d,
        params={**entry(n).params, "remote_block_ids": [list(range(blocks))]},
    )


def dropping(store):
    dropped = []
    store.on_drop = lambda e, why: dropped.append(
        (e.params["remote_request_id"], e.decode_url, why)
    )
    return dropped


def test_entries_that_leave_unread_are_dropped_with_why(clock):
    store = LocalStore(maxsize=2, ttl=450, timer=clock)
    dropped = dropping(store)
    store.put("a", on("http://d", 1))
    store.put("a", on("http://d", 2))  # a regenerated turn: the first is unread
    store.put("b", on("http://d", 3))
    store.put("c", on("http://d", 4))  # full: the least recently used goes
    assert dropped == [("r1", "http://d", "replaced"), ("r2", "http://d", "evicted")]
    assert take(store, "b") is not None  # taken: not a drop
    clock.advance(451)
    store.sweep()
    assert dropped[-1] == ("r4", "http://d", "expired") and len(dropped) == 3
    assert store.pinned() == {}


def test_a_ds_pinned_budget_drops_its_least_recently_put_entries(clock):
    store = LocalStore(maxsize=100, ttl=450, timer=clock, pinned_budget=10)
    dropped = dropping(store)
    for n in range(3):
        store.put(f"k{n}", on("http://d1", n, blocks=4))  # 12 > 10: k0 goes
    store.put("other", on("http://d2", 9, blocks=8))  # another D: its own budget
    assert dropped == [("r0", "http://d1", "budget")]
    assert store.pinned() == {"http://d1": 8, "http://d2": 8}
    assert take(store, "k0") is None and take(store, "k2") is not None
    assert store.pinned() == {"http://d1": 4, "http://d2": 8}
    store.put("big", on("http://d2", 10, blocks=11))  # over the budget alone: it stays
    assert dropped[-1] == ("r9", "http://d2", "budget")
    assert store.pinned() == {"http://d1": 4, "http://d2": 11}


def test_without_a_budget_blocks_are_counted_and_nothing_dropped(clock):
    store = LocalStore(maxsize=100, ttl=450, timer=clock)
    dropped = dropping(store)
    for n in range(50):
        store.put(f"k{n}", on("http://d", n, blocks=100))
    assert dropped == [] and store.pinned() == {"http://d": 5000}


def test_a_redis_put_that_replaces_an_entry_drops_it(redis_server):
    store = RedisStore(redis_server.url, ttl=30, timeout=1)
    dropped = dropping(store)
    store.put("regenerated", on("http://d", 1))
    store.put("regenerated", on("http://d", 2))
    assert dropped == [("r1", "http://d", "replaced")]
    assert take(store, "regenerated").params["remote_request_id"] == "r2"


def test_a_put_back_entry_leaves_the_ledger_at_its_own_expiry(clock):
    """An entry put back (another history under its id) keeps the expiry its first put stamped:
    D frees its blocks then, so the budget stops counting them then too."""
    store = LocalStore(maxsize=100, ttl=450, timer=clock, pinned_budget=100)
    dropped = dropping(store)
    store.put("k", on("http://d", 1, blocks=60))
    clock.advance(400)
    store.put("k", take(store, "k"))
    clock.advance(51)
    store.put("other", on("http://d", 2, blocks=60))  # 120 > 100 if the first still counted
    assert dropped == [("r1", "http://d", "expired")]
    assert store.pinned() == {"http://d": 60} and take(store, "k") is None


def test_metrics_and_reports_never_show_an_engine_urls_credentials(clock):
    store = LocalStore(maxsize=10, ttl=450, timer=clock)
    store.put("k", on("http://user:secret@d:8200", 1))
    assert store.pinned() == {"http://d:8200": 4}
    assert "secret" not in str(store.report())


def test_a_shared_store_counts_each_ds_blocks_for_every_host_within_one_budget(redis_server):
    redis_server.client.flushdb()
    one, two = (
        RedisStore(redis_server.url, ttl=30, timeout=1, pinned_budget=10) for _ in range(2)
    )  # two gateway hosts, one Redis
    dropped = dropping(one)
    dropping(two).clear()
    one.put("k0", on("http://d1", 0, blocks=4))
    two.put("k1", on("http://d1", 1, blocks=4))
    one.put("k2", on("http://d1", 2, blocks=4))  # 12 > 10: the oldest, put by the other host
    two.put("x", on("http://d2", 9, blocks=8))  # another D: its own budget
    assert dropped == [("r0", "http://d1", "budget")]
    assert take(two, "k0") is None and take(one, "k1") is not None
    one.put("big", on("http://d2", 10, blocks=11))  # over the budget alone: it stays
    assert dropped[-1] == ("r9", "http://d2", "budget")
    pinned = {
        k.decode(): int(v)
        for k, v in (
            (key, redis_server.client.get(key))
            for key in redis_server.client.keys("pd-gateway:pinned-total:*")
        )
    }
    assert sorted(pinned.values()) == [4, 11]  # d1: k2; d2: big


def test_a_shared_store_releases_beyond_a_ds_budget_that_shrank_at_its_next_sweep(redis_server):
    """D's budget follows its reports (gateway.engines.d_budget): a budget that shrank is met at
    the next sweep, the oldest entries released, on any host, whatever put them."""
    redis_server.client.flushdb()
    budgets = {"http://d1": 100, "http://d2": 100}
    one, two = (
        RedisStore(
            redis_server.url, ttl=30, timeout=1, pinned_budget=lambda decode: Limit(budgets[decode])
        )
        for _ in range(2)
    )
    dropped = dropping(one)
    for n in range(5):
        (one if n % 2 else two).put(f"k{n}", on("http://d1", n, blocks=20))
    one.put("x", on("http://d2", 9, blocks=20))
    budgets["http://d1"] = 50
    one.sweep()
    assert dropped == [
        ("r0", "http://d1", "budget"),
        ("r1", "http://d1", "budget"),
        ("r2", "http://d1", "budget"),
    ]
    assert take(two, "k2") is None and take(two, "k3") is not None
    one.sweep()  # within it now: nothing more
    assert len(dropped) == 3 and take(one, "x") is not None


def test_a_cut_is_made_against_the_count_redis_holds_not_the_workers(redis_server):
    """A worker that never put on D (its own count of D: none) makes its share of a cut from
    the total Redis holds: the oldest 30 blocks' worth go, not every conversation on D."""
    redis_server.client.flushdb()
    one = RedisStore(redis_server.url, ttl=30, timeout=1, pinned_budget=1000)
    for n in range(5):
        one.put(f"k{n}", on("http://d1", n, blocks=20))
    limits = [Limit(1000, 30)]  # a report found D 30 blocks over its mark
    fresh = RedisStore(
        redis_server.url,
        ttl=30,
        timeout=1,
        pinned_budget=lambda decode: limits.pop() if limits else Limit(1000),
    )
    dropped = dropping(fresh)
    fresh.put("k9", on("http://d1", 9, blocks=20))  # 120 pinned: 90 may stay
    assert dropped == [("r0", "http://d1", "budget"), ("r1", "http://d1", "budget")]
    fresh.put("k10", on("http://d1", 10, blocks=20))  # the cut was once: the cap again
    assert len(dropped) == 2 and take(fresh, "k9") is not None


def test_a_shared_store_uncounts_entries_redis_expired_or_that_moved(redis_server):
    redis_server.client.flushdb()
    clock = [time.time()]
    store = RedisStore(
        redis_server.url, ttl=30, timeout=1, pinned_budget=10, timer=lambda: clock[0]
    )
    dropped = dropping(store)
    store.put("old", on("http://d", 1, blocks=8))
    clock[0] += 31  # past its expiry: D freed the blocks
    store.put("new", on("http://d", 2, blocks=8))  # 8, not 16: nothing over the budget
    assert dropped == []
    mover = RedisStore(redis_server.url, ttl=30, timeout=1, pinned_budget=10)
    dropped = dropping(mover)
    mover.put("moved", on("http://d", 3, blocks=2))
    mover.put("moved", on("http://e", 4, blocks=2))  # regenerated on another D
    assert dropped == [("r3", "http://d", "replaced")]
    totals = sorted(
        int(redis_server.client.get(k))
        for k in redis_server.client.keys("pd-gateway:pinned-total:*")
    )
    assert totals == [2, 8]


def test_a_shared_ledger_that_lost_pieces_mends_itself_and_never_loops(redis_server):
    """Keys deleted by hand, or evicted by an allkeys-* policy: a put still ends, and the
    totals come back to what is really kept."""
    redis_server.client.flushdb()
    store = RedisStore(redis_server.url, ttl=30, timeout=1, pinned_budget=10)
    dropped = dropping(store)
    for n in range(3):
        store.put(f"k{n}", on("http://d", n, blocks=3))
    for key in redis_server.client.keys("pd-gateway:pinned-of:*"):
        redis_server.client.delete(key)  # every entry's owner gone
    for key in redis_server.client.keys("pd-gateway:pinned-blocks:*"):
        redis_server.client.delete(key)  # and every count
    store.put("k3", on("http://d", 3, blocks=3))  # 12 > 10 by the stale total
    assert [r for r, _, why in dropped] == ["r0", "r1", "r2"]
    (total_key,) = redis_server.client.keys("pd-gateway:pinned-total:*")
    assert int(redis_server.client.get(total_key)) == 3  # k3 alone: the total mended
    assert 0 < redis_server.client.pttl(total_key) <= 90_000


# --- tenants share a D's budget and the store's size ------------------------------------------


def test_one_tenants_long_turn_releases_nothing_of_anothers_locally(clock):
    one_tenants_long_turn_releases_nothing_of_anothers(
        LocalStore(maxsize=1000, ttl=450, timer=clock, pinned_budget=100)
    )


@pytest.mark.processes
def test_one_tenants_long_turn_releases_nothing_of_anothers_in_redis(redis_server):
    ticks = itertools.count()  # entries put in one millisecond would tie in D's order
    one_tenants_long_turn_releases_nothing_of_anothers(
        RedisStore(
            redis_server.url,
            ttl=450,
            timeout=2,
            pinned_budget=100,
            timer=lambda: time.time() + next(ticks),
        )
    )


def test_one_tenant_alone_keeps_its_latest_turn_over_the_budget_as_before(clock):
    store = LocalStore(maxsize=100, ttl=450, timer=clock, pinned_budget=10)
    dropped = dropping(store)
    store.put("a", on("http://d", 1, blocks=4), tenant="t")
    store.put("b", on("http://d", 2, blocks=11), tenant="t")
    assert dropped == [("r1", "http://d", "budget")] and store.pinned() == {"http://d": 11}


def test_a_full_store_makes_room_with_the_tenant_that_holds_the_most(clock):
    """One key's turns can no longer flush the worker's store: the tenant with the most entries
    gives way, its oldest first; alone, the least recently used goes as before."""
    store = LocalStore(maxsize=10, ttl=450, timer=clock)
    dropped = dropping(store)
    for n in range(4):
        store.put(f"quiet{n}", on("http://d", n, blocks=1), tenant="quiet")
    for n in range(10, 30):
        store.put(f"noisy{n}", on("http://d", n, blocks=1), tenant="noisy")
    assert all(take(store, f"quiet{n}") is not None for n in range(4))
    assert dropped == [(f"r{n}", "http://d", "evicted") for n in range(10, 24)]
    assert len(store) == 6
