"""The gateway's connections to its engines (gateway/engines/upstream.py): pools that cover every
engine and worker, a connection handed back to its pool never cut by the watch of the request
that used it, and failures classified by their type, not their message."""
from __future__ import annotations

import contextvars
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
