"""POST /v1/messages and /v1/messages/count_tokens in-process, as vLLM 0.33's Anthropic route serves
them: the chat request it converts to, the message and its event stream, the errors, and where
kv_transfer_params go (accepted on the request; on a body; never on a stream)."""

from __future__ import annotations

import json

import pytest

TOOLS = [
    {
        "name": "lookup",
        "description": "find a thing",
        "input_schema": {"type": "object", "properties": {"query": {"type": "string"}}},
    }
]
USER = [{"role": "user", "content": "tell me about kv caches please"}]


def messages(api, xid: str = "req-7", **body):
    return api.post(
        "/v1/messages",
        {"model": "emulated-model", "max_tokens": 3, "messages": USER, **body},
        headers={"X-Request-Id": xid},
    )


def count(api, **body) -> int:
    response = api.post(
        "/v1/messages/count_tokens", {"model": "emulated-model", "messages": USER, **body}
    )
    assert response.status_code == 200, response.data
    reply = response.get_json()
    assert reply["context_management"] == {"original_input_tokens": reply["input_tokens"]}
    return reply["input_tokens"]


def tokenize(api, messages: list, **body) -> int:
    """What the chat request vLLM converts to renders (the chat path's /tokenize)."""
    return api.post("/tokenize", {"messages": messages, **body}).get_json()["count"]


def test_a_message_is_the_chat_reply_converted(make_api):
    api = make_api()
    response = messages(api)
    assert response.status_code == 200 and b"\n" not in response.data
    message = json.loads(response.data)
    chat = api.post("/v1/chat/completions", {"messages": USER, "max_tokens": 3}).get_json()
    # serving.py:861-916, serialised without nulls (api_router.py:82-85): no stop_sequence, and no
    # kv_transfer_params when the chat response had none.
    assert message == {
        "id": "chatcmpl-req-7",
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": chat["choices"][0]["message"]["content"]}],
        "model": "emulated-model",
        "stop_reason": "max_tokens",
        "usage": {"input_tokens": chat["usage"]["prompt_tokens"], "output_tokens": 3},
    }
    # max_tokens is required here, and the emulator obeys it exactly (docs/emulator.md): every
    # text reply ends max_tokens. stop_sequences are passed on as the chat request's `stop`, which
    # the emulator accepts and does not model.
    assert (
        messages(api, max_tokens=9, stop_sequences=["zzz"]).get_json()["usage"]["output_tokens"]
        == 9
    )


def test_system_as_a_string_or_blocks_renders_as_one_system_message(make_api):
    api = make_api()
    as_chat = tokenize(api, [{"role": "system", "content": "be terse. and kind"}, *USER])
    assert count(api, system="be terse. and kind") == as_chat
    # Text blocks are joined with no separator; Claude Code's billing header is dropped
    # (serving.py:380-416).
    blocks = [
        {"type": "text", "text": "be terse."},
        {"type": "text", "text": "x-anthropic-billing-header: cch=1"},
        {"type": "text", "text": " and kind"},
    ]
    assert count(api, system=blocks) == as_chat
    assert messages(api, system=blocks).get_json()["usage"]["input_tokens"] == as_chat


def test_tool_use_and_tool_result_turns_convert_as_vllm_does(make_api, sse):
    api = make_api(tool_call_share=1.0)
    message = messages(api, max_tokens=50, tools=TOOLS).get_json()
    (call,) = message["content"]
    assert (
        call["type"] == "tool_use"
        and call["name"] == "lookup"
        and set(call["input"]) == {"query", "limit"}
    )
    assert message["stop_reason"] == "tool_use"
    # The next turn: the assistant's tool_use echoed, the user's tool_result. vLLM sends the result
    # as a tool message ahead of what is left of the user turn (serving.py:536-624), and the tools
    # as chat tools with tool_choice auto.
    history = [
        *USER,
        {"role": "assistant", "content": [call]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": call["id"], "content": "42 results"},
                {"type": "text", "text": "summarise them"},
            ],
        },
    ]
    chat_tools = [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "description": "find a thing",
                "parameters": TOOLS[0]["input_schema"],
            },
        }
    ]
    as_chat = [
        *USER,
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": "lookup", "arguments": json.dumps(call["input"])},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call["id"], "content": "42 results"},
        {"role": "user", "content": "summarise them"},
    ]
    assert count(api, messages=history, tools=TOOLS) == tokenize(api, as_chat, tools=chat_tools)
    # tool_choice none: no call (the emulator's rule); the stream is text.
    events = sse(
        messages(api, messages=history, tools=TOOLS, tool_choice={"type": "none"}, stream=True).data
    )
    assert [e["type"] for e in events] == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * 3,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    # A streamed call: one tool_use block, its arguments as one input_json_delta.
    events = sse(messages(api, max_tokens=50, tools=TOOLS, stream=True).data)
    start, delta = events[1], events[2]
    assert start["content_block"] == {
        "type": "tool_use",
        "id": call["id"],
        "name": "lookup",
        "input": {},
    }
    assert json.loads(delta["delta"]["partial_json"]) == call["input"]
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}


def test_stream_events_in_vllms_order(make_api, sse):
    api = make_api()
    response = messages(api, stream=True)
    assert response.headers["Content-Type"].startswith("text/event-stream")
    raw = response.data
    assert b"[DONE]" not in raw and raw.startswith(b"event: message_start\ndata: {")
    events = sse(raw)
    n = count(api)
    assert events[0] == {
        "type": "message_start",
        "message": {
            "id": "chatcmpl-req-7",
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": "emulated-model",
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": n, "output_tokens": 0},
        },
    }
    assert events[1] == {
        "type": "content_block_start",
        "content_block": {"type": "text", "text": ""},
        "index": 0,
    }
    deltas = events[2:5]
    assert all(
        d["type"] == "content_block_delta"
        and d["index"] == 0
        and d["delta"]["type"] == "text_delta"
        for d in deltas
    )
    assert (
        "".join(d["delta"]["text"] for d in deltas)
        == messages(api).get_json()["content"][0]["text"]
    )
    assert events[5:] == [
        {"type": "content_block_stop", "index": 0},
        {
            "type": "message_delta",
            "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
            "usage": {"input_tokens": n, "output_tokens": 3},
        },
        {"type": "message_stop"},
    ]


def test_thinking_blocks_carry_a_signature(make_api, sse):
    api = make_api(reasoning_share=1.0)
    message = messages(api, max_tokens=12).get_json()
    thinking, text = message["content"]
    assert (
        thinking["type"] == "thinking" and thinking["thinking"] and len(thinking["signature"]) == 32
    )
    assert text["type"] == "text"
    events = sse(messages(api, max_tokens=12, stream=True).data)
    kinds = [
        (e["type"], e.get("delta", {}).get("type") or e.get("content_block", {}).get("type"))
        for e in events
    ]
    first_text = kinds.index(("content_block_start", "text"))
    # The thinking block closes with its signature before the text block opens (serving.py:971-999).
    assert kinds[1] == ("content_block_start", "thinking")
    assert kinds[first_text - 2 : first_text] == [
        ("content_block_delta", "signature_delta"),
        ("content_block_stop", None),
    ]
    assert (
        "".join(
            e["delta"]["thinking"]
            for e in events
            if e.get("delta", {}).get("type") == "thinking_delta"
        )
        == thinking["thinking"]
    )
    assert events[first_text]["index"] == 1
    # An echoed thinking block renders as the assistant's reasoning (serving.py:519-520, 489-490).
    history = [
        *USER,
        {"role": "assistant", "content": [thinking, text]},
        {"role": "user", "content": "more"},
    ]
    as_chat = [
        *USER,
        {"role": "assistant", "reasoning": thinking["thinking"], "content": text["text"]},
        {"role": "user", "content": "more"},
    ]
    assert count(api, messages=history) == tokenize(api, as_chat)


def test_validation_errors_use_vllms_envelope_handler_errors_anthropics(make_api):
    api = make_api()
    # The route's own request model fails in FastAPI's validation handler: vLLM's OpenAI envelope.
    missing = api.post("/v1/messages", {"model": "emulated-model", "messages": USER})
    assert missing.status_code == 400
    assert missing.get_json()["error"] == {
        "message": "1 validation error: body.max_tokens: Field required",
        "type": "Bad Request",
        "param": "body.max_tokens",
        "code": 400,
    }
    zero = messages(api, max_tokens=0)
    assert (
        zero.status_code == 400
        and "max_tokens must be positive" in zero.get_json()["error"]["message"]
    )
    thinking = {"type": "enabled", "budget_tokens": 2048}
    budget = messages(api, max_tokens=100, thinking=thinking)
    assert budget.status_code == 400 and budget.get_json()["error"]["param"] == "body"
    assert (
        "thinking.budget_tokens must be less than max_tokens"
        in budget.get_json()["error"]["message"]
    )
    # What the handler returns is translated to Anthropic's envelope (api_router.py:40-49).
    unknown = messages(api, model="other")
    assert unknown.status_code == 404
    assert unknown.get_json() == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "The model `other` does not exist."},
    }
    long = messages(api, max_tokens=40000)
    assert long.status_code == 400 and long.get_json()["error"]["type"] == "invalid_request_error"
    assert (
        api.post("/v1/messages/count_tokens", {"model": "other", "messages": USER}).get_json()[
            "type"
        ]
        == "error"
    )
    api.post("/faults", {"mode": "down"})
    down = messages(api)
    assert down.status_code == 503 and down.get_json()["error"]["type"] == "overloaded_error"


def test_a_prefill_leg_takes_params_and_returns_them_in_the_body(make_api, stub):
    """protocol.py:301-304 accepts kv_transfer_params; the budget check skips a prefill leg
    (protocol.py:351-362); the body carries the chat response's params (serving.py:870)."""
    api = make_api(role="prefill")
    body = messages(
        api,
        max_tokens=1,
        kv_transfer_params=stub,
        thinking={"type": "enabled", "budget_tokens": 2048},
    ).get_json()
    params = body["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_num_tokens"] == count(api)
    assert body["stop_reason"] == "max_tokens" and body["usage"]["output_tokens"] == 1
    assert api.engine.snapshot()["kv_leases"] == 1


@pytest.mark.parametrize("placement", ["final", "separate"])
def test_a_stream_carries_no_params_though_d_keeps_its_blocks(make_api, sse, placement):
    """message_stream_converter never reads kv_transfer_params off the chat chunks
    (serving.py:918-1226), whatever --stream-params says of the chat stream."""
    api = make_api(bidirectional_kv_xfer=True, stream_params=placement)
    local = {"do_remote_prefill": False, "do_remote_decode": False}
    raw = messages(api, stream=True, kv_transfer_params=local).data
    assert b"kv_transfer_params" not in raw and b"remote_" not in raw
    assert sse(raw)[-1] == {"type": "message_stop"}
    assert api.engine.snapshot()["leaked_leases"] == 1  # D kept them; nobody can name them now
    body = messages(api, xid="req-8", kv_transfer_params=local).get_json()
    assert body["kv_transfer_params"]["do_remote_decode"] is True


def test_prompt_tokens_details_show_as_cache_reads(make_api):
    api = make_api(enable_prompt_tokens_details=True)
    messages(api, max_tokens=1)
    n = count(api)
    usage = messages(api, max_tokens=1).get_json()["usage"]
    cached = n - 1 - (n - 1) % 16
    assert usage == {
        "input_tokens": n - cached,
        "output_tokens": 1,
        "cache_read_input_tokens": cached,
    }


def test_an_error_mid_stream_is_an_error_event(make_api, sse):
    api = make_api(output_tokens=5)
    api.post("/faults", {"mode": "error_after", "tokens": 2})
    events = sse(messages(api, max_tokens=10, stream=True).data)
    assert [e["type"] for e in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "error",
    ]
    assert events[-1]["error"] == {"type": "api_error", "message": "emulated fault: error_after"}
