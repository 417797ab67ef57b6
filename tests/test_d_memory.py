"""D's memory on vLLM's rules (issue 22): the decode-only fast path leaves nothing untracked on
D, entries dropped unread are released through P, and a D keeps at most its pinned budget.

The engines are vLLM's defaults (prefix caching on, kv_recompute_threshold 64) but for
bidirectional transfer, switched on as a P/D gateway's engines run; the emulator keeps a lease
forever for D params that set neither flag, as vLLM 0.33 does (docs/emulator.md)."""

from __future__ import annotations

import pytest

from devtools import workload
from emulator.process import EmulatorProcess, wait_until
from tests.helpers.servers import gateway_process, reset, starts_processes

pytestmark = pytest.mark.processes  # engines and gateways, every test


@pytest.fixture(scope="module")
@starts_processes
def default_engines():
    with (
        EmulatorProcess("prefill", bidirectional_kv_xfer=True, host="127.0.0.70", itl_ms=1) as p,
        EmulatorProcess("decode", bidirectional_kv_xfer=True, host="127.0.0.71", itl_ms=1) as d,
    ):
        yield p, d


@pytest.fixture
def engines(default_engines):
    return reset(default_engines)


def short_follow_ups(gateway, count: int, **options) -> list[workload.Conversation]:
    """`count` conversations: a long first question, then two-word follow-ups."""
    return [
        workload.Conversation(
            gateway.url, first_words=120, turn_words=(2, 2), max_tokens=8, **options
        )
        for _ in range(count)
    ]


def kept_for_later(conversations: list[workload.Conversation]) -> int:
    """Conversations whose last turn left an entry: it ran two-stage (a decode-only turn keeps
    nothing on D)."""
    return sum(1 for c in conversations if c.paths[-1].startswith("two-stage"))


@pytest.mark.parametrize("worker_class", ["gevent", "gthread"])
def test_the_fast_path_leaves_nothing_on_d_that_nobody_frees(engines, worker_class):
    p, d = engines
    with gateway_process(
        [p.url], [d.url], worker_class=worker_class, fast_path_tokens=64
    ) as gateway:
        convs = short_follow_ups(gateway, 6)
        workload.drive(convs, turns=6, concurrency=3)
        assert workload.errors(convs) == []
        decode_only = sum(path.startswith("decode-only") for c in convs for path in c.paths)
        assert decode_only >= 6
        # Every lease but each conversation's latest is read by P or released; none leaks.
        wait_until(
            lambda: d.stats()["kv_leases"] == kept_for_later(convs),
            20,
            "the unread leases to be released",
        )
        stats = d.stats()
        assert stats["leaked_leases"] == 0 and stats["leaked_blocks"] == 0
        assert stats["plain_requests"] == decode_only  # a decode-only turn keeps nothing
        assert p.stats()["wrong_reuse"] == 0 and stats["wrong_reuse"] == 0
        assert (
            gateway.metric("pd_gateway_releases_total", reason="decode_only", result="released")
            == decode_only
        )


@pytest.mark.parametrize("partial", [0, 64])
def test_entries_refused_by_the_exactness_check_are_released(partial):
    """A template that drops reasoning: no entry is ever read whole (its tokens hold reasoning
    the next prompt lacks). Without partial reuse each is refused and released when dropped;
    with it, each is read in part (P's notification frees D's request) or, where too little is
    shared, refused and released. Either way nothing is left behind but each conversation's
    latest entry."""
    flags = dict(
        bidirectional_kv_xfer=True, itl_ms=1, reasoning_share=1.0, template_quirks="drop_reasoning"
    )
    with (
        EmulatorProcess("prefill", host="127.0.0.72", **flags) as p,
        EmulatorProcess("decode", host="127.0.0.73", **flags) as d,
        gateway_process([p.url], [d.url], partial_reuse_tokens=partial) as gateway,
    ):
        convs = [
            workload.Conversation(gateway.url, first_words=40, max_tokens=24) for _ in range(4)
        ]
        workload.drive(convs, turns=4, concurrency=2)
        assert workload.errors(convs) == []
        caches = [c for conv in convs for c in conv.caches]
        assert set(caches) == ({"miss", "partial"} if partial else {"miss"})
        wait_until(lambda: d.stats()["kv_leases"] == 4, 20, "refused entries to be released")
        released = gateway.metric("pd_gateway_releases_total", result="released")
        assert released + caches.count("partial") == 12
        assert p.stats()["wrong_reuse"] == 0


@pytest.mark.parametrize("store", ["local", "redis"])
def test_a_ds_pinned_blocks_stay_within_the_budget_and_recent_conversations_still_hit(
    store, request
):
    budget = 120
    settings = {"pinned_blocks": budget}
    if store == "redis":  # one budget for every worker and host sharing the store
        server = request.getfixturevalue("redis_server")
        server.client.flushdb()
        settings.update(store=server.url, workers=2)
    # Engines of its own: what D holds is counted from nothing.
    with (
        EmulatorProcess("prefill", bidirectional_kv_xfer=True, host="127.0.0.76", itl_ms=1) as p,
        EmulatorProcess("decode", bidirectional_kv_xfer=True, host="127.0.0.77", itl_ms=1) as d,
        gateway_process([p.url], [d.url], **settings) as gateway,
    ):
        convs = [
            workload.Conversation(gateway.url, first_words=150, max_tokens=8) for _ in range(12)
        ]
        workload.drive(convs, turns=1, concurrency=1)  # ~11 blocks each: 12 > budget
        gauge = (
            "pd_gateway_pinned_blocks" if store == "local" else "pd_gateway_shared_pinned_blocks"
        )
        pinned = gateway.metric(gauge, decode=d.url)
        assert 0 < pinned <= budget
        released = "pd_gateway_releases_total"
        wait_until(
            lambda: gateway.metric(released, reason="budget", result="released") >= 1,
            20,
            "the oldest entries to be released",
        )
        # D holds at most the budget for idle conversations (and a block more an entry: D keeps
        # the slot of its last sampled token, which it does not export).
        wait_until(
            lambda: d.stats()["kv_leases"] == 12 - gateway.metric(released, reason="budget"),
            20,
            "D to free them",
        )
        assert d.stats()["kv_lease_blocks"] <= budget + d.stats()["kv_leases"]
        workload.drive(convs[-3:], turns=1, concurrency=1)  # the most recent: still there
        assert [c.caches[-1] for c in convs[-3:]] == ["hit"] * 3
        workload.drive(convs[:1], turns=1, concurrency=1)  # the oldest: released, a miss
        assert convs[0].caches[-1] == "miss"
        assert workload.errors(convs) == []
