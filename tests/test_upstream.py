"""The gateway's connections to its engines (gateway/engines/upstream.py): pools that cover every
engine and worker, a connection handed back to its pool never cut by the watch of the request
that used it, and failures classified by their type, not their message."""
from __future__ import annotations

import contextlib
import contextvars
import socket
import threading
import time

import pytest
import requests

from tests.helpers.servers import MODEL


def test_the_connection_pools_cover_every_engine_and_worker():
    from gateway.service import Gateway
    from gateway.config import Settings
    gateway = Gateway(Settings(engine_metrics_interval=0, prefill=[f"http://10.0.0.{i}:8100" for i in range(12)],
                               decode=[f"http://10.0.1.{i}:8200" for i in range(12)], workers=8))
    try:
        adapter = gateway.upstream.session.get_adapter("http://10.0.0.1:8100")
        assert adapter._pool_connections >= 12 + 12 + 8
    finally:
        gateway.close()


def test_failures_are_classified_by_type_not_by_message():
    from gateway.support.errors import BadGateway, GatewayTimeout, ServiceUnavailable
    from gateway.engines.instances import Instance
    from gateway.engines.upstream import _translate
    instance = Instance("http://10.9.0.1:8100", "prefill", 0)

    def caused(message, cause):
        exc = requests.ConnectionError(message)
        exc.__cause__ = cause
        return exc

    # A reset whose message happens to say "refused", and a refusal whose message does not.
    assert isinstance(_translate(caused("peer refused to go on", ConnectionResetError()), instance),
                      BadGateway)
    assert isinstance(_translate(caused("Max retries exceeded", ConnectionRefusedError(111, "x")),
                                 instance), ServiceUnavailable)
    assert isinstance(_translate(caused("it timed out, says the text", OSError("no")), instance),
                      BadGateway)
    assert isinstance(_translate(requests.ReadTimeout("read"), instance), GatewayTimeout)


def test_a_rejected_stream_leaves_no_connection_for_its_watch_to_cut(fresh_engines):
    """A stream that gets a >= 400 reply gives its connection back to the pool; the next request
    reuses that socket. The first request's watch must not cut it when its deadline passes."""
    from gateway.support.errors import GatewayError
    from gateway.engines.instances import Instance
    from gateway.engines.upstream import Upstream
    from gateway.engines.watch import Watch
    p, d = fresh_engines
    upstream = Upstream(2, 30, pool_size=1)
    instance = Instance(d.url, "decode", 0)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True,
            "max_tokens": 20, "kv_transfer_params": {}}

    def first():
        Watch(None, time.monotonic() + 0.5)              # this request's deadline: 0.5 s
        d.set_fault("error500", count=1)
        with pytest.raises(GatewayError):
            upstream.open_stream(instance, "/v1/chat/completions", body, {})

    contextvars.copy_context().run(first)
    d.set_fault("slow", delay_s=1.0, count=1)           # the second request outlives it

    def second():
        stream = upstream.open_stream(instance, "/v1/chat/completions", body, {})
        try:
            return b"".join(stream.chunks())
        finally:
            stream.close()

    assert contextvars.copy_context().run(second).endswith(b"data: [DONE]\n\n")
    upstream.session.close()


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


@pytest.mark.parametrize("then_close, error", [(True, "BadGateway"), (False, "GatewayTimeout")],
                         ids=["cut", "silent"])
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
        upstream.session.close()
