"""The gateway's counters tell what P did with D's blocks (issue 21), on engines with vLLM's
defaults (prefix caching on, kv_recompute_threshold 64) and bidirectional transfer on.

P reads what D holds beyond its own prefix cache only when that is 64 tokens or more: a short
reply is recomputed, a long one read. The gateway learns which from what P reports
(`remote_prefill_cached_tokens` in P's params) and counts it in pd_gateway_kv_reads_total."""

from __future__ import annotations

import pytest

from devtools import workload
from emulator.process import EmulatorProcess
from tests.helpers.servers import gateway_process, starts_processes


@pytest.fixture(scope="module")
@starts_processes
def setup():
    with (
        EmulatorProcess("prefill", bidirectional_kv_xfer=True, host="127.0.0.74", itl_ms=1) as p,
        EmulatorProcess("decode", bidirectional_kv_xfer=True, host="127.0.0.75", itl_ms=1) as d,
        gateway_process([p.url], [d.url]) as gateway,
    ):
        yield p, d, gateway


@pytest.mark.parametrize("reply_tokens, result", [(8, "recomputed"), (100, "read")])
def test_the_gateway_counts_whether_p_read_ds_blocks(setup, reply_tokens, result):
    p, d, gateway = setup
    before = {
        r: gateway.metric("pd_gateway_kv_reads_total", result=r)
        for r in ("read", "recomputed", "own_cache", "unreported")
    }
    tokens = {
        k: gateway.metric("pd_gateway_prefill_tokens_total", kind=k) for k in ("prompt", "cached")
    }
    cached_by_kv = {
        k: gateway.metric("pd_gateway_prefill_cached_tokens_total", kv=k)
        for k in ("read", "recomputed", "own_cache", "none")
    }
    for engine in (p, d):
        engine.reset_stats()
    convs = [
        workload.Conversation(
            gateway.url, first_words=60, turn_words=(10, 10), max_tokens=reply_tokens
        )
        for _ in range(3)
    ]
    workload.drive(convs, turns=4, concurrency=3)
    assert workload.errors(convs) == []
    assert workload.later_hits(convs) == (9, 9)  # every later turn sent D's params ...
    after = {r: gateway.metric("pd_gateway_kv_reads_total", result=r) for r in before}
    assert {r: after[r] - before[r] for r in before} == {
        r: 9.0 if r == result else 0.0 for r in before
    }  # ... which P read, or not
    # Each turn's client is told the same: none on a first turn (nothing sent), then the word.
    assert [c.kvs for c in convs] == [["none"] + [result] * 3] * 3
    # The tokens P did not compute, by the turn's outcome: what it read from D on the turns
    # that read; on the others, only what P's own prefix cache held.
    cached = {
        k: gateway.metric("pd_gateway_prefill_cached_tokens_total", kv=k) - cached_by_kv[k]
        for k in cached_by_kv
    }
    stats = p.stats()
    assert stats["hits"] == (9 if result == "read" else 0)
    assert stats["declined_pulls"] == (0 if result == "read" else 9)
    # What P reported is what it did: its prompt tokens, and those it did not compute.
    assert (
        gateway.metric("pd_gateway_prefill_tokens_total", kind="prompt") - tokens["prompt"]
        == stats["local_prefix_tokens"]
        + stats["reused_prompt_tokens"]
        + stats["computed_prompt_tokens"]
    )
    assert (
        gateway.metric("pd_gateway_prefill_tokens_total", kind="cached") - tokens["cached"]
        == stats["local_prefix_tokens"] + stats["reused_prompt_tokens"]
        == sum(cached.values())
    )
    assert cached["own_cache"] == 0 and (
        cached["read"] >= stats["reused_prompt_tokens"] > 0
        if result == "read"
        else cached["read"] == 0
    )
    assert stats["wrong_reuse"] == d.stats()["wrong_reuse"] == 0
