"""Multi-worker affinity: conversations stick to the worker holding their cache; P/D choice."""

from __future__ import annotations

import os
import signal
import threading
import uuid

import pytest

from devtools import workload
from emulator.process import EmulatorProcess, wait_until
from gateway.config import Settings
from gateway.front.owners import Owners, owner
from gateway.reuse.conversation import identify
from tests.helpers.servers import gateway_process, metric, starts_processes, two_of_each, workers_of


def worker_health(gateway, slot: int) -> dict:
    return gateway.status(port=gateway.port + 1 + slot)


@pytest.mark.parametrize("worker_class", ["gevent", "gthread"])
def test_four_workers_keep_conversations_on_their_owner(
    fresh_engines, gateway_factory, worker_class
):
    p, d = fresh_engines
    gateway = gateway_factory([p.url], [d.url], workers=4, worker_class=worker_class)
    answered = metric(gateway, "pd_gateway_responses_total")
    convs = workload.run(gateway.url, conversations=200, turns=5)
    hits, later = workload.later_hits(convs)
    assert workload.errors(convs) == []
    # Forwarded or not, each answer counted once (where its client is), and the turn's KV
    # outcome relayed back with it.
    assert metric(gateway, "pd_gateway_responses_total") - answered == 1000
    assert {kv for c in convs for kv in c.kvs[1:]} == {"read"}
    assert later == 800 and hits / later >= 0.99, (hits, later)
    assert p.stats()["hits"] >= 0.99 * 800
    assert p.stats()["wrong_reuse"] == 0
    print(f"\n{worker_class}, 4 workers, affinity on: {hits}/{later} later turns hit")


def test_without_affinity_most_later_turns_miss(fresh_engines, gateway_factory):
    """The baseline the forwarding fixes: the kernel spreads connections over the workers."""
    p, d = fresh_engines
    gateway = gateway_factory([p.url], [d.url], workers=4, affinity="off")
    convs = workload.run(gateway.url, conversations=200, turns=5)
    hits, later = workload.later_hits(convs)
    assert workload.errors(convs) == []
    print(f"\n4 workers, affinity off: {hits}/{later} later turns hit")
    assert hits / later < 0.9


def test_forwarding_is_off_without_private_listeners_or_when_switched_off():
    # gunicorn_conf's post_fork gives a worker its slot, and the private listeners' address
    # when it opened them (several workers).
    environ = {"PD_GATEWAY_WORKER_SLOT": "1", "PD_GATEWAY_PRIVATE_BASE": "127.0.0.1:9001"}
    assert Owners(Settings(), None, environ).enabled
    assert not Owners(Settings(affinity=False), None, environ).enabled
    assert not Owners(Settings(store="redis://127.0.0.1:9/0"), None, environ).enabled
    assert not Owners(Settings(), None, {"PD_GATEWAY_WORKER_SLOT": "0"}).enabled  # one worker
    assert not Owners(Settings(), None, {}).enabled  # not under gunicorn's hooks
    # A request that came on this worker's own private port was forwarded: served here.
    owners = Owners(Settings(), None, environ)
    assert not owners.may_forward("9002")
    assert owners.may_forward("9001") and owners.may_forward("")


def test_owner_is_stable_and_spreads():
    roots = [uuid.uuid4().hex for _ in range(4000)]
    counts = [0] * 4
    for root in roots:
        counts[owner(root, 4)] += 1
    assert min(counts) > 800
    # Rendezvous: going from 4 to 5 slots only moves keys to the new slot.
    assert all(owner(r, 5) in (owner(r, 4), 4) for r in roots)


def test_sigkill_of_a_worker_costs_only_its_conversations_one_miss(fresh_engines):
    p, d = fresh_engines
    with gateway_process([p.url], [d.url], workers=4) as gateway:
        for slot in range(4):
            wait_until(lambda slot=slot: worker_health(gateway, slot), 20, f"worker {slot}")
        victim = worker_health(gateway, 2)
        # A request the killed process itself had accepted loses its connection before any
        # response; the client retries it, as the OpenAI SDK does by default (max_retries=2).
        convs = [workload.Conversation(gateway.url, stream=False, retries=2) for _ in range(96)]
        workload.drive(convs, turns=2)
        killed = threading.Event()

        def kill_once(conversation):
            if not killed.is_set():
                killed.set()
                os.kill(victim["pid"], signal.SIGKILL)

        workload.drive(convs, turns=3, before_turn=kill_once)  # killed amid the run
        assert workload.errors(convs) == []
        owned = {c.cid for c in convs if owner(identify({}, {}, c.cid).root, 4) == 2}
        misses = {c.cid: c.caches[1:].count("miss") for c in convs}
        assert all(n <= 1 for n in misses.values()), misses
        # Every conversation of the dead slot lost its entry: exactly one miss each. Another
        # conversation can miss only if its request was in flight through the killed process.
        assert all(misses[cid] == 1 for cid in owned), {cid: misses[cid] for cid in owned}
        others = [cid for cid, n in misses.items() if n and cid not in owned]
        assert len(others) <= 16, others
        print(
            f"\nSIGKILL of slot 2: {len(owned)} owned conversations missed once, "
            f"{len(others)} others (in flight through it) missed once"
        )
        wait_until(lambda: worker_health(gateway, 2)["pid"] != victim["pid"], 20, "replacement")
        assert worker_health(gateway, 2)["worker"] == 2


@pytest.mark.parametrize("worker_class", ["gevent", "gthread"])
def test_sighup_reload_keeps_serving_and_the_new_workers_take_the_slots(
    fresh_engines, worker_class
):
    p, d = fresh_engines
    with gateway_process([p.url], [d.url], workers=2, worker_class=worker_class) as gateway:
        for slot in range(2):
            wait_until(lambda slot=slot: worker_health(gateway, slot), 20, f"worker {slot}")
        old = workers_of(gateway)
        convs = [workload.Conversation(gateway.url) for _ in range(40)]
        workload.drive(convs, turns=1)
        reloaded = threading.Event()

        def hup_once(conversation):
            if not reloaded.is_set():
                reloaded.set()
                gateway.process.send_signal(signal.SIGHUP)

        workload.drive(convs, turns=3, before_turn=hup_once)  # reloaded amid the run
        assert workload.errors(convs) == []
        # gunicorn starts a new set of workers, then stops the old set.
        wait_until(
            lambda: len(workers_of(gateway)) == 2 and not workers_of(gateway) & old,
            60,
            "the old workers to stop",
        )
        assert [worker_health(gateway, slot)["worker"] for slot in range(2)] == [0, 1]
        fresh = workload.run(gateway.url, conversations=40, turns=3)
        hits, later = workload.later_hits(fresh)
        assert workload.errors(fresh) == [] and hits == later == 80, (hits, later)
        assert p.stats()["wrong_reuse"] == 0


def test_after_ttou_no_request_waits_for_a_worker_that_is_gone(fresh_engines):
    from devtools import procstat, workload

    p, d = fresh_engines
    with gateway_process([p.url], [d.url], workers=3) as gateway:
        convs = workload.run(gateway.url, conversations=12, turns=1, concurrency=6)
        gateway.process.send_signal(signal.SIGTTOU)
        wait_until(lambda: len(procstat.children(gateway.process.pid)) == 2, 30, "2 workers")
        workload.drive(convs, turns=2, concurrency=6)
        assert workload.errors(convs) == []
        # Before: requests owned by the stopped worker's slot waited --owner-wait (3 s) for it,
        # then were served where they landed ("away"): a wait is counted there, not timed here.
        assert metric(gateway, "pd_gateway_forwarded_total", result="away") == 0
        assert p.stats()["wrong_reuse"] == 0


@pytest.fixture(scope="module")
@starts_processes
def two_by_two():
    with two_of_each(4) as engines:
        yield engines


def pulled_on_d(two_by_two, routing: str, gateway_factory, **settings) -> tuple[int, int]:
    ps, ds = two_by_two
    for engine in ps + ds:
        engine.reset_stats()
    gateway = gateway_factory([p.url for p in ps], [d.url for d in ds], routing=routing, **settings)
    # Short questions, 200-token replies: D produced most of the history itself, which is
    # what staying on it saves. (With shorter replies turn 1's full pull, equal under both
    # policies, weighs more, and the cut varies more from run to run: docs/BENCHMARKS.md.)
    # One conversation at a time, its turns one after another: round robin then moves every
    # later turn to the other D. Run concurrently, which turns move would depend on how the
    # conversations' requests interleave (8 at once, in lockstep, would keep each on one D).
    convs = workload.run(gateway.url, conversations=6, turns=5, concurrency=1, max_tokens=200)
    assert workload.errors(convs) == []
    assert sum(p.stats()["wrong_reuse"] for p in ps) == 0
    return sum(d.stats()["pulled_tokens"] for d in ds), sum(p.stats()["hits"] for p in ps)


def test_conversation_affine_choice_cuts_decode_pulls(two_by_two, gateway_factory):
    rr_pulled, rr_hits = pulled_on_d(two_by_two, "round_robin", gateway_factory)
    # Affinity alone: a turn leaves its D only for a D that much less busy (the cost's
    # --route-move-streams, docs/routing.md), never at these 8 turns at once. With the default
    # (4 streams) some turns move when one D happens to run 5 more streams than the other:
    # what the cost is for, and not what this test is about.
    affine_pulled, affine_hits = pulled_on_d(
        two_by_two, "affinity", gateway_factory, route_move_streams=1000
    )
    print(
        f"\nD pulled tokens, 2P x 2D, 6 conversations x 5 turns: round robin {rr_pulled}, "
        f"affinity {affine_pulled} ({1 - affine_pulled / rr_pulled:.0%} fewer)"
    )
    assert rr_hits == affine_hits == 24
    assert affine_pulled <= 0.3 * rr_pulled


def test_failed_connection_marks_down_and_probe_brings_back(gateway_factory):
    with (
        EmulatorProcess("prefill", bidirectional_kv_xfer=True, host="127.0.0.8", itl_ms=1) as p,
        EmulatorProcess("decode", bidirectional_kv_xfer=True, host="127.0.0.9", itl_ms=1) as d1,
        EmulatorProcess("decode", bidirectional_kv_xfer=True, host="127.0.0.10", itl_ms=1) as d2,
    ):
        gateway = gateway_process([p.url], [d1.url, d2.url], probe_interval=0.2)
        try:
            health = gateway.status
            assert [i["state"] for i in health()["decode"]] == ["up", "up"]
            d2.stop()
            convs = workload.run(gateway.url, conversations=20, turns=2, concurrency=4)
            # A refused connection is retried on the other D: no client sees it.
            assert workload.errors(convs) == []
            assert health()["decode"][1]["state"] == "down"
            assert health()["status"] == "ok"
            d2.start()
            wait_until(lambda: health()["decode"][1]["state"] == "up", 10, "probe")
            report = health()["decode"][1]
            assert report["inflight"] == 0 and report["consecutive_failures"] == 0
        finally:
            gateway.stop()
