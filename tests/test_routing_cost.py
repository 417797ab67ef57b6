"""P and D chosen by an explicit cost (gateway.engines.cost, docs/routing.md): the conversation's
own P and the D that holds it unless another is cheaper by its queue; rendezvous breaks ties."""

from __future__ import annotations

import uuid
from dataclasses import replace

import pytest
import requests

from devtools import workload
from emulator.process import EmulatorProcess, wait_until
from gateway.engines.cost import CostModel, Need, cheapest
from gateway.engines.engine_load import Reported
from gateway.engines.instances import Instance, Policy, Pool, _weight
from gateway.flow.attempts import attempt
from gateway.flow.disagg import prefill_need
from gateway.parse import ClientRequest
from gateway.reuse.conversation import root_key
from gateway.reuse.store import Entry
from gateway.support.errors import ServiceUnavailable
from tests.helpers.servers import gateway_process, open_and_abandon, starts_processes

URLS = ["http://p0:8000", "http://p1:8000", "http://p2:8000"]


def rendezvous(pool: Pool, key: str) -> list[Instance]:
    return sorted(pool.instances, key=lambda i: _weight(key.encode(), i), reverse=True)


# --- the model --------------------------------------------------------------------------------


def test_a_d_prefilling_pays_the_turns_work_once_more_for_each_of_its_streams():
    model = CostModel(pull=0.1, request_tokens=512)
    need = Need(tokens=1100, held=1000, cached=1000)  # never the own P: 100 + 0.1 x 1000
    assert model.spilled(need, queued=0, waiting=0, streams=0) == pytest.approx(200)
    assert model.spilled(need, queued=0, waiting=0, streams=3) == pytest.approx(800)
    assert model.spilled(need, queued=300, waiting=1, streams=0) == pytest.approx(512 + 200)


def test_the_own_p_saves_the_pull_and_a_stranger_pays_it_at_the_pull_cost():
    model = CostModel(pull=0.1)
    need = Need(tokens=1100, held=1000, cached=1000)
    assert model.work(need, own=True) == 100  # only the new tokens
    assert model.work(need, own=False) == pytest.approx(100 + 0.1 * 1000)
    # Without an entry a stranger recomputes the history the own P has in its prefix cache.
    assert model.work(Need(1100, 0, 1000), own=False) == 1100
    assert model.work(Need(1100, 0, 1000), own=True) == 100
    # Queued: what this process sent, or what the engine reports, the larger.
    assert model.prefill(need, True, queued=50, reported=0) == 150
    assert model.prefill(need, True, queued=50, reported=2) == 2 * 512 + 100


def test_a_d_keeps_its_conversation_until_it_runs_move_streams_more():
    model = CostModel(move_streams=4)
    assert model.decode(3, holds=True) == 3
    assert model.decode(0, holds=False) == 4


def test_equal_costs_keep_the_first_in_order():
    assert cheapest(["a", "b", "c"], lambda x: 1.0) == "a"
    assert cheapest(["a", "b", "c"], {"a": 2, "b": 1, "c": 1}.get) == "b"


# --- the choice -------------------------------------------------------------------------------


@pytest.fixture
def ps() -> Pool:
    return Pool("prefill", URLS, Policy(cost=CostModel(pull=0.1)))


def test_idle_ps_keep_each_conversation_on_its_rendezvous_p(ps):
    need = Need(tokens=1100, held=1000, cached=1000)
    for n in range(50):
        key = f"conversation-{n}"
        assert ps.choose(key, need=need) is rendezvous(ps, key)[0]
        # A first turn (no history anywhere) too: equal costs, rendezvous order.
        assert ps.choose(key, need=Need(200)) is rendezvous(ps, key)[0]


def test_a_turn_leaves_its_busy_p_once_the_queue_outweighs_the_pull(ps):
    key = "conversation"
    own, second, _ = rendezvous(ps, key)
    need = Need(tokens=1100, held=1000, cached=1000)  # a stranger pulls 1000 at 0.1: 100
    own.queued = 100
    assert ps.choose(key, need=need) is own  # equal: the tie stays home
    own.queued = 101
    assert ps.choose(key, need=need) is second  # the next in rendezvous order
    # Without an entry a stranger would recompute 1000 tokens: the own P keeps it longer.
    assert ps.choose(key, need=Need(1100, 0, 1000)) is own
    own.queued = 1001
    assert ps.choose(key, need=Need(1100, 0, 1000)) is second


def test_engine_reports_count_as_queued_work(ps):
    key = "conversation"
    own, second, third = rendezvous(ps, key)
    reports = {own.url: Reported(waiting=1, running=0, kv_usage=0.1, age=0.0)}
    ps.load = lambda i: reports.get(i.url)
    assert ps.choose(key, need=Need(1100, 1000, 1000)) is second  # 512 queued > 100
    reports[second.url] = Reported(waiting=-1, running=1, kv_usage=0.1, age=0.0)
    assert ps.choose(key, need=Need(1100, 1000, 1000)) is third  # -1: no queue signal


def test_a_retry_never_counts_the_next_p_as_the_conversations_own(ps):
    key = "conversation"
    own, second, third = rendezvous(ps, key)
    # As its own P the second would cost 50 + 100; as what it is, 50 + 100 + 1000 x 0.1.
    second.queued = 50
    assert ps.choose(key, exclude=[own], need=Need(1100, 1000, 1000)) is third


def test_the_p_that_prefilled_the_last_turn_is_the_conversations_own(ps):
    key = "conversation"
    first, second, _ = rendezvous(ps, key)
    need = Need(1100, 0, 1000)  # no entry: only the own P's prefix cache holds the history
    ps.prefilled(key, second)  # the last turn went there (the first was busy, say)
    assert ps.choose(key, need=need) is second
    assert (ps.work(second, key, need), ps.work(first, key, need)) == (100, 1100)
    ps.prefilled(key, first)
    assert ps.choose(key, need=need) is first
    # One gone from the pool is no one's own: the rendezvous first is again.
    ps.prefilled(key, second)
    ps.remove(second.url)
    assert ps.work(first, key, need) == 100


def test_overload_and_busy_still_rule_out_before_the_cost(ps):
    key = "conversation"
    own, second, third = rendezvous(ps, key)
    ps.busy = lambda i: i is own
    assert ps.choose(key, need=Need(1100, 1000, 1000)) is second
    ps.busy = None
    second.inflight = third.inflight = 0
    own.inflight = 3  # > 2 x (0 + 1)
    assert ps.choose(key, need=Need(1100, 1000, 1000)) is second


# --- a D that prefills (--prefill-on-decode) --------------------------------------------------

D_URLS = ["http://d0:8000", "http://d1:8000"]


def spilling(policy: Policy) -> tuple[Pool, Pool]:
    ps, ds = Pool("prefill", URLS[:2], policy), Pool("decode", D_URLS, policy)
    ps.spill = ds
    return ps, ds


def test_a_d_prefills_only_where_it_costs_less_than_every_p():
    ps, ds = spilling(Policy(cost=CostModel(pull=0.1)))
    key, first = "conversation", Need(300)
    assert ps.choose(key, need=first).role == "prefill"  # equal costs: a P
    for p in ps.instances:
        ps.acquire(p, 1)  # one token queued on every P
    d = ps.choose(key, need=first)
    assert d in ds.instances and d is rendezvous(ds, key)[0]
    # Counted as a D's: in the D pool's counts, under its lock, and given back. A P call is
    # queued work there, not a stream.
    ps.acquire(d, 300)
    assert (d.inflight, d.queued, d.prefills, ds.streams(d)) == (1, 300, 1, 1)
    assert ps.choose(key, need=first) is not d  # its own queue: the other D
    ps.release(d, 300)
    assert (d.inflight, d.queued, d.prefills) == (0, 0, 0)
    # Each stream a D runs (as it reports them, or in flight from here) waits for the prefill:
    # the turn's work counts once more for each.
    reports = {i.url: Reported(waiting=0, running=2, kv_usage=0.1, age=0.0) for i in ds.instances}
    ps.load = lambda i: reports.get(i.url)
    for p in ps.instances:
        p.queued = 600  # + 300: 900, as a D with 2 streams: 300 x 3
    assert ps.choose(key, need=first).role == "prefill"
    for p in ps.instances:
        p.queued = 601
    assert ps.choose(key, need=first).role == "decode"
    ps.load = None
    for other in ds.instances:
        ds.acquire(other)  # a stream from here on each D
    assert ps.choose(key, need=Need(700)).role == "prefill"  # 601 + 700 < 700 x 2
    assert ps.choose(key, need=Need(300)).role == "decode"  # 601 + 300 > 300 x 2


def test_no_d_prefills_a_turn_with_an_entry_nor_without_another_d_to_decode():
    ps, ds = spilling(Policy(cost=CostModel(pull=0.1)))
    key = "conversation"
    for p in ps.instances:
        p.queued = 10_000
    holder = ds.instances[0]
    assert ps.choose(key, need=Need(300)).role == "decode"
    # A turn with an entry: P reads D's blocks, its work on any P is small; it stays on a P.
    assert ps.choose(key, need=Need(1100, 1000, 1000, holder.url)).role == "prefill"
    assert ps.choose(key, need=Need(1100, 0, 1000, holder.url)).role == "prefill"
    # One D down: it must decode whatever a D prefills, so none does.
    ds.failed(ds.instances[1], unreachable=True)
    assert ps.choose(key, need=Need(300)).role == "prefill"


@pytest.mark.parametrize("routing", ["affinity", "round_robin"])
def test_no_d_prefills_without_the_setting_or_under_round_robin(routing):
    ps, ds = spilling(Policy(routing=routing, cost=CostModel(pull=0.1)))
    if routing == "affinity":
        ps.spill = None  # --prefill-on-decode off
    for p in ps.instances:
        p.queued = 10_000
    assert {ps.choose(f"c{n}", need=Need(300)).role for n in range(20)} == {"prefill"}


def test_a_d_that_prefilled_is_never_remembered_as_the_conversations_own_p():
    ps, ds = spilling(Policy(cost=CostModel(pull=0.1)))
    key = "conversation"
    need = Need(1100, 0, 1000)
    second = rendezvous(ps, key)[1]
    ps.prefilled(key, second)  # its last turn moved to the other P
    ps.prefilled(key, ds.instances[0])  # and this one a D prefilled
    assert ps.work(second, key, need) == 100  # still its own: the P that holds its history


def test_a_d_computing_a_long_prompt_sheds_the_decodes_that_may_go_elsewhere():
    ps, ds = spilling(Policy(cost=CostModel(pull=0.1, move_streams=4)))
    key = "conversation"
    home, other = ds.instances
    assert ds.choose(key, prefer=home.url) is home
    ps.acquire(home, 1536)  # a 1,536-token prefill there: its request + 3 streams' worth
    assert ds.choose(key, prefer=home.url) is home  # 4 against 4 for leaving: a tie stays
    ps.release(home, 1536)
    ps.acquire(home, 1537)
    assert ds.choose(key, prefer=home.url) is other
    assert CostModel(request_tokens=0).decode(1, True, prefilling=5000) == 1  # no unit: none


def test_with_one_p_a_d_still_prefills_and_a_retry_may_go_on_to_it():
    ps, ds = spilling(Policy(cost=CostModel(pull=0.1)))
    ps.remove(ps.instances[1].url)
    (p,) = ps.instances
    assert ps.choose("k", need=Need(300)) is p
    p.queued = 1
    assert ps.choose("k", need=Need(300)) in ds.instances
    assert ps.reach == 3  # a failed P call may be tried on a D as well


def test_with_every_p_busy_a_d_still_costs_what_it_costs():
    ps, ds = spilling(Policy(cost=CostModel(pull=0.1)))
    ps.busy = lambda i: i.role == "prefill"  # every P queueing by its own report
    for d in ds.instances:
        for _ in range(2):
            ds.acquire(d)  # 2 streams each: a 300-token prefill there costs 900
    assert ps.choose("k", need=Need(300)).role == "prefill"  # the last resort's P: 300
    for p in ps.instances:
        p.queued = 601
    assert ps.choose("k", need=Need(300)).role == "decode"


def test_round_robin_ignores_the_cost():
    pool = Pool("prefill", URLS, Policy(routing="round_robin"))
    chosen = [pool.choose("k", need=Need(1100, 1000, 1000)).url for _ in range(3)]
    assert chosen == URLS
    # Nor counts P's queued work, which only a cost reads.
    assert pool.work(pool.instances[0], "k", Need(1100, 1000, 1000)) == 0


def test_ds_keep_the_holding_d_until_it_runs_move_streams_more():
    ds = Pool("decode", URLS[:2], Policy(overload_factor=100, cost=CostModel(move_streams=4)))
    holding, other = ds.instances
    holding.inflight, other.inflight = 5, 1
    assert ds.choose("k", prefer=holding.url) is holding  # 5 against 1 + 4
    holding.inflight = 6
    assert ds.choose("k", prefer=holding.url) is other
    # Reported streams count where they are more than this process's own.
    holding.inflight = other.inflight = 0
    ds.load = lambda i: Reported(0, 6 if i is holding else 0, 0.1, 0.0)
    assert ds.choose("k", prefer=holding.url) is other
    # No entry: the rendezvous D is home, so an idle pool stays sticky.
    ds.load = None
    assert ds.choose("k") is rendezvous(ds, "k")[0]


def test_a_ds_own_streams_are_not_counted_twice_with_its_report():
    # Our 3 streams are among the 2 running and 1 waiting D reports: 3 streams, not 3 + 1.
    ds = Pool("decode", URLS[:2], Policy(overload_factor=100, cost=CostModel(move_streams=3.5)))
    holding, other = ds.instances
    holding.inflight = 3
    ds.load = lambda i: Reported(1, 2, 0.1, 0.0) if i is holding else None
    assert ds.choose("k", prefer=holding.url) is holding  # 3 against 0 + 3.5
    # What D reports beyond ours counts: 4 running and 1 waiting are 5 streams.
    ds.load = lambda i: Reported(1, 4, 0.1, 0.0) if i is holding else None
    assert ds.choose("k", prefer=holding.url) is other


def test_without_an_entry_no_d_but_the_rendezvous_first_is_home():
    ds = Pool("decode", URLS, Policy(overload_factor=100, cost=CostModel(move_streams=4)))
    home, second, third = rendezvous(ds, "k")
    second.inflight = 1
    # Its home excluded (a retry) or down: the others both pay the move, 1 + 4 against 0 + 4.
    assert ds.choose("k", exclude=[home]) is third
    home.down = True
    assert ds.choose("k") is third


def test_a_ps_queued_work_is_counted_while_its_call_runs(ps):
    need = Need(tokens=1100, held=1000, cached=1000)
    seen = []

    def call(instance, failure):
        seen.append(instance.queued)
        return "ok"

    answered = attempt(ps, "conversation", call, 2, need=need)
    assert seen == [100]  # the own P: only the new tokens
    assert answered.instance.queued == 0 and answered.instance.inflight == 0


def test_a_retried_p_is_costed_without_ds_blocks(ps):
    key = "conversation"
    own, second, _ = rendezvous(ps, key)
    own.queued = 150  # the own P: 150 + 100; a stranger: 0 + 100 + 1000 x 0.1
    tried = []

    def call(instance, failure):
        tried.append((instance, instance.queued))
        if failure is None:
            raise ServiceUnavailable("connection refused")
        return "ok"

    attempt(ps, key, call, 2, need=Need(tokens=1100, held=1000, cached=1000))
    # A retry is never sent D's params: a stranger would recompute all 1100 tokens, the own P
    # only the 100 its prefix cache lacks (and counts that much queued).
    assert tried == [(second, 200), (own, 250)]
    assert own.queued == 150 and second.queued == 0


def test_the_need_is_estimated_from_characters():
    chat = ClientRequest(
        "/v1/chat/completions",
        {
            "messages": [
                {"role": "user", "content": "a" * 400},
                {"role": "assistant", "content": "b" * 400},
                {"role": "user", "content": "c" * 40},
            ]
        },
        False,
        None,
    )
    need = prefill_need(chat, None)
    assert 210 <= need.tokens <= 240 and need.held == 0
    assert need.cached == need.tokens - (10 + 8)  # all but the last message
    entry = Entry(
        params={"remote_num_tokens": 205}, decode_url="http://d", history_digest="", history_len=2
    )
    assert prefill_need(chat, entry) == Need(need.tokens, 205, 205, "http://d")
    prompt = ClientRequest("/v1/completions", {"prompt": "x" * 800}, False, None)
    assert prefill_need(prompt, None) == Need(201)


# --- with real engines --------------------------------------------------------------------------


def own_p_of(ps: list[str], body: dict, conversation: str) -> str:
    """The P a conversation's rendezvous order puts first, as the gateway computes it."""
    root = root_key(body, {}, conversation)
    return max(ps, key=lambda url: _weight(root.encode(), Instance(url, "prefill", 0)))


@pytest.fixture(scope="module")
@starts_processes
def two_ps_one_d():
    flags = dict(bidirectional_kv_xfer=True, itl_ms=1, recompute_threshold=0)
    with (
        EmulatorProcess("prefill", host="127.0.0.211", **flags) as p0,
        EmulatorProcess("prefill", host="127.0.0.212", **flags) as p1,
        EmulatorProcess("decode", host="127.0.0.213", **flags) as d,
    ):
        yield [p0, p1], d


def homed_on(urls: list[str], body: dict, p: str) -> str:
    """A new conversation id whose own P (the rendezvous first of `urls`) is `p`."""
    return next(
        name
        for name in (f"c-{uuid.uuid4().hex[:8]}" for _ in iter(int, 1))
        if own_p_of(urls, body, name) == p
    )


def chat(*messages: str) -> dict:
    roles = ["user", "assistant"]
    return {
        "model": workload.MODEL,
        "max_tokens": 16,
        "messages": [{"role": roles[n % 2], "content": text} for n, text in enumerate(messages)],
    }


def test_a_turn_whose_own_p_is_busy_goes_to_the_other_and_still_reads_ds_blocks(two_ps_one_d):
    ps, d = two_ps_one_d
    urls = [p.url for p in ps]
    busy, other = ps
    # Two conversations whose own P is the same: a long first turn that hangs there (the
    # emulator's hang fault holds it, in flight, until the gateway lets go), and a short one.
    first, long_body = chat("What is KV reuse?"), chat("x " * 8000)
    short, long = homed_on(urls, first, busy.url), homed_on(urls, long_body, busy.url)
    for p in ps:
        p.reset_stats()
    gateway = gateway_process(urls, [d.url], workers=1, engine_metrics_interval=0, release_rate=0)
    try:
        turn1 = requests.post(
            gateway.url + "/v1/chat/completions",
            json={**first, "conversation_id": short},
            timeout=30,
        )
        assert turn1.status_code == 200 and turn1.headers["X-Gateway-KV"] == "none"
        assert (busy.stats()["requests"], other.stats()["requests"]) == (1, 0)
        reply = turn1.json()["choices"][0]["message"]["content"]
        replies = []

        def while_the_long_prefill_hangs(sock) -> None:
            wait_until(lambda: busy.stats()["requests"] == 2, 10, "the long prefill on its P")
            turn2 = requests.post(
                gateway.url + "/v1/chat/completions",
                json={**chat("What is KV reuse?", reply, "And why?"), "conversation_id": short},
                timeout=30,
            )
            assert turn2.status_code == 200
            assert turn2.headers["X-Gateway-KV"] == "read"  # the other P read D's blocks
            assert (busy.stats()["requests"], other.stats()["requests"]) == (2, 1)
            assert other.stats()["hits"] == 1
            replies.append(turn2.json()["choices"][0]["message"]["content"])

        busy.set_fault("hang", count=1)
        # Its client leaves once the test is done: the gateway cuts the P call, and the
        # emulator's hang ends with it.
        open_and_abandon(
            gateway, {**long_body, "conversation_id": long}, while_the_long_prefill_hangs
        )
        wait_until(lambda: busy.stats()["fault_responses"] == 1, 10, "the hang to end")
        wait_until(
            lambda: all(i["inflight"] == 0 for i in gateway.status()["prefill"]),
            10,
            "the gateway to let go of the long prefill",
        )
        # Both Ps idle: the third turn stays on the P that prefilled the second, whose cache
        # holds the history (not on its rendezvous first, which would pull D's blocks).
        turn3 = requests.post(
            gateway.url + "/v1/chat/completions",
            json={
                **chat("What is KV reuse?", reply, "And why?", replies[0], "And then?"),
                "conversation_id": short,
            },
            timeout=30,
        )
        assert turn3.status_code == 200
        assert (busy.stats()["requests"], other.stats()["requests"]) == (2, 2)
    finally:
        busy.set_fault("none")
        gateway.stop()


def test_a_ps_queue_from_one_worker_steers_another_workers_first_turn(two_ps_one_d):
    ps, d = two_ps_one_d
    urls = [p.url for p in ps]
    busy, other = ps
    # A long first turn whose own P is `busy` hangs there, sent to one worker; first turns of
    # conversations whose own P is the same, sent to the other worker, see it queued.
    first, long_body = chat("What is KV reuse?"), chat("x " * 8000)
    long = homed_on(urls, long_body, busy.url)
    shorts = [homed_on(urls, first, busy.url) for _ in range(2)]
    for p in ps:
        p.reset_stats()
    gateway = gateway_process(urls, [d.url], workers=2, engine_metrics_interval=0, release_rate=0)
    # Each worker served on its private port (a request there is served where it lands),
    # whichever worker the kernel would give the public port's.
    one, another = (gateway.port + 1 + slot for slot in range(2))
    for port in (one, another):
        health = f"http://{gateway.host}:{port}{gateway.prefix}/health"
        wait_until(
            lambda url=health: requests.get(url, timeout=2).status_code == 200,
            30,
            f"the worker on port {port}",
        )

    def first_turn(port: int, conversation: str) -> None:
        url = f"http://{gateway.host}:{port}{gateway.prefix}/v1/chat/completions"
        reply = requests.post(url, json={**first, "conversation_id": conversation}, timeout=30)
        assert reply.status_code == 200

    try:

        def while_the_long_prefill_hangs(sock) -> None:
            wait_until(lambda: busy.stats()["requests"] == 1, 10, "the long prefill on its P")
            first_turn(another, shorts[0])
            assert (busy.stats()["requests"], other.stats()["requests"]) == (1, 1)

        busy.set_fault("hang", count=1)
        open_and_abandon(
            gateway, {**long_body, "conversation_id": long}, while_the_long_prefill_hangs, one
        )
        wait_until(lambda: busy.stats()["fault_responses"] == 1, 10, "the hang to end")
        wait_until(
            lambda: all(i["inflight"] == 0 for i in gateway.status(port=one)["prefill"]),
            10,
            "the first worker to let go of the long prefill",
        )
        # Released, it counts nowhere: the other worker's next first turn stays home.
        first_turn(another, shorts[1])
        assert (busy.stats()["requests"], other.stats()["requests"]) == (2, 1)
    finally:
        busy.set_fault("none")
        gateway.stop()


def test_a_held_count_that_is_not_a_count_is_not_held():
    chat = ClientRequest(
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "a" * 400}, {"role": "user", "content": "c"}]},
        False,
        None,
    )
    without = prefill_need(chat, None)
    # True is an int to isinstance: it must not read as 1 token held (nor -1, nor "205").
    for held in (True, -1, "205", 1.5):
        params = {"remote_num_tokens": held}
        entry = Entry(params=params, decode_url="http://d", history_digest="", history_len=1)
        assert prefill_need(chat, entry) == replace(without, held_on="http://d")


def test_token_id_prompts_count_their_ids():
    def need(prompt) -> Need:
        return prefill_need(ClientRequest("/v1/completions", {"prompt": prompt}, False, None), None)

    assert need(list(range(10_000, 10_300))) == Need(300)  # not their JSON's digits / 4
    # A list of prompts is as many requests on the one P it goes to: all of them count.
    assert need([list(range(10_000, 10_100)), list(range(100))]) == Need(200)
    assert need(["x" * 800, "y" * 400]) == Need(201 + 101)


def test_the_history_and_its_last_message_are_counted_in_the_same_unit():
    def need(text: str) -> Need:
        messages = [{"role": "user", "content": text * 400}, {"role": "user", "content": text * 40}]
        return prefill_need(
            ClientRequest("/v1/chat/completions", {"messages": messages}, False, None), None
        )

    # UTF-8 bytes both: 2 per "é", so the history's estimate and its last message's agree.
    ascii, accented = need("ab"), need("é")
    assert accented == ascii and ascii.tokens - ascii.cached == 80 // 4 + 8
