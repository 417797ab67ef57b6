"""Clients that stall or send too much cost their own connections, not the worker: a request
stalled in its headers or its body is closed after --client-timeout, a stream its client stops
reading ends and lets go of its place and of D, and bodies beyond the worker's
--max-bodies-bytes are refused before they are read."""

from __future__ import annotations

import json
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from emulator.process import EmulatorProcess, wait_until
from tests.helpers.servers import MODEL, gateway_process

# --- clients that stall cost their connections, not the worker ----------------------------------

STALLED = {
    "headers": b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl",
    "body": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
        b'\r\nContent-Length: 1000\r\n\r\n{"model": '
    ),
}


@pytest.mark.parametrize("stall", ["headers", "body"])
@pytest.mark.parametrize("worker_class", ["gthread", "gevent"])
def test_clients_that_stall_their_request_cost_their_connections_not_the_worker(
    fresh_engines, worker_class, stall
):
    """8 clients send part of their request and stop, on a worker of 4 threads (or 16
    connections): /health still answers, a stalled body gets 408 and a stalled gthread request
    is closed, each after --client-timeout, quietly. Before, gthread's threads were theirs for
    as long as they stayed, /health included."""
    p, d = fresh_engines
    sizing = {"threads": 4} if worker_class == "gthread" else {"worker_connections": 16}
    with gateway_process(
        [p.url], [d.url], worker_class=worker_class, client_timeout=1, **sizing
    ) as gateway:
        stalled = [socket.create_connection(("127.0.0.1", gateway.port)) for _ in range(8)]
        try:
            for sock in stalled:
                sock.sendall(STALLED[stall])
            assert requests.get(gateway.url + "/health", timeout=30).status_code == 200
            if stall == "body" or worker_class == "gthread":
                for sock in stalled:
                    sock.settimeout(30)
                    reply = sock.recv(4096)  # what the gateway sends, then its close
                    assert reply.startswith(b"HTTP/1.1 408") if stall == "body" else True
                    while reply:
                        reply = sock.recv(4096)
            assert p.stats()["requests"] == 0
            # A stalled client is no error of the gateway's: no traceback (clients could fill
            # the log with them).
            assert "Traceback" not in gateway.log()
        finally:
            for sock in stalled:
                sock.close()


HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


PARTS = {
    "head": HEAD + b"X-Wait: a",
    "body": HEAD + b'Content-Length: 1000\r\n\r\n{"model": ',
    "chunked": HEAD + b'Transfer-Encoding: chunked\r\n\r\n9\r\n{"model":\r\n',
    "expect": HEAD + b"Expect: 100-continue\r\nContent-Length: 1000\r\n\r\n",
    "expect-chunked": HEAD + b"Expect: 100-continue\r\nTransfer-Encoding: chunked\r\n\r\n",
    # A chunk whose data ends as a chunked body does (CRLF CRLF): the body is not whole.
    "crlf-chunk": HEAD + b"Transfer-Encoding: chunked\r\n\r\n2\r\n\r\n\r\n",
    # A whole request, and the start of the next behind it on the same connection.
    "pipelined": b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\n",
}


@pytest.mark.parametrize("part", list(PARTS))
def test_gthread_requests_that_come_slowly_hold_no_thread(fresh_engines, part):
    """16 connections on a worker of 4 threads, each with part of its request in (its head, its
    head and part of its body, of a known length or chunked, a head that waits for 100 Continue,
    or a next request's head behind a whole one) and no hurry to send the rest
    (--client-timeout 60 s): the worker's loop holds them, and /health and a turn are answered
    at once. Before, each held a thread while it trickled, and nothing else was answered."""
    p, d = fresh_engines
    with gateway_process([p.url], [d.url], worker_class="gthread", threads=4) as gateway:
        partial = PARTS[part]
        slow = [socket.create_connection(("127.0.0.1", gateway.port)) for _ in range(16)]
        try:
            for sock in slow:
                sock.sendall(partial)
            assert requests.get(gateway.url + "/health", timeout=10).status_code == 200
            reply = requests.post(
                gateway.url + "/v1/chat/completions",
                timeout=10,
                json={
                    "model": MODEL,
                    "max_tokens": 4,
                    "messages": [{"role": "user", "content": "hi"}],
                },
            )
            assert reply.status_code == 200
        finally:
            for sock in slow:
                sock.close()


def test_a_body_sent_in_time_is_served_whenever_a_thread_takes_it(fresh_engines):
    """A 1.5 MB body (a thread's to read, over the loop's 1 MiB) sent whole at once, while the
    worker's one thread serves a turn longer than --request-timeout: read late, it is still
    served (what has come is taken past the deadline; only waiting for more is refused)."""
    p, d = fresh_engines
    with gateway_process(
        [p.url], [d.url], worker_class="gthread", threads=1, request_timeout=1
    ) as gateway:
        with ThreadPoolExecutor(1) as pool:
            running = d.stats()["requests"]
            long_turn = pool.submit(
                requests.post,
                gateway.url + "/v1/chat/completions",
                timeout=60,
                json={
                    "model": MODEL,
                    "max_tokens": 3000,
                    "messages": [{"role": "user", "content": "go on"}],
                },
            )
            wait_until(lambda: d.stats()["requests"] > running, 10, "the long turn on D")
            body = json.dumps(
                {
                    "model": MODEL,
                    "max_tokens": 2,
                    "messages": [{"role": "user", "content": "x" * 1_500_000}],
                }
            ).encode()
            sock = socket.create_connection(("127.0.0.1", gateway.port))
            try:
                sock.sendall(
                    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                    b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                    % len(body)
                    + body
                )
                sock.settimeout(60)
                answer = sock.recv(4096)
            finally:
                sock.close()
            assert long_turn.result().status_code == 200
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]


def _trickle(sock: socket.socket, piece: bytes, pieces: int, every: float) -> bytes:
    """Send `piece` every `every` seconds, `pieces` times at most, until the gateway answers
    or closes; what it sent back (b"" for a close), or None if it never did."""
    sock.settimeout(every)
    for _ in range(pieces):
        try:
            sock.sendall(piece)
            return sock.recv(4096)
        except TimeoutError:
            continue
        except OSError:
            return b""
    return None


@pytest.mark.parametrize("part", ["head", "body"])
@pytest.mark.parametrize("worker_class", ["gthread", "gevent"])
def test_a_request_that_trickles_is_cut_at_its_deadline(fresh_engines, worker_class, part):
    """A byte every 0.2 s, every read within --client-timeout (60 s): the request's head and
    body must still arrive within --request-timeout (2 s here) of its first byte: a body
    gets 408, a head its connection closed. Before, the client kept its connection (and with
    gthread a thread) for as long as it trickled: here, 100 bytes in 20 s, all taken."""
    p, d = fresh_engines
    with gateway_process([p.url], [d.url], worker_class=worker_class, request_timeout=2) as gateway:
        sock = socket.create_connection(("127.0.0.1", gateway.port))
        try:
            if part == "body":
                sock.sendall(HEAD + b"Content-Length: 1000\r\n\r\n")
            answer = _trickle(sock, b"x" if part == "head" else b" ", 100, 0.2)
        finally:
            sock.close()
        assert answer is not None, answer
        assert answer.startswith(b"HTTP/1.1 408") if part == "body" else answer == b"", answer
        assert p.stats()["requests"] == 0


@pytest.mark.parametrize("worker_class", ["gthread", "gevent"])
def test_a_client_that_stops_reading_its_stream_lets_go_of_its_place_and_d(
    fresh_engines, worker_class
):
    """A client that asks for a long stream and reads none of it: once the socket buffers
    are full and a write waits --client-timeout, the turn ends, its place is free and D's
    stream is closed. Before, both were held until the 900 s total deadline. The reply (up
    to 400,000 tokens, some 60 MB of events, as fast as D makes them) is far beyond what any
    socket buffers hold; a D of its own, as that needs a long context."""
    p, _ = fresh_engines
    stats = _unread_stream(
        p, worker_class, "127.0.0.9", itl_ms=0, client_timeout=1, max_tokens=400_000, within=60
    )
    assert stats["completed"] == 0


def _unread_stream(
    p,
    worker_class: str,
    host: str,
    itl_ms: int,
    client_timeout: float,
    max_tokens: int,
    within: float,
) -> dict:
    """A D of its own (a long context) streams to a client whose receive buffer is small and
    which reads nothing: D's stream must be closed within `within` seconds and the turn's
    place freed, quietly. Returns D's stats then."""
    with (
        EmulatorProcess(
            "decode", host=host, itl_ms=itl_ms, max_model_len=500_000, kv_capacity_blocks=40_000
        ) as d,
        gateway_process(
            [p.url], [d.url], worker_class=worker_class, client_timeout=client_timeout
        ) as gateway,
    ):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", gateway.port))
        body = json.dumps(
            {
                "model": MODEL,
                "stream": True,
                "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": "say a lot"}],
            }
        )
        try:
            sock.sendall(
                (
                    f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {len(body)}"
                    f"\r\n\r\n{body}"
                ).encode()
            )
            wait_until(
                lambda: d.stats()["aborted_streams"] == 1,
                within,
                "D's stream closed",
                gateway.process,
                gateway.log_path,
            )
            wait_until(lambda: gateway.status()["turns_in_flight"] == 0, 10, "the place free")
            assert "Traceback" not in gateway.log()
            stats = d.stats()
        finally:
            sock.close()
    return stats


@pytest.mark.parametrize("worker_class", ["gthread", "gevent"])
def test_a_stream_its_client_takes_nothing_of_is_cut_before_the_buffers_fill(
    fresh_engines, worker_class
):
    """A stream of some 40 KB a second (5 ms a token) to a client that reads nothing and whose
    receive buffer is small: once its side has taken nothing for --client-timeout (2 s), the
    turn ends, however much the gateway's own send buffer could still take. Before, the
    writes went on until that buffer (which the kernel grows to megabytes) was full: about a
    minute here, D decoding all the while."""
    p, _ = fresh_engines
    _unread_stream(
        p, worker_class, "127.0.0.12", itl_ms=5, client_timeout=2, max_tokens=100_000, within=30
    )


# --- bodies in flight within a budget, refused before they are read -----------------------------


def _headers_of(length: int) -> bytes:
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
        f"\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


@pytest.mark.parametrize("worker_class", ["gthread", "gevent"])
def test_bodies_beyond_the_workers_budget_are_refused_before_they_are_read(
    fresh_engines, worker_class
):
    """A worker holds at most --max-bodies-bytes of bodies, counted as they arrive: with
    150 KB of one body in (its client slow to send the last byte), a 100 KB one gets 429 before it
    is parsed; once the first is gone the same request is served. Before, every body was read
    and parsed whatever the others. (gthread: bodies of up to 1 MiB are read whole by the
    worker's loop before a thread takes them, so the bodies here are ten times as large.)"""
    p, d = fresh_engines
    scale = 10 if worker_class == "gthread" else 1
    with gateway_process(
        [p.url],
        [d.url],
        worker_class=worker_class,
        max_body_bytes=160_000 * scale,
        max_bodies_bytes=200_000 * scale,
    ) as gateway:
        slow = socket.create_connection(("127.0.0.1", gateway.port))
        sent = 150_000 * scale
        slow.sendall(_headers_of(sent + 1) + b"x" * sent)  # and then nothing
        try:
            # Counted as read, 64 KiB at a time: the last read waits for the rest.
            wait_until(
                lambda: gateway.status()["body_bytes_held"] == sent // 65536 * 65536,
                10,
                "the slow body counted",
            )
            second = socket.create_connection(("127.0.0.1", gateway.port))
            second.sendall(_headers_of(100_000 * scale) + b"y" * 100_000 * scale)
            second.settimeout(30)
            reply = second.recv(4096)
            assert reply.startswith(b"HTTP/1.1 429") and b"retry-after" in reply.lower()
            second.close()
        finally:
            slow.close()
        wait_until(lambda: gateway.status()["body_bytes_held"] == 0, 10, "the budget free")
        padding = "x" * 99_000
        served = requests.post(
            gateway.url + "/v1/chat/completions",
            timeout=30,
            json={
                "model": MODEL,
                "max_tokens": 4,
                "messages": [{"role": "user", "content": padding}],
            },
        )
        assert served.status_code == 200
        assert gateway.metric("pd_gateway_admissions_total", result="rejected_bodies") == 1
