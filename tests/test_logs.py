"""Logs that trace a turn: the request id on every line of a request, W3C trace context to P and D;
no client can forge a line of the text log."""

from __future__ import annotations

import json
import logging
import re

import pytest
import requests
import responses

from emulator.process import wait_until
from gateway.support import logs
from tests.helpers.payloads import D_URL, P_URL, chat_events, d_params, p_params, p_reply
from tests.helpers.servers import MODEL

CHAT = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
GIVEN = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def engines() -> None:
    responses.post(P_URL + CHAT, json=p_reply(p_params(1)))
    responses.post(
        D_URL + CHAT, body=chat_events(["hello"], d_params(1)), content_type="text/event-stream"
    )


@responses.activate
@pytest.mark.parametrize(
    "sent,kept",
    [
        (GIVEN, True),
        (None, False),
        ("00-zz-bad-01", False),
        ("00-" + "0" * 32 + "-00f067aa0ba902b7-01", False),
    ],
)
def test_trace_context_reaches_p_and_d(client, sent, kept):
    engines()
    headers = {"traceparent": sent, "tracestate": "vendor=1"} if sent else {}
    assert client.post(CHAT, json=BODY, headers=headers).status_code == 200
    seen = [c.request.headers.get("traceparent") for c in responses.calls]
    assert len(seen) == 2 and seen[0] == seen[1], seen  # one trace for the turn
    assert re.fullmatch(r"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}", seen[0])
    assert (seen[0] == GIVEN) is kept
    if kept:
        assert all(c.request.headers.get("tracestate") == "vendor=1" for c in responses.calls)


@responses.activate
def test_every_line_of_a_request_carries_its_id(client, caplog):
    engines()
    responses.replace(responses.POST, D_URL + CHAT, status=500, json={"error": "boom"})
    handler = caplog.handler
    handler.addFilter(logs.RequestIdFilter())
    with caplog.at_level(logging.INFO):
        reply = client.post(CHAT, json=BODY, headers={"X-Request-Id": "req-42"})
    assert reply.status_code == 502
    lines = [r for r in caplog.records if r.name.startswith("gateway")]
    assert lines and all(r.request_id == "req-42" for r in lines), [
        (r.name, r.request_id, r.getMessage()) for r in lines
    ]


def test_json_lines_hold_the_request_id():
    record = logging.LogRecord(
        "gateway.flow.disagg", logging.WARNING, __file__, 1, "D said %s", ("no",), None
    )
    token = logs.REQUEST_ID.set("req-7")
    try:
        logs.RequestIdFilter().filter(record)
    finally:
        logs.REQUEST_ID.reset(token)
    line = json.loads(logs.JsonFormatter().format(record))
    assert line["request_id"] == "req-7" and line["message"] == "D said no"
    assert line["level"] == "WARNING" and line["logger"] == "gateway.flow.disagg"


def test_a_client_cannot_forge_a_line_of_the_text_log(fresh_engines, gateway_factory):
    """vLLM's 404 quotes the model a client sent; the gateway logs what the engine answered.
    A model name with a newline stays inside its line, escaped."""
    p, d = fresh_engines
    gateway = gateway_factory([p.url], [d.url])
    forged = "2026-12-05 00:00:00,000 1 ERROR gateway.admin [-]: admin token rotated"
    reply = requests.post(
        gateway.url + "/v1/chat/completions",
        timeout=30,
        json={
            "model": f"nope\n{forged}\r\n{forged}",
            "messages": [{"role": "user", "content": "hi"}],
        },
    )
    assert reply.status_code == 404
    wait_until(lambda: "nope\\n2026" in gateway.log(), 10, "the engine's answer logged")
    assert not any(line.startswith(forged) for line in gateway.log().splitlines())


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_a_model_name_is_logged_short_and_reads_as_it_is_written(
    fresh_engines, gateway_factory, log_format
):
    """A model name of 200,000 characters with a right-to-left override and Unicode's line
    separator: the engine echoes it in its 404 and the gateway logs the answer, and a gateway of
    several models answers its own 404 with it. Each says a bounded part of it, the override
    and the separator escaped, in either log format."""
    p, d = fresh_engines
    name = "\u202e" + "x" * 100_000 + "\u2028" + "y" * 100_000
    models = [f"{MODEL};prefill={p.url};decode={d.url}"]
    for gateway in (
        gateway_factory([p.url], [d.url], log_format=log_format),
        gateway_factory([], [], models=" ".join(models), log_format=log_format),
    ):
        before = len(gateway.log())
        reply = requests.post(
            gateway.url + "/v1/chat/completions",
            timeout=30,
            json={"model": name, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert reply.status_code == 404 and len(reply.json()["error"]["message"]) < 2_000
        wait_until(
            lambda gateway=gateway, before=before: "\\u202e" in gateway.log()[before:],
            10,
            "the 404 logged",
        )
        logged = gateway.log()[before:]
        assert "\u202e" not in logged and "\u2028" not in logged
        assert max(len(line) for line in logged.splitlines()) < 4_000


def test_an_engine_key_from_openai_api_key_is_said_and_never_shown(fresh_engines, monkeypatch):
    """The seed's convention: the engines' key from $OPENAI_API_KEY. Where a gateway takes it
    from there, its log says so at start (an operator finds a key the engines get without
    meaning to), and never shows the key."""
    from tests.helpers.servers import gateway_process

    p, d = fresh_engines
    monkeypatch.setenv("OPENAI_API_KEY", "sk-never-in-a-log-4711")
    with gateway_process([p.url], [d.url]) as gateway:
        assert (
            requests.post(
                gateway.url + "/v1/chat/completions",
                timeout=30,
                json={
                    "model": MODEL,
                    "max_tokens": 2,
                    "messages": [{"role": "user", "content": "hi"}],
                },
            ).status_code
            == 200
        )
        log = gateway.log()
    assert "the engines get the key in $OPENAI_API_KEY" in log
    assert "sk-never-in-a-log-4711" not in log
