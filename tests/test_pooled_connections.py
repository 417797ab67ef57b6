"""A pooled engine connection is checked before each reuse (`is_connected`, urllib3's name):
under gevent by a non-blocking peek of the real socket, elsewhere by a poll, as urllib3's. Both must
say the same: reusable while the engine sent nothing, dropped on EOF or on bytes nobody asked
for."""

from __future__ import annotations

import contextlib
import select
import socket

import gevent.socket
import pytest

from gateway.engines.transport import ONE_SEND_BYTES, EngineConnection


@contextlib.contextmanager
def connected(kind: str):
    """(the pooled connection, the engine's end of it), its socket gevent's or a plain one."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        address = server.getsockname()
        connection = EngineConnection(*address)
        connection.sock = (
            gevent.socket.create_connection(address)
            if kind == "gevent"
            else socket.create_connection(address, timeout=30)
        )
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
    assert not EngineConnection("127.0.0.1", 9).is_connected


class _Recording:
    """A socket whose writes are recorded, one entry a `sendall`."""

    def __init__(self, sock) -> None:
        self.sock = sock
        self.writes: list[bytes] = []

    def sendall(self, data) -> None:
        self.writes.append(bytes(data))
        self.sock.sendall(data)

    def __getattr__(self, name):
        return getattr(self.sock, name)


def _receive(engine, size: int) -> bytes:
    got = b""
    while len(got) < size:
        chunk = engine.recv(1 << 16)
        assert chunk, "the engine's end closed early"
        got += chunk
    return got


@pytest.mark.parametrize("body_bytes", [1, 10_000, ONE_SEND_BYTES])
def test_a_request_goes_out_in_one_write(body_bytes):
    """Head and body in one send: one segment and one wake-up of the engine, not two."""
    body = b"x" * body_bytes
    with connected("plain") as (connection, engine):
        connection.sock = recording = _Recording(connection.sock)
        connection.request(
            "POST", "/v1/completions", body=body, headers={"Content-Length": str(len(body))}
        )
        assert len(recording.writes) == 1
        sent = recording.writes[0]
        assert sent.endswith(b"\r\n\r\n" + body)
        assert _receive(engine, len(sent)) == sent


def test_a_larger_body_goes_after_its_head():
    body = b"x" * (ONE_SEND_BYTES + 1)
    with connected("plain") as (connection, engine):
        connection.sock = recording = _Recording(connection.sock)
        connection.request(
            "POST", "/v1/completions", body=body, headers={"Content-Length": str(len(body))}
        )
        head, sent_body = recording.writes
        assert head.endswith(b"\r\n\r\n") and sent_body == body
        assert _receive(engine, len(head) + len(body)) == head + body


def test_a_request_without_a_body_is_its_head():
    with connected("plain") as (connection, engine):
        connection.sock = recording = _Recording(connection.sock)
        connection.request("GET", "/health")
        [head] = recording.writes
        assert head.startswith(b"GET /health ") and head.endswith(b"\r\n\r\n")
        assert _receive(engine, len(head)) == head


def test_an_engine_at_an_ip_address_is_connected_to_without_a_resolution(monkeypatch):
    """gevent resolves every address `create_connection` is given on its thread pool, even an
    IP address: a new engine connection to one never goes through it; a name still does."""
    from gateway.engines import transport

    asked = []
    create_connection = socket.create_connection

    def resolving(address, *args, **kwargs):
        asked.append(address[0])
        return create_connection(address, *args, **kwargs)

    monkeypatch.setattr(transport.socket, "create_connection", resolving)
    with socket.create_server(("127.0.0.1", 0)) as server:
        host, port = server.getsockname()
        connection = EngineConnection(host, port, timeout=5)
        connection.connect()
        assert connection.sock.getpeername() == (host, port)
        connection.close()
        connection = EngineConnection("localhost", port, timeout=5)
        with contextlib.suppress(Exception):  # localhost may be ::1 first, where nobody listens
            connection.connect()
        connection.close()
    assert asked == ["localhost"]
