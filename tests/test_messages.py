"""Anthropic's Messages API, POST /v1/messages: converted at the gateway's edge to the chat request
vLLM's own /v1/messages builds (vllm/entrypoints/anthropic/serving.py), run through P and D as a
chat completion, its reply converted back. The payloads P and D get and what the client gets are
pinned with `responses`; the anthropic SDK runs multi-turn conversations through a gateway under
gunicorn to the emulator."""

from __future__ import annotations

import json
import uuid

import pytest
import responses
from responses import matchers

from gateway.app import create_app
from gateway.config import Settings
from gateway.flow.decoded import Decoded
from gateway.front import anthropic as edge
from gateway.reuse.conversation import identify
from tests.helpers.payloads import CHAT, D_URL, MISS, P_URL, d_params, p_params, p_reply, sse
from tests.helpers.servers import MODEL, reset, starts_processes
from tests.helpers.transport import ResponsesTransport

MESSAGES = "/v1/messages"
SYSTEM = [
    {"type": "text", "text": "be brief"},
    {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abc;"},
]
TOOLS = [
    {
        "name": "lookup",
        "description": "look it up",
        "input_schema": {"properties": {"q": {"type": "string"}}},
    }
]


def anthropic_events(body: bytes) -> list[tuple[str, dict]]:
    out = []
    for block in body.decode().split("\n\n"):
        if block:
            event, data = block.split("\n")
            assert event.startswith("event: ") and data.startswith("data: ")
            out.append((event[7:], json.loads(data[6:])))
    return out


# --- the conversion, against vLLM's ----------------------------------------------------------


def test_a_request_converts_as_vllms_to_chat_completion_request():
    body = {
        "model": "m",
        "max_tokens": 64,
        "system": SYSTEM,
        "stream": True,
        "stop_sequences": ["END"],
        "temperature": 0.2,
        "top_k": 5,
        "cache_salt": "s",
        "metadata": {"user_id": "u"},
        "unknown_field": 1,
        "tools": TOOLS,
        "tool_choice": {"type": "tool", "name": "lookup", "disable_parallel_tool_use": True},
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "max_tokens_x": None,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "see"},
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"},
                    },
                ],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "sig"},
                    {"type": "text", "text": "calling"},
                    {"type": "tool_use", "id": "t1", "name": "lookup", "input": {"q": "é"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "content": [
                            {"type": "text", "text": "a"},
                            {"type": "text", "text": "b"},
                            {"type": "image", "source": {"type": "url", "url": "http://x/i.png"}},
                        ],
                    },
                    {"type": "text", "text": "go on"},
                ],
            },
            {"role": "system", "content": "inline"},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t0", "content": "only a result"}
                ],
            },
        ],
    }
    body["max_tokens"] = 2048
    assert edge.to_chat(body) == {
        "model": "m",
        "max_tokens": 2048,
        "max_completion_tokens": 2048,
        "stop": ["END"],
        "temperature": 0.2,
        "top_k": 5,
        "cache_salt": "s",
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "thinking_token_budget": 1024,
        "parallel_tool_calls": False,
        "tool_choice": {"type": "function", "function": {"name": "lookup"}},
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "lookup",
                    "description": "look it up",
                    "parameters": {"properties": {"q": {"type": "string"}}, "type": "object"},
                },
            }
        ],
        "messages": [
            # the billing header block is dropped (serving.py L396-402)
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "see"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                ],
            },
            {
                "role": "assistant",
                "content": "calling",
                "reasoning": "hm",
                "tool_calls": [
                    {
                        "id": "t1",
                        "type": "function",
                        "function": {"name": "lookup", "arguments": '{"q": "\\u00e9"}'},
                    }
                ],
            },
            # a user's tool_result: a tool message, its images a user message after it
            {"role": "tool", "tool_call_id": "t1", "content": "a\nb"},
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": "http://x/i.png"}}],
            },
            {"role": "user", "content": "go on"},
            {"role": "system", "content": "inline"},
            # a user message of tool results only: no user message of its own (L464-465)
            {"role": "tool", "tool_call_id": "t0", "content": "only a result"},
        ],
    }


def test_the_rest_of_the_conversion():
    base = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "q"}]}
    assert edge.to_chat({**base, "system": "x-anthropic-billing-header: kept as a string"})[
        "messages"
    ][0] == {"role": "system", "content": "x-anthropic-billing-header: kept as a string"}
    assert (
        edge.to_chat(
            {**base, "thinking": {"type": "disabled"}, "output_config": {"effort": "high"}}
        )["reasoning_effort"]
        == "none"
    )
    assert edge.to_chat(
        {
            **base,
            "output_config": {
                "effort": "high",
                "format": {"type": "json_schema", "schema": {"type": "object"}},
            },
        }
    ) == {
        **base,
        "max_completion_tokens": 8,
        "reasoning_effort": "high",
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "json_schema", "schema": {"type": "object"}},
        },
    }
    assert edge.to_chat({**base, "tools": TOOLS})["tool_choice"] == "auto"
    assert edge.to_chat({**base, "tool_choice": {"type": "any"}})["tool_choice"] == "required"
    # an assistant's tool_result is text (L558-564), str() of the content as vLLM has it
    assert edge.to_chat(
        {
            **base,
            "messages": [
                {
                    "role": "assistant",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t",
                            "content": [{"type": "text", "text": "r"}],
                        }
                    ],
                }
            ],
        }
    )["messages"] == [
        {"role": "assistant", "content": "Tool result: [{'type': 'text', 'text': 'r'}]"}
    ]
    # a system message's tool_addition / tool_removal rewrite the tools (L745-788)
    changed = edge.to_chat(
        {
            **base,
            "tools": TOOLS + [{"name": "other", "input_schema": {}}],
            "messages": [
                {
                    "role": "system",
                    "content": [
                        {
                            "type": "tool_removal",
                            "tool": {"type": "tool_reference", "name": "lookup"},
                        }
                    ],
                },
                {"role": "user", "content": "q"},
            ],
        }
    )
    assert [t["function"]["name"] for t in changed["tools"]] == ["other"]
    # the gateway's own conversation_id goes on (gateway.parse takes it off before P and D)
    assert edge.to_chat({**base, "conversation_id": "c1"})["conversation_id"] == "c1"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": "m", "messages": []}, "max_tokens"),
        ({"model": "m", "max_tokens": 0, "messages": []}, "max_tokens"),
        ({"max_tokens": 5, "messages": []}, "model"),
        (
            {"model": "m", "max_tokens": 5, "messages": [{"role": "bot", "content": "x"}]},
            "messages.0.role",
        ),
        (
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": [{"type": "video"}]}],
            },
            "messages.0.content.0.type",
        ),
        (
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [
                    {"role": "user", "content": [{"type": "tool_use", "input": "not an object"}]}
                ],
            },
            "messages.0.content.0.input",
        ),
        (
            {"model": "m", "max_tokens": 5, "messages": [], "tools": [{"name": "t"}]},
            "tools.0.input_schema",
        ),
        (
            {
                "model": "m",
                "max_tokens": 2000,
                "messages": [],
                "thinking": {"type": "enabled", "budget_tokens": 4000},
            },
            "thinking.budget_tokens",
        ),
        (
            {"model": "m", "max_tokens": 5, "messages": [], "stop_sequences": ["a"] * 5},
            "stop_sequences",
        ),
        # A tool_result's own items (they were a 500: a source that is no object, a text no string)
        (
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "tool_result",
                                "tool_use_id": "t",
                                "content": [{"type": "image", "source": "x"}],
                            }
                        ],
                    }
                ],
            },
            "messages.0.content.0.content.0.source",
        ),
        (
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "tool_result",
                                "tool_use_id": "t",
                                "content": [{"type": "text", "text": 5}],
                            }
                        ],
                    }
                ],
            },
            "messages.0.content.0.content.0.text",
        ),
    ],
)
def test_a_bad_body_is_a_400_in_anthropics_envelope(client, body, param):
    reply = client.post(MESSAGES, json=body)
    assert reply.status_code == 400
    error = reply.get_json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"].startswith(param) or param in error["error"]["message"]


def test_not_json_is_a_400_in_anthropics_envelope(client):
    reply = client.post(MESSAGES, data=b"{not json", content_type="application/json")
    assert reply.status_code == 400
    assert reply.get_json()["error"]["type"] == "invalid_request_error"


# --- through the flow, the engines pinned -----------------------------------------------------


def d_message_body(params, tool=True):
    reply = {"role": "assistant", "content": "calling"}
    if tool:
        reply.update(
            reasoning="let me see",
            tool_calls=[
                {
                    "id": "call-1",
                    "type": "function",
                    "function": {"name": "lookup", "arguments": '{"q": "kv"}'},
                }
            ],
        )
    return {
        "id": "chatcmpl-d",
        "object": "chat.completion",
        "created": 5,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": reply,
                "logprobs": None,
                "finish_reason": "tool_calls" if tool else "stop",
                "stop_reason": None,
            }
        ],
        "usage": {"prompt_tokens": 20, "completion_tokens": 3, "total_tokens": 23},
        "kv_transfer_params": params,
    }


@responses.activate
def test_a_reply_of_thinking_and_a_tool_call_is_anthropics_message(client):
    responses.post(P_URL + CHAT, json=p_reply(p_params(1)))
    responses.post(D_URL + CHAT, json=d_message_body(d_params(1)))
    reply = client.post(
        MESSAGES,
        json={
            "model": "m",
            "max_tokens": 8,
            "tools": TOOLS,
            "messages": [{"role": "user", "content": "hi"}],
        },
    )
    message = reply.get_json()
    assert len(message["content"][0].pop("signature")) == 32
    assert message == {
        "id": "chatcmpl-d",
        "type": "message",
        "role": "assistant",
        "model": "m",
        "content": [
            {"type": "thinking", "thinking": "let me see"},
            {"type": "text", "text": "calling"},
            {"type": "tool_use", "id": "call-1", "name": "lookup", "input": {"q": "kv"}},
        ],
        "stop_reason": "tool_use",
        "usage": {"input_tokens": 20, "output_tokens": 3},
    }


def test_the_identity_of_a_turn_extends_the_last_with_its_reply_echoed():
    """Turn N+1 converted extends turn N converted plus the reply as the flow keeps it (D's chat
    message), when the client echoes the reply in Anthropic's form: the entry is found."""
    body = {
        "model": "m",
        "max_tokens": 8,
        "system": SYSTEM,
        "tools": TOOLS,
        "messages": [{"role": "user", "content": "hi"}],
    }
    decoded = Decoded()
    decoded.absorb_body(d_message_body(d_params(1)))
    key, digest, length = identify(edge.to_chat(body), {}, None).after(decoded.reply_message())
    reply = edge.message(d_message_body(d_params(1)))
    for echoed in (
        reply["content"],  # as it came, signature and all
        [b for b in reply["content"] if b["type"] != "thinking"],
    ):  # thinking left
        turn2 = {
            **body,
            "messages": body["messages"]
            + [
                {"role": "assistant", "content": echoed},
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "call-1", "content": "found it"}
                    ],
                },
            ],
        }
        identity = identify(edge.to_chat(turn2), {}, None)
        assert key in identity.lookups()
        assert identity.extends(digest, length)


@responses.activate
def test_a_message_runs_as_chat_on_p_and_d_and_its_next_turn_reads_ds_blocks(client):
    body = {
        "model": "m",
        "max_tokens": 32,
        "system": SYSTEM,
        "tools": TOOLS,
        "stop_sequences": ["END"],
        "cache_salt": "salt-1",
        "messages": [{"role": "user", "content": "hi there"}],
    }
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    tools = [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "description": "look it up",
                "parameters": {"properties": {"q": {"type": "string"}}, "type": "object"},
            },
        }
    ]
    common = {
        "model": "m",
        "stop": ["END"],
        "cache_salt": "salt-1",
        "tools": tools,
        "tool_choice": "auto",
    }
    responses.post(
        P_URL + CHAT,
        json=p_reply(p_params(1)),
        match=[
            matchers.json_params_matcher(
                {
                    **common,
                    "messages": chat,
                    "max_tokens": 1,
                    "stream": False,
                    "kv_transfer_params": MISS,
                }
            )
        ],
    )
    responses.post(
        D_URL + CHAT,
        json=d_message_body(d_params(1), tool=False),
        match=[
            matchers.json_params_matcher(
                {
                    **common,
                    "messages": chat,
                    "max_tokens": 32,
                    "max_completion_tokens": 32,
                    "kv_transfer_params": {**p_params(1), "remote_host": "10.9.0.1"},
                }
            )
        ],
    )
    reply = client.post(MESSAGES, json=body)
    assert reply.status_code == 200, reply.data
    assert reply.headers["X-Gateway-Cache"] == "miss"
    message = reply.get_json()
    assert message == {
        "id": "chatcmpl-d",
        "type": "message",
        "role": "assistant",
        "model": "m",
        "content": [{"type": "text", "text": "calling"}],
        "stop_reason": "end_turn",
        "usage": {"input_tokens": 20, "output_tokens": 3},
    }

    # Turn 2, no id: the reply echoed as the SDK keeps it. (A reply that reasoned or called a
    # tool is reused only once its tokens are verified, which this app has off: the identity
    # of those is test_the_identity_of_a_turn_extends_the_last_with_its_reply_echoed's.)
    turn2 = body["messages"] + [
        {"role": "assistant", "content": message["content"]},
        {"role": "user", "content": "go on"},
    ]
    chat2 = chat + [
        {"role": "assistant", "content": "calling"},
        {"role": "user", "content": "go on"},
    ]
    responses.post(
        P_URL + CHAT,
        json=p_reply(p_params(2)),
        match=[
            matchers.json_params_matcher(
                {
                    **common,
                    "messages": chat2,
                    "max_tokens": 1,
                    "stream": False,
                    "kv_transfer_params": {
                        **d_params(1),
                        "remote_host": "10.9.0.2",
                        "do_remote_decode": True,
                        "do_remote_prefill": False,
                    },
                }
            )
        ],
    )
    responses.post(
        D_URL + CHAT,
        json={
            **d_message_body(d_params(2)),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "done END"},
                    "finish_reason": "stop",
                    "stop_reason": "END",
                }
            ],
        },
    )
    reply = client.post(MESSAGES, json={**body, "messages": turn2})
    assert reply.status_code == 200, reply.data
    assert reply.headers["X-Gateway-Cache"] == "hit"
    message = reply.get_json()
    assert message["content"] == [{"type": "text", "text": "done END"}]
    assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", "END")


def chat_stream(params, reasoning="hmm"):
    usage = {"prompt_tokens": 20, "completion_tokens": 0, "total_tokens": 20}
    return sse(
        {
            "id": "c",
            "model": "m",
            "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            ],
            "usage": usage,
        },
        {
            "id": "c",
            "model": "m",
            "choices": [{"index": 0, "delta": {"reasoning": reasoning}, "finish_reason": None}],
            "usage": usage,
        },
        {
            "id": "c",
            "model": "m",
            "choices": [{"index": 0, "delta": {"content": "hello"}, "finish_reason": None}],
            "usage": usage,
        },
        {
            "id": "c",
            "model": "m",
            "choices": [{"index": 0, "delta": {"content": " world"}, "finish_reason": None}],
            "usage": usage,
        },
        {
            "id": "c",
            "model": "m",
            "choices": [{"index": 0, "delta": {}, "finish_reason": "stop", "stop_reason": None}],
            "usage": usage,
            "kv_transfer_params": params,
        },
        {
            "id": "c",
            "model": "m",
            "choices": [],
            "usage": {"prompt_tokens": 20, "completion_tokens": 4, "total_tokens": 24},
        },
        b"[DONE]",
    )


@responses.activate
def test_a_streamed_message_is_anthropics_event_stream(client):
    body = {
        "model": "m",
        "max_tokens": 16,
        "stream": True,
        "messages": [{"role": "user", "content": "hi there"}],
    }
    chat = [{"role": "user", "content": "hi there"}]
    responses.post(
        P_URL + CHAT,
        json=p_reply(p_params(1)),
        match=[
            matchers.json_params_matcher(
                {
                    "model": "m",
                    "messages": chat,
                    "max_tokens": 1,
                    "stream": False,
                    "kv_transfer_params": MISS,
                }
            )
        ],
    )
    responses.post(
        D_URL + CHAT,
        body=chat_stream(d_params(1)),
        content_type="text/event-stream",
        match=[
            matchers.json_params_matcher(
                {
                    "model": "m",
                    "messages": chat,
                    "max_tokens": 16,
                    "max_completion_tokens": 16,
                    "stream": True,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                    "kv_transfer_params": {**p_params(1), "remote_host": "10.9.0.1"},
                }
            )
        ],
    )
    from prometheus_client import REGISTRY

    def count(name: str, **labels) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    before = (
        count("pd_gateway_client_disconnects_total"),
        count("pd_gateway_e2e_request_latency_seconds_count", model="unknown"),
    )
    reply = client.post(MESSAGES, json=body)
    assert reply.status_code == 200
    assert reply.content_type.startswith("text/event-stream")
    assert b"kv_transfer_params" not in reply.data
    reply.close()  # the server's close of the reply: the relay's end
    # A completed turn, as a chat stream's: no disconnect, timed end to end (the converter
    # stops reading at [DONE]; that was counted a client gone).
    assert (
        count("pd_gateway_client_disconnects_total") - before[0],
        count("pd_gateway_e2e_request_latency_seconds_count", model="unknown") - before[1],
    ) == (0, 1)
    events = anthropic_events(reply.data)
    signature = events[3][1]["delta"].pop("signature")
    assert len(signature) == 32
    assert events == [
        (
            "message_start",
            {
                "type": "message_start",
                "message": {
                    "id": "c",
                    "type": "message",
                    "role": "assistant",
                    "content": [],
                    "model": "m",
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": {"input_tokens": 20, "output_tokens": 0},
                },
            },
        ),
        (
            "content_block_start",
            {
                "type": "content_block_start",
                "content_block": {"type": "thinking", "thinking": ""},
                "index": 0,
            },
        ),
        (
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "thinking_delta", "thinking": "hmm"},
            },
        ),
        (
            "content_block_delta",
            {"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta"}},
        ),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        (
            "content_block_start",
            {
                "type": "content_block_start",
                "content_block": {"type": "text", "text": ""},
                "index": 1,
            },
        ),
        (
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": 1,
                "delta": {"type": "text_delta", "text": "hello"},
            },
        ),
        (
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": 1,
                "delta": {"type": "text_delta", "text": " world"},
            },
        ),
        ("content_block_stop", {"type": "content_block_stop", "index": 1}),
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                "usage": {"input_tokens": 20, "output_tokens": 4},
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    ]


@responses.activate
def test_a_streamed_turns_next_turn_reads_ds_blocks(client):
    body = {
        "model": "m",
        "max_tokens": 16,
        "stream": True,
        "messages": [{"role": "user", "content": "hi there"}],
    }
    chat = [{"role": "user", "content": "hi there"}]
    responses.post(P_URL + CHAT, json=p_reply(p_params(1)))
    responses.post(
        D_URL + CHAT, body=chat_stream(d_params(1), reasoning=""), content_type="text/event-stream"
    )
    reply = client.post(MESSAGES, json=body)
    assert [name for name, _ in anthropic_events(reply.data)].count("content_block_start") == 1
    turn2 = body["messages"] + [
        {"role": "assistant", "content": [{"type": "text", "text": "hello world"}]},
        {"role": "user", "content": "more"},
    ]
    responses.post(
        P_URL + CHAT,
        json=p_reply(p_params(2)),
        match=[
            matchers.json_params_matcher(
                {
                    "model": "m",
                    "max_tokens": 1,
                    "stream": False,
                    "messages": chat
                    + [
                        {"role": "assistant", "content": "hello world"},
                        {"role": "user", "content": "more"},
                    ],
                    "kv_transfer_params": {
                        **d_params(1),
                        "remote_host": "10.9.0.2",
                        "do_remote_decode": True,
                        "do_remote_prefill": False,
                    },
                }
            )
        ],
    )
    responses.post(D_URL + CHAT, body=chat_stream(d_params(2)), content_type="text/event-stream")
    reply = client.post(MESSAGES, json={**body, "messages": turn2})
    assert reply.headers["X-Gateway-Cache"] == "hit"
    assert anthropic_events(reply.data)[-1][0] == "message_stop"


@responses.activate
def test_a_stream_that_fails_midway_ends_with_anthropics_error_event(client):
    responses.post(P_URL + CHAT, json=p_reply(p_params(1)))
    cut = chat_stream(d_params(1)).split(b"\n\n")
    responses.post(
        D_URL + CHAT, body=b"\n\n".join(cut[:3]) + b"\n\n", content_type="text/event-stream"
    )
    reply = client.post(
        MESSAGES,
        json={
            "model": "m",
            "max_tokens": 16,
            "stream": True,
            "messages": [{"role": "user", "content": "hi"}],
        },
    )
    assert reply.status_code == 200
    events = anthropic_events(reply.data)
    assert [name for name, _ in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "error",
    ]  # the open block stopped first (L1228-1231)
    assert events[-1][1]["error"]["type"] == "api_error"
    assert "ended the stream" in events[-1][1]["error"]["message"]


@responses.activate
def test_an_engines_refusal_is_in_anthropics_envelope(client):
    responses.post(
        P_URL + CHAT,
        status=404,
        json={
            "error": {
                "message": "The model `other` does not exist.",
                "type": "NotFoundError",
                "code": 404,
            }
        },
    )
    reply = client.post(
        MESSAGES,
        json={"model": "other", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert reply.status_code == 404
    assert reply.get_json() == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "The model `other` does not exist."},
    }


@pytest.fixture
def keyed(store):
    app = create_app(
        Settings(
            prefill=[P_URL],
            decode=[D_URL],
            worker_class="gthread",
            threads=8,
            max_body_bytes=4096,
            verify_reuse="off",
            release_rate=0,
            engine_metrics_interval=0,
            probe_interval=0,
            api_keys=["sk-good"],
        ),
        store=store,
        transport=ResponsesTransport(),
    )
    yield app.test_client()
    app.extensions["pd_gateway"].close()


@responses.activate
def test_the_key_comes_as_x_api_key_and_a_tenant_is_the_same_either_way(keyed):
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    reply = keyed.post(MESSAGES, json=body)
    assert reply.status_code == 401
    assert reply.get_json()["error"]["type"] == "authentication_error"
    assert keyed.post(MESSAGES, json=body, headers={"x-api-key": "sk-bad"}).status_code == 401
    responses.post(P_URL + CHAT, json=p_reply(p_params(1)))
    responses.post(
        D_URL + CHAT,
        json={
            **d_message_body(d_params(1)),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "yo"},
                    "finish_reason": "stop",
                }
            ],
        },
    )
    reply = keyed.post(
        MESSAGES, json=body, headers={"x-api-key": "sk-good", "anthropic-version": "2023-06-01"}
    )
    assert reply.status_code == 200, reply.data
    # the key's own tenant salt, as a Bearer key's: one tenant whichever header carries it
    salt = json.loads(responses.calls[0].request.body)["cache_salt"]
    responses.post(P_URL + CHAT, json=p_reply(p_params(2)))
    responses.post(
        D_URL + CHAT,
        json={
            **d_message_body(d_params(2)),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "yo"},
                    "finish_reason": "stop",
                }
            ],
        },
    )
    assert (
        keyed.post(MESSAGES, json=body, headers={"Authorization": "Bearer sk-good"}).status_code
        == 200
    )
    assert json.loads(responses.calls[2].request.body)["cache_salt"] == salt
    # count_tokens, passed through, takes the SDK's x-api-key too, and refuses in Anthropic's
    # envelope
    count = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    refused = keyed.post("/v1/messages/count_tokens", json=count, headers={"x-api-key": "bad"})
    assert refused.status_code == 401 and refused.get_json()["type"] == "error"
    responses.post(P_URL + "/v1/messages/count_tokens", json={"input_tokens": 7})
    responses.post(D_URL + "/v1/messages/count_tokens", json={"input_tokens": 7})
    counted = keyed.post("/v1/messages/count_tokens", json=count, headers={"x-api-key": "sk-good"})
    assert counted.status_code == 200 and counted.get_json() == {"input_tokens": 7}


# --- the anthropic SDK through a gateway under gunicorn to the emulator ------------------------

TURNS = 4
# A system prompt long enough that P reading D's blocks is most of each later turn's prompt.
LONG_SYSTEM = " ".join(f"rule {i}: answer about kv blocks plainly." for i in range(60))


def sdk(gateway, key: str = "test-key"):
    from anthropic import Anthropic

    return Anthropic(base_url=gateway.url, api_key=key, max_retries=0)


@pytest.fixture
@starts_processes
def gateway(fresh_engines, gateway_factory):
    p, d = fresh_engines
    return gateway_factory([p.url], [d.url])


def converse(client, stream: bool, turns: int = TURNS, **extra) -> list[tuple[str, str, object]]:
    """A conversation sent with no id: each turn echoes the last reply as the SDK returned it.
    Returns each turn's (X-Gateway-Cache, X-Gateway-KV, message)."""
    messages = [{"role": "user", "content": f"first question {uuid.uuid4().hex}"}]
    out = []
    for turn in range(turns):
        args = dict(model=MODEL, max_tokens=24, system=LONG_SYSTEM, messages=messages, **extra)
        if stream:
            with client.messages.stream(**args) as events:
                message = events.get_final_message()
                headers = events.response.headers
        else:
            raw = client.messages.with_raw_response.create(**args)
            message, headers = raw.parse(), raw.headers
        out.append((headers["X-Gateway-Cache"], headers["X-Gateway-KV"], message))
        messages = messages + [
            {"role": "assistant", "content": message.content},
            {"role": "user", "content": _next(message, turn)},
        ]
    return out


def _next(message, turn: int):
    calls = [block for block in message.content if block.type == "tool_use"]
    if calls:
        return [
            {"type": "tool_result", "tool_use_id": call.id, "content": f"result {turn}"}
            for call in calls
        ]
    return f"follow up number {turn}"


@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
def test_later_turns_sent_with_no_id_make_p_read_ds_blocks(gateway, fresh_engines, stream):
    p, d = fresh_engines
    reads = gateway.metric("pd_gateway_kv_reads_total", result="read")
    turns = converse(sdk(gateway), stream)
    assert [(cache, kv) for cache, kv, _ in turns] == [("miss", "none")] + [("hit", "read")] * 3
    for _, _, message in turns:
        assert message.type == "message" and message.role == "assistant"
        assert message.content[0].type == "text" and message.content[0].text
        assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 24
    assert p.stats()["hits"] == TURNS - 1
    assert p.stats()["wrong_reuse"] == 0 and d.stats()["wrong_reuse"] == 0
    assert gateway.metric("pd_gateway_kv_reads_total", result="read") - reads == TURNS - 1
    assert gateway.metric("pd_gateway_requests_total", endpoint="/v1/messages") >= TURNS


def test_errors_are_anthropics(gateway):
    import anthropic

    client = sdk(gateway)
    with pytest.raises(anthropic.NotFoundError) as found:
        client.messages.create(
            model="no-such-model", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    assert found.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(
            model=MODEL, max_tokens=0, messages=[{"role": "user", "content": "hi"}]
        )
    assert bad.value.body == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "max_tokens: max_tokens must be positive",
        },
    }


def test_the_sdks_x_api_key_is_the_clients_key(fresh_engines, gateway_factory):
    import anthropic

    p, d = fresh_engines
    gateway = gateway_factory([p.url], [d.url], api_keys="sk-messages")
    with pytest.raises(anthropic.AuthenticationError):
        sdk(gateway, "sk-wrong").messages.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    message = sdk(gateway, "sk-messages").messages.create(
        model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}]
    )
    assert message.usage.output_tokens == 4


@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
def test_thinking_and_tool_use_turns_read_ds_blocks(agent_engines, gateway_factory, stream):
    p, d = reset(agent_engines)
    gateway = gateway_factory([p.url], [d.url])
    tools = [
        {
            "name": "lookup",
            "description": "look something up",
            "input_schema": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
            },
        }
    ]
    turns = converse(sdk(gateway), stream, tools=tools)
    for _, _, message in turns:
        kinds = [block.type for block in message.content]
        assert kinds[0] == "thinking" and message.content[0].signature
        assert "tool_use" in kinds and message.stop_reason == "tool_use"
    assert [cache for cache, _, _ in turns] == ["miss"] + ["hit"] * 3
    assert p.stats()["hits"] == TURNS - 1
    assert p.stats()["wrong_reuse"] == 0 and d.stats()["wrong_reuse"] == 0
