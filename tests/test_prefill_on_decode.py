"""--prefill-on-decode: a D prefills a turn without an entry, as a P does, where that costs less
than every P; the other D decodes it, pulling from it, and keeps its blocks for the next turn,
which a P reads (docs/routing.md).
Real engines (two emulated Ps and Ds, bidirectional KV transfer) and a real gateway process."""

from __future__ import annotations

import pytest
import requests

from devtools import workload
from emulator.process import wait_until
from tests.helpers.servers import (
    gateway_process,
    metric,
    open_and_abandon,
    starts_processes,
    two_of_each,
)


@pytest.fixture(scope="module")
@starts_processes
def engines():
    with two_of_each(221) as (prefills, decodes):
        yield prefills, decodes


QUESTION = "What is KV reuse? " + "Tell me all about it. " * 30


def chat(*messages: str, conversation: str) -> dict:
    roles = ["user", "assistant"]
    return {
        "model": workload.MODEL,
        "max_tokens": 16,
        "conversation_id": conversation,
        "messages": [{"role": roles[n % 2], "content": text} for n, text in enumerate(messages)],
    }


def ask(gateway, body: dict) -> requests.Response:
    response = requests.post(gateway.url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    return response


def test_a_d_prefills_a_first_turn_while_both_ps_are_busy_and_the_other_d_keeps_it(engines):
    prefills, decodes = engines
    for engine in prefills + decodes:
        engine.set_fault("none")
        engine.reset_stats()
    # No engine reports (interval 0): the costs are the work this gateway has in flight, which
    # the test drives: a long first turn hangs on each P (the emulator's hang fault holds it in
    # flight until its client leaves).
    gateway = gateway_process(
        [p.url for p in prefills],
        [d.url for d in decodes],
        workers=1,
        engine_metrics_interval=0,
        release_rate=0,
        prefill_on_decode=True,
    )
    requests_on = lambda engines: [e.stats()["requests"] for e in engines]  # noqa: E731
    try:
        for p in prefills:
            p.set_fault("hang", count=1)
        seen = {}

        def while_both_ps_hang(sock) -> None:
            # The second long turn went to the other P: the first's was queued (a D ties
            # with an idle P, and Ps come first).
            wait_until(lambda: requests_on(prefills) == [1, 1], 10, "a long prefill on each P")
            # Long enough that what D holds passes vLLM's kv_recompute_threshold (64 tokens).
            first = chat(QUESTION, conversation="spilled")
            turn1 = ask(gateway, first)
            stats = [d.stats() for d in decodes]
            # One D prefilled it (a P's request), the other decoded it, pulling from it.
            assert sorted(s["prefill_requests"] for s in stats) == [0, 1]
            prefiller = next(
                d for d, s in zip(decodes, stats, strict=True) if s["prefill_requests"]
            )
            decoder = next(d for d in decodes if d is not prefiller)
            assert decoder.stats()["remote_prefill_requests"] == 1
            assert decoder.stats()["pulled_tokens"] > 0
            assert turn1.headers["X-Gateway-Cache"] == "miss"
            before_turn2 = [d.stats()["prefill_requests"] for d in decodes]
            reply = turn1.json()["choices"][0]["message"]["content"]
            # Turn 2 has an entry (on the decoder): it costs any P little, so a P takes it even
            # now, reading the decoder's blocks, and the decoder decodes it.
            second = chat(QUESTION, reply, "And why?", conversation="spilled")
            turn2 = ask(gateway, second)
            assert (turn2.headers["X-Gateway-Cache"], turn2.headers["X-Gateway-KV"]) == (
                "hit",
                "read",
            )
            assert requests_on(prefills) in ([2, 1], [1, 2])
            assert sum(p.stats()["hits"] for p in prefills) == 1
            assert [d.stats()["prefill_requests"] for d in decodes] == before_turn2
            assert decoder.stats()["remote_prefill_requests"] == 2
            name = f"decode[{decodes.index(prefiller)}]"
            assert metric(gateway, "pd_gateway_prefills_on_decode_total", engine=name) == 1
            seen["d_prefills"] = before_turn2

        def while_one_p_hangs(sock) -> None:
            wait_until(lambda: sum(requests_on(prefills)) == 1, 10, "a long prefill on a P")
            body = chat("y " * 4000, conversation="long-2")
            open_and_abandon(gateway, body, while_both_ps_hang)

        open_and_abandon(gateway, chat("x " * 4000, conversation="long-1"), while_one_p_hangs)
        assert "d_prefills" in seen  # the turns above ran (and asserted) while both Ps hung
        # The long turns' clients left: the gateway cut both P calls, and the hangs ended.
        wait_until(
            lambda: sum(p.stats()["fault_responses"] for p in prefills) == 2, 10, "the hangs"
        )
        wait_until(
            lambda: all(i["inflight"] == 0 for i in gateway.status()["prefill"]),
            10,
            "the gateway to let go of the long prefills",
        )
        # The Ps idle again: a new conversation's first turn goes to a P.
        ask(gateway, chat(QUESTION, conversation="calm"))
        assert [d.stats()["prefill_requests"] for d in decodes] == seen["d_prefills"]
        assert sum(requests_on(prefills)) == 4
        assert sum(e.stats()["wrong_reuse"] for e in prefills + decodes) == 0
    finally:
        for p in prefills:
            p.set_fault("none")
        gateway.stop()
