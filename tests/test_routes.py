"""vLLM's other routes through the gateway (docs/routes.md): each passed to an engine of its
model as it came (P, D, either, any), the reply relayed as it came, retried before any byte;
the client's key, its limits and the body limit as for completions; vLLM's engine-internal
routes and any unknown path a 404 naming what the gateway serves, under a host's prefix too."""

from __future__ import annotations

import io
import json
import time

import pytest
import requests
import responses
from flask import Flask
from urllib3 import encode_multipart_formdata

from devtools.processes import models_toml
from emulator.other_routes import vector
from emulator.process import EmulatorProcess
from emulator.tokens import VOCAB, token_id
from gateway.app import create_app
from gateway.config import Settings
from gateway.engines.instances import Instance, _weight
from gateway.extension import PDGateway
from gateway.flow.passthrough import ROUTES, form_field
from gateway.support import metrics
from tests.helpers.payloads import D_URL, P_URL
from tests.helpers.servers import MODEL, gateway_process, starts_processes
from tests.helpers.transport import ResponsesTransport

P2_URL = "http://10.9.0.5:8100"
# vLLM 0.33.0's routes the gateway leaves closed (docs/routes.md says where each is).
CLOSED = [
    ("POST", "/sleep"),
    ("POST", "/wake_up"),
    ("GET", "/is_sleeping"),
    ("POST", "/reset_prefix_cache"),
    ("POST", "/collective_rpc"),
    ("POST", "/start_profile"),
    ("POST", "/stop_profile"),
    ("POST", "/update_weights"),
    ("POST", "/scale_elastic_ep"),
    ("GET", "/server_info"),
    ("GET", "/load"),
    ("POST", "/v1/load_lora_adapter"),
    ("POST", "/v1/unload_lora_adapter"),
    ("GET", "/kv_event_sources"),
    ("POST", "/pause"),
    ("POST", "/invocations"),
    ("POST", "/generative_scoring"),
    ("POST", "/inference/v1/generate"),
    ("GET", "/docs"),
    ("GET", "/openapi.json"),
]


def _app(store, **settings):
    base = dict(
        prefill=[P_URL],
        decode=[D_URL],
        worker_class="gthread",
        threads=8,
        max_body_bytes=4096,
        release_rate=0,
        engine_metrics_interval=0,
        probe_interval=0,
    )
    return create_app(Settings(**{**base, **settings}), store=store, transport=ResponsesTransport())


@pytest.fixture
def make_app(store):
    made = []

    def make(**settings):
        made.append(_app(store, **settings))
        return made[-1]

    yield make
    for app in made:
        app.extensions["pd_gateway"].close()


def first_for(urls: list[str], role: str = "prefill") -> str:
    """A request id whose engine of `urls` chosen first is urls[0] (Pool.choose: rendezvous on
    the request id among engines equally idle)."""
    instances = [Instance(url, role, i) for i, url in enumerate(urls)]
    for n in range(1000):
        key = f"req-{n}"
        if max(instances, key=lambda i: _weight(key.encode(), i)).url == urls[0]:
            return key
    raise AssertionError("no such request id")


def form(**fields) -> tuple[bytes, str]:
    """A multipart/form-data body, as the OpenAI SDK sends an audio file."""
    return encode_multipart_formdata(fields)


# --- the table, the wire ----------------------------------------------------------------------


def test_the_passed_routes_are_the_ones_the_metric_declares():
    assert tuple(route.path for route in ROUTES) == metrics.PASSED_ROUTES
    assert {route.role for route in ROUTES} == {"prefill", "decode", "either", "any"}


def test_a_forms_model_is_read_and_renamed_where_it_is():
    body, content_type = form(file=("a.wav", b"model\r\n" * 3), model="alias", stream="true")
    value, where = form_field(body, content_type, "model")
    assert value == "alias"
    renamed = body[: where.start] + b"real" + body[where.stop :]
    assert form_field(renamed, content_type, "model")[0] == "real"
    assert form_field(renamed, content_type, "stream")[0] == "true"
    assert form_field(body, content_type, "file") is None  # a file is not a field
    assert form_field(body, "application/json", "model") is None


@responses.activate
def test_a_passed_request_reaches_the_engine_as_it_came_and_its_reply_the_client(make_app):
    client = make_app().test_client()
    engine_reply = b'{"count":2,"max_model_len":32768,"tokens":[5,6],"token_strs":null}'
    responses.post(P_URL + "/tokenize", body=engine_reply, content_type="application/json")
    sent = b'{"model":"m","prompt":"a b", "extra":  1}'
    reply = client.post(
        "/tokenize",
        data=sent,
        headers={
            "Content-Type": "application/json",
            "X-Request-Id": "tok-1",
            "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        },
    )
    assert (reply.status_code, reply.data) == (200, engine_reply)
    assert reply.content_type == "application/json" and reply.headers["X-Request-Id"] == "tok-1"
    (call,) = responses.calls
    assert call.request.body == sent  # byte for byte, spacing and all
    assert call.request.headers["X-Request-Id"] == "tok-1"
    assert call.request.headers["traceparent"].startswith("00-0af7651916cd43dd8448eb211c80319c-")
    assert call.request.headers["Content-Type"] == "application/json"


@responses.activate
def test_embeddings_as_bytes_keep_the_header_that_says_their_shapes(make_app):
    client = make_app().test_client()
    metadata = '{"model":"m","data":[{"index":0,"shape":[4]}]}'
    responses.post(
        P_URL + "/v1/embeddings",
        body=b"\x00" * 16,
        headers={"metadata": metadata, "server": "uvicorn"},
        content_type="application/octet-stream",
    )
    reply = client.post("/v1/embeddings", json={"input": "x", "encoding_format": "bytes"})
    assert reply.data == b"\x00" * 16 and reply.content_type == "application/octet-stream"
    assert reply.headers["metadata"] == metadata and "uvicorn" not in str(reply.headers)


@responses.activate
def test_the_engines_refusals_are_relayed_and_its_failures_are_the_gateways(make_app):
    client = make_app().test_client()
    refusal = b'{"error":{"message":"bad","type":"BadRequestError","param":null,"code":400}}'
    responses.post(
        P_URL + "/v1/embeddings", body=refusal, status=400, content_type="application/json"
    )
    reply = client.post("/v1/embeddings", json={"input": "x"})
    assert (reply.status_code, reply.data) == (400, refusal)
    responses.replace(
        responses.POST,
        P_URL + "/v1/embeddings",
        status=501,
        json={
            "error": {
                "message": "The model does not support Embeddings API",
                "type": "NotImplementedError",
                "param": None,
                "code": 501,
            }
        },
    )
    assert client.post("/v1/embeddings", json={"input": "x"}).status_code == 501
    # Its own 500 message may name hosts: the client gets the gateway's 502, nothing of it.
    responses.replace(
        responses.POST,
        P_URL + "/v1/embeddings",
        status=500,
        json={"error": {"message": "engine at 10.0.0.9 died"}},
    )
    failed = client.post("/v1/embeddings", json={"input": "x"})
    assert failed.status_code == 502 and "10.0.0.9" not in failed.get_data(as_text=True)
    assert failed.json["error"]["type"] == "upstream_error"


@responses.activate
def test_a_failure_before_any_byte_is_tried_on_another_engine(make_app):
    client = make_app(prefill=[P_URL, P2_URL]).test_client()
    responses.post(P_URL + "/score", status=500, json={"error": {"message": "gone"}})
    responses.post(P2_URL + "/score", json={"object": "list", "data": []})
    reply = client.post(
        "/score",
        json={"queries": "a", "documents": ["b"]},
        headers={"X-Request-Id": first_for([P_URL, P2_URL])},
    )
    assert reply.status_code == 200 and reply.json == {"object": "list", "data": []}
    assert [c.request.url for c in responses.calls] == [P_URL + "/score", P2_URL + "/score"]


@responses.activate
def test_each_route_goes_to_its_role(make_app):
    client = make_app().test_client()
    for url in (P_URL, D_URL):
        for path in ("/v1/embeddings", "/v1/audio/transcriptions", "/detokenize"):
            responses.post(url + path, json={"from": url})
        responses.get(url + "/version", json={"version": url})
    assert client.post("/v1/embeddings", json={"input": "x"}).json == {"from": P_URL}
    body, content_type = form(file=("a.wav", b"\0" * 10), model=MODEL)
    assert client.post("/v1/audio/transcriptions", data=body, content_type=content_type).json == {
        "from": D_URL
    }
    # Either role, or any engine: the least busy pool, all idle here (P's first).
    assert client.post("/detokenize", json={"tokens": [1]}).json == {"from": P_URL}
    assert client.get("/version").json == {"version": P_URL}
    gateway = client.application.extensions["pd_gateway"].gateway
    gateway.prefill.instances[0].inflight = 3  # P busier than D: D's turn
    try:
        assert client.post("/detokenize", json={"tokens": [1]}).json == {"from": D_URL}
    finally:
        gateway.prefill.instances[0].inflight = 0


@responses.activate
def test_a_body_that_is_not_json_too_large_or_naming_no_model_served_is_refused(make_app):
    client = make_app(models=[f"m1;prefill={P_URL};decode={D_URL}"]).test_client()
    bad = client.post("/v1/embeddings", data=b"{", content_type="application/json")
    assert bad.status_code == 400 and bad.json["error"]["type"] == "invalid_request_error"
    assert client.post("/score", json=["a"]).status_code == 400
    assert client.post("/score", json={"model": 7}).json["error"]["param"] == "model"
    large = client.post("/v1/embeddings", json={"input": "x" * 5000})
    assert large.status_code == 413
    unknown = client.post("/v1/embeddings", json={"model": "gpt-4", "input": "x"})
    assert unknown.status_code == 404 and unknown.json["error"]["param"] == "model"
    assert len(responses.calls) == 0


@responses.activate
def test_the_clients_key_guards_the_passed_routes_and_the_engines_get_the_upstream_one(make_app):
    client = make_app(
        api_keys=["key-alpha"], upstream_api_key="engine-key", key_rpm=2
    ).test_client()
    responses.post(P_URL + "/tokenize", json={"tokens": [1]})
    responses.get(P_URL + "/version", json={"version": "0.33.0"})
    for method, path in (("POST", "/tokenize"), ("GET", "/version")):
        refused = client.open(path, method=method, json={} if method == "POST" else None)
        assert refused.status_code == 401, path
    assert len(responses.calls) == 0
    # /ping is vLLM's /health under another name: open, as the gateway's /health is.
    assert client.get("/ping").status_code == 200 and client.post("/ping").status_code == 200
    key = {"Authorization": "Bearer key-alpha"}
    assert client.post("/tokenize", json={"prompt": "a"}, headers=key).status_code == 200
    assert responses.calls[0].request.headers["Authorization"] == "Bearer engine-key"
    version = client.get("/version", headers=key)
    assert version.status_code == 200 and version.headers["x-ratelimit-remaining-requests"] == "0"
    assert client.post("/tokenize", json={"prompt": "a"}, headers=key).status_code == 429


@responses.activate
def test_a_keys_tokens_count_the_text_an_engine_computes(make_app):
    client = make_app(api_keys=["key-alpha"], key_tpm=100).test_client()
    key = {"Authorization": "Bearer key-alpha"}
    responses.post(D_URL + "/v1/audio/transcriptions", json={"text": "hi"})
    responses.post(P_URL + "/v1/embeddings", json={"data": [], "usage": {"prompt_tokens": 60}})
    # An audio file's bytes are not its tokens: 2,000 of them are no 500-token estimate.
    body, content_type = form(file=("a.wav", b"\0" * 2000))
    assert (
        client.post(
            "/v1/audio/transcriptions", data=body, content_type=content_type, headers=key
        ).status_code
        == 200
    )
    # Text is: 400 bytes are 100 tokens until the engine says 60, which is what counts.
    first = client.post("/v1/embeddings", json={"input": "x" * 380}, headers=key)
    assert first.status_code == 200
    assert (
        client.post("/v1/embeddings", json={"input": "x" * 100}, headers=key).status_code == 200
    )  # 61 + 30 <= 100
    refused = client.post("/v1/embeddings", json={"input": "x" * 380}, headers=key)
    assert refused.status_code == 429 and len(responses.calls) == 3


@responses.activate
def test_an_alias_reaches_its_models_engines_under_the_models_name(make_app):
    client = make_app(
        models=[
            f"chat;prefill={P_URL};decode={D_URL}",
            f"speech;prefill={P2_URL};decode=http://10.9.0.6:8200;aliases=whisper",
        ]
    ).test_client()
    responses.post(P2_URL + "/pooling", json={"data": []})
    responses.post("http://10.9.0.6:8200/v1/audio/translations", json={"text": "hi"})
    assert client.post("/pooling", json={"model": "whisper", "input": "x"}).status_code == 200
    assert json.loads(responses.calls[0].request.body) == {"model": "speech", "input": "x"}
    body, content_type = form(model="whisper", file=("a.wav", b"\0" * 10))
    reply = client.post("/v1/audio/translations", data=body, content_type=content_type)
    assert reply.status_code == 200
    sent = responses.calls[1].request
    assert form_field(sent.body, sent.headers["Content-Type"], "model")[0] == "speech"
    assert sent.headers["Content-Length"] == str(len(sent.body))


# --- what the gateway does not serve ------------------------------------------------------------


@responses.activate
@pytest.mark.parametrize("method,path", CLOSED)
def test_vllms_engine_internal_routes_are_closed(client, method, path):
    reply = client.open(path, method=method, json={})
    assert reply.status_code == 404
    message = reply.json["error"]["message"]
    assert message.startswith(f"{method} {path} is not a route of this gateway. It serves ")
    assert "/v1/chat/completions" in message and "/v1/embeddings" in message
    assert "/admin/" not in message
    assert len(responses.calls) == 0


def test_a_wrong_method_on_a_route_is_a_405_naming_the_one_it_takes(client):
    reply = client.get("/v1/embeddings")
    assert reply.status_code == 405 and reply.headers["Allow"] == "POST"
    assert reply.json["error"]["code"] == 405


def _host(prefix):
    host = Flask("host")

    @host.get("/own")
    def own():
        return {"own": True}

    @host.errorhandler(404)
    def not_found(exc):
        return {"host": "not found"}, 404

    PDGateway(
        host,
        url_prefix=prefix,
        engine_metrics_interval=0,
        probe_interval=0,
        prefill=[P_URL],
        decode=[D_URL],
        worker_class="gthread",
        threads=8,
        transport=ResponsesTransport(),
    )
    return host


def test_under_a_prefix_the_gateway_answers_unknown_paths_below_it_only():
    host = _host("/llm")
    client = host.test_client()
    try:
        ours = client.post("/llm/sleep")
        assert ours.status_code == 404
        assert "/llm/v1/embeddings" in ours.json["error"]["message"]
        assert client.get("/llm/").status_code == 404 and client.get("/llm/").json["error"]
        wrong = client.get("/llm/v1/chat/completions")
        assert wrong.status_code == 405 and wrong.headers["Allow"] == "POST"
        for path in ("/sleep", "/llmx", "/own/x"):
            assert client.get(path).json == {"host": "not found"}, path
        assert client.get("/own").json == {"own": True}
        assert client.get("/llm/ping").status_code == 200
    finally:
        host.extensions["pd_gateway"].close()
    root = _host(None)
    try:
        assert root.test_client().get("/sleep").json == {"host": "not found"}
    finally:
        root.extensions["pd_gateway"].close()


# --- real engines ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
@starts_processes
def routed(tmp_path_factory):
    """Two P and a D of the tests' model (D's words 250 ms apart: a stream shows as one), an
    embedding model with one engine as its P and D, and three gateways: the first model's,
    one with client keys, and one of both models (--models-file)."""
    engines = [
        EmulatorProcess("prefill", host="127.0.0.70", itl_ms=1),
        EmulatorProcess("prefill", host="127.0.0.71", itl_ms=1),
        EmulatorProcess("decode", host="127.0.0.72", itl_ms=250),
        EmulatorProcess("prefill", host="127.0.0.73", model="embedder"),
    ]
    p1, p2, d, e = engines
    path = tmp_path_factory.mktemp("routes") / "models.toml"
    path.write_text(
        models_toml(
            **{
                MODEL: {"prefill": [p1.url, p2.url], "decode": [d.url]},
                "embedder": {"prefill": [e.url], "decode": [e.url], "aliases": ["embed"]},
            }
        )
    )
    gateways = []
    try:
        gateways.append(gateway_process([p1.url, p2.url], [d.url]))
        gateways.append(gateway_process([p1.url, p2.url], [d.url], api_keys="key-alpha"))
        gateways.append(gateway_process([], [], models_file=str(path)))
        yield gateways, engines
    finally:
        for gateway in gateways:
            gateway.stop()
        for engine in engines:
            engine.stop()


def _requests_of(engines) -> list[int]:
    return [engine.stats()["other_requests"] for engine in engines]


def test_embeddings_through_the_openai_sdk_reach_a_p(routed):
    from openai import OpenAI

    (gateway, *_), (p1, p2, d, e) = routed
    before = _requests_of((p1, p2, d, e))
    client = OpenAI(base_url=gateway.url + "/v1", api_key="none", max_retries=0)
    reply = client.embeddings.create(model=MODEL, input=["alpha bravo", "charlie"])
    assert [item.index for item in reply.data] == [0, 1]
    # The SDK asked for base64 and decoded it: the emulator's own vectors, in float32.
    assert reply.data[0].embedding == pytest.approx(vector("alpha bravo"), abs=1e-6)
    assert reply.usage.prompt_tokens == 3 and reply.model == MODEL
    after = _requests_of((p1, p2, d, e))
    assert sum(after[:2]) - sum(before[:2]) == 1 and after[2:] == before[2:]


def test_tokenizer_version_scoring_and_pooling_answer_as_the_engine_does(routed):
    (gateway, *_), (p1, *_) = routed
    words = f"{VOCAB[0]} {VOCAB[3]}"
    tokens = requests.post(
        gateway.url + "/tokenize", json={"model": MODEL, "prompt": words}, timeout=10
    )
    assert tokens.status_code == 200
    assert tokens.json()["tokens"] == [token_id(VOCAB[0]), token_id(VOCAB[3])]
    back = requests.post(
        gateway.url + "/detokenize",
        timeout=10,
        json={"model": MODEL, "tokens": tokens.json()["tokens"]},
    )
    assert back.json() == {"prompt": words}
    version = requests.get(gateway.url + "/version", timeout=10)
    assert version.json() == {"version": "emulated"}
    direct = requests.post(
        p1.url + "/v1/score", timeout=10, json={"text_1": "alpha", "text_2": ["alpha", "zulu"]}
    ).json()
    passed = requests.post(
        gateway.url + "/v1/score", timeout=10, json={"text_1": "alpha", "text_2": ["alpha", "zulu"]}
    ).json()
    assert passed["data"] == direct["data"] and passed["usage"] == direct["usage"]
    ranked = requests.post(
        gateway.url + "/rerank",
        timeout=10,
        json={"query": "alpha", "documents": ["zulu", "alpha"], "top_n": 1},
    )
    assert [r["index"] for r in ranked.json()["results"]] == [1]
    pooled = requests.post(gateway.url + "/pooling", json={"input": "alpha"}, timeout=10)
    assert pooled.json()["data"][0]["data"] == vector("alpha")
    wrong = requests.post(gateway.url + "/detokenize", json={"tokens": [7]}, timeout=10)
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "tokens"
    assert gateway.metric("pd_gateway_passed_total", route="/detokenize", status="400") == 1


def test_a_transcription_goes_to_d_and_streams_as_d_sends_it(routed):
    (gateway, *_), (p1, p2, d, e) = routed
    before = _requests_of((p1, p2, d))
    audio = {"file": ("a.wav", io.BytesIO(b"\0" * 64000), "audio/wav")}
    whole = requests.post(
        gateway.url + "/v1/audio/transcriptions", files=audio, data={"model": MODEL}, timeout=20
    )
    assert whole.status_code == 200 and whole.headers["Content-Type"] == "application/json"
    assert whole.json()["usage"] == {"type": "duration", "seconds": 2}
    audio["file"][1].seek(0)
    started = time.monotonic()
    with requests.post(
        gateway.url + "/v1/audio/transcriptions",
        files=audio,
        timeout=20,
        data={"model": MODEL, "stream": "true"},
        stream=True,
    ) as streamed:
        assert streamed.headers["Content-Type"].startswith("text/event-stream")
        arrived = []
        for line in streamed.iter_lines():
            if line.startswith(b"data: "):
                arrived.append((time.monotonic() - started, line[6:]))
    events = [json.loads(data) for _, data in arrived[:-1]]
    assert arrived[-1][1] == b"[DONE]"
    assert "".join(e["choices"][0]["delta"]["content"] for e in events) == whole.json()["text"]
    # Six words 250 ms apart: the first reached the client over a second before the last.
    assert arrived[-1][0] - arrived[0][0] >= 1.0, arrived
    after = _requests_of((p1, p2, d))
    assert after[2] - before[2] == 2 and after[:2] == before[:2]


def test_closed_and_unknown_routes_reach_no_engine(routed):
    (gateway, *_), engines = routed
    before = [engine.stats() for engine in engines]
    for method, path in CLOSED + [("GET", "/no/such/route")]:
        reply = requests.request(method, gateway.url + path, json={}, timeout=10)
        assert reply.status_code == 404, path
        assert reply.json()["error"]["type"] == "not_found_error"
    after = [engine.stats() for engine in engines]
    assert [(a["requests"], a["other_requests"]) for a in after] == [
        (b["requests"], b["other_requests"]) for b in before
    ]


def test_with_keys_the_passed_routes_need_one_and_ping_does_not(routed):
    (_, keyed, _), _ = routed
    assert (
        requests.post(keyed.url + "/v1/embeddings", json={"input": "x"}, timeout=10).status_code
        == 401
    )
    assert requests.get(keyed.url + "/version", timeout=10).status_code == 401
    assert requests.get(keyed.url + "/ping", timeout=10).status_code == 200
    reply = requests.post(
        keyed.url + "/v1/embeddings",
        json={"input": "x"},
        timeout=10,
        headers={"Authorization": "Bearer key-alpha"},
    )
    assert reply.status_code == 200 and reply.json()["data"][0]["embedding"] == vector("x")


def test_a_model_is_passed_to_its_own_engines(routed):
    (_, _, both), (p1, p2, d, e) = routed
    before = _requests_of((p1, p2, d, e))
    for model in ("embedder", "embed"):
        reply = requests.post(
            both.url + "/v1/embeddings", timeout=10, json={"model": model, "input": "alpha"}
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["model"] == "embedder"  # the alias went as its model's name
    assert (
        requests.post(
            both.url + "/v1/embeddings", timeout=10, json={"model": MODEL, "input": "alpha"}
        ).json()["model"]
        == MODEL
    )
    unknown = requests.post(
        both.url + "/v1/embeddings", json={"model": "gpt-4", "input": "x"}, timeout=10
    )
    assert unknown.status_code == 404 and "Valid aliases" in unknown.json()["error"]["message"]
    after = _requests_of((p1, p2, d, e))
    assert after[3] - before[3] == 2 and sum(after[:2]) - sum(before[:2]) == 1
    assert after[2] == before[2]


@responses.activate
def test_a_query_no_url_may_carry_is_passed_encoded_and_blames_no_engine(make_app):
    """A byte http.client refuses in a URL (a server before gunicorn 27 lets it in) was taken
    for the engine breaking the connection: eight such requests opened every breaker."""
    client = make_app().test_client()
    for url in (P_URL, D_URL):
        responses.get(url + "/version", json={"version": url})
    for _ in range(8):
        reply = client.get("/version", environ_overrides={"QUERY_STRING": "x=\x7f&y=a b"})
        assert reply.status_code == 200
    assert responses.calls[0].request.url.endswith("/version?x=%7F&y=a%20b")
    gateway = client.application.extensions["pd_gateway"].gateway
    assert [i.failures for i in gateway.prefill.instances + gateway.decode.instances] == [0, 0]
