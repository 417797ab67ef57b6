"""OpenAI's Responses API through a real gateway (gunicorn) to the emulated engines, with the
openai SDK's client.responses: stateless and chained by previous_response_id, streamed and not,
later turns reading the blocks D kept; an agent loop of function calls; GET, cancel, DELETE;
the 400s and 404s; tenants apart; the chain in Redis."""

from __future__ import annotations

import uuid

import openai
import pytest
import requests
from openai import OpenAI

from tests.helpers.servers import MODEL, metric, reset, starts_processes

LONG = {"max_output_tokens": 12}
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    }
]


@pytest.fixture
@starts_processes
def gateway(fresh_engines, gateway_factory):
    p, d = fresh_engines
    return gateway_factory([p.url], [d.url])


def client_of(gateway, key: str = "tenant-a") -> OpenAI:
    return OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)


def create(client: OpenAI, **body):
    """One request; (the Response, X-Gateway-Cache, X-Gateway-KV)."""
    raw = client.responses.with_raw_response.create(model=MODEL, **{**LONG, **body})
    return raw.parse(), raw.headers["X-Gateway-Cache"], raw.headers["X-Gateway-KV"]


def streamed(client: OpenAI, **body):
    """A streamed request: (its events' types, the final Response, X-Gateway-Cache)."""
    raw = client.responses.with_raw_response.create(model=MODEL, stream=True, **{**LONG, **body})
    events = list(raw.parse())
    return [e.type for e in events], events[-1].response, raw.headers["X-Gateway-Cache"]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_chain_by_previous_response_id_reads_ds_blocks(gateway, fresh_engines, stream):
    p, _ = fresh_engines
    client = client_of(gateway)
    reads = metric(gateway, "pd_gateway_kv_reads_total", result="read")
    hits = metric(gateway, "pd_gateway_requests_total", endpoint="/v1/responses", cache="hit")
    previous, caches = None, []
    for turn in range(4):
        body = dict(
            input=f"turn {turn} of {uuid.uuid4().hex}",
            instructions="short answers",
            previous_response_id=previous,
        )
        if stream:
            types, response, cache = streamed(client, **body)
            assert types[:2] == ["response.created", "response.in_progress"]
            assert types[-1] in ("response.completed", "response.incomplete")
        else:
            response, cache, kv = create(client, **body)
        assert response.id.startswith("resp_") and response.output_text
        caches.append(cache)
        previous = response.id
    print(
        f"\nchained ({'stream' if stream else 'json'}): caches {caches}, P hits {p.stats()['hits']}"
    )
    assert caches == ["miss", "hit", "hit", "hit"]
    assert p.stats()["hits"] == 3 and p.stats()["wrong_reuse"] == 0
    assert metric(gateway, "pd_gateway_kv_reads_total", result="read") - reads == 3
    assert (
        metric(gateway, "pd_gateway_requests_total", endpoint="/v1/responses", cache="hit") - hits
        == 3
    )


def test_the_stream_is_in_openais_order(gateway):
    types, response, _ = streamed(client_of(gateway), input="say something", store=False)
    text = [t for t in types if t.startswith("response.output_text.delta")]
    assert text and types == (
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
        ]
        + text
        + [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            types[-1],
        ]
    )
    assert types[-1] in ("response.completed", "response.incomplete")
    assert response.usage.input_tokens > 0 and response.usage.output_tokens > 0


def test_a_failure_mid_stream_ends_it_with_response_failed(gateway, fresh_engines):
    _, d = fresh_engines
    d.set_fault("die_after", tokens=2, count=1)
    types, last, _ = streamed(client_of(gateway), input="this one breaks", store=False)
    assert types[:2] == ["response.created", "response.in_progress"]
    assert "response.output_text.delta" in types
    assert types[-2:] == ["error", "response.failed"]
    assert last.status == "failed" and last.error.message


def test_stateless_input_carrying_the_conversation_hits(gateway, fresh_engines):
    p, _ = fresh_engines
    client = client_of(gateway)
    items: list = [{"role": "user", "content": f"stateless {uuid.uuid4().hex}"}]
    caches = []
    for turn in range(3):
        response, cache, _ = create(client, input=items, store=False)
        caches.append(cache)
        items += [o.model_dump(exclude_none=True) for o in response.output]
        items.append({"role": "user", "content": [{"type": "input_text", "text": f"q{turn}"}]})
    assert caches == ["miss", "hit", "hit"]
    assert p.stats()["hits"] == 2 and p.stats()["wrong_reuse"] == 0
    # Nothing kept: store false.
    assert (
        requests.get(
            f"{gateway.url}/v1/responses/{response.id}",
            timeout=10,
            headers={"Authorization": "Bearer tenant-a"},
        ).status_code
        == 404
    )


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_an_agent_loop_of_function_calls(agent_engines, gateway_factory, stream):
    p, d = reset(agent_engines)
    p.reset_stats()
    gateway = gateway_factory([p.url], [d.url])
    client = client_of(gateway)
    ask = (
        (lambda **body: streamed(client, max_output_tokens=64, **body)[1:])
        if stream
        else (lambda **body: create(client, max_output_tokens=64, **body)[:2])
    )
    response, cache = ask(input=f"What is the weather in Paris? {uuid.uuid4().hex}", tools=TOOLS)
    caches = [cache]
    for turn in range(3):
        kinds = [o.type for o in response.output]
        assert kinds == ["reasoning", "function_call"], kinds
        call = response.output[1]
        assert call.name == "get_weather" and call.call_id and call.arguments
        # The function's result, chained: the call stays in the prompt, D's blocks are read.
        response, cache = ask(
            previous_response_id=response.id,
            tools=TOOLS,
            input=[
                {
                    "type": "function_call_output",
                    "call_id": call.call_id,
                    "output": f"sunny, {20 + turn} C",
                }
            ],
        )
        caches.append(cache)
    assert caches == ["miss", "hit", "hit", "hit"]
    assert p.stats()["hits"] == 3 and p.stats()["wrong_reuse"] == 0


def test_get_cancel_and_delete_a_stored_response(gateway):
    client = client_of(gateway)
    response, _, _ = create(client, input="keep this one")
    again = client.responses.retrieve(response.id)
    assert again.id == response.id and again.output_text == response.output_text
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response"):
        client.responses.cancel(response.id)
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_bad_bodies_are_400_and_unknown_ids_404(gateway):
    client = client_of(gateway)
    cases = [
        {"model": MODEL},
        {"model": MODEL, "input": 5},
        {"model": MODEL, "input": [{"type": "file_search_call"}]},
        {"model": MODEL, "input": "x", "tool_choice": "required"},
        {"model": MODEL, "input": "x", "no_such_field": 1},
    ]
    for body in cases:
        reply = requests.post(gateway.url + "/v1/responses", json=body, timeout=10)
        assert reply.status_code == 400, (body, reply.text)
        assert reply.json()["error"]["type"] == "invalid_request_error"
    reply = requests.post(gateway.url + "/v1/responses", data=b"{not json", timeout=10)
    assert reply.status_code == 400
    with pytest.raises(openai.NotFoundError, match="not found"):
        create(client, input="x", previous_response_id="resp_nosuch")
    for call in (client.responses.retrieve, client.responses.cancel, client.responses.delete):
        with pytest.raises(openai.NotFoundError):
            call("resp_nosuch")


def test_tenants_cannot_read_each_others_responses(fresh_engines, gateway_factory, tmp_path):
    p, d = fresh_engines
    keys = tmp_path / "keys"
    keys.write_text("key-alpha\nkey-beta\n")
    gateway = gateway_factory([p.url], [d.url], api_keys_file=str(keys))
    alpha, beta = client_of(gateway, "key-alpha"), client_of(gateway, "key-beta")
    response, _, _ = create(alpha, input="alpha's secret")
    assert alpha.responses.retrieve(response.id).id == response.id
    with pytest.raises(openai.NotFoundError):
        beta.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        create(beta, input="continue", previous_response_id=response.id)
    with pytest.raises(openai.AuthenticationError):
        client_of(gateway, "key-none").responses.retrieve(response.id)


def test_the_chain_in_redis(fresh_engines, gateway_factory, redis_server):
    p, d = fresh_engines
    gateway = gateway_factory([p.url], [d.url], store=redis_server.url)
    client = client_of(gateway)
    previous, caches = None, []
    for turn in range(3):
        response, cache, _ = create(
            client, input=f"redis turn {turn} {uuid.uuid4().hex}", previous_response_id=previous
        )
        caches.append(cache)
        previous = response.id
    assert caches == ["miss", "hit", "hit"] and p.stats()["hits"] == 2
    assert client.responses.retrieve(previous).output_text == response.output_text


def test_several_workers_with_a_local_store_keep_each_chain_in_one(fresh_engines, gateway_factory):
    """Each request naming a response goes to the worker that keeps its chain, whichever
    worker the kernel gave the connection to."""
    p, d = fresh_engines
    gateway = gateway_factory([p.url], [d.url], workers=3)
    chains = []
    for n in range(4):
        previous, caches = None, []
        for turn in range(4):
            client = client_of(gateway, f"key-{n}")  # a new connection: any worker's
            response, cache, _ = create(
                client,
                input=f"chain {n} turn {turn} {uuid.uuid4().hex}",
                previous_response_id=previous,
            )
            caches.append(cache)
            previous = response.id
        chains.append((client, previous, caches))
    assert [caches for _, _, caches in chains] == [["miss", "hit", "hit", "hit"]] * 4
    assert p.stats()["hits"] == 12 and p.stats()["wrong_reuse"] == 0
    for client, last, _ in chains:
        for _ in range(4):
            assert client_of(gateway, client.api_key).responses.retrieve(last).id == last
        client.responses.delete(last)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(last)
