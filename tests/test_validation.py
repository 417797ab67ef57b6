"""Bad client input gets a 400/413 OpenAI envelope and never reaches an engine."""

from __future__ import annotations

import threading

import pytest
import responses

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

BAD = [
    (CHAT, b"{not json", None),
    (CHAT, b"\xff\xfe", None),
    (CHAT, b"[1, 2]", "body"),
    (CHAT, b'"text"', "body"),
    (CHAT, b"{}", "messages"),
    (CHAT, b'{"messages": "hi"}', "messages"),
    (CHAT, b'{"messages": []}', "messages"),
    (CHAT, b'{"messages": [1]}', "messages.0"),
    (CHAT, b'{"messages": [{"content": "x"}]}', "messages.0.role"),
    (CHAT, b'{"messages": [{"role": "user", "content": 5}]}', "messages.0.content"),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}', "stream"),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}', "max_tokens"),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": true}', "max_tokens"),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "model": 3}', "model"),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', None),
    (
        CHAT,
        b'{"messages": [{"role": "user", "content": "x"}], "conversation_id": 7}',
        "conversation_id",
    ),
    (CHAT, b"[" * 2000 + b"]" * 2000, None),
    # Parsed fine, but nested past any later walk's reach (fuzzing found a 500 at ~900 levels).
    (COMPLETIONS, b'{"prompt": "", "temperature": ' + b"[" * 900 + b"]" * 900 + b"}", None),
    (
        CHAT,
        b'{"messages": [{"role": "user", "content": "x"}], "tools": '
        + b'[{"a": ' * 65
        + b"1"
        + b"}]" * 65
        + b"}",
        None,
    ),
    (COMPLETIONS, b'{"model": "m"}', "prompt"),
    (COMPLETIONS, b'{"prompt": {"a": 1}}', "prompt"),
    (COMPLETIONS, b'{"prompt": []}', "prompt"),
    (COMPLETIONS, b'{"prompt": [1, "a"]}', "prompt"),
]


@responses.activate  # no mocks registered: any call to an engine would fail the test
@pytest.mark.parametrize("path,raw,param", BAD)
def test_bad_bodies_get_400_envelopes(client, path, raw, param):
    reply = client.post(path, data=raw, content_type="application/json")
    assert reply.status_code == 400, reply.data
    error = reply.get_json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == 400 and error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert not responses.calls, (
        [(c.request.method, c.request.url) for c in responses.calls],
        [t.name for t in threading.enumerate()],
    )


@responses.activate
def test_oversized_body_gets_413(client):
    raw = b'{"messages": [{"role": "user", "content": "' + b"x" * 5000 + b'"}]}'
    reply = client.post(CHAT, data=raw, content_type="application/json")
    assert reply.status_code == 413
    assert reply.get_json()["error"]["code"] == 413


def test_unknown_route_and_method_get_envelopes(client):
    assert client.get("/nope").get_json()["error"]["code"] == 404
    reply = client.get(CHAT)
    assert reply.status_code == 405 and reply.get_json()["error"]["code"] == 405


@responses.activate
def test_unreachable_prefill_gets_503_with_message(client):
    # No mock registered for P: responses raises ConnectionError, as a refused connection does.
    reply = client.post(CHAT, json={"messages": [{"role": "user", "content": "x"}]})
    assert reply.status_code in (502, 503)
    assert "prefill[0]" in reply.get_json()["error"]["message"]
