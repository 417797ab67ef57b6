"""D's pinned budget from what D reports (gateway/engines/d_budget.py), the stores keeping each D
within it as it changes, and the block size partial reuse cuts at, from the engines'
vllm:cache_config_info (gateway/engines/engine_load.py BlockSize)."""

from __future__ import annotations

import logging
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from emulator.process import EmulatorProcess, wait_until
from emulator.tokens import VOCAB
from gateway.engines.d_budget import FALLBACK, HIGH_WATER, DBudget, Limit
from gateway.engines.engine_load import DEFAULT_BLOCK_SIZE, BlockSize, Facts, Reported
from gateway.engines.instances import Pool
from gateway.reuse.store import Entry, LocalStore
from tests.helpers.servers import MODEL, gateway_process

D = "http://d:1"


class Reports:
    """What the engines said, as EngineLoad tells it: facts (kept), the last read (or None)."""

    def __init__(self) -> None:
        self.enabled = True
        self.facts_of: dict[str, Facts] = {}
        self.read: dict[str, Reported] = {}

    def facts(self, instance):
        return self.facts_of.get(instance.url)

    def reported(self, instance):
        return self.read.get(instance.url)

    def says(self, url: str, usage: float, at: float) -> None:
        self.read[url] = Reported(0.0, 0.0, usage, 0.0, at)


def _budget(
    reports: Reports,
    given=None,
    shares: int = 1,
    capacity: int | None = 1000,
    workers: int | None = None,
    ranks: int = 1,
    pending=lambda decode: 0,
):
    pool = Pool("decode", [D])
    if capacity is not None:
        reports.facts_of[D] = Facts(16, capacity, True, ranks)
    return DBudget(
        given, reports, pool.get, shares=shares, workers=workers or shares, pending=pending
    )


def test_a_given_budget_is_every_ds_and_each_worker_keeps_its_share():
    assert _budget(Reports(), given=8192)(D) == Limit(8192)
    assert _budget(Reports(), given=8192, shares=4)(D) == Limit(2048)
    assert _budget(Reports(), given=0)(D).at(5000) == 0  # no budget


def test_a_d_that_says_nothing_of_its_capacity_gets_the_old_default():
    assert _budget(Reports(), capacity=None)(D) == Limit(FALLBACK)
    assert _budget(Reports(), capacity=None)("http://gone:1") == Limit(FALLBACK)


def test_the_pins_never_take_more_than_the_high_water_mark_of_d():
    """600 blocks: at most 0.9 of them pinned, whatever D says of its usage (or if it says
    nothing now)."""
    reports = Reports()
    budget = _budget(reports, capacity=600)
    assert budget(D).at(0) == int(HIGH_WATER * 600) == 540
    reports.says(D, usage=0.5, at=1.0)
    assert budget(D).at(300) == 540


def test_usage_above_the_mark_cuts_the_pins_by_the_excess_once_a_report():
    reports = Reports()
    budget = _budget(reports, capacity=1000)
    reports.says(D, usage=0.8, at=1.0)  # room: the pins may grow
    assert budget(D) == Limit(900)
    reports.says(D, usage=1.0, at=2.0)  # running requests filled D: 100 over
    assert budget(D) == Limit(900, 100)  # released at once, 100 fewer...
    assert budget(D).at(500) == 900  # ...once: then the cap again, as pins
    reports.says(D, usage=0.93, at=3.0)  # of turns that end take no new room
    assert budget(D).at(700) == 670
    reports.says(D, usage=0.5, at=4.0)  # D emptied: the pins may grow back
    assert budget(D).at(670) == 900


def test_a_cut_counts_the_releases_still_queued_as_made():
    """Releases wait in a queue (at most --release-rate a second): a report taken before they
    landed cuts only what they will not free."""
    reports = Reports()
    queued = {D: 60}
    budget = _budget(reports, capacity=1000, pending=lambda decode: queued.get(decode, 0))
    reports.says(D, usage=1.0, at=1.0)
    assert budget(D) == Limit(900, 40)
    reports.says(D, usage=0.95, at=2.0)  # 50 over, 60 on their way: no cut
    assert budget(D) == Limit(900)


def test_a_stale_report_cuts_nothing():
    reports = Reports()
    budget = _budget(reports, capacity=1000)
    reports.says(D, usage=1.0, at=1.0)
    assert budget(D).at(500) == 400
    assert budget(D).at(500) == 900  # the same report again: acted on already
    del reports.read[D]  # reads failing: the cap alone
    assert budget(D).at(500) == 900


def test_each_worker_of_a_local_store_keeps_and_cuts_its_share():
    reports = Reports()
    budget = _budget(reports, capacity=1000, shares=4, workers=4)
    assert budget(D) == Limit(900 // 4)
    reports.says(D, usage=1.0, at=1.0)  # 100 over: each of 4 workers gives 25
    assert budget(D).at(120) == 95
    assert budget("http://other:1") == Limit(FALLBACK // 4)


def test_each_worker_of_a_shared_store_cuts_its_share_of_the_whole():
    """A Redis store's count is every worker's and host's: the cap is the whole D's, and each
    worker of the host makes its share of a cut, from the count Redis holds then."""
    reports = Reports()
    budget = _budget(reports, capacity=1000, shares=1, workers=4)
    assert budget(D) == Limit(900)
    reports.says(D, usage=1.0, at=1.0)
    assert budget(D) == Limit(900, 25)


def test_a_data_parallel_ds_excess_is_its_fullest_ranks():
    """vLLM's num_gpu_blocks is every rank's together (v1/engine/core_client.py ~L874-877);
    its usage here is the fullest rank's (engine_load.parse): the excess is of that rank's
    share."""
    reports = Reports()
    budget = _budget(reports, capacity=2000, ranks=2)
    reports.says(D, usage=1.0, at=1.0)
    assert budget(D) == Limit(1800, 100)


def test_a_full_d_keeps_only_the_conversation_just_stored():
    """0 would be no budget at all: the least is 1 block (the store keeps the newest entry)."""
    reports = Reports()
    budget = _budget(reports, capacity=100)
    reports.says(D, usage=1.0, at=1.0)
    assert budget(D).at(5) == 1


# --- the store keeps each D within its budget as the budget changes ---------------------------


def _entry(decode: str, blocks: int, n: int) -> Entry:
    return Entry(
        params={"remote_block_ids": [list(range(blocks))], "remote_engine_id": f"e{n}"},
        decode_url=decode,
        history_digest=f"h{n}",
        history_len=1,
    )


def test_a_local_store_releases_beyond_a_budget_that_shrank_at_its_next_sweep(clock):
    budgets = {D: 100}
    store = LocalStore(
        maxsize=100, ttl=450, timer=clock, pinned_budget=lambda decode: Limit(budgets[decode])
    )
    dropped = []
    store.on_drop = lambda entry, why: dropped.append((entry.history_digest, why))
    for n in range(5):
        store.put(f"k{n}", _entry(D, 20, n))
    assert store.pinned() == {D: 100} and dropped == []
    budgets[D] = 50  # D filled with running requests
    store.sweep()
    assert dropped == [("h0", "budget"), ("h1", "budget"), ("h2", "budget")]
    assert store.pinned() == {D: 40}
    budgets[D] = 200  # it emptied again: nothing comes back,
    store.put("k9", _entry(D, 20, 9))  # and more may be kept
    assert store.pinned() == {D: 60} and len(dropped) == 3


# --- the block size partial reuse cuts at -----------------------------------------------------


def _block_size(sizes: dict[str, int], given=None, enabled=True) -> BlockSize:
    reports = Reports()
    reports.enabled = enabled
    reports.facts_of = {url: Facts(size, 1000, True) for url, size in sizes.items()}
    pools = [
        Pool("prefill", [u for u in sizes if "p" in u]),
        Pool("decode", [u for u in sizes if "d" in u]),
    ]
    return BlockSize(given, pools, reports)


def test_the_block_size_is_what_every_engine_of_the_model_reports():
    assert _block_size({"http://p:1": 32, "http://d:1": 32})() == 32
    assert _block_size({"http://p:1": 32, "http://d:1": 32}, given=16)() == 16  # overrides
    assert _block_size({"http://p:1": 32}, enabled=False)() == DEFAULT_BLOCK_SIZE


def test_engines_that_disagree_get_no_partial_reuse_and_a_warning(caplog):
    size = _block_size({"http://p:1": 32, "http://d:1": 16})
    with caplog.at_level(logging.WARNING):
        assert size() is None
        size._at = float("-inf")
        assert size() is None
    assert [r.getMessage() for r in caplog.records].count(
        caplog.records[0].getMessage()
    ) == 1 and "16, 32" in caplog.text


def test_until_an_engine_reports_the_block_size_is_unknown(clock):
    reports = Reports()
    size = BlockSize(None, [Pool("decode", [D])], reports, clock=clock)
    assert size() is None
    reports.facts_of[D] = Facts(32, 1000, True)  # the first read: known a moment later
    clock.advance(0.2)
    assert size() == 32


@pytest.mark.parametrize("held, prompt", [(64, 60)])
def test_a_block_size_of_none_makes_no_checkpoints(held, prompt):
    from gateway.reuse.exactness import Exactness

    exactness = Exactness("auto", 64, lambda: None)
    assert exactness.held(list(range(prompt)), list(range(5)), held, True)[1] is None
    assert (
        Exactness("auto", 64, lambda: 16).held(list(range(prompt)), list(range(5)), held, True)[1]
        is not None
    )


# --- a real D of 600 blocks -------------------------------------------------------------------

SMALL_D_HOSTS = ("127.0.0.175", "127.0.0.176")  # P, D


def _conversation(url: str, index: int) -> list:
    """Two turns: a 150-word question, a short follow-up; each turn's status (or error)."""
    rng = random.Random(index)
    messages = [
        {"role": "user", "content": f"c{index} " + " ".join(rng.choice(VOCAB) for _ in range(150))}
    ]
    outcomes = []
    for _ in range(2):
        try:
            reply = requests.post(
                url + "/v1/chat/completions",
                timeout=20,
                json={"model": MODEL, "messages": messages, "max_tokens": 32},
            )
        except requests.RequestException as exc:  # a turn that waited for D's memory
            return outcomes + [repr(exc)]
        outcomes.append(reply.status_code)
        if reply.status_code != 200:
            return outcomes
        messages += [
            {"role": "assistant", "content": reply.json()["choices"][0]["message"]["content"]},
            {"role": "user", "content": "and more please"},
        ]
    return outcomes


@pytest.mark.processes
def test_a_d_that_reports_600_blocks_never_gets_more_pinned_than_it_can_spare():
    """48 conversations would pin some 720 blocks on a D of 600 if nothing were released: with
    the old fixed budget (8192 blocks) D fills with pins and turns wait for its memory until
    they time out (bench.d_memory). Derived from D's report, the budget stays within 0.9 of
    it, beside what D's running requests take, and every turn is served."""
    engine = {"itl_ms": 1, "bidirectional_kv_xfer": True}
    with (
        EmulatorProcess("prefill", host=SMALL_D_HOSTS[0], **engine) as p,
        EmulatorProcess(
            "decode", host=SMALL_D_HOSTS[1], kv_capacity_blocks=600, max_model_len=8192, **engine
        ) as d,
        gateway_process([p.url], [d.url]) as gateway,
    ):
        with ThreadPoolExecutor(8) as pool:
            outcomes = list(pool.map(lambda i: _conversation(gateway.url, i), range(48)))
        assert [o for o in outcomes if o != [200, 200]] == []
        budget = gateway.metric("pd_gateway_pinned_blocks_budget", decode=d.url)
        assert 0 < budget <= HIGH_WATER * 600

        # Once the releases have landed, D holds what the budget allows, no more (each lease
        # also holds the block of its last sampled token, which D does not export: one block
        # a lease beyond what the gateway counts).
        def within() -> bool:
            stats = d.stats()
            return stats["kv_lease_blocks"] - stats["kv_leases"] <= budget

        wait_until(within, 20, "the releases to land")
        assert gateway.metric("pd_gateway_releases_total", reason="budget", result="released") > 0
        assert p.stats()["wrong_reuse"] == 0
