"""The Responses conversion without processes: the chat request P and D get for a Responses
request (vLLM's rendering, vllm/entrypoints/openai/responses/utils.py L263-457), and a chat
reply, whole or streamed, as the Response object and events."""

from __future__ import annotations

import orjson
import pytest

from gateway.responses.chain import LocalChain
from gateway.responses.items import chat_body, input_messages, parse_request
from gateway.responses.output import EventStream, Shape, response_of
from gateway.support.errors import BadRequest


def request(**body):
    return parse_request(orjson.dumps({"model": "m", **body}))


def test_items_render_as_vllms_chat_messages():
    r = request(
        instructions="be brief",
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "call it"}],
            },
            {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": "It is sunny.", "annotations": []}],
            },
        ],
    )
    assert input_messages(r, None) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
        {
            "role": "assistant",
            "reasoning": "call it",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny."},
    ]


def test_a_previous_response_expands_without_its_instructions():
    previous = {
        "messages": [{"role": "system", "content": "old"}, {"role": "user", "content": "hi"}],
        "response": {
            "output": [
                {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "r"}]},
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "hello"}],
                },
            ]
        },
    }
    r = request(input="again", instructions="new", previous_response_id="resp_x")
    assert input_messages(r, previous) == [
        {"role": "system", "content": "new"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "reasoning": "r", "content": "hello"},
        {"role": "user", "content": "again"},
    ]


def test_options_become_chat_options():
    r = request(
        input="x",
        stream=True,
        max_output_tokens=5,
        temperature=0.2,
        reasoning={"effort": "low"},
        tools=[{"type": "function", "name": "w", "parameters": {}}],
        tool_choice={"type": "function", "name": "w"},
    )
    body = chat_body(r, [{"role": "user", "content": "x"}])
    assert body == {
        "model": "m",
        "temperature": 0.2,
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 5,
        "tools": [{"type": "function", "function": {"name": "w", "parameters": {}}}],
        "tool_choice": {"type": "function", "function": {"name": "w"}},
        "reasoning_effort": "low",
        "stream": True,
        "stream_options": {"include_usage": True},
    }


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "input"),
        ({"input": []}, "input"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0"),
        ({"input": "x", "bogus": 1}, "bogus"),
    ],
)
def test_bad_requests_name_the_field(body, param):
    with pytest.raises(BadRequest) as caught:
        r = request(**body)
        chat_body(r, input_messages(r, None))
    assert caught.value.param == param


def test_a_chat_completion_becomes_a_response():
    shape = Shape({"model": "m", "input": "x"}, "resp_1", "m", "none")
    response = response_of(
        shape,
        {
            "model": "m",
            "choices": [
                {
                    "finish_reason": "tool_calls",
                    "message": {
                        "role": "assistant",
                        "content": "ok",
                        "reasoning": "think",
                        "tool_calls": [
                            {
                                "id": "c1",
                                "type": "function",
                                "function": {"name": "w", "arguments": "{}"},
                            }
                        ],
                    },
                }
            ],
            "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10},
        },
    )
    assert [o["type"] for o in response["output"]] == ["reasoning", "message", "function_call"]
    assert response["output"][2]["call_id"] == "c1" and response["status"] == "completed"
    assert response["usage"]["input_tokens"] == 7 and response["usage"]["total_tokens"] == 10


def _sse(*chunks) -> list[bytes]:
    return [b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks] + [b"data: [DONE]\n\n"]


def _events(raw: bytes) -> list[dict]:
    return [orjson.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: ")]


def test_a_chat_stream_becomes_responses_events_in_order_cut_anywhere():
    kept = []
    chunks = _sse(
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {"reasoning": "hm"}}]},
        {"choices": [{"index": 0, "delta": {"content": "Hel"}}]},
        {"choices": [{"index": 0, "delta": {"content": "lo"}}]},
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [
                            {"index": 0, "id": "c1", "function": {"name": "w", "arguments": '{"a"'}}
                        ]
                    },
                }
            ]
        },
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ":1}"}}]},
                    "finish_reason": "tool_calls",
                }
            ]
        },
        {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 5}},
    )
    whole = b"".join(chunks)
    pieces = [whole[i : i + 7] for i in range(0, len(whole), 7)]  # bytes cut anywhere
    stream = EventStream(Shape({"input": "x"}, "resp_1", "m", "auto"), kept.append)
    events = _events(b"".join(stream.convert(iter(pieces))))
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert final["output"][1]["content"][0]["text"] == "Hello"
    assert final["output"][2]["arguments"] == '{"a":1}' and final["usage"]["output_tokens"] == 5
    assert kept == [final]


def test_an_error_event_ends_the_stream_with_response_failed():
    chunks = [
        b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n',
        b'data: {"error":{"message":"D went away","type":"upstream_error","code":502}}'
        b"\n\ndata: [DONE]\n\n",
    ]
    kept = []
    stream = EventStream(Shape({"input": "x"}, "resp_1", "m", "auto"), kept.append)
    events = _events(b"".join(stream.convert(iter(chunks))))
    assert [e["type"] for e in events][-2:] == ["error", "response.failed"]
    assert events[-1]["response"]["status"] == "failed" and kept == []


def test_stored_responses_are_apart_by_tenant_and_expire():
    now = [0.0]
    chain = LocalChain(1 << 20, ttl=10, timer=lambda: now[0])
    chain.put(b"alpha", "resp_1", {"response": {"id": "resp_1"}})
    assert chain.get(b"alpha", "resp_1") == {"response": {"id": "resp_1"}}
    assert chain.get(b"beta", "resp_1") is None and not chain.delete(b"beta", "resp_1")
    now[0] = 11
    assert chain.get(b"alpha", "resp_1") is None
