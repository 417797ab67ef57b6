"""POST /v1/responses, GET /v1/responses/{id} and POST .../cancel in-process, as vLLM 0.33 serves
them for a model that is not gpt-oss: input items rendered as chat messages, the response object and
its event stream, the store (off by default), and where kv_transfer_params go (the request; the
response object: body, stored response, the stream's last event)."""

from __future__ import annotations

import json
import re

TOOLS = [
    {
        "type": "function",
        "name": "lookup",
        "description": "find a thing",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
    }
]
LOCAL = {"do_remote_prefill": False, "do_remote_decode": False}


def create(api, **body):
    return api.post(
        "/v1/responses", {"model": "emulated-model", "input": "tell me about kv caches", **body}
    )


def tokenize(api, messages: list, **body) -> int:
    return api.post("/tokenize", {"messages": messages, **body}).get_json()["count"]


def kinds(events: list) -> list[str]:
    return [e["type"] for e in events]


def test_a_response_object(make_api):
    api = make_api()
    body = create(api, instructions="be terse", max_output_tokens=3, metadata={"k": "v"}).get_json()
    assert re.fullmatch(
        r"resp_[0-9a-f]{32}", body["id"]
    )  # never X-Request-Id (protocol.py:357-364)
    n = tokenize(
        api,
        [
            {"role": "system", "content": "be terse"},
            {"role": "user", "content": "tell me about kv caches"},
        ],
    )
    (message,) = body["output"]
    assert (
        message["type"] == "message"
        and message["status"] == "incomplete"
        and message["role"] == "assistant"
    )
    assert (
        len(message["content"][0]["text"].split()) == 3
        and message["content"][0]["annotations"] == []
    )
    assert body["status"] == "incomplete" and body["incomplete_details"] == {
        "reason": "max_output_tokens"
    }
    assert body["usage"]["input_tokens"] == n and body["usage"]["output_tokens"] == 3
    # cached_tokens whatever --enable-prompt-tokens-details says (context.py:212-218).
    assert body["usage"]["input_tokens_details"]["cached_tokens"] == 0
    assert (body["instructions"], body["metadata"], body["max_output_tokens"]) == (
        "be terse",
        {"k": "v"},
        3,
    )
    assert body["tool_choice"] == "none" and body["tools"] == []  # no tools: auto becomes none
    assert "kv_transfer_params" in body and body["kv_transfer_params"] is None
    again = create(api, instructions="be terse").get_json()
    assert again["status"] == "completed" and again["usage"]["output_tokens"] == 5  # 4 words + EOS
    assert again["max_output_tokens"] == 32768 - n  # what the context leaves
    assert again["usage"]["input_tokens_details"]["cached_tokens"] == n - 1 - (n - 1) % 16
    assert create(api, request_id="resp_mine").get_json()["id"] == "resp_mine"


def test_text_stream_events_in_vllms_order(make_api, sse):
    api = make_api(output_tokens=3)
    events = sse(create(api, stream=True).data)
    assert kinds(events) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 3,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    created, completed = events[0]["response"], events[-1]["response"]
    assert (
        created["status"] == "in_progress" and created["output"] == [] and created["usage"] is None
    )
    item = events[-2]["item"]
    assert completed["output"] == [item] and item["status"] == "completed"
    assert (
        "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        == item["content"][0]["text"]
        == events[7]["text"]
    )
    assert {e["item_id"] for e in events[3:9]} == {item["id"]} and completed["id"] == created["id"]


def test_a_function_call_and_its_output(make_api, sse):
    api = make_api(tool_call_share=1.0)
    events = sse(create(api, tools=TOOLS, stream=True).data)
    assert kinds(events) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    call = events[-1]["response"]["output"][0]
    assert (
        call["type"] == "function_call"
        and call["name"] == "lookup"
        and call["status"] == "completed"
    )
    assert events[3]["delta"] == events[4]["arguments"] == call["arguments"]
    body = create(api, tools=TOOLS).get_json()
    assert body["output"][0]["call_id"] == call["call_id"] and body["tool_choice"] == "auto"
    # Stateless: the call and its output come back as input items, rendered as an assistant tool
    # call and a tool message (utils.py:308-436).
    turn2 = [
        "tell me about kv caches",
        call,
        {"type": "function_call_output", "call_id": call["call_id"], "output": "42 results"},
    ]
    turn2[0] = {"role": "user", "content": [{"type": "input_text", "text": turn2[0]}]}
    as_chat = [
        {"role": "user", "content": "tell me about kv caches"},
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": call["call_id"],
                    "type": "function",
                    "function": {"name": "lookup", "arguments": call["arguments"]},
                }
            ],
        },
        {"role": "tool", "content": "42 results", "tool_call_id": call["call_id"]},
    ]
    chat_tools = [
        {"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}
    ]
    out = create(api, input=turn2, tools=TOOLS, tool_choice="none").get_json()
    assert out["usage"]["input_tokens"] == tokenize(api, as_chat, tools=chat_tools)
    assert out["output"][0]["type"] == "message"


def test_without_the_store_nothing_is_kept(make_api):
    """VLLM_ENABLE_RESPONSES_API_STORE is off by default: store=true is dropped silently
    (serving.py:355-362) and every id is unknown."""
    api = make_api()
    body = create(api, store=True).get_json()
    not_found = {
        "error": {
            "message": f"Response with id '{body['id']}' not found.",
            "type": "invalid_request_error",
            "param": "response_id",
            "code": 404,
        }
    }
    for response in (
        api.client.get(f"/v1/responses/{body['id']}"),
        api.post(f"/v1/responses/{body['id']}/cancel", {}),
        create(api, input="and then", previous_response_id=body["id"]),
    ):
        assert response.status_code == 404 and response.get_json() == not_found
    background = create(api, background=True)
    assert (
        background.status_code == 400
        and "VLLM_ENABLE_RESPONSES_API_STORE=1" in background.get_json()["error"]["message"]
    )


def test_the_store_chains_responses_on_one_engine(make_api, sse):
    api = make_api(responses_api_store=True, reasoning_share=1.0)
    first = create(api, instructions="be terse", max_output_tokens=12).get_json()
    reasoning, message = first["output"]
    assert reasoning["type"] == "reasoning" and reasoning["content"][0]["type"] == "reasoning_text"
    assert first["usage"]["output_tokens_details"]["reasoning_tokens"] == len(
        reasoning["content"][0]["text"].split()
    )
    assert api.client.get(f"/v1/responses/{first['id']}").get_json() == first
    # The next turn sees the previous request's messages (less its system one) and the previous
    # reply's message items; its reasoning is skipped (utils.py:263-305).
    second = create(
        api, input="and then", previous_response_id=first["id"], instructions="be kind", stream=True
    )
    completed = sse(second.data)[-1]["response"]
    history = [
        {"role": "system", "content": "be kind"},
        {"role": "user", "content": "tell me about kv caches"},
        {"role": "assistant", "content": message["content"][0]["text"]},
        {"role": "user", "content": "and then"},
    ]
    assert completed["usage"]["input_tokens"] == tokenize(api, history)
    assert completed["previous_response_id"] == first["id"]
    assert api.client.get(f"/v1/responses/{completed['id']}").get_json() == completed
    cancel = api.post(f"/v1/responses/{first['id']}/cancel", {})
    assert (
        cancel.status_code == 400
        and cancel.get_json()["error"]["message"] == "Cannot cancel a synchronous response."
    )
    unstored = create(api, store=False).get_json()
    assert api.client.get(f"/v1/responses/{unstored['id']}").status_code == 404


def test_a_previous_function_call_is_not_rendered(make_api):
    """Only message items of the previous output become history (utils.py:285-296): a function
    call answered by previous_response_id is left out of the prompt, as vLLM 0.33 does."""
    api = make_api(responses_api_store=True, tool_call_share=1.0)
    first = create(api, tools=TOOLS).get_json()
    (call,) = first["output"]
    output = {"type": "function_call_output", "call_id": call["call_id"], "output": "42 results"}
    second = create(
        api, input=[output], previous_response_id=first["id"], tools=TOOLS, tool_choice="none"
    ).get_json()
    chat_tools = [
        {"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}
    ]
    without_call = [
        {"role": "user", "content": "tell me about kv caches"},
        {"role": "tool", "content": "42 results", "tool_call_id": call["call_id"]},
    ]
    assert second["usage"]["input_tokens"] == tokenize(api, without_call, tools=chat_tools)


def test_validation_and_errors(make_api):
    api = make_api()
    missing = api.post("/v1/responses", {"model": "emulated-model"})
    assert missing.status_code == 400 and missing.get_json()["error"]["param"] == "body.input"
    assert create(api, model="other").status_code == 404
    bad_item = create(api, input=[{"type": "web_search_call", "id": "x"}])
    assert bad_item.status_code == 400
    assert bad_item.get_json()["error"]["message"] == "Unsupported input item type: web_search_call"
    too_long = create(api, input="word " * 32768)
    assert too_long.status_code == 400 and too_long.get_json()["error"]["param"] == "input"
    required = create(api, tool_choice="required")
    assert (
        required.status_code == 400
        and "must be specified with 'tools'" in required.get_json()["error"]["message"]
    )


def test_a_prefill_leg_and_a_decode_leg(make_api, sse, stub):
    """kv_transfer_params are a request field (protocol.py:458-461, 622-624) and a field of the
    response object (protocol.py:928-930, 1029): a body has them (serving.py:940); of a stream's
    events only the last (response.completed / response.incomplete, serving.py:1431-1457) does."""
    p = make_api(role="prefill")
    leg = create(p, max_output_tokens=1, kv_transfer_params=stub).get_json()
    assert leg["status"] == "incomplete" and leg["usage"]["output_tokens"] == 1
    assert leg["kv_transfer_params"]["do_remote_prefill"] is True
    assert re.fullmatch(
        re.escape(leg["id"]) + r"_0-[0-9a-f]{8}", leg["kv_transfer_params"]["remote_request_id"]
    )
    d = make_api(bidirectional_kv_xfer=True)
    events = sse(create(d, stream=True, kv_transfer_params=LOCAL).data)
    assert [e["type"] for e in events if "kv_transfer_params" in json.dumps(e)] == [
        "response.created",
        "response.in_progress",
        "response.completed",
    ]
    assert (
        events[0]["response"]["kv_transfer_params"] is None
        and events[1]["response"]["kv_transfer_params"] is None
    )
    assert events[-1]["response"]["kv_transfer_params"]["do_remote_decode"] is True


def test_an_error_mid_stream_breaks_the_stream_off(make_api, sse):
    """vLLM validates the GenerationError's JSON as a stream event, which fails
    (serving.py:1418-1423): no terminal event, the connection dropped."""
    api = make_api(output_tokens=5)
    api.post("/faults", {"mode": "error_after", "tokens": 2})
    response = create(api, stream=True)
    chunks = []
    try:
        for chunk in response.response:
            chunks.append(chunk)
    except ConnectionAbortedError:
        pass
    else:
        raise AssertionError("the stream ended normally")
    assert kinds(sse(b"".join(chunks))) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
    ]
