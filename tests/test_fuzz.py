"""Fuzzed bodies, headers and framing: no 5xx, every error an OpenAI envelope, big bodies 413."""

from __future__ import annotations

import http.client
import itertools
import json
import socket
import threading
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import pytest
import responses
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.reuse.kv_params import MISS_PARAMS
from tests.helpers.payloads import D_URL, P_URL
from tests.helpers.servers import starts_processes

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
LIMIT = 4096  # max_body_bytes of conftest's `app`; the real gateways below use it too
ENVELOPE_KEYS = {"message", "type", "param", "code"}

# Scope. In process (Flask test client) the gateway sees every body and header value a WSGI
# server can hand it. Against a real gateway under gunicorn, only requests gunicorn passes to
# the app are in scope: a malformed request line, an invalid header name, a header value with
# control characters, a bad Content-Length or Transfer-Encoding get gunicorn's own HTML 400
# before the app runs (test_gunicorn_rejects_broken_http_itself pins that boundary). Bytes past
# Content-Length are the next request on the connection, so only the in-process run sends them.

# --- what clients send -------------------------------------------------------------------------
text = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)  # no lone surrogates
scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | text
    | st.floats(allow_nan=False, allow_infinity=False)
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
    max_leaves=5,
)

part = st.fixed_dictionaries({"type": st.just("text"), "text": text}) | st.fixed_dictionaries(
    {"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": text})}
)
tool_call = st.fixed_dictionaries(
    {
        "id": text,
        "type": st.just("function"),
        "function": st.fixed_dictionaries({"name": text, "arguments": text}),
    }
)
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant", "tool"]),
        "content": st.none() | text | st.lists(part, max_size=2),
    },
    optional={
        "name": text,
        "tool_calls": st.lists(tool_call, max_size=2),
        "tool_call_id": text,
        "reasoning_content": text,
    },
)
token_ids = st.lists(st.integers(0, 50_000), min_size=1, max_size=4)
prompt = (
    text
    | st.lists(text, min_size=1, max_size=3)
    | token_ids
    | st.lists(token_ids, min_size=1, max_size=2)
)
common = {
    "model": text,
    "stream": st.booleans(),
    "max_tokens": st.integers(1, 16),
    "conversation_id": text.filter(bool),
    "temperature": st.floats(0, 2),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
}
chat_fields = {**common, "tools": st.lists(json_values, max_size=2)}
VALID = {
    CHAT: st.fixed_dictionaries(
        {"messages": st.lists(message, min_size=1, max_size=2)}, optional=chat_fields
    ),
    COMPLETIONS: st.fixed_dictionaries(
        {"prompt": prompt}, optional={**common, "echo": st.booleans(), "suffix": text}
    ),
}

# Every field the gateway reads or forwards, at any depth.
TOP = (
    "model",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "min_tokens",
    "n",
    "conversation_id",
    "kv_transfer_params",
    "temperature",
    "tools",
    "chat_template",
    "chat_template_kwargs",
    "echo",
    "suffix",
)
FIELDS = {
    CHAT: TOP
    + (
        "messages",
        "messages.0",
        "messages.0.role",
        "messages.0.content",
        "messages.0.content.0",
        "messages.0.content.0.type",
        "messages.0.content.0.text",
        "messages.0.name",
        "messages.0.tool_calls",
        "messages.0.tool_calls.0",
        "messages.0.tool_call_id",
        "messages.0.reasoning_content",
    ),
    COMPLETIONS: TOP + ("prompt", "prompt.0", "prompt.0.0"),
}
DELETE = object()


def put(doc: dict, path: str, value: object) -> None:
    """Set (or with DELETE remove) `path` like "messages.0.role", building what is missing."""
    keys = [int(k) if k.isdigit() else k for k in path.split(".")]
    node = doc
    for key, below in itertools.pairwise(keys):
        kind = list if isinstance(below, int) else dict
        child = _get(node, key)
        if not isinstance(child, kind) or child == []:
            child = [None] if kind is list else {}
            _set(node, key, child)
        node = child
    if value is DELETE:
        if _get(node, keys[-1]) is not None:
            del node[keys[-1]]
    else:
        _set(node, keys[-1], value)


def _get(node: dict | list, key: str | int) -> object:
    return node.get(key) if isinstance(node, dict) else node[key] if key < len(node) else None


def _set(node: dict | list, key: str | int, value: object) -> None:
    if isinstance(node, list) and key >= len(node):
        node.append(value)
    else:
        node[key] = value


@st.composite
def _mutated(draw, path: str) -> bytes:
    """A valid body with one to three fields replaced by any JSON value, or removed."""
    body = draw(VALID[path])
    for _ in range(draw(st.integers(1, 3))):
        put(body, draw(st.sampled_from(FIELDS[path])), draw(json_values | st.just(DELETE)))
    return json.dumps(body).encode()


BAD_UTF8 = [
    b"\xff",
    b"\xc3\x28",
    b"\xed\xa0\x80",
    b"\xf4\x90\x80\x80",
    b"\xc0\xaf",
    b"\x80",
    b"\xe2\x82",
]
# Python's json module reads these; the gateway must not.
CONSTANTS = [b"NaN", b"Infinity", b"-Infinity", b"nan", b"inf", b"undefined", b"True", b"None"]


@st.composite
def _corrupted(draw, path: str) -> bytes:
    """A valid body broken at the byte level: truncated, spliced, mis-encoded, nested, padded."""
    how = draw(
        st.sampled_from(
            ["truncate", "splice", "utf8", "constant", "nest", "encoding", "binary", "pad"]
        )
    )
    if how == "binary":
        return draw(st.binary(max_size=64))
    raw = json.dumps(draw(VALID[path])).encode()
    # A top-level field to put a bad value in, before the body's own fields.
    field_ = b'{"' + draw(st.sampled_from(FIELDS[path])).split(".")[0].encode() + b'": '
    if how in ("truncate", "splice", "utf8"):
        at = draw(st.integers(0, len(raw)))
        insert = {
            "truncate": st.just(None),
            "splice": st.binary(min_size=1, max_size=8),
            "utf8": st.sampled_from(BAD_UTF8),
        }[how]
        piece = draw(insert)
        return raw[:at] if piece is None else raw[:at] + piece + raw[at:]
    if how == "constant":
        return field_ + draw(st.sampled_from(CONSTANTS)) + b", " + raw[1:]
    if how == "nest":
        # Deep enough to pass json's recursion limit (about 990) and still fit under LIMIT.
        depth = draw(st.integers(1, 2000))
        nested = b"[" * depth + b"]" * depth
        return nested if draw(st.booleans()) else field_ + nested + b", " + raw[1:]
    if how == "encoding":
        return raw.decode().encode(
            draw(st.sampled_from(["utf-16", "utf-16-be", "utf-32", "utf-8-sig"]))
        )
    return b'{"pad": "' + b"x" * (LIMIT + draw(st.integers(-100, 2000))) + b'", ' + raw[1:]


def mutated(path: str) -> st.SearchStrategy[bytes]:
    return _mutated(path)


def corrupted(path: str) -> st.SearchStrategy[bytes]:
    return _corrupted(path)


def bodies(path: str) -> st.SearchStrategy[bytes]:
    return mutated(path) | corrupted(path) | VALID[path].map(lambda b: json.dumps(b).encode())


# Header values as a server hands them over: latin-1, no control characters but tab (gunicorn
# refuses those), no surrounding spaces (gunicorn strips them).
FIELD_CHARS = (
    "\t" + "".join(chr(c) for c in range(0x20, 0x7F)) + "".join(chr(c) for c in range(0x80, 0x100))
)
header_value = st.text(FIELD_CHARS, max_size=40).map(lambda v: v.strip(" \t")) | st.sampled_from(
    ["", "a" * 128, "a" * 129, "x" * 1025, "Bearer ", "null", "../../etc", "\xe9t\xe9"]
)
authorization = header_value
content_types = st.sampled_from(
    [
        "application/json",
        "application/json; charset=utf-16",
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=xyz",
        "",
        "*/*",
        "garbage;;;",
    ]
)
headers = st.fixed_dictionaries(
    {},
    optional={
        "Content-Type": content_types,
        "Authorization": authorization,
        "X-Request-Id": header_value,
        "X-Conversation-Id": header_value,
        "X-Session-ID": header_value,
        "Accept": header_value,
        "User-Agent": header_value,
        "Accept-Encoding": st.sampled_from(["gzip", "br", "identity"]),
    },
)


@dataclass
class Case:
    """One request as sent on the wire; `framing` says how the body is delimited."""

    path: str
    raw: bytes
    headers: dict = field(default_factory=dict)
    method: str = "POST"
    framing: str = "length"  # length | chunked | long (Content-Length claims more) | short
    delta: int = 0  # Content-Length error (long/short) or chunk size (chunked)

    @property
    def declared(self) -> int:
        """The body size the request claims: its Content-Length, or what it sends if chunked."""
        return len(self.raw) + {"long": self.delta, "short": -self.delta}.get(self.framing, 0)

    @property
    def served(self) -> bool:
        """A POST to a gateway route: the gateway reads it (others get 404/405 first)."""
        return self.method == "POST" and self.path in (CHAT, COMPLETIONS)


@st.composite
def cases(draw, framings: tuple[str, ...]) -> Case:
    path = draw(st.sampled_from([CHAT, COMPLETIONS]))
    case = Case(path, draw(bodies(path)), draw(headers), framing=draw(st.sampled_from(framings)))
    case.delta = draw(
        st.integers(0, min(len(case.raw), 512)) if case.framing == "short" else st.integers(1, 512)
    )
    if draw(st.integers(0, 9)) == 0:  # a wrong method or route now and then
        case.method = draw(st.sampled_from(["GET", "PUT", "DELETE", "PATCH"]))
        case.path = draw(
            st.sampled_from(
                [CHAT, COMPLETIONS, CHAT + "/x", "/v1/complete", "/v1//completions", "/%ff"]
            )
        )
    return case


# --- the property ------------------------------------------------------------------------------
def check_reply(case: Case, status: int, content_type: str, body: bytes) -> None:
    """No 5xx; every error the four-key envelope with `code` = status; oversized bodies 413."""
    assert status < 500, f"{status} for {case!r}: {body[:300]!r}"
    if case.served and case.declared > LIMIT:
        assert status == 413, f"{status} for an oversized body: {body[:300]!r}"
    if status < 400:
        assert b"kv_transfer_params" not in body
        return
    assert content_type.startswith("application/json"), (status, content_type, body[:300])
    document = json.loads(body)
    assert set(document) == {"error"} and set(document["error"]) == ENVELOPE_KEYS, document
    error = document["error"]
    assert error["code"] == status, document
    assert isinstance(error["message"], str) and isinstance(error["type"], str), document
    assert error["param"] is None or isinstance(error["param"], str), document


def run_fuzz(strategy: st.SearchStrategy, examples: int, check) -> None:
    """`check` every example; fail if hypothesis ran fewer than `examples` (issue 6: >= 5,000)."""
    ran = 0

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck))
    @given(strategy)
    def one(case) -> None:
        nonlocal ran
        ran += 1
        check(case)

    one()
    assert ran >= examples


# --- in process: the Flask test client, engines mocked with `responses` -----------------------
P_PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[1, 2]],
    "remote_engine_id": "p-engine",
    "remote_request_id": "p-req",
    "remote_host": "localhost",
    "remote_port": 5600,
    "tp_size": 1,
}
D_PARAMS = {
    **P_PARAMS,
    "do_remote_prefill": False,
    "do_remote_decode": True,
    "remote_engine_id": "d-engine",
    "remote_request_id": "d-req",
    "remote_port": 5700,
}
P_HOST, D_HOST = urlsplit(P_URL).hostname, urlsplit(D_URL).hostname


def _choice(chat: bool, finish: str | None, stream: bool) -> dict:
    key = ("delta" if stream else "message") if chat else "text"
    value = {"role": "assistant", "content": " a"} if chat else " a"
    return {"index": 0, key: value, "finish_reason": finish}


def engine(request) -> tuple[int, dict, str]:
    """A P or D engine that accepts anything (the gateway's own checks are what is under test)."""
    chat = request.url.endswith(CHAT)
    if request.url.startswith(P_URL):
        return (
            200,
            {},
            json.dumps(
                {"choices": [_choice(chat, "length", False)], "kv_transfer_params": P_PARAMS}
            ),
        )
    if not json.loads(request.body).get("stream"):
        return (
            200,
            {},
            json.dumps({"choices": [_choice(chat, "stop", False)], "kv_transfer_params": D_PARAMS}),
        )
    events = [
        {"choices": [_choice(chat, None, True)]},
        {"choices": [_choice(chat, "stop", True)], "kv_transfer_params": D_PARAMS},
    ]
    return (
        200,
        {"Content-Type": "text/event-stream"},
        "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n",
    )


@pytest.fixture
def engines_mock():
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        for url in (P_URL, D_URL):
            for path in (CHAT, COMPLETIONS):
                mock.add_callback("POST", url + path, callback=engine)
        yield mock


def _strict(raw: bytes) -> dict:
    def reject(name: str):
        raise AssertionError(f"the gateway forwarded {name}, which is not JSON: {raw[:300]!r}")

    return json.loads(raw, parse_constant=reject)


def check_in_process(client, mock: responses.RequestsMock, case: Case) -> None:
    """Send `case` through the test client; check the reply and what reached the engines."""
    mock.calls.reset()
    environ, headers = {}, dict(case.headers)
    if case.framing == "chunked":
        headers["Transfer-Encoding"] = "chunked"
        environ["wsgi.input_terminated"] = True
    elif case.framing != "length":
        environ["CONTENT_LENGTH"] = str(case.declared)
    reply = client.open(
        case.path, method=case.method, data=case.raw, headers=headers, environ_overrides=environ
    )
    body = reply.get_data()  # runs a streamed reply to its end
    check_reply(case, reply.status_code, reply.content_type or "", body)
    # Every engine call of a turn has a body: one without is some thread's, not this turn's.
    odd = [(c.request.method, c.request.url) for c in mock.calls if c.request.body is None]
    assert not odd, (odd, [t.name for t in threading.enumerate()])
    sent = [_strict(call.request.body) for call in mock.calls]
    if reply.status_code >= 400:
        assert not sent, f"a rejected request reached an engine: {case!r}"
        return
    # Accepted: exactly P then D, with the gateway's fields, never the client's.
    assert [c.request.url.split("/v1")[0] for c in mock.calls] == [P_URL, D_URL]
    assert all("conversation_id" not in b for b in sent)
    entry_params = {**D_PARAMS, "remote_host": D_HOST}
    assert sent[0]["kv_transfer_params"] in (MISS_PARAMS, entry_params), sent[0]
    assert sent[1]["kv_transfer_params"] == {**P_PARAMS, "remote_host": P_HOST}


@pytest.mark.parametrize("path,examples", [(CHAT, 1500), (COMPLETIONS, 1000)])
def test_fields_of_any_type_get_envelopes(client, engines_mock, path, examples):
    run_fuzz(
        mutated(path).map(lambda raw: Case(path, raw)),
        examples,
        lambda case: check_in_process(client, engines_mock, case),
    )


def test_broken_bytes_get_envelopes(client, engines_mock):
    raw_cases = st.sampled_from([CHAT, COMPLETIONS]).flatmap(
        lambda path: corrupted(path).map(lambda raw: Case(path, raw))
    )
    run_fuzz(raw_cases, 1500, lambda case: check_in_process(client, engines_mock, case))


def test_odd_headers_framing_and_routes_get_envelopes(client, engines_mock):
    run_fuzz(
        cases(("length", "chunked", "long", "short")),
        1000,
        lambda case: check_in_process(client, engines_mock, case),
    )


# --- a real gateway under gunicorn, raw sockets ------------------------------------------------
# One worker: gunicorn reads bodies differently per worker class, not per worker count.
@pytest.fixture(params=["gevent", "gthread"])
@starts_processes
def real_gateway(request, fresh_engines, gateway_factory):
    p, d = fresh_engines
    return gateway_factory([p.url], [d.url], worker_class=request.param, max_body_bytes=LIMIT)


def wire(case: Case, host: str) -> bytes:
    """The request's bytes: request line, headers, then the body framed as `case` says."""
    lines = [f"{case.method} {case.path} HTTP/1.1", f"Host: {host}"]
    lines += [f"{name}: {value}" for name, value in case.headers.items()]
    body = case.raw
    if case.framing == "chunked":
        lines.append("Transfer-Encoding: chunked")
        pieces = [body[i : i + case.delta] for i in range(0, len(body), case.delta)]
        body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
    else:
        lines.append(f"Content-Length: {case.declared}")
    return "\r\n".join(lines).encode("latin-1") + b"\r\n\r\n" + body


def send_raw(
    gateway, case: Case, data: bytes | None = None, end_early: bool | None = None
) -> tuple[int, str, bytes]:
    """One request on a fresh connection; the client closes after the one response.

    `end_early` shuts the write side after sending, so a body shorter than it claims ends in
    EOF rather than a wait (by default when Content-Length claims more than is sent).
    """
    with socket.create_connection((gateway.host, gateway.port), timeout=15) as sock:
        sock.sendall(wire(case, gateway.host) if data is None else data)
        if end_early is None:
            end_early = case.framing == "long"
        if end_early:
            sock.shutdown(socket.SHUT_WR)
        response = http.client.HTTPResponse(sock, method=case.method)
        response.begin()
        return response.status, response.getheader("Content-Type", ""), response.read()


def test_real_gateway_fuzzed_requests_get_envelopes(real_gateway):
    def check(case: Case) -> None:
        check_reply(case, *send_raw(real_gateway, case))

    run_fuzz(cases(("length", "chunked", "long")), 150, check)


OVERSIZED = {
    "content-length": Case(CHAT, b"x" * (LIMIT + 1)),
    "chunked": Case(CHAT, b"x" * (3 * LIMIT), framing="chunked", delta=1000),
    "chunked-one-byte-over": Case(CHAT, b"x" * (LIMIT + 1), framing="chunked", delta=LIMIT + 1),
    # Claims a gigabyte, sends 20 bytes and waits: rejected on the header, not after a read.
    "lying-content-length": Case(CHAT, b'{"messages": [1, 2]}', framing="long", delta=10**9),
}


@pytest.mark.parametrize("name", OVERSIZED)
def test_real_gateway_oversized_bodies_get_413(real_gateway, name):
    case = OVERSIZED[name]
    status, content_type, body = send_raw(real_gateway, case, end_early=False)
    assert status == 413, body
    check_reply(case, status, content_type, body)


def test_real_gateway_deep_nesting_inside_a_field(real_gateway):
    # Just under json's recursion limit: parsed, then digested and forwarded under gunicorn's
    # own threads or greenlets, which have less stack left than the test client.
    nested = b"[" * 950 + b"]" * 950
    case = Case(
        CHAT,
        b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, '
        b'"tools": ' + nested + b"}",
    )
    status, content_type, body = send_raw(real_gateway, case)
    check_reply(case, status, content_type, body)


BROKEN_HTTP = {
    "request-line": b"GARBAGE\r\n\r\n",
    "header-name": b"POST /v1/completions HTTP/1.1\r\nHost: h\r\nBad Name: 1\r\n\r\n",
    "control-char": b"POST /v1/completions HTTP/1.1\r\nHost: h\r\nX-Request-Id: a\x01b\r\n\r\n",
    "content-length": b"POST /v1/completions HTTP/1.1\r\nHost: h\r\nContent-Length: 1x\r\n\r\n",
    "both-framings": b"POST /v1/completions HTTP/1.1\r\nHost: h\r\nContent-Length: 2\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "transfer-coding": b"POST /v1/completions HTTP/1.1\r\nHost: h\r\n"
    b"Transfer-Encoding: gzip\r\n\r\n",
}


@pytest.mark.parametrize("name", BROKEN_HTTP)
def test_gunicorn_rejects_broken_http_itself(real_gateway, name):
    """Out of scope for the envelope: these never reach the app; gunicorn answers 400 itself."""
    status, content_type, _ = send_raw(
        real_gateway, Case(COMPLETIONS, b""), data=BROKEN_HTTP[name], end_early=True
    )
    assert status == 400 and content_type.startswith("text/html")


# --- once bugs: each the smallest input that showed it (a 5xx or Infinity sent upstream) -------
SURROGATE = b'{"messages": [{"role": "user", "content": "\\ud800"}]}'
TOOL_CALL = (
    b'{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", '
    b'"content": "", "tool_calls": [{"id": "c", "function": "f"}]}]}'
)
OVERFLOW = b'{"messages": [{"role": "user", "content": "x"}], "temperature": 1e999}'


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(Case(CHAT, SURROGATE), id="lone-surrogate"),
        pytest.param(Case(CHAT, TOOL_CALL), id="tool-call-function-not-object"),
        pytest.param(Case(CHAT, OVERFLOW), id="number-overflow-forwarded-as-infinity"),
    ],
)
def test_former_bugs(client, engines_mock, case):
    check_in_process(client, engines_mock, case)


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(
            Case(
                CHAT,
                b'{"messages": [{"role": "user", "content": "x"}]}',
                headers={"Authorization": "\xa0token"},
            ),
            id="authorization-leading-nbsp",
        ),
        pytest.param(
            Case(
                CHAT,
                b'{"messages": [{"role": "user", "content": "x"}]}',
                framing="chunked",
                delta=10,
            ),
            id="truncated-chunked-body",
        ),
    ],
)
def test_former_bugs_real_gateway(real_gateway, case):
    data = wire(case, real_gateway.host)
    truncated = case.framing == "chunked"
    if truncated:
        data = data[: -len(b"0\r\n\r\n")]
    check_reply(case, *send_raw(real_gateway, case, data=data, end_early=truncated))
