"""One emulator process holds 500 concurrent streams (gevent), each delivered whole."""

from __future__ import annotations

import json
import selectors
import socket
import time

import pytest

from emulator.process import EmulatorProcess

pytestmark = pytest.mark.processes  # an engine process

STREAMS = 500


def run_streams(host: str, port: int, body: bytes, count: int, timeout: float) -> list[bytes]:
    """Open `count` raw HTTP/1.1 connections at once and read each response to EOF, in one
    thread."""
    request = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body
    selector = selectors.DefaultSelector()
    received: dict[int, bytearray] = {}
    for i in range(count):
        sock = socket.create_connection((host, port), timeout=timeout)
        sock.sendall(request)
        sock.setblocking(False)
        received[i] = bytearray()
        selector.register(sock, selectors.EVENT_READ, i)
    deadline = time.monotonic() + timeout
    while selector.get_map() and time.monotonic() < deadline:
        for key, _ in selector.select(timeout=1.0):
            data = key.fileobj.recv(65536)
            if data:
                received[key.data] += data
            else:
                selector.unregister(key.fileobj)
                key.fileobj.close()
    left = len(selector.get_map())
    for key in list(selector.get_map().values()):
        key.fileobj.close()
    assert left == 0, f"{left} streams still open after {timeout} s"
    return [bytes(received[i]) for i in range(count)]


def test_500_concurrent_streams_complete():
    # Streams last ~5 s (21 steps of 250 ms) so all of them are open at the same time: opening
    # 500 connections can take seconds on a loaded machine, and a stream keeps to its engine's
    # steps however late its greenlet runs, so it is not stretched by the load.
    with EmulatorProcess(
        "decode", itl_ms=250, prefill_ms_per_token=0.01, output_tokens=20
    ) as engine:
        body = json.dumps(
            {
                "model": "emulated-model",
                "stream": True,
                "messages": [{"role": "user", "content": "hello load test"}],
            }
        ).encode()
        responses = run_streams(engine.host, engine.port, body, STREAMS, timeout=60)
        for response in responses:
            head, _, payload = response.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200") and b"Transfer-Encoding: chunked" in head, head
            assert payload.endswith(b"0\r\n\r\n") and b"data: [DONE]\n\n" in payload
            assert payload.count(b'"delta":{"content":') == 21  # 20 words + the EOS finish chunk
        stats = engine.stats()
        assert stats["completed"] == STREAMS and stats["aborted_streams"] == 0
        assert stats["peak_streams_in_flight"] == STREAMS
        assert stats["streams_in_flight"] == 0
