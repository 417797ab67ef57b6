"""Two real engine processes on different loopback addresses exchanging KV blocks through real
pulls."""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from devtools import sse as sse_client
from emulator.process import EmulatorProcess, wait_until
from emulator.tokens import render_chat
from tests.helpers.emulator import PD, STUB

pytestmark = pytest.mark.processes  # engine processes, every test


def fresh_history() -> list[dict]:
    """A conversation no engine has seen, so prefix caches left by other tests cannot blur
    counters."""
    return [
        {
            "role": "system",
            "content": f"session {uuid.uuid4().hex} " + "you are a terse assistant " * 4,
        },
        {"role": "user", "content": "explain bidirectional kv transfer between prefill and decode"},
    ]


def test_second_turn_reads_what_d_holds_beyond_ps_own_cache(pd):
    """With vLLM's defaults (prefix caching on, kv_recompute_threshold 64) a P that prefilled
    turn 1 holds its prompt, and reads from D only the rest: here a 100-token reply."""
    history = fresh_history()
    n1 = len(render_chat(history))
    reply, d1 = pd.turn(history, max_tokens=100)
    assert d1["do_remote_decode"] is True and d1["do_remote_prefill"] is False
    assert d1["remote_host"] == "localhost" and isinstance(d1["remote_blocks_expiry_time"], float)
    assert d1["remote_num_tokens"] == n1 + 100 - 1  # prompt + generated - 1 (a length finish)
    p_stats, d_stats = pd.p.stats(), pd.d.stats()
    assert (p_stats["hits"], p_stats["computed_prompt_tokens"]) == (0, n1)
    # D loads the whole prompt and still computes its last token (scheduler.py ~L3515).
    assert (d_stats["pulled_tokens"], d_stats["computed_prompt_tokens"]) == (n1, 1)

    history2 = history + [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "and what happens when the blocks expire " * 3},
    ]
    n2 = len(render_chat(history2))
    for engine in (pd.p, pd.d):
        engine.reset_stats()
    reply2, d2 = pd.turn(history2, d1)
    p_stats, d_stats = pd.p.stats(), pd.d.stats()
    held, own = d1["remote_num_tokens"], n1 // 16 * 16
    assert p_stats["local_prefix_tokens"] == own > 0
    assert p_stats["hits"] == 1 and p_stats["wrong_reuse"] == 0
    assert p_stats["reused_prompt_tokens"] == held - own
    assert p_stats["computed_prompt_tokens"] == n2 - held
    # Same D: its prefix cache already holds turn 1, so it pulls only the blocks it lacks from P.
    assert d_stats["local_prefix_tokens"] == held // 16 * 16
    assert d_stats["pulled_tokens"] == n2 - d_stats["local_prefix_tokens"] < n2
    assert d2["remote_num_tokens"] == n2 + len(reply2.split())


@pytest.mark.parametrize("count", [63, 64])
def test_p_recomputes_under_the_threshold_and_d_frees_its_blocks_either_way(pd, count):
    """count = min(remote_num_tokens, prompt) - P's own hit (nixl/pull_scheduler.py ~L85-103):
    63 is recomputed, 64 is read; either way P's connector notifies D, which frees the request."""
    history = fresh_history()
    n1 = len(render_chat(history))
    own = n1 // 16 * 16
    reply, d1 = pd.turn(history, max_tokens=count - (n1 - own) + 1)
    assert d1["remote_num_tokens"] - own == count
    history2 = history + [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "and then"},
    ]
    n2 = len(render_chat(history2))
    assert pd.d.holds(d1["remote_request_id"])
    for engine in (pd.p, pd.d):
        engine.reset_stats()
    p_in = {**d1, "do_remote_decode": True, "do_remote_prefill": False, "remote_host": pd.d.host}
    assert pd.prefill(history2, p_in).status_code == 200
    p_stats = pd.p.stats()
    assert p_stats["local_prefix_tokens"] == own
    read = count >= 64
    assert (p_stats["hits"], p_stats["declined_pulls"]) == ((1, 0) if read else (0, 1))
    assert p_stats["reused_prompt_tokens"] == (count if read else 0)
    assert p_stats["computed_prompt_tokens"] == n2 - own - (count if read else 0)
    # The notification goes out beside the request (as NIXL's): D frees the lease soon after.
    wait_until(lambda: not pd.d.holds(d1["remote_request_id"]), 10, "D to free the lease")


def test_p_maps_its_new_blocks_onto_the_last_entries_of_the_remote_group(pd):
    """The suffix trim (nixl/base_worker.py ~L3784-3793): P's m new blocks read the last m
    entries of D's list. Reading fewer tokens than D holds is right only with the list cut to
    them (vLLM issue #43094); a list shorter than m is the worker's assert."""

    def second_turn() -> tuple[list, dict, int]:
        """A new conversation's turn 1 (a 100-token reply), and turn 2 as P would get it:
        allowed to read 30 tokens less than D holds."""
        history = fresh_history()
        reply, d1 = pd.turn(history, max_tokens=100)
        history2 = history + [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "next"},
        ]
        p_in = {
            **d1,
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_host": pd.d.host,
            "remote_num_tokens": d1["remote_num_tokens"] - 30,
        }
        return history2, p_in, len(render_chat(history)) // 16 * 16

    pd.p.reset_stats()
    # The whole list: P reads D's last blocks into its positions [own, part).
    history2, p_in, own = second_turn()
    assert len(p_in["remote_block_ids"][0]) > -(-p_in["remote_num_tokens"] // 16)
    assert pd.prefill(history2, p_in).status_code == 200
    assert (pd.p.stats()["wrong_reuse"], pd.p.stats()["hits"]) == (1, 0)
    # The list cut to the blocks holding those tokens: read right.
    history2, p_in, own = second_turn()
    keep = -(-p_in["remote_num_tokens"] // 16)
    cut = {**p_in, "remote_block_ids": [p_in["remote_block_ids"][0][:keep]]}
    assert pd.prefill(history2, cut).status_code == 200
    assert pd.p.stats()["hits"] == 1
    assert pd.p.stats()["reused_prompt_tokens"] == p_in["remote_num_tokens"] - own
    # Cut shorter than P's new blocks: vLLM's worker asserts; the request fails.
    history2, p_in, own = second_turn()
    short = {**p_in, "remote_block_ids": [p_in["remote_block_ids"][0][:2]]}
    failed = pd.prefill(history2, short)
    assert failed.status_code == 500 and "AssertionError" in failed.json()["error"]["message"]


def test_a_hybrid_models_window_group_is_read_right_only_whole():
    """A hybrid model (full attention and a 64-token sliding window; not the emulator's default)
    exports two groups, the window's holding only D's last cdiv(64, 16) + 1 = 5 blocks
    (nixl/base_scheduler.py ~L141-154). A read of D's whole sequence maps both right; a read
    cut to fewer tokens maps D's last window onto P's earlier positions: wrong reuse, whatever
    is done to the lists. P's prefix cache is off (not vLLM's default) so every read happens."""
    kw = dict(prefill_ms_per_token=0.01, itl_ms=1, bidirectional_kv_xfer=True, sliding_window=64)
    with (
        EmulatorProcess(
            "prefill", host="127.0.0.2", port=18150, enable_prefix_caching=False, **kw
        ) as p,
        EmulatorProcess("decode", host="127.0.0.3", port=18250, **kw) as d,
    ):
        pd = PD(p, d)

        def second_turn() -> tuple[list, dict]:
            history = fresh_history()
            reply, d1 = pd.turn(history, max_tokens=100)
            history2 = history + [
                {"role": "assistant", "content": reply},
                {"role": "user", "content": "next"},
            ]
            return history2, {
                **d1,
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "remote_host": d.host,
            }

        history2, p_in = second_turn()
        full, window = p_in["remote_block_ids"]
        assert len(full) == -(-p_in["remote_num_tokens"] // 16) and len(window) == 5
        assert pd.prefill(history2, p_in).status_code == 200
        assert (p.stats()["hits"], p.stats()["wrong_reuse"]) == (1, 0)
        assert p.stats()["reused_prompt_tokens"] == p_in["remote_num_tokens"]
        for cut_window in (False, True):
            history2, p_in = second_turn()
            full, window = p_in["remote_block_ids"]
            k = (p_in["remote_num_tokens"] - 40) // 16 * 16
            cut = {
                **p_in,
                "remote_num_tokens": k,
                "remote_block_ids": [full[: k // 16], window[: k // 16] if cut_window else window],
            }
            p.reset_stats()
            assert pd.prefill(history2, cut).status_code == 200
            assert (p.stats()["hits"], p.stats()["wrong_reuse"]) == (0, 1)
        # One group where the model has two: vLLM's "Number of KV cache groups must match".
        history2, p_in = second_turn()
        failed = pd.prefill(history2, {**p_in, "remote_block_ids": p_in["remote_block_ids"][:1]})
        assert failed.status_code == 500 and "AssertionError" in failed.json()["error"]["message"]
        assert d.stats()["wrong_reuse"] == 0  # D's whole-prompt reads from P: right


def test_a_request_waits_for_kv_memory_and_the_wait_is_part_of_its_ttft():
    """Running requests, leases and the cache share one bounded pool; a request that cannot get
    its blocks waits in line (v1/core/sched/scheduler.py ~L1454-1461) until some are freed."""
    with EmulatorProcess(
        "prefill",
        host="127.0.0.4",
        kv_capacity_blocks=64,
        max_model_len=1024,
        kv_lease_duration=600,
        itl_ms=1,
    ) as p:

        def prefill(i: int) -> requests.Response:
            # ~190 tokens each: 12 blocks for the prompt and the one generated token.
            body = {
                "prompt": f"request {i} " + "word " * 188,
                "max_tokens": 1,
                "kv_transfer_params": STUB,
            }
            return requests.post(p.url + "/v1/completions", json=body, timeout=30)

        held = [prefill(i).json()["kv_transfer_params"] for i in range(5)]  # 60 of 64 blocks
        assert p.stats()["kv_blocks_used"] == 60 and p.stats()["kv_lease_blocks"] == 60
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(prefill, 5)
            wait_until(lambda: p.stats()["requests_waiting"] == 1, 10, "the request to wait")
            assert (
                'vllm:num_requests_waiting{engine="0",model_name="emulated-model"} 1.0'
                in requests.get(p.url + "/metrics", timeout=5).text
            )
            release = {
                "remote_engine_id": held[0]["remote_engine_id"],
                "remote_request_id": held[0]["remote_request_id"],
            }
            kv_url = f"http://{p.host}:{p.kv_port}/kv/release"
            assert requests.post(kv_url, json=release, timeout=5).status_code == 200
            assert waiting.result(timeout=30).status_code == 200
        stats = p.stats()
        assert stats["kv_wait_seconds"] > 0 and stats["requests_waiting"] == 0
        assert p.recent_requests()[-1]["kv_wait_ms"] > 0


def test_a_request_loading_remote_kv_waits_deferred_not_running():
    """vLLM holds a request whose KV is still arriving in WAITING_FOR_REMOTE_KVS: a deferred
    waiting request, not a running one and not one waiting for capacity (scheduler.py
    ~L2705-2712, ~L3288-3292; loggers.py ~L1150-1160)."""
    with (
        EmulatorProcess("prefill", host="127.0.0.4", itl_ms=1) as p,
        EmulatorProcess("decode", host="127.0.0.5", itl_ms=1, pull_ms_per_block=200) as d,
    ):
        pd = PD(p, d)
        history = fresh_history()
        p_params = {**pd.prefill(history).json()["kv_transfer_params"], "remote_host": p.host}
        with ThreadPoolExecutor(1) as pool:
            decoding = pool.submit(pd.decode, history, p_params, stream=False)
            wait_until(lambda: d.stats()["requests_waiting_deferred"] == 1, 10, "the load")
            stats = d.stats()
            assert (
                stats["requests_waiting"],
                stats["requests_waiting_capacity"],
                stats["requests_running"],
            ) == (1, 0, 0)
            page = requests.get(d.url + "/metrics", timeout=5).text.splitlines()
            labels = 'engine="0",model_name="emulated-model"'
            assert f"vllm:num_requests_waiting{{{labels}}} 1.0" in page
            assert f'vllm:num_requests_waiting_by_reason{{{labels},reason="deferred"}} 1.0' in page
            assert f'vllm:num_requests_waiting_by_reason{{{labels},reason="capacity"}} 0.0' in page
            assert decoding.result(timeout=30).status_code == 200
        assert d.stats()["requests_waiting"] == 0 and d.stats()["pulled_blocks"] > 0


def test_remote_host_must_be_rewritten(pd, sse):
    history = fresh_history()
    p_params = pd.prefill(history).json()["kv_transfer_params"]
    assert p_params["remote_host"] == "localhost"  # 127.0.0.1, where neither engine listens
    response = pd.decode(history, p_params, stream=False)
    assert response.status_code == 500
    assert response.json()["error"]["code"] == 500
    streamed = pd.decode(history, p_params)
    assert streamed.status_code == 200 and sse(streamed.content)[0]["error"]["code"] == 500
    d_stats = pd.d.stats()
    assert (d_stats["failed_pulls"], d_stats["kv_load_errors"], d_stats["pulled_tokens"]) == (
        2,
        2,
        0,
    )
    # P's blocks were never read, so they are still waiting for the right reader.
    response = pd.decode(history, {**p_params, "remote_host": pd.p.host}, stream=False)
    assert response.status_code == 200


def test_blocks_are_handed_over_once(pd):
    history = fresh_history()
    p_params = {**pd.prefill(history).json()["kv_transfer_params"], "remote_host": pd.p.host}
    assert pd.decode(history, p_params, stream=False).status_code == 200
    again = pd.decode(history, p_params, stream=False)
    assert again.status_code == 500 and "already read" in again.json()["error"]["message"]
    assert pd.d.stats()["stale_pulls"] == 1


def test_edited_history_counts_wrong_reuse(pd):
    history = fresh_history()
    reply, d1 = pd.turn(history, max_tokens=100)  # read past the recompute threshold
    edited = (
        [{"role": "system", "content": "you are a verbose assistant " * 4}]
        + history[1:]
        + [{"role": "assistant", "content": reply}, {"role": "user", "content": "go on"}]
    )
    p_in = {**d1, "do_remote_decode": True, "do_remote_prefill": False, "remote_host": pd.d.host}
    response = pd.prefill(edited, p_in)
    assert response.status_code == 200
    stats = pd.p.stats()
    assert (stats["hits"], stats["wrong_reuse"]) == (0, 1)
    assert stats["computed_prompt_tokens"] == len(render_chat(history)) + len(render_chat(edited))


def test_invalid_params_are_treated_as_turn_one(pd):
    history = fresh_history()
    reply, d1 = pd.turn(history)
    partial = {**d1, "do_remote_decode": True, "do_remote_prefill": False, "remote_host": None}
    history2 = history + [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "more"},
    ]
    response = pd.prefill(history2, partial)
    assert (
        response.status_code == 200 and response.json()["kv_transfer_params"]["do_remote_prefill"]
    )
    stats = pd.p.stats()
    assert stats["hits"] == 0 and stats["failed_pulls"] == stats["stale_pulls"] == 0


def test_prefill_declines_nearly_expired_decode_blocks_as_a_failed_load(pd):
    """Within 5 s of D's exported expiry P declines the read (nixl/pull_worker.py ~L127-172):
    the request goes to failure handling, which vLLM's default kv_load_failure_policy (fail)
    turns into an error; D is not notified (its TTL frees the blocks)."""
    history = fresh_history()
    reply, d1 = pd.turn(history, max_tokens=100)  # past the recompute threshold
    history2 = history + [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "next"},
    ]
    expired = {
        **d1,
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_host": pd.d.host,
        "remote_blocks_expiry_time": time.monotonic() + 4.0,
    }
    failed = pd.prefill(history2, expired)
    assert failed.status_code == 500 and "expired" in failed.json()["error"]["message"]
    stats = pd.p.stats()
    assert (stats["declined_pulls"], stats["stale_pulls"], stats["hits"]) == (1, 1, 0)
    assert pd.d.holds(d1["remote_request_id"])  # nothing reached D
    fresh = {**expired, "remote_blocks_expiry_time": time.monotonic() + 60.0}
    assert pd.prefill(history2, fresh).status_code == 200 and pd.p.stats()["hits"] == 1


def test_openai_sdk_streams_from_decode(pd):
    history = fresh_history()
    import openai

    client = openai.OpenAI(base_url=pd.d.url + "/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model="emulated-model",
        messages=history,
        stream=True,
        max_tokens=5,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text.split()) == 5
    assert chunks[-1].usage.completion_tokens == 5
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_die_after_cuts_the_stream(pd):
    history = fresh_history()
    pd.d.set_fault("die_after", tokens=3)
    response = pd.decode(history, None, max_tokens=20, stream=True)
    events = []
    try:
        for event in sse_client.iter_events(response):
            events.append(event)
        broke = False
    except requests.exceptions.ChunkedEncodingError:
        broke = True
    assert broke, events
    assert len(events) == 1 + 3 and sse_client.DONE not in events
    try:
        pd.decode(history, None, stream=False)
        raise AssertionError("non-stream request should have lost its connection")
    except requests.exceptions.ConnectionError:
        pass
    assert pd.d.stats()["fault_responses"] == 2


def test_error_after_sends_the_error_inside_the_chunked_stream(pd):
    """As vLLM: content, then `{"error": ...}` and [DONE] in the same chunked stream."""
    history = fresh_history()
    pd.d.set_fault("error_after", tokens=3)
    response = pd.decode(history, None, max_tokens=20, stream=True)
    assert response.headers.get("Transfer-Encoding") == "chunked"
    assert "Content-Length" not in response.headers
    events = list(sse_client.iter_events(response))
    assert len(events) == 1 + 3 + 2 and events[-1] == sse_client.DONE
    assert events[-2]["error"]["code"] == 500 and "choices" in events[-3]
    assert pd.decode(history, None, stream=False).status_code == 500
    pd.d.set_fault("none")
    assert pd.d.stats()["fault_responses"] == 2


def test_a_failed_pull_is_an_error_event_of_a_chunked_stream(pd):
    history = fresh_history()
    p_params = pd.prefill(history).json()["kv_transfer_params"]  # remote_host: localhost
    streamed = pd.decode(history, p_params)
    assert streamed.headers.get("Transfer-Encoding") == "chunked"
    assert "error" in next(sse_client.iter_events(streamed))


def test_hang_holds_the_request_without_blocking_others(pd):
    history = fresh_history()
    pd.d.set_fault("hang")
    try:
        requests.post(
            pd.d.url + "/v1/chat/completions", json={"messages": history}, timeout=(2, 0.3)
        )
        raise AssertionError("a hanging engine answered")
    except requests.exceptions.ReadTimeout:
        pass
    assert requests.get(pd.d.url + "/health", timeout=2).status_code == 200
    assert pd.d.fault()["mode"] == "hang"
    pd.d.set_fault("none")
    assert pd.decode(history, None, stream=False).status_code == 200
    # The hung request's greenlet notices the client left and finishes.
    wait_until(lambda: pd.d.stats()["fault_responses"] == 1, 10, "the hung request to finish")


def test_client_leaving_mid_stream_counts_as_aborted(pd):
    history = fresh_history()
    response = pd.decode(history, None, max_tokens=3000, stream=True)
    events = sse_client.iter_events(response)
    for _ in range(2):
        next(events)
    response.close()
    stats = wait_until(
        lambda: (s := pd.d.stats())["aborted_streams"] == 1 and s,
        10,
        "the stream to count as aborted",
    )
    assert stats["streams_in_flight"] == 0 and stats["completed"] == 0


def test_down_fault_on_a_real_process(pd):
    history = fresh_history()
    pd.p.set_fault("down")
    assert requests.get(pd.p.url + "/health", timeout=2).status_code == 503
    refused = pd.prefill(history)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == 503
