"""A pooled engine connection is checked before each reuse (urllib3's is_connected): under
gevent by a non-blocking peek of the real socket, elsewhere by urllib3's own poll. Both must
say the same: reusable while the engine sent nothing, dropped on EOF or on bytes nobody asked
for."""
from __future__ import annotations

import contextlib
import select
import socket

import gevent.socket
import pytest

from gateway.engines.watch import _TrackedHTTPConnection


@contextlib.contextmanager
def connected(kind: str):
    """(the pooled connection, the engine's end of it), its socket gevent's or a plain one."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        address = server.getsockname()
        connection = _TrackedHTTPConnection(*address)
        connection.sock = (gevent.socket.create_connection(address) if kind == "gevent"
                           else socket.create_connection(address, timeout=30))
        engine, _ = server.accept()
        with engine:
            yield connection, engine
        connection.close()


def wait_readable(connection) -> None:
    """Until the engine's EOF or bytes have reached the connection's socket."""
    select.select([getattr(connection.sock, "_sock", connection.sock)], [], [], 5)


@pytest.mark.parametrize("kind", ["gevent", "plain"])
def test_an_idle_connection_is_reused(kind):
    with connected(kind) as (connection, _):
        assert connection.is_connected


@pytest.mark.parametrize("kind", ["gevent", "plain"])
def test_a_connection_the_engine_closed_is_dropped(kind):
    with connected(kind) as (connection, engine):
        engine.close()
        wait_readable(connection)
        assert not connection.is_connected


@pytest.mark.parametrize("kind", ["gevent", "plain"])
def test_a_connection_with_bytes_nobody_asked_for_is_dropped(kind):
    with connected(kind) as (connection, engine):
        engine.sendall(b"HTTP/1.1 408 Request Timeout\r\n\r\n")
        wait_readable(connection)
        assert not connection.is_connected


def test_a_connection_never_opened_is_not_connected():
    assert not _TrackedHTTPConnection("127.0.0.1", 9).is_connected
