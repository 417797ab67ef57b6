"""The OpenAI surface in-process: chunk order, bodies, error envelopes, params placement, faults,
stats."""

from __future__ import annotations

import json

import pytest

from emulator.tokens import render_chat

MESSAGES = [{"role": "user", "content": "tell me about kv caches please"}]
# D-side params that set neither flag (what a gateway sends for a local decode).
LOCAL = {"do_remote_prefill": False, "do_remote_decode": False}
N_PROMPT = len(render_chat(MESSAGES))


def chat(api, **body):
    return api.post(
        "/v1/chat/completions",
        {"model": "emulated-model", "messages": MESSAGES, **body},
        headers={"X-Request-Id": "req-42"},
    )


def test_chat_stream_chunk_order(make_api, sse):
    api = make_api(output_tokens=3)
    response = chat(api, stream=True, stream_options={"include_usage": True})
    assert response.status_code == 200
    assert response.headers["Content-Type"].startswith("text/event-stream")
    assert float(response.headers["X-Engine-Prefill-Ms"]) >= 0
    events = sse(response.data)
    role, *content, finish, usage, done = events
    assert role["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
    ]
    assert [c["choices"][0]["finish_reason"] for c in content] == [None, None, None]
    assert all(
        c["object"] == "chat.completion.chunk" and c["id"] == "chatcmpl-req-42" for c in events[:-1]
    )
    assert (
        finish["choices"][0]["finish_reason"] == "stop"
        and finish["choices"][0]["stop_reason"] is None
    )
    assert finish["choices"][0]["delta"] == {"content": ""}  # EOS has no text
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": N_PROMPT,
        "completion_tokens": 4,
        "total_tokens": N_PROMPT + 4,
    }
    assert done == "[DONE]"
    # One sleep for prefill, then one decode step (itl_ms) before each chunk after the first.
    assert api.clock.slept[1:] == pytest.approx([0.002] * 3)
    text = "".join(c["choices"][0]["delta"]["content"] for c in content)
    assert text == chat(api).get_json()["choices"][0]["message"]["content"]
    assert len(text.split()) == 3 and not text.startswith(" ")


def test_length_finish_carries_the_last_token(make_api, sse):
    api = make_api(output_tokens=10)
    events = sse(chat(api, stream=True, max_tokens=3).data)
    assert len(events) == 1 + 2 + 1 + 1  # role, 2 content, finish with the third word, [DONE]
    finish = events[-2]["choices"][0]
    assert finish["finish_reason"] == "length" and finish["delta"]["content"].startswith(" ")
    body = chat(api, max_completion_tokens=2, max_tokens=50).get_json()
    assert (
        body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 2
    )
    longer = chat(
        api, max_tokens=25
    ).get_json()  # max_tokens is obeyed exactly, past --output-tokens
    assert (
        longer["choices"][0]["finish_reason"] == "length"
        and longer["usage"]["completion_tokens"] == 25
    )
    natural = chat(api).get_json()  # no max_tokens: --output-tokens words, then EOS
    assert (
        natural["choices"][0]["finish_reason"] == "stop"
        and natural["usage"]["completion_tokens"] == 11
    )
    assert len(natural["choices"][0]["message"]["content"].split()) == 10
    assert chat(api, min_tokens=12).get_json()["usage"]["completion_tokens"] == 13
    room = chat(api, ignore_eos=True, stream=False)
    assert room.get_json()["usage"]["completion_tokens"] == 32768 - N_PROMPT


def test_non_stream_body_is_one_line_with_top_level_params(make_api):
    api = make_api()
    response = chat(api, max_tokens=2, some_unknown_field={"x": 1})
    assert response.status_code == 200 and b"\n" not in response.data
    body = json.loads(response.data)
    assert body["id"] == "chatcmpl-req-42" and body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert "kv_transfer_params" in body and body["kv_transfer_params"] is None  # plain decode
    assert body["usage"]["prompt_tokens"] == N_PROMPT


def test_completions_stream_and_body(make_api, sse):
    api = make_api(output_tokens=2)
    request = {"model": "emulated-model", "prompt": "once upon a time"}
    events = sse(api.post("/v1/completions", {**request, "stream": True}).data)
    assert [e["choices"][0]["finish_reason"] for e in events[:-1]] == [None, None, "stop"]
    assert all(
        e["object"] == "text_completion"
        and set(e["choices"][0]) == {"index", "text", "logprobs", "finish_reason", "stop_reason"}
        for e in events[:-1]
    )
    streamed = "".join(e["choices"][0]["text"] for e in events[:-1])
    body = api.post("/v1/completions", request, headers={"X-Request-Id": "c1"}).get_json()
    assert body["id"] == "cmpl-c1" and body["choices"][0]["text"] == streamed
    assert streamed.startswith(" ") and len(streamed.split()) == 2


def test_prefill_stub_returns_prefill_params(make_api, stub):
    api = make_api(role="prefill", port=18100, advertise_host="localhost")
    body = chat(api, max_tokens=1, kv_transfer_params=stub).get_json()
    params = body["kv_transfer_params"]
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {
        "prompt_tokens": N_PROMPT,
        "completion_tokens": 1,
        "total_tokens": N_PROMPT + 1,
        "prompt_tokens_details": None,
    }
    assert params == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": params["remote_block_ids"],
        "remote_engine_id": api.engine.engine_id,
        "remote_request_id": params["remote_request_id"],
        "remote_host": "localhost",
        "remote_port": 19100,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": N_PROMPT,
        "remote_blocks_expiry_time": None,
        "transfer_mode": "pull",
        "remote_registration_generation": 0,
        "remote_prefill_cached_tokens": 0,
    }
    assert len(params["remote_block_ids"][0]) == -(-N_PROMPT // 16)
    assert params["remote_request_id"].startswith("chatcmpl-req-42-")
    assert len(params["remote_request_id"]) == len("chatcmpl-req-42-") + 8
    assert api.engine.snapshot()["kv_leases"] == 1


@pytest.mark.parametrize("placement", ["final", "separate", "absent"])
def test_stream_params_placement(make_api, sse, placement):
    api = make_api(stream_params=placement, bidirectional_kv_xfer=True)
    # Params with neither flag: a decode-node request; bidirectional D returns its params at finish.
    events = sse(
        chat(
            api, stream=True, stream_options={"include_usage": True}, kv_transfer_params=LOCAL
        ).data
    )
    carriers = [
        i for i, e in enumerate(events) if isinstance(e, dict) and "kv_transfer_params" in e
    ]
    finish_at = next(
        i
        for i, e in enumerate(events)
        if e != "[DONE]" and e["choices"] and e["choices"][0]["finish_reason"]
    )
    if placement == "final":
        assert carriers == [finish_at]
    elif placement == "separate":
        assert carriers == [len(events) - 2] and set(events[-2]) == {"kv_transfer_params"}
        assert events[-3]["choices"] == [] and "usage" in events[-3]  # after the usage chunk
    else:
        assert carriers == []
    body = chat(api, kv_transfer_params=LOCAL).get_json()  # non-stream: always top-level
    params = body["kv_transfer_params"]
    assert params["do_remote_decode"] is True and params["do_remote_prefill"] is False
    assert params["remote_num_tokens"] == N_PROMPT + body["usage"]["completion_tokens"] - 1
    assert params["remote_blocks_expiry_time"] == pytest.approx(api.clock.now + 480, abs=1)


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/v1/chat/completions", b"{not json", 400, None),
        ("/v1/chat/completions", b"[1, 2]", 400, "body"),
        ("/v1/chat/completions", {"model": "emulated-model"}, 400, "body.messages"),
        ("/v1/chat/completions", {"messages": "hi"}, 400, "body.messages"),
        ("/v1/chat/completions", {"messages": []}, 400, "body.messages"),
        ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "body.messages.0.role"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": 7}]},
            400,
            "body.messages.0.content",
        ),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": "9"}, 400, "body.max_tokens"),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 0}, 400, "body.max_tokens"),
        (
            "/v1/chat/completions",
            {"messages": MESSAGES, "max_tokens": True},
            400,
            "body.max_tokens",
        ),
        ("/v1/chat/completions", {"messages": MESSAGES, "stream": "yes"}, 400, "body.stream"),
        (
            "/v1/chat/completions",
            {"messages": MESSAGES, "kv_transfer_params": [1]},
            400,
            "body.kv_transfer_params",
        ),
        (
            "/v1/chat/completions",
            {"messages": MESSAGES, "stream_options": {"include_usage": 1}},
            400,
            "body.stream_options.include_usage",
        ),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 40000}, 400, None),
        ("/v1/chat/completions", {"messages": MESSAGES, "model": "gpt-9"}, 404, "model"),
        ("/v1/completions", {"model": "emulated-model"}, 400, "body.prompt"),
        ("/v1/completions", {"prompt": 5}, 400, "body.prompt"),
        ("/v1/completions", {"prompt": "   "}, 400, "prompt"),
    ],
)
def test_bad_input_gets_the_error_envelope(make_api, path, body, status, param):
    api = make_api()
    if isinstance(body, bytes):
        response = api.client.post(path, data=body, content_type="application/json")
    else:
        response = api.post(path, body)
    assert response.status_code == status
    error = response.get_json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["param"] == param and error["message"]
    assert api.engine.stats.bad_requests == 1 and api.engine.stats.requests == 1


def test_unknown_routes_and_methods_get_the_envelope(make_api):
    api = make_api()
    assert api.client.get("/v1/nope").get_json()["error"]["code"] == 404
    assert api.client.get("/v1/chat/completions").get_json()["error"]["code"] == 405


def test_health_and_models(make_api):
    api = make_api(model="m-1", max_model_len=4096)
    health = api.client.get("/health")
    assert health.status_code == 200 and health.data == b""
    models = api.client.get("/v1/models").get_json()
    assert models["object"] == "list"
    (card,) = models["data"]
    assert (card["id"], card["object"], card["owned_by"], card["root"], card["max_model_len"]) == (
        "m-1",
        "model",
        "vllm",
        "m-1",
        4096,
    )
    assert card["permission"][0]["object"] == "model_permission"


def test_fault_down_error500_and_recovery(make_api):
    api = make_api()
    assert api.post("/faults", {"mode": "down"}).get_json()["mode"] == "down"
    assert api.client.get("/health").status_code == 503
    assert api.client.get("/v1/models").status_code == 503
    refused = chat(api)
    assert refused.status_code == 503 and refused.get_json()["error"]["code"] == 503
    api.post("/faults", {"mode": "error500"})
    failed = chat(api)
    assert failed.status_code == 500 and failed.get_json()["error"]["type"] == "InternalServerError"
    assert api.client.get("/health").status_code == 200
    api.post("/faults", {"mode": "none"})
    assert chat(api).status_code == 200
    assert api.client.get("/faults").get_json()["mode"] == "none"
    assert api.engine.stats.fault_responses == 2


def test_fault_count_reverts_to_none(make_api):
    api = make_api()
    api.post("/faults", {"mode": "error500", "count": 1})
    assert [chat(api).status_code for _ in range(2)] == [500, 200]


def test_fault_slow_delays_the_first_byte(make_api):
    api = make_api()
    api.post("/faults", {"mode": "slow", "delay_s": 2})
    response = chat(api, stream=True)
    assert api.clock.slept[0] == 2 and float(response.headers["X-Engine-Prefill-Ms"]) >= 2000


def test_fault_no_params_omits_them(make_api, sse):
    api = make_api()
    api.post("/faults", {"mode": "no_params"})
    assert chat(api, kv_transfer_params=LOCAL).get_json()["kv_transfer_params"] is None
    events = sse(chat(api, stream=True, kv_transfer_params=LOCAL).data)
    assert all("kv_transfer_params" not in e for e in events if isinstance(e, dict))
    assert api.engine.snapshot()["kv_leases"] == 0


def test_bad_fault_requests_are_400(make_api):
    api = make_api()
    for body in (
        {"mode": "explode"},
        {"mode": "slow", "delay_s": "soon"},
        {"mode": "hang", "bogus": 1},
    ):
        response = api.post("/faults", body)
        assert response.status_code == 400 and response.get_json()["error"]["code"] == 400
    assert api.client.post("/faults", data=b"nope").status_code == 400


def test_stats_count_and_reset(make_api):
    api = make_api(block_size=4)
    chat(api)
    chat(api, max_tokens=1)
    stats = api.client.get("/stats").get_json()
    assert (stats["role"], stats["engine_id"]) == ("decode", api.engine.engine_id)
    assert stats["requests"] == stats["completed"] == 2
    # The second time, the prompt's whole blocks are cached, except that the last token is
    # recomputed.
    cached = (N_PROMPT - 1) // 4 * 4
    assert stats["local_prefix_tokens"] == cached
    assert stats["computed_prompt_tokens"] == N_PROMPT * 2 - cached
    assert len(api.client.get("/stats/requests").get_json()) == 2
    reset = api.client.post("/stats/reset").get_json()
    assert reset["requests"] == 0 and reset["engine_id"] == api.engine.engine_id
    assert api.client.get("/stats/requests").get_json() == []


@pytest.mark.parametrize("policy, status", [("fail", 500), ("recompute", 200)])
def test_failed_pull_follows_the_load_failure_policy(make_api, sse, policy, status):
    api = make_api(kv_load_failure_policy=policy)
    # Nothing listens on port 9 of 127.0.0.1: the pull is refused at once.
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[1, 2]],
        "remote_engine_id": "e",
        "remote_request_id": "r",
        "remote_host": "127.0.0.1",
        "remote_port": 9,
        "remote_num_tokens": N_PROMPT,
    }
    response = chat(api, kv_transfer_params=params)
    assert response.status_code == status
    stats = api.engine.stats
    assert stats.failed_pulls == 1 and stats.pulled_tokens == 0
    assert stats.computed_prompt_tokens == (N_PROMPT if policy == "recompute" else 0)
    if policy == "fail":
        assert response.get_json()["error"]["code"] == 500
        streamed = sse(chat(api, stream=True, kv_transfer_params=params).data)
        assert streamed[0]["error"]["code"] == 500 and streamed[-1] == "[DONE]"


def test_empty_params_keep_nothing(make_api):
    """request_finished: `if not params: return False, None` (nixl/pull_scheduler.py ~L209-210)."""
    api = make_api()
    assert chat(api, kv_transfer_params={}).get_json()["kv_transfer_params"] is None
    assert chat(api).get_json()["kv_transfer_params"] is None
    snapshot = api.engine.snapshot()
    assert snapshot["kv_leases"] == snapshot["leaked_leases"] == snapshot["kv_blocks_used"] == 0


def test_d_params_without_either_flag_keep_their_blocks_for_good(make_api):
    """vLLM 0.33: such a request exports D params and delays its free, but was never in
    reqs_in_batch, so no TTL reaps it and a reader's notification is ignored
    (nixl/pull_scheduler.py ~L119-125, nixl/pull_worker.py ~L97-121, ~L670-681)."""
    api = make_api(bidirectional_kv_xfer=True)
    params = chat(api, kv_transfer_params=LOCAL).get_json()["kv_transfer_params"]
    assert params["do_remote_decode"] is True and isinstance(
        params["remote_blocks_expiry_time"], float
    )
    api.clock.now += 480 * 10
    held = api.engine.snapshot()
    assert (held["kv_leases"], held["leaked_leases"]) == (0, 1)
    assert held["leaked_blocks"] == held["kv_blocks_used"] > 0
    assert api.engine.leases.notify(params["remote_request_id"]) is None
    assert api.engine.snapshot()["leaked_blocks"] == held["leaked_blocks"]


@pytest.mark.parametrize("bidirectional", [True, False])
def test_a_decode_request_with_p_params_is_tracked_and_expires(make_api, bidirectional):
    """With bidirectional_kv_xfer (off by default) D keeps its blocks for the next turn's P,
    tracked; without it D keeps nothing (nixl/pull_scheduler.py ~L232-233)."""
    api = make_api(kv_load_failure_policy="recompute", bidirectional_kv_xfer=bidirectional)
    # P's params naming a P that cannot be reached: D recomputes, and still keeps its blocks
    # for the next turn, tracked (do_remote_prefill put it in reqs_in_batch).
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[1, 2]],
        "remote_engine_id": "e",
        "remote_request_id": "r",
        "remote_host": "127.0.0.1",
        "remote_port": 9,
        "remote_num_tokens": N_PROMPT,
    }
    out = chat(api, kv_transfer_params=params).get_json()["kv_transfer_params"]
    if not bidirectional:
        assert out is None and api.engine.snapshot()["kv_blocks_used"] == 0
        return
    assert out["remote_blocks_expiry_time"] == pytest.approx(api.clock.now + 480, abs=1)
    assert api.engine.snapshot()["kv_leases"] == 1
    api.clock.now += 480
    snapshot = api.engine.snapshot()
    assert (
        snapshot["kv_leases"],
        snapshot["leases_expired_unread"],
        snapshot["kv_blocks_used"],
    ) == (0, 1, 0)


def test_usage_reports_cached_tokens_with_prompt_tokens_details(make_api, sse):
    api = make_api(block_size=4, enable_prompt_tokens_details=True)
    assert chat(api).get_json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    cached = (N_PROMPT - 1) // 4 * 4
    assert chat(api).get_json()["usage"]["prompt_tokens_details"] == {"cached_tokens": cached}
    events = sse(chat(api, stream=True, stream_options={"include_usage": True}).data)
    assert events[-2]["usage"]["prompt_tokens_details"] == {"cached_tokens": cached}
    assert make_api().engine.config.enable_prompt_tokens_details is False


# CacheConfig's fields in vLLM 0.33.0, in declaration order (vllm/config/cache.py ~L187-445):
# `metrics_info()` makes each a label of vllm:cache_config_info (~L440-443), `engine` added by
# the logger (v1/metrics/loggers.py ~L1114-1136).
CACHE_CONFIG_FIELDS = (
    "block_size",
    "user_specified_block_size",
    "kv_cache_layout",
    "prefix_match_unit",
    "gpu_memory_utilization",
    "cache_dtype",
    "is_attention_free",
    "num_gpu_blocks_override",
    "sliding_window",
    "enable_prefix_caching",
    "prefix_caching_hash_algo",
    "prefix_cache_retention_interval",
    "kv_cache_dtype_skip_layers",
    "mamba_page_size_padded",
    "skip_page_size_padded",
    "mamba_block_size",
    "mamba_cache_dtype",
    "mamba_ssm_cache_dtype",
    "mamba_cache_mode",
    "enable_mamba_shared_prefix_checkpoint",
    "replayssm_buffer_len",
    "use_replayssm",
    "use_kda_recoverssm",
    "num_gpu_blocks",
    "num_cpu_blocks",
    "simple_cpu_offload_num_blocks",
    "effective_attention_block_size",
    "kv_cache_size_tokens",
    "kv_cache_max_concurrency",
    "hash_block_size",
    "cache_hit_alignment_tokens",
    "kv_sharing_fast_prefill",
    "swa_bounded_replay",
    "kv_cache_memory_bytes",
    "kv_offloading_size",
    "kv_offloading_backend",
    "_block_size_resolved",
    "engine",
)


@pytest.mark.parametrize(
    "flags, block, blocks, caching",
    [
        ({}, "16", "20000", "True"),
        (
            {"block_size": 32, "kv_capacity_blocks": 1200, "enable_prefix_caching": False},
            "32",
            "1200",
            "False",
        ),
    ],
)
def test_cache_config_info_reports_what_vllm_reports(make_api, flags, block, blocks, caching):
    from prometheus_client.parser import text_string_to_metric_families

    api = make_api(**flags)
    text = api.client.get("/metrics").get_data(as_text=True)
    (family,) = [
        f for f in text_string_to_metric_families(text) if f.name == "vllm:cache_config_info"
    ]
    (sample,) = family.samples
    assert sample.value == 1.0 and sorted(sample.labels) == sorted(CACHE_CONFIG_FIELDS)
    assert (
        sample.labels["block_size"],
        sample.labels["num_gpu_blocks"],
        sample.labels["enable_prefix_caching"],
        sample.labels["engine"],
    ) == (block, blocks, caching, "0")


def test_metrics_use_vllms_names(make_api):
    api = make_api(block_size=4)
    chat(api)
    chat(api)
    text = api.client.get("/metrics").get_data(as_text=True)
    labels = '{engine="0",model_name="emulated-model"}'
    cached = (N_PROMPT - 1) // 4 * 4
    for line in (
        f"vllm:num_requests_running{labels} 0.0",
        f"vllm:num_requests_waiting{labels} 0.0",
        f"vllm:prefix_cache_queries_total{labels} {float(N_PROMPT * 2)}",
        f"vllm:prefix_cache_hits_total{labels} {float(cached)}",
    ):
        assert line in text.splitlines(), line
    assert "vllm:kv_cache_usage_perc" in text and "vllm:external_prefix_cache_hits_total" in text
