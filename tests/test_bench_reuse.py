"""bench.reuse's measuring side: the skewed workload as specified (seeded, long conversations
near 10,000 tokens beside short ones), issue 44's goal per row, and its client against a real
engine (every gap between content events kept, every turn tagged with its conversation's kind)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from bench import reuse
from emulator.tokens import render_chat

SKEWED = reuse.SCENARIOS[3]


def last_prompts(scenario: reuse.Scenario, reply: int) -> dict[str, list[int]]:
    """Each conversation's longest prompt (its last turn), by kind, replies of `reply` words."""
    out: dict[str, list[int]] = {}
    for kind, conv in reuse.conversations(scenario, reply, "t", ids=False):
        for _ in range(reuse.TURNS):
            conv.ask()
            prompt = len(render_chat(conv.messages))
            conv.add_reply(" ".join(["word"] * reply))
        out.setdefault(kind, []).append(prompt)
    return out


@pytest.mark.parametrize("reply", reuse.REPLIES)
def test_skewed_workload_has_a_few_long_conversations_beside_many_short(reply):
    prompts = last_prompts(SKEWED, reply)
    assert len(prompts["long"]) == 3 and len(prompts["short"]) == 32
    # The long ones grow to about 10,000 tokens whatever the reply, and stay within
    # max_model_len with the reply; each short one stays several times shorter.
    assert all(8_000 <= p <= 12_000 for p in prompts["long"])
    assert max(prompts["long"]) + reply <= reuse.ENGINE["max_model_len"]
    assert max(prompts["short"]) * 1.5 < min(prompts["long"])
    assert reuse.live_blocks(SKEWED, reply) * reuse.BLOCK >= sum(map(sum, prompts.values()))


def test_short_conversations_are_a_few_hundred_tokens_at_short_replies():
    assert max(last_prompts(SKEWED, 32)["short"]) < 1_000


def test_the_skewed_text_is_the_same_for_every_run_and_system():
    def texts(salt: str) -> list:
        convs = reuse.conversations(SKEWED, 32, salt, ids=False)
        for _, conv in convs:
            conv.ask()
        return [(kind, conv.cid, conv.messages) for kind, conv in convs]

    assert texts("s0") == texts("s0")
    assert texts("s0") != texts("s1")


def test_short_conversations_start_spread_over_one_think_time():
    delays = [reuse.start_delay(SKEWED, i) for i in range(SKEWED.live)]
    assert delays[:3] == [0.0] * 3
    assert delays[3:] == sorted(delays[3:]) and 0.0 <= delays[-1] < SKEWED.think
    assert {reuse.start_delay(reuse.SCENARIOS[0], i) for i in range(16)} == {0.0}


def row(system: str, computed: int, ttft_p99: float) -> dict:
    return {
        "scenario": "s",
        "reply": 256,
        "system": system,
        "computed": computed,
        "turns": 10,
        "ttft_p50_ms": 1.0,
        "ttft_p99_ms": ttft_p99,
        "short_ttft_p99_ms": None,
        "itl_p99_ms": 5.0,
        "read_turns": 0,
        "d_pinned_peak": 0,
    }


def test_goal_bounds_the_gateway_by_cache_aware_only_where_it_computes_2x_fewer_tokens():
    ours = row("pd-gateway", 1_000, 70.0)
    assert "(70.0 ms; 2.00x fewer tokens) PASS" in reuse.goal(ours, row("ca", 2_000, 100.0), None)
    assert "(69.3 ms; 2.00x fewer tokens) FAIL" in reuse.goal(ours, row("ca", 2_000, 99.0), None)
    assert "not checked (1.99x fewer tokens" in reuse.goal(ours, row("ca", 1_990, 10.0), None)
    assert "round_robin's (70.0 ms) PASS" in reuse.goal(ours, None, row("rr", 1, 70.0))
    assert "round_robin's (69.9 ms) FAIL" in reuse.goal(ours, None, row("rr", 1, 69.9))


def test_summary_prints_the_goal_for_each_gateway_row():
    rows = [
        row(reuse.SYSTEMS[key].label, computed, p99)
        for key, computed, p99 in (
            ("gateway", 1_000, 50.0),
            ("vllm-router", 3_000, 100.0),
            ("vllm-router-rr", 3_000, 40.0),
        )
    ]
    goal_lines = [line for line in reuse.summary(rows).splitlines() if "goal" in line]
    assert len(goal_lines) == 2  # every turn, and turns 2+
    assert "3.00x fewer tokens) PASS" in goal_lines[0]
    assert "round_robin's (40.0 ms) FAIL" in goal_lines[0]


def test_goal_on_turns_2_and_later_reads_their_p99():
    ours = {**row("pd-gateway", 1_000, 500.0), "later_ttft_p99_ms": 60.0}
    cache_aware = {**row("ca", 3_000, 400.0), "later_ttft_p99_ms": 100.0}
    assert "FAIL" in reuse.goal(ours, cache_aware, None)
    assert "PASS" not in reuse.goal(
        ours, {**cache_aware, "later_ttft_p99_ms": None}, None, "later_ttft_p99_ms"
    )  # no figure, no verdict
    assert "(70.0 ms; 3.00x fewer tokens) PASS" in reuse.goal(
        ours, cache_aware, None, "later_ttft_p99_ms"
    )


def test_a_row_is_the_median_of_its_repeats():
    runs = [
        {
            **row("pd-gateway", computed, p99),
            "later_ttft_p99_ms": later,
            "first_error": None,
            "errors": 0,
        }
        for computed, p99, later in ((1_000, 90.0, 30.0), (1_200, 50.0, None), (1_100, 70.0, 10.0))
    ]
    runs[1]["errors"], runs[1]["first_error"] = 7, "c3: StreamError"
    runs[0]["later_ttft_p99_ms"], runs[1]["later_ttft_p99_ms"] = None, 30.0
    merged = reuse.median_row(runs)
    assert (merged["errors"], merged["first_error"]) == (7, "c3: StreamError")  # never hidden
    assert (merged["computed"], merged["ttft_p99_ms"], merged["runs"]) == (1_100, 70.0, 3)
    assert merged["later_ttft_p99_ms"] == 20.0  # of the runs that have one (30 and 10)
    assert type(reuse.median_row(runs[:2])["computed"]) is int  # counts stay whole
    assert merged["ttft_p99_ms_runs"] == [90.0, 50.0, 70.0]
    assert merged["system"] == "pd-gateway"


@pytest.mark.processes
def test_client_keeps_every_gap_and_tags_each_turn(fresh_engines, tmp_path):
    _, d = fresh_engines
    scenario = dataclasses.replace(SKEWED, live=3, long=1, think=0.0)
    out = tmp_path / "load.json"
    spec = {
        "url": d.url,
        "out": str(out),
        "reply": 8,
        "ids": False,
        "salt": "client-test",
        "scenario": dataclasses.asdict(scenario),
    }
    subprocess.run([sys.executable, "-c", reuse.CLIENT, json.dumps(spec)], check=True, timeout=120)
    load = json.loads(out.read_text())
    assert load["errors"] == []
    turns = load["turns"]
    assert sorted(t["kind"] for t in turns) == ["long"] * 6 + ["short"] * 12
    assert sorted(t["turn"] for t in turns) == sorted(list(range(reuse.TURNS)) * 3)
    assert all(len(t["gaps"]) == t["content_events"] - 1 == 7 for t in turns)
    assert all(t["first"] + sum(t["gaps"]) == pytest.approx(t["last"], abs=1e-4) for t in turns)
    latencies = reuse.latencies(turns, scenario)
    assert latencies["itl_p99_ms"] is not None and latencies["short_ttft_p99_ms"] is not None
    assert latencies["later_ttft_p99_ms"] is not None
