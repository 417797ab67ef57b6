"""Two real engine processes on different loopback addresses exchanging KV blocks through real pulls."""

from __future__ import annotations

import uuid

import requests

from devtools import sse as sse_client
from gateway.emulator.process import wait_until
from gateway.emulator.tokens import render_chat


def fresh_history() -> list[dict]:
    """A conversation no engine has seen, so prefix caches left by other tests cannot blur counters."""
    return [{"role": "system", "content": f"session {uuid.uuid4().hex} " + "you are a terse assistant " * 4},
            {"role": "user", "content": "explain bidirectional kv transfer between prefill and decode"}]


def test_second_turn_reuses_decode_blocks(pd):
    history = fresh_history()
    n1 = len(render_chat(history))
    reply, d1 = pd.turn(history)
    assert d1["do_remote_decode"] is True and d1["do_remote_prefill"] is False
    assert d1["remote_host"] == "localhost" and isinstance(d1["remote_blocks_expiry_time"], float)
    assert d1["remote_num_tokens"] == n1 + len(reply.split())  # prompt + generated - 1 (EOS)
    p_stats, d_stats = pd.p.stats(), pd.d.stats()
    assert (p_stats["hits"], p_stats["computed_prompt_tokens"]) == (0, n1)
    assert (d_stats["pulled_tokens"], d_stats["computed_prompt_tokens"]) == (n1, 0)

    history2 = history + [{"role": "assistant", "content": reply},
                          {"role": "user", "content": "and what happens when the blocks expire " * 3}]
    n2 = len(render_chat(history2))
    pd.p.reset_stats()
    pd.d.reset_stats()
    reply2, d2 = pd.turn(history2, d1)
    p_stats, d_stats = pd.p.stats(), pd.d.stats()
    assert p_stats["hits"] == 1 and p_stats["wrong_reuse"] == 0
    assert p_stats["reused_prompt_tokens"] == d1["remote_num_tokens"]
    assert p_stats["computed_prompt_tokens"] == n2 - d1["remote_num_tokens"]
    # Same D: its prefix cache already holds turn 1, so it pulls only the blocks it lacks from P.
    assert d_stats["local_prefix_tokens"] == d1["remote_num_tokens"] // 16 * 16 > 0
    assert d_stats["pulled_tokens"] == n2 - d_stats["local_prefix_tokens"] < n2
    assert d2["remote_num_tokens"] == n2 + len(reply2.split())
    assert d_stats["kv_leases"] >= 1


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
    assert (d_stats["failed_pulls"], d_stats["kv_load_errors"], d_stats["pulled_tokens"]) == (2, 2, 0)
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
    reply, d1 = pd.turn(history)
    edited = [{"role": "system", "content": "you are a verbose assistant " * 4}] + history[1:] + [
        {"role": "assistant", "content": reply}, {"role": "user", "content": "go on"}]
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
    history2 = history + [{"role": "assistant", "content": reply}, {"role": "user", "content": "more"}]
    response = pd.prefill(history2, partial)
    assert response.status_code == 200 and response.json()["kv_transfer_params"]["do_remote_prefill"]
    stats = pd.p.stats()
    assert stats["hits"] == 0 and stats["failed_pulls"] == stats["stale_pulls"] == 0


def test_prefill_declines_expired_decode_blocks_and_frees_them(pd):
    history = fresh_history()
    reply, d1 = pd.turn(history)
    leases = pd.d.stats()["kv_leases"]
    history2 = history + [{"role": "assistant", "content": reply}, {"role": "user", "content": "next"}]
    expired = {**d1, "do_remote_decode": True, "do_remote_prefill": False, "remote_host": pd.d.host,
               "remote_blocks_expiry_time": 0.0}
    assert pd.prefill(history2, expired).status_code == 200
    assert pd.p.stats()["declined_pulls"] == 1 and pd.p.stats()["hits"] == 0
    assert pd.d.stats()["kv_leases"] == leases - 1  # the release reached D


def test_openai_sdk_streams_from_decode(pd):
    history = fresh_history()
    import openai

    client = openai.OpenAI(base_url=pd.d.url + "/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(model="emulated-model", messages=history, stream=True,
                                            max_tokens=5, stream_options={"include_usage": True})
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
    p_params = pd.prefill(history).json()["kv_transfer_params"]     # remote_host: localhost
    streamed = pd.decode(history, p_params)
    assert streamed.headers.get("Transfer-Encoding") == "chunked"
    assert "error" in next(sse_client.iter_events(streamed))


def test_hang_holds_the_request_without_blocking_others(pd):
    history = fresh_history()
    pd.d.set_fault("hang")
    try:
        requests.post(pd.d.url + "/v1/chat/completions", json={"messages": history}, timeout=(2, 0.3))
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
    stats = wait_until(lambda: (s := pd.d.stats())["aborted_streams"] == 1 and s, 10,
                       "the stream to count as aborted")
    assert stats["streams_in_flight"] == 0 and stats["completed"] == 0


def test_down_fault_on_a_real_process(pd):
    history = fresh_history()
    pd.p.set_fault("down")
    assert requests.get(pd.p.url + "/health", timeout=2).status_code == 503
    refused = pd.prefill(history)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == 503
