"""The exact payloads the gateway sends P and D, and what reaches the client (pinned with
responses)."""

from __future__ import annotations

import json
import logging
import re

import pytest
import requests
import responses
from responses import matchers

from gateway.reuse.conversation import identify
from tests.helpers.payloads import (
    CHAT,
    D_URL,
    MESSAGES,
    MISS,
    P_URL,
    REFUSED,
    chat_events,
    client_events,
    d_params,
    p_params,
    p_reply,
    pinned_app,
    sse,
)
from tests.helpers.stores import take
from tests.helpers.transport import ResponsesTransport


@responses.activate
@pytest.mark.parametrize("placement", ["final", "separate"])
def test_streaming_turns_send_exact_payloads_and_strip_params(client, placement):
    request = {
        "model": "m",
        "messages": MESSAGES,
        "stream": True,
        "max_tokens": 8,
        "stream_options": {"include_usage": False},
        "conversation_id": "conv-1",
    }
    forwarded = {k: v for k, v in request.items() if k != "conversation_id"}
    responses.post(
        P_URL + CHAT,
        json=p_reply(p_params(1)),
        match=[
            matchers.json_params_matcher(
                {
                    "model": "m",
                    "messages": MESSAGES,
                    "stream": False,
                    "max_tokens": 1,
                    "kv_transfer_params": MISS,
                }
            )
        ],
    )
    responses.post(
        D_URL + CHAT,
        body=chat_events(["hello", " world"], d_params(1), placement),
        content_type="text/event-stream",
        match=[
            matchers.json_params_matcher(
                {**forwarded, "kv_transfer_params": {**p_params(1), "remote_host": "10.9.0.1"}}
            )
        ],
    )
    reply = client.post(CHAT, json=request, headers={"X-Request-Id": "req-1"})
    assert reply.status_code == 200
    assert reply.headers["X-Accel-Buffering"] == "no"
    assert reply.headers["X-Gateway-Cache"] == "miss"
    assert b"kv_transfer_params" not in reply.data and b"engine" not in reply.data
    events = client_events(reply.data)
    assert events[-1] == "[DONE]"
    assert (
        "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) == "hello world"
    )
    assert all(e["choices"] for e in events[:-1])  # the params-only event was dropped
    assert [c.request.headers["X-Request-Id"] for c in responses.calls] == ["req-1", "req-1"]

    # Turn 2: P reads D's blocks (flags flipped, remote_host = D's host); same D preferred.
    turn2 = MESSAGES + [
        {"role": "assistant", "content": "hello world"},
        {"role": "user", "content": "more"},
    ]
    responses.post(
        P_URL + CHAT,
        json=p_reply(p_params(2)),
        match=[
            matchers.json_params_matcher(
                {
                    "model": "m",
                    "messages": turn2,
                    "stream": False,
                    "max_tokens": 1,
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
        body=chat_events([" ok"], d_params(2), placement),
        content_type="text/event-stream",
    )
    reply = client.post(CHAT, json={**request, "messages": turn2})
    assert reply.status_code == 200, reply.data
    assert reply.headers["X-Gateway-Cache"] == "hit"


@responses.activate
def test_non_streaming_reply_is_ds_own_body_minus_params(client):
    d_body = {
        "id": "chatcmpl-d",
        "object": "chat.completion",
        "created": 5,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "yes",
                    "tool_calls": [
                        {
                            "id": "t1",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}"},
                        }
                    ],
                },
                "logprobs": {"content": []},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 20, "completion_tokens": 3, "total_tokens": 23},
        "kv_transfer_params": d_params(),
    }
    responses.post(P_URL + CHAT, json=p_reply(p_params()))
    responses.post(
        D_URL + CHAT,
        json=d_body,
        match=[
            matchers.json_params_matcher(
                {
                    "messages": MESSAGES,
                    "kv_transfer_params": {**p_params(), "remote_host": "10.9.0.1"},
                }
            )
        ],
    )
    reply = client.post(CHAT, json={"messages": MESSAGES})
    assert reply.status_code == 200
    expected = {k: v for k, v in d_body.items() if k != "kv_transfer_params"}
    assert reply.get_json() == expected
    assert b"\n" not in reply.data.strip()  # compact one-line JSON


@responses.activate
def test_no_params_from_p_means_plain_decode(client):
    responses.post(P_URL + CHAT, json=p_reply(None))
    responses.post(
        D_URL + CHAT,
        body=chat_events([" x"], None, "absent"),
        content_type="text/event-stream",
        match=[matchers.json_params_matcher({"messages": MESSAGES, "stream": True})],
    )
    reply = client.post(CHAT, json={"messages": MESSAGES, "stream": True})
    assert reply.status_code == 200


@responses.activate
def test_client_sent_params_never_reach_engines(client):
    responses.post(
        P_URL + CHAT,
        json=p_reply(p_params()),
        match=[
            matchers.json_params_matcher(
                {"messages": MESSAGES, "stream": False, "max_tokens": 1, "kv_transfer_params": MISS}
            )
        ],
    )
    responses.post(D_URL + CHAT, json={"choices": [], "kv_transfer_params": None})
    hostile = {"do_remote_decode": True, "remote_block_ids": [[1]], "remote_host": "evil"}
    reply = client.post(CHAT, json={"messages": MESSAGES, "kv_transfer_params": hostile})
    assert reply.status_code == 200
    assert "evil" not in responses.calls[1].request.body.decode()


@responses.activate
def test_prefill_4xx_is_relayed_with_its_status_and_message(client):
    responses.post(
        P_URL + CHAT,
        status=404,
        json={
            "error": {
                "message": "The model `nope` does not exist.",
                "type": "NotFoundError",
                "param": None,
                "code": 404,
            }
        },
    )
    reply = client.post(CHAT, json={"model": "nope", "messages": MESSAGES})
    assert reply.status_code == 404
    assert reply.get_json()["error"]["message"] == "The model `nope` does not exist."
    assert len(responses.calls) == 1


@responses.activate
def test_engine_5xx_becomes_502_without_hosts(client):
    responses.post(P_URL + CHAT, json=p_reply(p_params()))
    responses.post(
        D_URL + CHAT,
        status=500,
        json={"error": {"message": "boom", "type": "x", "param": None, "code": 500}},
    )
    reply = client.post(CHAT, json={"messages": MESSAGES, "stream": True})
    assert reply.status_code == 502
    error = reply.get_json()["error"]
    assert "decode[0]" in error["message"] and "10.9" not in error["message"]
    assert error["code"] == 502


@responses.activate
def test_stream_cut_short_ends_with_error_event_and_stores_nothing(client, store):
    cut = chat_events([" a", " b"], d_params(), "final").split(
        b'data: {"id": "c", "choices": [{"index": 0, "delta": {}'
    )[0]
    responses.post(P_URL + CHAT, json=p_reply(p_params()))
    responses.post(D_URL + CHAT, body=cut, content_type="text/event-stream")
    reply = client.post(CHAT, json={"messages": MESSAGES, "stream": True, "conversation_id": "c"})
    events = client_events(reply.data)
    assert events[-1] == "[DONE]" and "error" in events[-2]
    assert len(store) == 0


@responses.activate
@pytest.mark.parametrize(
    "finish,stored", [("stop", 1), ("length", 1), ("tool_calls", 1), ("abort", 0), ("error", 0)]
)
def test_only_turns_the_engine_finished_are_stored(client, store, finish, stored):
    # "tool_calls" is vLLM's serving layer renaming a stop (FINISHED_STOPPED): D kept its blocks.
    responses.post(P_URL + CHAT, json=p_reply(p_params()))
    responses.post(
        D_URL + CHAT,
        body=chat_events([" a"], d_params(), "final", finish),
        content_type="text/event-stream",
    )
    client.post(CHAT, json={"messages": MESSAGES, "stream": True, "conversation_id": "c"})
    assert len(store) == stored


def stream_with(delta_events, params, finish="stop"):
    events = [
        {"id": "c", "choices": [{"index": 0, "delta": d, "finish_reason": None}]}
        for d in delta_events
    ]
    events.append(
        {
            "id": "c",
            "choices": [{"index": 0, "delta": {}, "finish_reason": finish}],
            "kv_transfer_params": params,
        }
    )
    return sse(*events, b"[DONE]")


def two_turns(client, first_deltas, echo, finish="stop"):
    """Turn 1 streams `first_deltas`; turn 2 echoes `echo`; returns turn 2's cache header."""
    responses.post(P_URL + CHAT, json=p_reply(p_params()))
    responses.post(
        D_URL + CHAT,
        body=stream_with(first_deltas, d_params(), finish),
        content_type="text/event-stream",
    )
    client.post(CHAT, json={"messages": MESSAGES, "stream": True})
    responses.post(
        D_URL + CHAT,
        body=stream_with([{"content": "k"}], d_params(2)),
        content_type="text/event-stream",
    )
    reply = client.post(
        CHAT,
        json={"messages": MESSAGES + [echo, {"role": "user", "content": "next"}], "stream": True},
    )
    return reply.headers["X-Gateway-Cache"]


TOOL_DELTAS = [
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "index": 0,
                "id": "call_1",
                "type": "function",
                "function": {"name": "lookup", "arguments": '{"q": '},
            }
        ],
    },
    {"tool_calls": [{"index": 0, "function": {"arguments": '"kv"}'}}]},
]


# Templates re-render tool calls from parsed JSON, so only token verification can prove their
# reuse (tests/test_exactness_payloads.py); with verify_reuse off each is a counted miss.
TOOL_ECHOES = {
    # Echoed canonically: the digest finds the entry, which stays unproven.
    "canonical": (
        {
            "content": None,
            "role": "assistant",
            "tool_calls": [
                {
                    "type": "function",
                    "id": "call_1",
                    "function": {"arguments": '{"q": "kv"}', "name": "lookup"},
                }
            ],
        },
        "REUSE_CHECKS",
        "unproven",
        1,
    ),
    # Arguments re-serialised: the digest leads nowhere; the first turn's miss and this one.
    "reserialised": (
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "lookup", "arguments": '{"q":"kv"}'},
                }
            ],
        },
        "ENTRIES",
        "absent",
        2,
    ),
}


@responses.activate
@pytest.mark.parametrize("case", sorted(TOOL_ECHOES))
def test_tool_call_echoes_are_counted_misses(client, case):
    from gateway.support import metrics

    echo, metric, label, counted = TOOL_ECHOES[case]
    counter = getattr(metrics, metric).labels(label)
    before = counter._value.get()
    assert two_turns(client, TOOL_DELTAS, echo) == "miss"
    assert counter._value.get() == before + counted


@responses.activate
def test_stripped_reasoning_misses(client):
    deltas = [
        {"role": "assistant", "content": ""},
        {"reasoning_content": "let me think"},
        {"content": "answer"},
    ]
    stripped = {"role": "assistant", "content": "answer"}
    assert two_turns(client, deltas, stripped) == "miss"


@responses.activate
@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_reasoning_echoed_back_is_not_reused_on_digests_alone(client, field):
    # Qwen3 and DeepSeek-R1 templates drop the reasoning of earlier turns while D's blocks hold
    # the <think> tokens (vLLM issue #43094): an echo proves nothing about the tokens.
    deltas = [{"role": "assistant", "content": ""}, {field: "let me think"}, {"content": "answer"}]
    kept = {"role": "assistant", "content": "answer", field: "let me think"}
    assert two_turns(client, deltas, kept) == "miss"


@responses.activate
@pytest.mark.parametrize(
    "bad",
    [
        {"remote_port": "5700"},
        {"remote_block_ids": [7, 8]},
        {"remote_block_ids": [["7"]]},
        {"remote_engine_id": None},
        {"tp_size": "1"},
        {"remote_num_tokens": -1},
    ],
)
def test_malformed_decode_params_are_not_stored_and_are_counted(client, store, bad):
    from gateway.support import metrics

    before = metrics.ENTRIES.labels("rejected")._value.get()
    responses.post(P_URL + CHAT, json=p_reply(p_params()))
    responses.post(
        D_URL + CHAT,
        body=chat_events([" a"], {**d_params(), **bad}),
        content_type="text/event-stream",
    )
    client.post(CHAT, json={"messages": MESSAGES, "stream": True, "conversation_id": "c"})
    assert len(store) == 0
    assert metrics.ENTRIES.labels("rejected")._value.get() == before + 1


@responses.activate
def test_only_allowlisted_params_are_stored(client, store):
    responses.post(P_URL + CHAT, json=p_reply(p_params()))
    responses.post(
        D_URL + CHAT,
        body=chat_events([" a"], {**d_params(), "evil": "x", "remote_host": "attacker"}),
        content_type="text/event-stream",
    )
    client.post(CHAT, json={"messages": MESSAGES, "stream": True, "conversation_id": "c"})
    (key,) = list(store._cache)  # a digest, kept as its 16 bytes
    entry = take(store, key.hex())
    assert "evil" not in entry.params and entry.params["remote_host"] == "10.9.0.2"


@pytest.fixture
def two_instance_app(store):
    """make(prefill URLs, decode URLs): an app over those; closed (prober stopped) after the
    test."""
    from gateway.app import create_app
    from gateway.config import Settings

    apps = []

    def make(prefill, decode):
        apps.append(
            create_app(
                Settings(
                    release_rate=0,
                    engine_metrics_interval=0,
                    probe_interval=0,
                    prefill=prefill,
                    decode=decode,
                    worker_class="gthread",
                    verify_reuse="off",
                ),
                store=store,
                transport=ResponsesTransport(),
            )
        )
        return apps[-1]

    yield make
    for app in apps:
        app.extensions["pd_gateway"].close()


@pytest.mark.parametrize("failure", ["refused", "error500", "broken"])
@responses.activate
def test_decode_retry_replays_prefill_params_only_if_the_failed_d_never_got_them(
    two_instance_app, failure
):
    d2 = "http://10.9.0.4:8200"
    app = two_instance_app([P_URL], [D_URL, d2])
    first = app.extensions["pd_gateway"].gateway.decode.choose(
        identify({"messages": MESSAGES}, {}, "conv").root
    )
    second = [u for u in (D_URL, d2) if u != first.url][0]
    responses.post(P_URL + CHAT, json=p_reply(p_params()))
    if failure == "refused":
        responses.post(first.url + CHAT, body=REFUSED)
    elif failure == "error500":
        responses.post(first.url + CHAT, status=500, json={"error": {"message": "boom"}})
    else:
        responses.post(first.url + CHAT, body=requests.ConnectionError("Connection aborted."))
    responses.post(
        second + CHAT, body=chat_events([" a"], d_params()), content_type="text/event-stream"
    )
    reply = app.test_client().post(
        CHAT, json={"messages": MESSAGES, "stream": True, "conversation_id": "conv"}
    )
    assert reply.status_code == 200 and b"[DONE]" in reply.data
    (retried,) = [
        json.loads(c.request.body) for c in responses.calls if c.request.url == second + CHAT
    ]
    if failure == "refused":  # that D never saw P's blocks: the next one pulls them
        assert retried["kv_transfer_params"]["remote_engine_id"] == "p-engine-1"
    else:  # it may have read them: the next one prefills itself,
        # with no params at all (neither flag set would leak its blocks on vLLM 0.33)
        assert "kv_transfer_params" not in retried


@pytest.mark.parametrize("failure", ["error500", "refused"])
@responses.activate
def test_prefill_retry_never_replays_decode_params(store, two_instance_app, failure):
    from gateway.reuse.store import Entry

    p2 = "http://10.9.0.3:8100"
    app = two_instance_app([P_URL, p2], [D_URL])
    identity = identify({"messages": MESSAGES}, {}, "conv")
    # An entry holding the first message, so the first attempt replays D's params.
    store.put(
        identity.root,
        Entry(
            params=d_params(),
            decode_url=D_URL,
            history_digest=identity.messages[0].hex(),
            history_len=1,
            plain=True,
        ),
    )
    sent = []

    def prefill(request):
        sent.append(json.loads(request.body)["kv_transfer_params"])
        if len(sent) == 1:
            if failure == "refused":  # never reached P, yet the retry still sends the stub
                return REFUSED
            return 500, {}, json.dumps({"error": {"message": "boom"}})
        return 200, {}, json.dumps(p_reply(p_params()))

    responses.add_callback(responses.POST, P_URL + CHAT, callback=prefill)
    responses.add_callback(responses.POST, p2 + CHAT, callback=prefill)
    responses.post(D_URL + CHAT, json={"choices": [], "kv_transfer_params": None})
    reply = app.test_client().post(CHAT, json={"messages": MESSAGES, "conversation_id": "conv"})
    assert reply.status_code == 200
    assert sent[0]["remote_engine_id"] == "d-engine-1"  # first attempt: D's blocks
    assert sent[1] == MISS  # the retry: the plain stub
    assert reply.headers["X-Gateway-Cache"] == "miss"


@responses.activate
def test_engine_urls_keep_their_own_path_and_credentials(store):
    """An engine behind a path prefix (a balancer's route) gets the API under it, and user:password
    in its URL becomes Basic auth, as requests sends them."""
    from gateway.app import create_app
    from gateway.config import Settings

    p_url, d_url = "http://lb.test:8000/prefill-0", "http://bob:s%3Acret@10.9.0.3:8200/d"
    auth = "Basic Ym9iOnM6Y3JldA=="  # bob:s:cret
    responses.post("http://lb.test:8000/prefill-0" + CHAT, json=p_reply(p_params()))
    responses.post(
        d_url + CHAT,
        body=chat_events([" a"], d_params()),
        content_type="text/event-stream",
        match=[matchers.header_matcher({"Authorization": auth})],
    )
    app = create_app(
        Settings(
            release_rate=0,
            engine_metrics_interval=0,
            probe_interval=0,
            prefill=[p_url],
            decode=[d_url],
            worker_class="gthread",
            threads=8,
            verify_reuse="off",
            resolve_interval=0,
        ),
        store=store,
        transport=ResponsesTransport(),
    )
    try:
        reply = app.test_client().post(CHAT, json={"messages": MESSAGES, "stream": True})
        assert reply.status_code == 200 and b"[DONE]" in reply.data
        assert [c.request.path_url for c in responses.calls] == ["/prefill-0" + CHAT, "/d" + CHAT]
    finally:
        app.extensions["pd_gateway"].close()


def test_an_empty_user_in_an_engine_url_sends_no_authorization():
    """As requests: `http://@host` and `http://:@host` carry no credentials."""
    from gateway.engines.instances import Instance

    assert [
        Instance(url, "decode", 0).credentials
        for url in ("http://@d:1", "http://:@d:1", "http://d:1", "http://u@d:1", "http://:p@d:1")
    ] == [None, None, None, ("u", ""), ("", "p")]


@responses.activate
def test_a_stream_reaches_the_server_as_the_relays_own_chunks(app):
    """No werkzeug generators around every event (direct passthrough); the server's close of
    them releases the turn."""
    from werkzeug.test import EnvironBuilder

    responses.post(P_URL + CHAT, json=p_reply(p_params()))
    responses.post(
        D_URL + CHAT, body=chat_events([" a", " b"], d_params()), content_type="text/event-stream"
    )
    environ = EnvironBuilder(
        path=CHAT, method="POST", json={"messages": MESSAGES, "stream": True}
    ).get_environ()
    started = []
    body = app.wsgi_app(environ, lambda status, headers, exc_info=None: started.append(status))
    try:
        assert started == ["200 OK"]
        assert type(body).__name__ == "_Chunks"  # the relay's, not a ClosingIterator
        assert b"[DONE]" in b"".join(body)
    finally:
        body.close()
    assert app.extensions["pd_gateway"].gateway.admission.inflight == 0


def streaming_host(store, after_request):
    """A host Flask app whose `after_request` is given, the gateway mounted under /llm, and P
    and D mocked for one streamed turn."""
    from flask import Flask

    from gateway.extension import PDGateway

    responses.post(P_URL + CHAT, json=p_reply(p_params()))
    responses.post(
        D_URL + CHAT, body=chat_events([" a", " b"], d_params()), content_type="text/event-stream"
    )
    host = Flask("host")
    host.after_request(after_request)
    PDGateway(
        host,
        url_prefix="/llm",
        conversation_store=store,
        engine_metrics_interval=0,
        probe_interval=0,
        prefill=[P_URL],
        decode=[D_URL],
        worker_class="gthread",
        threads=8,
        verify_reuse="off",
        transport=ResponsesTransport(),
    )
    return host


@responses.activate
def test_a_host_app_may_read_a_streams_body_after_the_request(store):
    """A host's after_request that reads the body (a request logger, say) gets it whole, and so
    does the client (werkzeug refuses to read a body passed through: a 500)."""
    logged = []

    def log_body(response):
        logged.append(response.get_data())
        return response

    host = streaming_host(store, log_body)
    try:
        reply = host.test_client().post("/llm" + CHAT, json={"messages": MESSAGES, "stream": True})
        assert reply.status_code == 200 and reply.data.endswith(b"data: [DONE]\n\n")
        assert logged == [reply.data]
        reply.close()
        assert host.extensions["pd_gateway"].gateway.admission.inflight == 0
    finally:
        host.extensions["pd_gateway"].close()


@responses.activate
def test_a_host_app_that_leaves_a_body_passed_through_unread_leaves_it_streaming(store):
    """werkzeug's advice: a body passed through is not to be read. A host's after_request that
    follows it (a logger, a compressor) sees `direct_passthrough` and leaves the stream alone;
    told otherwise, it would read all of D's stream before the client got a byte."""
    seen = []

    def log_preview(response):
        seen.append("stream" if response.direct_passthrough else response.get_data()[:40])
        return response

    host = streaming_host(store, log_preview)
    try:
        reply = host.test_client().post("/llm" + CHAT, json={"messages": MESSAGES, "stream": True})
        assert reply.status_code == 200 and reply.data.endswith(b"data: [DONE]\n\n")
        assert seen == ["stream"]
        reply.close()
    finally:
        host.extensions["pd_gateway"].close()


@responses.activate
def test_a_host_apps_call_on_close_runs_after_a_stream(store):
    """The relay's bytes reach the server without werkzeug's wrappers, and still a host app's
    `call_on_close` runs when the server closes the stream, after the reply is released."""
    closed = []

    def remember_close(response):
        response.call_on_close(lambda: closed.append(len(store)))
        return response

    host = streaming_host(store, remember_close)
    try:
        reply = host.test_client().post(
            "/llm" + CHAT, json={"messages": MESSAGES, "stream": True, "conversation_id": "c"}
        )
        assert b"[DONE]" in reply.data
        reply.close()
        assert closed == [1]  # it ran, once, with the turn's entry already stored
    finally:
        host.extensions["pd_gateway"].close()


@responses.activate
@pytest.mark.parametrize(
    "value", [b"-Infinity", b"NaN", b'"a\\ud800b"', b"123456789012345678901234567890"]
)
def test_a_non_streamed_reply_keeps_what_python_json_reads_and_orjson_would_change(client, value):
    """-Infinity (a logprob), NaN, a lone surrogate, an integer beyond 64 bits in D's reply
    reach the client as D wrote them (orjson alone wrote null, raised a 500, or a float)."""
    d_body = (
        b'{"id":"chatcmpl-d","object":"chat.completion","choices":[{"index":0,'
        b'"message":{"role":"assistant","content":"yes"},"finish_reason":"stop",'
        b'"odd":' + value + b'}],"kv_transfer_params":' + json.dumps(d_params()).encode() + b"}"
    )
    responses.post(P_URL + CHAT, json=p_reply(p_params()))
    responses.post(D_URL + CHAT, body=d_body, content_type="application/json")
    reply = client.post(CHAT, json={"messages": MESSAGES})
    assert reply.status_code == 200
    assert b'"odd":' + value + b"}" in reply.data and b"kv_transfer_params" not in reply.data


@responses.activate
def test_the_access_log_says_ps_time_and_the_ttft(store, caplog):
    app = pinned_app(store, access_log=True)
    try:
        responses.post(P_URL + CHAT, json=p_reply(p_params()))
        responses.post(
            D_URL + CHAT,
            body=chat_events([" x"], d_params(), "final"),
            content_type="text/event-stream",
        )
        with caplog.at_level(logging.INFO, logger="gateway.access"):
            reply = app.test_client().post(CHAT, json={"messages": MESSAGES, "stream": True})
            assert reply.status_code == 200 and reply.data.endswith(b"data: [DONE]\n\n")
    finally:
        app.extensions["pd_gateway"].close()
    [line] = [r.getMessage() for r in caplog.records if r.name == "gateway.access"]
    prefill_ms = float(re.search(r" prefill_ms=([0-9.]+) ", line).group(1))
    ttft_ms = float(re.search(r" ttft_ms=([0-9.]+) ", line).group(1))
    assert "path=two-stage" in line and 0 < prefill_ms <= ttft_ms
