"""The gateway's connections to its engines (gateway/engines/upstream.py): pools that cover every
engine and worker, a connection handed back to its pool never cut by the watch of the request
that used it, and failures classified by their type, not their message."""

from __future__ import annotations

import contextlib
import contextvars
import gzip
import http.server
import json
import socket
import threading
import time
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.helpers.servers import MODEL, QuietHandler
from tests.helpers.transport import Replay


def test_the_connection_pools_cover_every_engine_and_worker():
    """A pool per engine and per worker listener (forwarding), none dropped while the others are
    used: fewer pools than hosts would close and reopen connections all the time."""
    from gateway.engines.instances import Instance
    from gateway.engines.transport import Transport

    transport = Transport(pool_size=4)
    hosts = (
        [Instance(f"http://10.0.0.{i}:8100", "prefill", i) for i in range(12)]
        + [Instance(f"http://10.0.1.{i}:8200", "decode", i) for i in range(12)]
        + [Instance(f"http://127.0.0.1:{9000 + i}", "decode", i) for i in range(8)]
    )
    pools = [transport._pool(instance) for instance in hosts]
    try:
        assert len(set(map(id, pools))) >= 12 + 12 + 8
        assert [transport._pool(instance) for instance in hosts] == pools
    finally:
        transport.close()


def test_failures_are_classified_by_type_not_by_message():
    from gateway.engines.instances import Instance
    from gateway.engines.upstream import _translate
    from gateway.support.errors import BadGateway, GatewayTimeout, ServiceUnavailable

    instance = Instance("http://10.9.0.1:8100", "prefill", 0)

    def caused(message, cause):
        exc = OSError(message)
        exc.__cause__ = cause
        return exc

    # A reset whose message happens to say "refused", and a refusal whose message does not.
    assert isinstance(
        _translate(caused("peer refused to go on", ConnectionResetError()), instance), BadGateway
    )
    assert isinstance(
        _translate(caused("Max retries exceeded", ConnectionRefusedError(111, "x")), instance),
        ServiceUnavailable,
    )
    assert isinstance(
        _translate(caused("it timed out, says the text", OSError("no")), instance), BadGateway
    )
    assert isinstance(_translate(TimeoutError("read"), instance), GatewayTimeout)


def test_a_rejected_stream_leaves_no_connection_for_its_watch_to_cut(fresh_engines):
    """A stream that gets a >= 400 reply gives its connection back to the pool; the next request
    reuses that socket. The first request's watch must not cut it when its deadline passes."""
    from gateway.engines.instances import Instance
    from gateway.engines.upstream import Upstream
    from gateway.engines.watch import Watch
    from gateway.support.errors import GatewayError

    p, d = fresh_engines
    upstream = Upstream(2, 30, pool_size=1)
    instance = Instance(d.url, "decode", 0)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "x"}],
        "stream": True,
        "max_tokens": 20,
        "kv_transfer_params": {},
    }

    def first():
        Watch(None, time.monotonic() + 0.5)  # this request's deadline: 0.5 s
        d.set_fault("error500", count=1)
        with pytest.raises(GatewayError):
            upstream.open_stream(instance, "/v1/chat/completions", body, {})

    contextvars.copy_context().run(first)
    d.set_fault("slow", delay_s=1.0, count=1)  # the second request outlives it

    def second():
        stream = upstream.open_stream(instance, "/v1/chat/completions", body, {})
        try:
            return b"".join(stream.chunks())
        finally:
            stream.close()

    assert contextvars.copy_context().run(second).endswith(b"data: [DONE]\n\n")
    upstream.close()


@contextlib.contextmanager
def engine_that_answers(head: bytes, then_close: bool):
    """A raw engine on loopback: reads one request, sends `head` (a status line, headers and
    the start of a body), then closes the connection or stays silent."""
    server = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def serve() -> None:
        connection, _ = server.accept()
        with connection:
            connection.recv(65536)
            connection.sendall(head)
            if not then_close:
                done.wait(10)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        done.set()
        thread.join(10)
        server.close()


@pytest.mark.parametrize(
    "then_close, error", [(True, "BadGateway"), (False, "GatewayTimeout")], ids=["cut", "silent"]
)
def test_a_json_reply_that_breaks_off_is_a_gateway_error(then_close, error):
    """P's headers came, its body did not all come: the engine's failure (502, or 504 when it
    goes silent past the read timeout), never an exception the view would answer with a 500."""
    from gateway.engines.instances import Instance
    from gateway.engines.upstream import Upstream
    from gateway.support import errors

    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
    with engine_that_answers(head, then_close) as url:
        upstream = Upstream(2, 0.5, pool_size=1)
        with pytest.raises(getattr(errors, error)):
            upstream.post_json(Instance(url, "prefill", 0), "/v1/chat/completions", {}, {})
        upstream.close()


@contextlib.contextmanager
def engine_of_replies(replies: list):
    """A raw engine on loopback that answers each request it reads with the next of `replies`
    (whole HTTP responses; a pair (response, True) closes the connection after it), on whatever
    connection it came; yields (its URL, the connections it accepted)."""
    server = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    pending = list(replies)
    stop = threading.Event()

    def serve_one(connection: socket.socket) -> None:
        with connection:
            while pending and not stop.is_set():
                request = b""
                while b"\r\n\r\n" not in request:
                    chunk = connection.recv(65536)
                    if not chunk:
                        return
                    request += chunk
                head, _, body = request.partition(b"\r\n\r\n")
                length = int(
                    next(
                        (
                            line.split(b":")[1]
                            for line in head.split(b"\r\n")
                            if line.lower().startswith(b"content-length:")
                        ),
                        b"0",
                    )
                )
                while len(body) < length:
                    body += connection.recv(65536)
                reply, then_close = pending.pop(0), False
                if isinstance(reply, tuple):
                    reply, then_close = reply
                connection.sendall(reply)
                if then_close:
                    return

    def serve() -> None:
        while pending and not stop.is_set():
            try:
                connection, _ = server.accept()
            except OSError:
                return
            accepted.append(connection)
            threading.Thread(target=serve_one, args=(connection,), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}", accepted
    finally:
        stop.set()
        with contextlib.suppress(OSError):
            socket.create_connection(server.getsockname(), timeout=1).close()  # ends accept()
        thread.join(10)
        server.close()


OK_JSON = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
STREAM = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
    b'10\r\ndata: {"a": 1}\n\n\r\n0\r\n\r\n'
)


def _upstream_and_instance(url: str):
    from gateway.engines.instances import Instance
    from gateway.engines.upstream import Upstream

    return Upstream(2, 5, pool_size=4), Instance(url, "prefill", 0)


def test_an_engine_connection_is_used_again_once_its_reply_was_read():
    with engine_of_replies([OK_JSON, STREAM, OK_JSON]) as (url, accepted):
        upstream, instance = _upstream_and_instance(url)
        assert upstream.post_json(instance, "/v1/completions", {}, {}) == {}
        stream = upstream.open_stream(instance, "/v1/completions", {}, {})
        assert b"".join(stream.chunks()) == b'data: {"a": 1}\n\n'
        stream.close()
        assert upstream.post_json(instance, "/v1/completions", {}, {}) == {}
        assert len(accepted) == 1
        upstream.close()


@pytest.mark.parametrize("first", ["stream cut short", "connection: close"])
def test_an_engine_connection_is_not_used_again_after(first):
    """A stream closed before its end still has bytes coming on its connection; an engine that
    said `Connection: close` closes it: the next call opens a new one."""
    reply = (
        STREAM
        if first == "stream cut short"
        else OK_JSON.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n")
    )
    with engine_of_replies([reply, OK_JSON]) as (url, accepted):
        upstream, instance = _upstream_and_instance(url)
        if first == "stream cut short":
            stream = upstream.open_stream(instance, "/v1/completions", {}, {})
            stream.close()  # nothing of it read
        else:
            assert upstream.post_json(instance, "/v1/completions", {}, {}) == {}
        assert upstream.post_json(instance, "/v1/completions", {}, {}) == {}
        assert len(accepted) == 2
        upstream.close()


def test_an_engine_that_answers_no_http_is_a_bad_gateway():
    from gateway.support.errors import BadGateway

    with engine_of_replies([b"SSH-2.0-OpenSSH_9.6\r\n\r\n"]) as (url, _):
        upstream, instance = _upstream_and_instance(url)
        with pytest.raises(BadGateway):
            upstream.post_json(instance, "/v1/completions", {}, {})
        upstream.close()


def test_an_engine_that_refuses_or_never_accepts_is_unavailable():
    """A refused connection and one not accepted within the connect timeout: 503 (the engine
    never saw the request), not 502 or 504."""
    from gateway.engines.instances import Instance
    from gateway.engines.upstream import Upstream
    from gateway.support.errors import ServiceUnavailable

    with socket.create_server(("127.0.0.1", 0)) as closed:
        port = closed.getsockname()[1]
    upstream = Upstream(0.3, 5, pool_size=4)
    with pytest.raises(ServiceUnavailable, match="refused"):
        upstream.post_json(Instance(f"http://127.0.0.1:{port}", "prefill", 0), "/x", {}, {})
    # A listener whose queue is full: Linux drops further SYNs, so connect waits.
    with socket.socket() as full:
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        queued = [socket.create_connection(full.getsockname(), timeout=1)]
        try:
            while True:  # fill the accept queue (its size is the backlog, plus one)
                extra = socket.socket()
                extra.settimeout(0.2)
                try:
                    extra.connect(full.getsockname())
                except OSError:
                    extra.close()
                    break
                queued.append(extra)
            with pytest.raises(ServiceUnavailable, match="in time"):
                upstream.post_json(
                    Instance("http://{}:{}".format(*full.getsockname()), "prefill", 0), "/x", {}, {}
                )
        finally:
            for sock in queued:
                sock.close()
    upstream.close()


@contextlib.contextmanager
def engine_that_stalls(head: bytes):
    """A raw engine on loopback that reads one request, sends `head`, then waits for the
    gateway to close the connection; yields (its URL, a list that gets what its next read
    returned: b"" once the gateway closed it) and its thread, to join."""
    seen: list[bytes] = []
    with socket.create_server(("127.0.0.1", 0)) as server:

        def engine() -> None:
            connection, _ = server.accept()
            with connection:
                connection.recv(65536)
                connection.sendall(head)
                connection.settimeout(10)
                seen.append(connection.recv(10))

        thread = threading.Thread(target=engine, daemon=True)
        thread.start()
        yield f"http://127.0.0.1:{server.getsockname()[1]}", seen, thread


def test_a_failed_body_read_closes_the_engine_connection_at_once():
    """P sent its head and part of its body, then stalled: 504, and P sees its connection
    closed then (vLLM stops a request whose client left), not when the error is forgotten."""
    from gateway.engines.instances import Instance
    from gateway.engines.upstream import Upstream
    from gateway.support.errors import GatewayTimeout

    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
    with engine_that_stalls(head) as (url, seen, thread):
        upstream = Upstream(2, 0.3, pool_size=1)
        with pytest.raises(GatewayTimeout) as held:  # the error kept while P is checked
            upstream.post_json(Instance(url, "prefill", 0), "/v1/completions", {}, {})
        thread.join(10)
        assert seen == [b""] and held.value is not None
        upstream.close()


def test_an_error_reply_whose_body_stalls_is_a_gateway_error():
    """A 500 whose body stops coming, on a stream call: 504, not an exception the view answers
    with a 500 of its own."""
    from gateway.support.errors import GatewayTimeout

    head = b"HTTP/1.1 500 Oops\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
    with engine_that_answers(head, then_close=False) as url:
        from gateway.engines.instances import Instance
        from gateway.engines.upstream import Upstream

        upstream = Upstream(2, 0.3, pool_size=1)
        with pytest.raises(GatewayTimeout):
            upstream.open_stream(Instance(url, "decode", 0), "/v1/completions", {}, {})
        upstream.close()


def test_an_unreachable_engine_is_unavailable():
    """No route to it (a pod's address gone): 503 as for a refusal, so it is marked down and P's
    params may go to another D; not 502."""
    from gateway.engines.instances import Instance
    from gateway.engines.upstream import Upstream
    from gateway.support.errors import ServiceUnavailable

    upstream = Upstream(1, 5, pool_size=1)
    with pytest.raises(ServiceUnavailable, match="could not be reached"):
        upstream.post_json(Instance("http://255.255.255.255:9", "decode", 0), "/x", {}, {})
    upstream.close()


def test_an_ipv6_engine_with_credentials_and_a_base_path():
    requests_seen: list[bytes] = []
    try:
        server = socket.create_server(("::1", 0), family=socket.AF_INET6)
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")
    port = server.getsockname()[1]

    def engine() -> None:
        connection, _ = server.accept()
        with connection:
            for _ in range(2):
                request = b""
                while not request.endswith(b"{}"):
                    request += connection.recv(65536)
                requests_seen.append(request)
                connection.sendall(OK_JSON)

    thread = threading.Thread(target=engine, daemon=True)
    thread.start()
    try:
        upstream, instance = _upstream_and_instance(f"http://u:p%40w@[::1]:{port}/base")
        assert upstream.post_json(instance, "/v1/completions", {}, {}) == {}
        assert upstream.post_json(instance, "/v1/completions", {}, {}) == {}  # same connection
        thread.join(10)
        first = requests_seen[0]
        assert first.startswith(b"POST /base/v1/completions ")
        assert f"Host: [::1]:{port}".encode() in first
        assert b"Authorization: Basic dTpwQHc=" in first  # u:p@w
        upstream.close()
    finally:
        server.close()


def test_threads_share_an_engine_pool():
    """gthread: calls from 8 threads at once on one engine's pool, none failing, at most
    `pool_size` connections kept."""
    with engine_of_replies([OK_JSON] * 240) as (url, accepted):
        upstream, instance = _upstream_and_instance(url)
        errors: list[BaseException] = []

        def calls() -> None:
            try:
                for _ in range(30):
                    assert upstream.post_json(instance, "/v1/completions", {}, {}) == {}
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=calls) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        [pool] = upstream.transport._pools.values()
        assert not errors and len(pool._idle) <= 4
        upstream.close()


def test_a_failed_stream_read_closes_the_engine_connection_at_once():
    """D's stream stalls past the read timeout: the read's error closes D's connection before
    the relay writes its error event (D computes a request until its connection closes)."""
    from gateway.engines.instances import Instance
    from gateway.engines.upstream import Upstream
    from gateway.support.errors import GatewayTimeout

    with engine_that_stalls(STREAM.split(b"0\r\n\r\n")[0]) as (url, seen, thread):
        upstream = Upstream(2, 0.3, pool_size=1)
        stream = upstream.open_stream(Instance(url, "decode", 0), "/v1/completions", {}, {})
        chunks = stream.chunks()
        assert next(chunks) == b'data: {"a": 1}\n\n'
        with pytest.raises(GatewayTimeout):
            next(chunks)
        thread.join(10)  # the stream itself not closed yet
        assert seen == [b""]
        stream.close()
        upstream.close()


@pytest.mark.parametrize(
    "head, reused",
    [
        # field names in any case, the chunked coding named in capitals
        (
            b"HTTP/1.1 200 OK\r\nCONTENT-type: application/json\r\n"
            b"Transfer-Encoding: Chunked\r\n\r\n"
            b"2\r\n{}\r\n0\r\n\r\n",
            True,
        ),
        # a line that is not a field ends the fields: the length after it is not read (to close)
        (b"HTTP/1.1 200 OK\r\nno colon here\r\nContent-Length: 2\r\n\r\n{}", False),
        (b"HTTP/1.1 200 OK\r\nContent-Length : 2\r\n\r\n{}", False),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: Close\r\n\r\n{}", False),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\n{}", False),  # 1.0 without keep-alive
        (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\nKeep-Alive: timeout=5\r\n\r\n{}", True),
        # interim replies before the reply: 100 Continue, 103 Early Hints
        (
            b"HTTP/1.1 100 Continue\r\nX-Skipped: 1\r\n\r\n"
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}",
            True,
        ),
        (
            b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}",
            True,
        ),
        (b"HTTP/1.1 200 OK\r\n" + b"X-Many: 1\r\n" * 98 + b"Content-Length: 2\r\n\r\n{}", True),
    ],
)
def test_an_engine_reply_head_is_read_as_http_client_reads_it(head, reused):
    """The engine calls read a reply's head with their own field parser (transport.read_fields),
    not the email package's: the same fields, framing and keep-alive as http.client's (and an
    interim reply of any kind skipped, where http.client skips only 100)."""
    # (a reply read to its connection's close gets it closed)
    with engine_of_replies([head if reused else (head, True), OK_JSON]) as (url, accepted):
        upstream, instance = _upstream_and_instance(url)
        assert upstream.post_json(instance, "/v1/completions", {}, {}) == {}
        assert upstream.post_json(instance, "/v1/completions", {}, {}) == {}
        assert len(accepted) == (1 if reused else 2)
        upstream.close()


def test_a_reply_without_a_body_leaves_the_connection_ready():
    """204: no body whatever its fields say; the connection serves the next call."""
    head = b"HTTP/1.1 204 No Content\r\nContent-Length: 7\r\n\r\n"
    with engine_of_replies([head, OK_JSON]) as (url, accepted):
        upstream, instance = _upstream_and_instance(url)
        stream = upstream.post_raw(instance, "/v1/completions", b"{}", {})
        assert stream.status == 204 and b"".join(stream.chunks()) == b""
        stream.close()
        assert upstream.post_json(instance, "/v1/completions", {}, {}) == {}
        assert len(accepted) == 1
        upstream.close()


def test_an_error_reply_s_message_in_latin_1_is_kept():
    """An engine's 400 whose JSON is not UTF-8: its message still reaches the client."""
    from gateway.support.errors import UpstreamRejected

    body = b'{"error": {"message": "caf\xe9"}}'
    head = b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n" % len(body)
    with engine_of_replies([head + body]) as (url, _):
        upstream, instance = _upstream_and_instance(url)
        with pytest.raises(UpstreamRejected, match="café"):
            upstream.post_json(instance, "/v1/completions", {}, {})
        upstream.close()


def test_a_streamed_reply_s_fields_are_found_in_any_case():
    """What the gateway reads of a stream's head (its content type; through forwarding, the
    owner's Retry-After and rate-limit fields) is found whatever the case either side wrote."""
    head = (
        b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n"
        b"RETRY-AFTER: 7\r\nx-ratelimit-remaining-requests: 0\r\nX-Note: one\r\n  two\r\n  \r\n"
        b"x-note: three\r\nContent-Length: 2\r\n\r\n{}"
    )
    with engine_of_replies([head]) as (url, _):
        upstream, instance = _upstream_and_instance(url)
        stream = upstream.post_raw(instance, "/v1/completions", b"{}", {})
        assert (stream.status, stream.content_type) == (429, "application/json")
        assert "Retry-After" in stream.headers and stream.headers["Retry-After"] == "7"
        assert stream.headers.get("X-RateLimit-Remaining-Requests") == "0"
        assert "Retry-After-Ms" not in stream.headers and 7 not in stream.headers
        # folded (a fold of blanks only adds one, as http.client's value keeps them); the first
        assert stream.headers["x-NOTE"] == "one two "
        assert b"".join(stream.chunks()) == b"{}"
        stream.close()
        upstream.close()


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 200 OK\r\n" + b"X-Many: 1\r\n" * 99 + b"Content-Length: 2\r\n\r\n{}",
        b"HTTP/1.1 200 OK\r\nX-Long: " + b"a" * 70_000 + b"\r\nContent-Length: 2\r\n\r\n{}",
        b"HTTP/2 200 OK\r\nContent-Length: 2\r\n\r\n{}",
    ],
)
def test_an_engine_reply_head_past_http_client_s_limits_is_a_bad_gateway(head):
    """More lines than http.client takes (100, the blank one too), a field line longer than it takes
    (64 KiB), an HTTP version it does not speak: 502, as with http.client's own parser."""
    from gateway.support.errors import BadGateway

    with engine_of_replies([head]) as (url, _):
        upstream, instance = _upstream_and_instance(url)
        with pytest.raises(BadGateway):
            upstream.post_json(instance, "/v1/completions", {}, {})
        upstream.close()


_FIELD_NAMES = st.sampled_from(
    [
        "Content-Length",
        "content-length",
        "Transfer-Encoding",
        "Connection",
        "Keep-Alive",
        "X-Note",
        "x-note",
        "Retry-After",
    ]
)
_FIELD_VALUES = st.one_of(
    st.sampled_from(
        [
            "2",
            " 7 ",
            "-1",
            "abc",
            "chunked",
            "Chunked",
            "chunked ",
            "gzip, chunked",
            "close",
            "close\t",
            "keep-alive",
            "Keep-Alive",
            "",
        ]
    ),
    st.text(
        alphabet=st.characters(min_codepoint=0x20, max_codepoint=0xFF, blacklist_characters="\x7f"),
        max_size=20,
    ),
)
_HEAD_LINES = st.one_of(
    st.tuples(_FIELD_NAMES, _FIELD_VALUES).map(lambda f: f"{f[0]}: {f[1]}"),  # a field
    st.tuples(st.sampled_from([" ", "\t", "   "]), _FIELD_VALUES).map("".join),  # folded
    st.sampled_from(["no colon here", "Content-Length : 2", "X Note: 1", ":"]),  # odd lines
)


@given(st.lists(_HEAD_LINES, max_size=40), st.sampled_from(["HTTP/1.1", "HTTP/1.0"]))
@example(["Transfer-Encoding: chunked", " "], "HTTP/1.1")  # a fold of blanks only
@example(["Transfer-Encoding: chunked  "], "HTTP/1.1")  # trailing blanks
@example(["Content-Length: 2 ", "Connection: close\t"], "HTTP/1.1")
@settings(max_examples=1000, deadline=None, derandomize=True)  # the same heads every run
def test_a_reply_head_is_read_as_http_client_reads_it(lines, version):
    """Any head, odd lines and all: each field is http.client's own first value of it (the
    email package's parser; a folded line's break and indent as one space), and the reply is
    framed as http.client frames it (chunked or not, its length, whether the connection
    closes after it)."""
    import http.client

    from gateway.engines.transport import EngineHTTPResponse

    raw = (f"{version} 200 OK\r\n" + "".join(f"{line}\r\n" for line in lines)).encode("latin-1")
    raw += b"\r\nbody"
    ours, theirs = (
        EngineHTTPResponse(Replay(raw), method="POST"),
        http.client.HTTPResponse(Replay(raw), method="POST"),
    )
    ours.begin()
    theirs.begin()

    def words(value):
        return None if value is None else value.split()

    for name in {line.partition(":")[0] for line in lines}:
        for variant in (name, name.lower(), name.upper()):
            assert words(ours.headers.get(variant)) == words(theirs.headers.get(variant))
    assert (ours.chunked, ours.length, ours.will_close) == (
        theirs.chunked,
        theirs.length,
        theirs.will_close,
    )


class _Sizes(QuietHandler):
    """Answers a POST with a JSON body of `size` bytes and `status`."""

    protocol_version = "HTTP/1.1"
    size, status = 3000, 200

    def do_POST(self):  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers["Content-Length"]))
        message = "x" * (self.size - 30)
        body = json.dumps(
            {"error": {"message": message}} if self.status >= 400 else {"text": message}
        ).encode()
        try:
            self.answer(self.status, body, {"Content-Type": "application/json"})
        except OSError:  # the gateway stopped reading: as it should
            pass


def test_an_engine_reply_is_read_up_to_its_limit_and_no_further(monkeypatch):
    """A reply beyond what the gateway reads of one is a 502, not the worker's memory; an error
    body, however large, gives its message from its first MiB."""
    from gateway.engines import upstream as module
    from gateway.engines.instances import Instance
    from gateway.support.errors import BadGateway, UpstreamRejected

    monkeypatch.setattr(module, "REPLY_LIMIT", 1000)
    with contextlib.ExitStack() as stack:
        upstream = module.Upstream(2.0, 5.0, pool_size=2)
        stack.callback(upstream.close)
        for size, status in ((900, 200), (3000, 200), (5 * 1024 * 1024, 400)):
            handler = type("Sized", (_Sizes,), {"size": size, "status": status})
            server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
            stack.callback(server.server_close)
            stack.callback(server.shutdown)
            threading.Thread(target=server.serve_forever, daemon=True).start()
            engine = Instance(f"http://127.0.0.1:{server.server_address[1]}", "prefill", 0)
            call = lambda engine=engine: upstream.post_json(engine, "/v1/completions", {}, {})  # noqa: E731
            if size == 900:
                assert len(call()["text"]) == 870
            elif status == 200:
                with pytest.raises(BadGateway, match="larger than 1,000 bytes"):
                    call()
            else:  # a stream's error: its body read for the message, 1 MiB at most
                with pytest.raises(UpstreamRejected) as refused:
                    upstream.open_stream(engine, "/v1/completions", {}, {})
                assert refused.value.status == 400 and len(refused.value.message) < 2000


class _Gzipped(QuietHandler):
    """An engine (or a proxy before it) that compresses its pages whatever it is asked."""

    protocol_version = "HTTP/1.1"
    page = b'vllm:num_requests_running{engine="0"} 1.0\n' * 100
    asked: list = []

    def do_GET(self):  # noqa: N802 (http.server's name)
        type(self).asked.append(self.headers.get("Accept-Encoding"))
        self.answer(200, gzip.compress(self.page), {"Content-Encoding": "gzip"})


def test_a_compressed_page_is_read_as_its_text_and_none_is_asked_for():
    from gateway.engines.instances import Instance
    from gateway.engines.upstream import Upstream

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Gzipped)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    upstream = Upstream(2.0, 5.0, pool_size=2)
    try:
        engine = Instance(f"http://127.0.0.1:{server.server_address[1]}", "decode", 0)
        assert upstream.get_bytes(engine, "/metrics", 2.0) == _Gzipped.page
        assert _Gzipped.asked == ["identity"]
    finally:
        upstream.close()
        server.shutdown()
        server.server_close()


# A self-signed certificate for 127.0.0.1 and its key, made once for these tests (openssl req
# -x509 -newkey rsa:2048 -nodes -days 36500 -subj /CN=127.0.0.1 -addext subjectAltName=IP:...).
TLS = Path(__file__).parent / "helpers" / "tls"
CERTIFICATE = (TLS / "engine-cert.pem", TLS / "engine-key.pem")


class _Page(QuietHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.answer(200, b"page", {"Content-Type": "text/plain"})

    def do_POST(self):  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers["Content-Length"]))
        self.answer(200, b'{"ok": true}', {"Content-Type": "application/json"})


@contextlib.contextmanager
def tls_engine(certificate=CERTIFICATE):
    """An `https://` engine on loopback; yields its URL and the sockets it accepted."""
    import ssl

    cert, key = certificate
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    accepted: list = []

    class Server(http.server.ThreadingHTTPServer):
        def get_request(self):
            sock, address = super().get_request()
            accepted.append(sock)
            return context.wrap_socket(sock, server_side=True), address

    server = Server(("127.0.0.1", 0), _Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"https://127.0.0.1:{server.server_address[1]}", accepted
    finally:
        server.shutdown()
        server.server_close()


def test_an_https_engine_is_called_over_verified_tls():
    """Every kind of engine call over TLS on the one transport, its connection kept alive; an
    engine whose certificate is not trusted (here: not in certifi's bundle, as with requests)
    is never called: 502 for a POST, down for a probe."""
    import ssl

    from gateway.engines.instances import Instance
    from gateway.engines.transport import Transport
    from gateway.engines.upstream import Upstream
    from gateway.support.errors import BadGateway

    trusting = ssl.create_default_context(cafile=str(CERTIFICATE[0]))
    with tls_engine() as (url, accepted):
        engine = Instance(url, "prefill", 0)
        upstream = Upstream(2, 5, pool_size=2, transport=Transport(2, tls=trusting))
        try:
            assert upstream.post_json(engine, "/v1/completions", {}, {}) == {"ok": True}
            assert upstream.get_bytes(engine, "/metrics", 2.0) == b"page"
            assert upstream.probe(engine, 2.0)
            assert len(accepted) == 1
        finally:
            upstream.close()
        default = Upstream(2, 5, pool_size=2)
        try:
            with pytest.raises(BadGateway):
                default.post_json(engine, "/v1/completions", {}, {})
            assert not default.probe(engine, 2.0)
        finally:
            default.close()
