"""The engine's steps as vLLM 0.33's scheduler runs them (emulator/scheduler.py), on a fake
clock: budgets, chunks, max_num_seqs, and what a prefill costs the other requests."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from emulator.config import EngineConfig
from emulator.engine import Engine
from emulator.process import EmulatorProcess, wait_until
from emulator.scheduler import Scheduler, Seq

ITL_MS, PREFILL_MS = 10.0, 0.1  # the emulator's defaults


def step_s(prefill: int, decode: int) -> float:
    return max(ITL_MS, (prefill + decode) * PREFILL_MS) / 1000.0


def make(**limits: object) -> Scheduler:
    return Scheduler(
        **{"max_num_batched_tokens": 8192, "max_num_seqs": 1024, "step_s": step_s, **limits}
    )


def run(sched: Scheduler, *seqs: Seq, now: float = 0.0) -> list[list[int]]:
    """Add `seqs` at `now` and run every step; returns, per step, each seq's generated count."""
    for seq in seqs:
        sched.add(seq, now)
    history = []
    while sched.step_end is not None:
        sched.advance(sched.step_end)
        history.append([seq.generated for seq in seqs])
    return history


def first_token_step(history: list[list[int]], which: int) -> int:
    return next(i for i, counts in enumerate(history, 1) if counts[which] >= 1)


def test_defaults_are_vllms_for_an_80_gb_gpu_serving_openai():
    """engine/arg_utils.py ~L2983-2997, ~L3040-3048, ~L3190-3199; config/scheduler.py ~L79."""
    cfg = EngineConfig(role="decode", port=18200)
    assert (
        cfg.max_num_batched_tokens,
        cfg.max_num_seqs,
        cfg.enable_chunked_prefill,
        cfg.long_prefill_token_threshold,
    ) == (8192, 1024, True, 0)
    whole = EngineConfig(role="decode", port=18200, enable_chunked_prefill=False)
    assert whole.max_num_batched_tokens == whole.max_model_len == 32768


def test_one_request_alone_prefills_in_chunks_at_the_per_token_cost():
    sched, seq = make(), Seq(20_000, 1)
    history = run(sched, seq)
    assert len(history) == 3  # 8192 + 8192 + 3616 tokens: three chunks
    assert seq.generated == 1 and sched.running == []


def test_unloaded_ttft_is_prompt_tokens_times_the_per_token_cost():
    sched, seq = make(), Seq(20_000, 2)
    sched.add(seq, 0.0)
    ends = []
    while seq.generated < 1:
        ends.append(sched.step_end)
        sched.advance(sched.step_end)
    assert ends[-1] == pytest.approx(20_000 * PREFILL_MS / 1000)


def test_a_long_prefill_delays_a_short_ones_first_token_until_its_last_chunk():
    """vLLM's default: the long request, admitted first, runs first and takes the whole budget
    each step (scheduler.py ~L795-848); the short one gets only what the long one's last chunk
    leaves, so its first token comes with the long one's."""
    long, short = Seq(20_000, 4), Seq(100, 4)
    history = run(make(), long, short)
    assert first_token_step(history, 1) == first_token_step(history, 0) == 3
    assert first_token_step(run(make(), Seq(100, 4)), 0) == 1  # alone: the first step


def test_a_long_prefill_cap_lets_a_short_one_in_at_once():
    """With long_prefill_token_threshold the long one computes at most that many tokens a step
    while another request is there (~L754-763, ~L844-845): the short one gets in at the next
    step. The long one took a whole budget in the first step: it was alone then."""
    long, short = Seq(20_000, 4), Seq(100, 4)
    history = run(make(long_prefill_token_threshold=2048), long, short)
    # 8192 alone, then 2048 a step beside the short one until it finishes, then the rest.
    assert (first_token_step(history, 1), first_token_step(history, 0)) == (2, 6)


def test_without_chunked_prefill_a_short_one_waits_for_the_whole_long_prompt():
    """Without chunked prefill a prompt runs whole or waits (~L1337-1344): the short one starts
    only in the step after the long one's single 20k-token step."""
    long, short = Seq(20_000, 4), Seq(100, 4)
    sched = make(enable_chunked_prefill=False, max_num_batched_tokens=32_768)
    history = run(sched, long, short)
    assert (first_token_step(history, 0), first_token_step(history, 1)) == (1, 2)


def test_a_request_beyond_max_num_seqs_waits_until_one_finishes():
    sched = make(max_num_seqs=2)
    a, b, c = Seq(10, 3), Seq(10, 5), Seq(10, 1)
    for seq in (a, b, c):
        sched.add(seq, 0.0)  # a's step starts at once; b and c join the next one
    sched.advance(sched.step_end)
    assert (sched.running, list(sched.waiting)) == ([a, b], [c])
    while not a.finished:
        sched.advance(sched.step_end)
        assert c.computed == 0
    sched.advance(sched.step_end)  # the next step admits c
    assert c.generated == 1 and sched.running == [b]


def test_decode_streams_slow_while_the_engine_prefills():
    """A decoding request keeps its one token a step (it runs before the newcomer), but each
    step now carries a prompt chunk: its tokens come at the chunk's pace, then at itl again."""
    sched, stream = make(), Seq(1, 100)
    sched.add(stream, 0.0)
    sched.advance(sched.step_end)  # its prompt: now it decodes
    times, now = [], sched.step_end
    sched.add(Seq(20_000, 1), sched.step_end - 0.001)  # arrives during a decode step
    while stream.generated < 8:
        now = sched.step_end
        sched.advance(now)
        times.append(now)
    gaps = [round((b - a) * 1000, 3) for a, b in zip(times, times[1:], strict=False)]
    # A step of 8192 tokens (its decode and 8191 of the prompt), again, the prompt's last 3618
    # and the decode, then decode-only steps.
    assert gaps == [819.2, 819.2, 361.9, 10.0, 10.0, 10.0]


def test_an_aborted_request_leaves_the_queue_and_the_batch():
    sched = make(max_num_seqs=1)
    a, b = Seq(10, 50), Seq(10, 1)
    sched.add(a, 0.0)
    sched.add(b, 0.0)
    sched.remove(a, 0.0)
    sched.advance(sched.step_end)  # a's step ends; its tokens go nowhere
    assert a.generated == 0 and sched.running == [b]


def test_the_engine_reports_the_schedulers_running_and_capacity_waiting():
    """vllm:num_requests_running is the running batch; a request the scheduler has not admitted
    waits for capacity (scheduler.py ~L2920-2922, ~L3288-3292; loggers.py ~L1146-1160)."""
    now = [100.0]
    engine = Engine(
        EngineConfig(role="decode", port=18200, max_num_seqs=1, max_num_batched_tokens=1024),
        clock=lambda: now[0],
        sleep=lambda s: None,
        background=lambda fn, *args: fn(*args),
    )
    engine.scheduler.add(Seq(10, 100), now[0])
    engine.scheduler.add(Seq(10, 100), now[0])
    snap = engine.snapshot()
    assert (
        snap["requests_running"],
        snap["requests_waiting"],
        snap["requests_waiting_capacity"],
        snap["requests_waiting_deferred"],
    ) == (1, 1, 1, 0)


def test_a_decode_engine_counts_what_its_prefills_cost_its_streams():
    now = [100.0]
    engine = Engine(
        EngineConfig(role="decode", port=18200),
        clock=lambda: now[0],
        sleep=lambda s: None,
        background=lambda fn, *args: fn(*args),
    )
    sched = engine.scheduler
    sched.add(Seq(1, 100), now[0])
    sched.advance(sched.step_end)
    # Added as the stream's next step starts: it joins the one after.
    sched.add(Seq(8191, 1), sched.step_end)
    sched.advance(sched.step_end)
    # That step computes 8192 tokens (819.2 ms) where the decode alone takes itl (10 ms).
    assert engine.stats.decode_stall_seconds == pytest.approx((8192 * PREFILL_MS - ITL_MS) / 1000)


@pytest.mark.processes
def test_a_request_beyond_max_num_seqs_waits_for_capacity_on_a_real_engine():
    """With max_num_seqs running, the next request waits unscheduled, counted as waiting for
    capacity (loggers.py ~L1146-1160); it runs once a running one leaves."""
    with EmulatorProcess("decode", host="127.0.0.4", max_num_seqs=1, itl_ms=20) as d:

        def complete(max_tokens: int, **kwargs: object) -> requests.Response:
            body = {"model": "emulated-model", "prompt": "a b c", "max_tokens": max_tokens}
            return requests.post(
                d.url + "/v1/completions",
                json={**body, **kwargs},
                timeout=30,
                stream=kwargs.get("stream", False),
            )

        first = complete(25_000, stream=True)  # runs until its client leaves
        first.raw.read(1)
        with ThreadPoolExecutor(1) as pool:
            second = pool.submit(complete, 3)
            stats = wait_until(
                lambda: (s := d.stats())["requests_waiting"] == 1 and s,
                10,
                "the second request to wait",
            )
            assert (
                stats["requests_running"],
                stats["requests_waiting_capacity"],
                stats["requests_waiting_deferred"],
            ) == (1, 1, 0)
            page = requests.get(d.url + "/metrics", timeout=5).text.splitlines()
            labels = 'engine="0",model_name="emulated-model"'
            assert f"vllm:num_requests_running{{{labels}}} 1.0" in page
            assert f'vllm:num_requests_waiting_by_reason{{{labels},reason="capacity"}} 1.0' in page
            assert not second.done()
            first.close()  # the client leaves: its request is aborted and frees its slot
            assert second.result(timeout=30).json()["usage"]["completion_tokens"] == 3
        assert [r["outcome"] for r in d.recent_requests()] == ["aborted", "completed"]
