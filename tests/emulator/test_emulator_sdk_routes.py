"""/v1/messages and /v1/responses with the real clients (the anthropic and openai SDKs) against
engine processes, and a P/D turn on each route as a gateway would run it."""

from __future__ import annotations

import uuid

import anthropic
import openai
import pytest
import requests

from emulator.process import EmulatorProcess
from tests.helpers.emulator import STUB, parse_sse
from tests.helpers.servers import starts_processes

pytestmark = pytest.mark.processes  # engine processes, every test

TOOLS = [
    {
        "name": "lookup",
        "description": "find a thing",
        "input_schema": {"type": "object", "properties": {"query": {"type": "string"}}},
    }
]
FUNCTION = [
    {
        "type": "function",
        "name": "lookup",
        "description": "find a thing",
        "parameters": TOOLS[0]["input_schema"],
    }
]


@pytest.fixture(scope="module")
@starts_processes
def engine():
    # Every reply to a request with tools is a call; the store on
    # (VLLM_ENABLE_RESPONSES_API_STORE=1).
    with EmulatorProcess(
        "decode", itl_ms=1, output_tokens=6, tool_call_share=1.0, responses_api_store=True
    ) as process:
        yield process


def fresh(text: str = "explain bidirectional kv transfer") -> str:
    return f"session {uuid.uuid4().hex} {text}"


@pytest.fixture
def claude(engine):
    return anthropic.Anthropic(base_url=engine.url, api_key="unused", max_retries=0)


@pytest.fixture
def oai(engine):
    return openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0)


def test_anthropic_sdk_message_and_stream(claude):
    prompt = [{"role": "user", "content": fresh()}]
    system = [{"type": "text", "text": "be terse"}]
    message = claude.messages.create(
        model="emulated-model", max_tokens=8, system=system, messages=prompt
    )
    assert message.type == "message" and message.stop_reason == "max_tokens"
    assert len(message.content[0].text.split()) == 8 and message.usage.output_tokens == 8
    assert (
        claude.messages.count_tokens(
            model="emulated-model", system=system, messages=prompt
        ).input_tokens
        == message.usage.input_tokens
    )
    with claude.messages.stream(
        model="emulated-model", max_tokens=8, system=system, messages=prompt
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].text == message.content[0].text and final.usage.output_tokens == 8
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"


def test_anthropic_sdk_tool_use_then_tool_result(claude):
    prompt = [{"role": "user", "content": fresh("look it up")}]
    with claude.messages.stream(
        model="emulated-model", max_tokens=200, tools=TOOLS, messages=prompt
    ) as stream:
        streamed = stream.get_final_message()
    (call,) = streamed.content
    assert (
        call.type == "tool_use" and call.name == "lookup" and set(call.input) == {"query", "limit"}
    )
    assert streamed.stop_reason == "tool_use"
    message = claude.messages.create(
        model="emulated-model", max_tokens=200, tools=TOOLS, messages=prompt
    )
    assert message.content[0].input == call.input
    history = [
        *prompt,
        {"role": "assistant", "content": [call.model_dump(exclude_none=True)]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "42"}],
        },
    ]
    reply = claude.messages.create(
        model="emulated-model",
        max_tokens=5,
        tools=TOOLS,
        tool_choice={"type": "none"},
        messages=history,
    )
    assert reply.content[0].type == "text" and reply.stop_reason == "max_tokens"
    assert reply.usage.input_tokens > message.usage.input_tokens


def test_anthropic_sdk_errors(claude):
    prompt = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.create(model="other", max_tokens=5, messages=prompt)
    assert missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(
            model="emulated-model",
            max_tokens=100,
            messages=prompt,
            thinking={"type": "enabled", "budget_tokens": 2048},
        )


def test_openai_sdk_responses_chained_and_streamed(oai):
    question = fresh()
    first = oai.responses.create(model="emulated-model", input=question, instructions="be terse")
    assert first.status == "completed" and len(first.output_text.split()) == 6
    stream = oai.responses.create(
        model="emulated-model",
        input="and then",
        previous_response_id=first.id,
        instructions="be terse",
        stream=True,
    )
    events = list(stream)
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    second = events[-1].response
    # previous_response_id renders what the same history sent whole renders.
    stateless = oai.responses.create(
        model="emulated-model",
        instructions="be terse",
        store=False,
        input=[
            {"role": "user", "content": question},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "and then"},
        ],
    )
    assert stateless.usage.input_tokens == second.usage.input_tokens
    assert stateless.output_text == second.output_text  # same prompt, same words
    assert oai.responses.retrieve(second.id).output_text == second.output_text
    with pytest.raises(openai.BadRequestError):
        oai.responses.cancel(second.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(stateless.id)


def test_openai_sdk_function_call_and_output(oai):
    first = oai.responses.create(model="emulated-model", input=fresh("look it up"), tools=FUNCTION)
    (call,) = first.output
    assert call.type == "function_call" and call.name == "lookup" and call.status == "completed"
    stream = oai.responses.create(
        model="emulated-model", input=fresh("look it up"), tools=FUNCTION, stream=True
    )
    kinds = [event.type for event in stream]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "42 results"}
    chained = oai.responses.create(
        model="emulated-model",
        input=[output],
        previous_response_id=first.id,
        tools=FUNCTION,
        tool_choice="none",
    )
    assert chained.output[0].type == "message" and chained.output_text


def test_messages_prefill_and_decode_legs(pd):
    """A P leg takes the stub and answers its params in the body; a streamed D leg loads from P
    and answers none; a D leg that is not streamed answers D's, which the next turn's P reads."""
    prompt = [{"role": "user", "content": fresh("and a long question " * 8)}]
    body = {"model": "emulated-model", "messages": prompt}
    leg = requests.post(
        pd.p.url + "/v1/messages",
        json={**body, "max_tokens": 1, "kv_transfer_params": STUB},
        timeout=10,
    ).json()
    p_params = {**leg["kv_transfer_params"], "remote_host": pd.p.host}
    assert p_params["do_remote_prefill"] is True
    claude = anthropic.Anthropic(base_url=pd.d.url, api_key="unused", max_retries=0)
    held = pd.d.stats()["kv_leases"]  # other tests' leases live on (480 s)
    raw = requests.post(
        pd.d.url + "/v1/messages",
        json={**body, "max_tokens": 100, "stream": True, "kv_transfer_params": p_params},
        timeout=10,
    ).content
    assert b"kv_transfer_params" not in raw and parse_sse(raw)[-1] == {"type": "message_stop"}
    assert pd.d.stats()["pulled_tokens"] == leg["usage"]["input_tokens"]
    assert pd.d.stats()["kv_leases"] == held + 1  # kept for a next turn no one can name
    # Not streamed: D's params come back, and turn 2's P reads D's blocks.
    leg = requests.post(
        pd.p.url + "/v1/messages",
        json={**body, "max_tokens": 1, "kv_transfer_params": STUB},
        timeout=10,
    ).json()
    reply = claude.messages.create(
        model="emulated-model",
        max_tokens=100,
        messages=prompt,
        extra_body={"kv_transfer_params": {**leg["kv_transfer_params"], "remote_host": pd.p.host}},
    )
    d_params = reply.model_extra["kv_transfer_params"]
    assert d_params["do_remote_decode"] is True
    turn2 = [
        *prompt,
        {"role": "assistant", "content": reply.content[0].text},
        {"role": "user", "content": "more"},
    ]
    pd.p.reset_stats()
    p_in = {
        **d_params,
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_host": pd.d.host,
    }
    assert (
        requests.post(
            pd.p.url + "/v1/messages",
            json={
                "model": "emulated-model",
                "messages": turn2,
                "max_tokens": 1,
                "kv_transfer_params": p_in,
            },
            timeout=10,
        ).status_code
        == 200
    )
    assert pd.p.stats()["hits"] == 1 and pd.p.stats()["wrong_reuse"] == 0


def test_responses_prefill_and_decode_legs(pd):
    """The stream's response.completed carries D's params; turn 2's P reads D's blocks."""
    oai = openai.OpenAI(base_url=pd.p.url + "/v1", api_key="unused", max_retries=0)
    question = fresh("and a long question " * 8)
    leg = oai.responses.create(
        model="emulated-model",
        input=question,
        max_output_tokens=1,
        extra_body={"kv_transfer_params": STUB},
    )
    assert leg.status == "incomplete"
    p_params = {**leg.model_extra["kv_transfer_params"], "remote_host": pd.p.host}
    d = openai.OpenAI(base_url=pd.d.url + "/v1", api_key="unused", max_retries=0)
    events = list(
        d.responses.create(
            model="emulated-model",
            input=question,
            max_output_tokens=100,
            stream=True,
            extra_body={"kv_transfer_params": p_params},
        )
    )
    assert events[0].response.model_extra["kv_transfer_params"] is None
    final = events[-1].response
    d_params = final.model_extra["kv_transfer_params"]
    assert events[-1].type == "response.incomplete" and d_params["do_remote_decode"] is True
    turn2 = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": final.output_text},
        {"role": "user", "content": "more"},
    ]
    pd.p.reset_stats()
    oai.responses.create(
        model="emulated-model",
        input=turn2,
        max_output_tokens=1,
        extra_body={
            "kv_transfer_params": {
                **d_params,
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "remote_host": pd.d.host,
            }
        },
    )
    assert pd.p.stats()["hits"] == 1 and pd.p.stats()["wrong_reuse"] == 0
