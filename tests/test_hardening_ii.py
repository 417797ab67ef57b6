"""Hardening II (the second security review): a burst past capacity gets fast refusals and never
deadlocks forwarding workers; private listeners nobody else can take."""
from __future__ import annotations

import json
import os
import selectors
import signal
import socket

import pytest
import requests

from emulator.process import EmulatorProcess, free_port, wait_until
from devtools import workload
from tests.helpers.servers import MODEL, gateway_process

BURST = 128


def _burst_request(i: int, host: str, port: int) -> bytes:
    body = json.dumps({"model": MODEL, "stream": True, "max_tokens": 4,
                       "messages": [{"role": "user", "content": f"burst conversation {i}"}]})
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n\r\n{body}").encode()


@pytest.mark.parametrize("workers", [1, 4])
@pytest.mark.parametrize("worker_class", ["gthread", "gevent"])
def test_a_burst_past_capacity_gets_refusals_and_health_answers(fresh_engines, worker_class,
                                                                workers):
    """128 streams at once on workers of 8 threads (or 32 connections): every turn is either
    admitted (held at P, which hangs) or refused with 429, and /health answers while they are
    held. Before, a request relayed to its owner held a thread and no place: 4 gthread workers
    filled every thread with relays whose owners' requests queued behind them, for good."""
    p, _ = fresh_engines
    p.set_fault("hang", max_s=120)          # every admitted turn is held until its client leaves
    sizing = {"threads": 8} if worker_class == "gthread" else {"worker_connections": 32}
    with gateway_process([p.url], [fresh_engines[1].url], worker_class=worker_class,
                         workers=workers, **sizing) as gateway:
        host, port = "127.0.0.1", gateway.port
        clients = [socket.create_connection((host, port)) for _ in range(BURST)]
        selector = selectors.DefaultSelector()
        replies: dict[socket.socket, bytes] = {}
        try:
            for i, sock in enumerate(clients):
                sock.sendall(_burst_request(i, host, port))
                selector.register(sock, selectors.EVENT_READ)
                replies[sock] = b""
            ended: list[int] = []        # statuses of the replies that ended

            def settled() -> bool:
                for key, _ in selector.select(0.2):
                    sock = key.fileobj
                    chunk = sock.recv(65536)
                    replies[sock] += chunk
                    if not chunk:
                        # The gateway's close (Connection: close). Waiting for it, rather than
                        # hanging up first, is what a client may do: gunicorn 27's gthread
                        # main loop lingered up to 2 s for such a client's own close.
                        selector.unregister(sock)
                        ended.append(int(replies[sock].split(b" ", 2)[1]) if replies[sock]
                                     else 0)
                return len(ended) + p.stats()["requests"] == BURST

            # Bounded for a deadlock's sake only: settled in well under a second when it works.
            wait_until(settled, 60, "every turn of the burst admitted or refused",
                       gateway.process, gateway.log_path)
            admitted = p.stats()["requests"]
            assert set(ended) <= {429} and admitted + len(ended) == BURST
            assert ended, "a burst of 128 on these workers is refused in part"
            for _ in range(5):                    # the admitted turns are still held
                assert requests.get(gateway.url + "/health", timeout=10).status_code == 200
            print(f"\n{worker_class} x{workers}: {admitted} admitted, {len(ended)} x 429")
        finally:
            for sock in clients:
                sock.close()
            selector.close()
        # Their clients gone, the held turns end: no place stays taken.
        wait_until(lambda: p.stats()["fault_responses"] == p.stats()["requests"], 30,
                   "P's held requests ended")
        p.set_fault("none")


# --- 2. private listeners nobody else can take ----------------------------------------------

def _another_user_binds(host: str, port: int) -> bool:
    """Can another local user bind host:port now, as a squatter would (SO_REUSEPORT, which
    Linux honours only between sockets of one uid)? Run as root, the child is uid 65534;
    otherwise it is this uid without SO_REUSEPORT, which no listener of ours lets in either."""
    pid = os.fork()
    if pid == 0:                      # the child only makes system calls, then _exits
        code = 1
        try:
            root = os.geteuid() == 0
            if root:
                os.setuid(65534)
            sock = socket.socket()                       # owned by the uid that makes it
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if root:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, port))
            code = 0
        finally:
            os._exit(code)
    return os.waitpid(pid, 0)[1] == 0


def _zombie(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"


def test_a_private_port_stays_the_gateways_while_its_worker_is_away(fresh_engines):
    """The master holds every slot's private port (bound, never listening): with its worker
    killed and no replacement yet (the master stopped), no other user can bind it, and a
    forward is refused at once (the forwarder waits --owner-wait, then serves). Before, the
    port was free until the replacement came: another user's listener got the forwarded
    requests, with the clients' keys and prompts."""
    p, d = fresh_engines
    with gateway_process([p.url], [d.url], workers=2) as gateway:
        private = gateway.port + 1                      # slot 0
        victim = gateway.status(port=private)["pid"]
        os.kill(gateway.process.pid, signal.SIGSTOP)     # no respawn until we say
        try:
            os.kill(victim, signal.SIGKILL)
            wait_until(lambda: _zombie(victim), 10, "the killed worker gone")
            assert not _another_user_binds("127.0.0.1", private)
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", private), timeout=10).close()
        finally:
            os.kill(gateway.process.pid, signal.SIGCONT)
        replacement = wait_until(lambda: gateway.status(port=private)["pid"], 30,
                                 "the replacement on the private port")
        assert replacement != victim


def test_a_slot_whose_port_is_taken_serves_and_the_gateway_goes_on(fresh_engines):
    """A port squatted before start: that worker serves without owning conversations; the
    others own them all (every later turn a hit) and the squatter is never sent a request.
    Before, the worker failed to boot and the master halted the whole gateway (exit 3)."""
    p, d = fresh_engines
    port = free_port("127.0.0.1", 3)
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", port + 2))               # slot 1's private port
    squatter.listen(16)
    squatter.setblocking(False)
    try:
        with gateway_process([p.url], [d.url], port=port, workers=2) as gateway:
            convs = workload.run(gateway.url, conversations=24, turns=2)
            assert workload.errors(convs) == []
            assert workload.later_hits(convs) == (24, 24)
            assert gateway.process.poll() is None
            with pytest.raises(BlockingIOError):
                squatter.accept()
            assert "slot 1 cannot have its private port" in gateway.log()
    finally:
        squatter.close()


# --- 3. clients that stall cost their connections, not the worker ----------------------------

STALLED = {
    "headers": b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl",
    "body": (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
             b"\r\nContent-Length: 1000\r\n\r\n{\"model\": "),
}


@pytest.mark.parametrize("stall", ["headers", "body"])
@pytest.mark.parametrize("worker_class", ["gthread", "gevent"])
def test_clients_that_stall_their_request_cost_their_connections_not_the_worker(
        fresh_engines, worker_class, stall):
    """8 clients send part of their request and stop, on a worker of 4 threads (or 16
    connections): /health still answers, a stalled body gets 408 and a stalled gthread request
    is closed, each after --client-timeout, quietly. Before, gthread's threads were theirs for
    as long as they stayed, /health included."""
    p, d = fresh_engines
    sizing = {"threads": 4} if worker_class == "gthread" else {"worker_connections": 16}
    with gateway_process([p.url], [d.url], worker_class=worker_class, client_timeout=1,
                         **sizing) as gateway:
        stalled = [socket.create_connection(("127.0.0.1", gateway.port)) for _ in range(8)]
        try:
            for sock in stalled:
                sock.sendall(STALLED[stall])
            assert requests.get(gateway.url + "/health", timeout=30).status_code == 200
            if stall == "body" or worker_class == "gthread":
                for sock in stalled:
                    sock.settimeout(30)
                    reply = sock.recv(4096)          # what the gateway sends, then its close
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


@pytest.mark.parametrize("worker_class", ["gthread", "gevent"])
def test_a_client_that_stops_reading_its_stream_lets_go_of_its_place_and_d(fresh_engines,
                                                                         worker_class):
    """A client that asks for a long stream and reads none of it: once the socket buffers
    are full and a write waits --client-timeout, the turn ends, its place is free and D's
    stream is closed. Before, both were held until the 900 s total deadline. The reply (up
    to 400,000 tokens, some 60 MB of events, as fast as D makes them) is far beyond what any
    socket buffers hold; a D of its own, as that needs a long context."""
    p, _ = fresh_engines
    with EmulatorProcess("decode", host="127.0.0.9", itl_ms=0, max_model_len=500_000,
                         kv_capacity_blocks=40_000) as d, \
            gateway_process([p.url], [d.url], worker_class=worker_class,
                            client_timeout=1) as gateway:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", gateway.port))
        body = json.dumps({"model": MODEL, "stream": True, "max_tokens": 400_000,
                           "messages": [{"role": "user", "content": "say a lot"}]})
        try:
            sock.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                          f"Content-Type: application/json\r\nContent-Length: {len(body)}"
                          f"\r\n\r\n{body}").encode())
            wait_until(lambda: d.stats()["aborted_streams"] == 1, 60, "D's stream closed",
                       gateway.process, gateway.log_path)
            wait_until(lambda: gateway.status()["turns_in_flight"] == 0, 10, "the place free")
            assert d.stats()["completed"] == 0
            assert "Traceback" not in gateway.log()
        finally:
            sock.close()


# --- 4. bodies in flight within a budget, refused before they are read ----------------------

def _headers_of(length: int) -> bytes:
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            f"\r\nContent-Length: {length}\r\n\r\n").encode()


@pytest.mark.parametrize("worker_class", ["gthread", "gevent"])
def test_bodies_beyond_the_workers_budget_are_refused_before_they_are_read(fresh_engines,
                                                                          worker_class):
    """A worker holds at most --max-bodies-bytes of bodies, counted as they arrive: with
    150 KB of one body in (its client slow to send the last byte), a 100 KB one gets 429 before it
    is parsed; once the first is gone the same request is served. Before, every body was read
    and parsed whatever the others."""
    p, d = fresh_engines
    with gateway_process([p.url], [d.url], worker_class=worker_class,
                         max_body_bytes=160_000, max_bodies_bytes=200_000) as gateway:
        slow = socket.create_connection(("127.0.0.1", gateway.port))
        slow.sendall(_headers_of(150_001) + b"x" * 150_000)        # and then nothing
        try:
            # Counted as read, 64 KiB at a time: two reads in, the third waits for the rest.
            wait_until(lambda: gateway.status()["body_bytes_held"] == 2 * 65536, 10,
                       "the slow body counted")
            second = socket.create_connection(("127.0.0.1", gateway.port))
            second.sendall(_headers_of(100_000) + b"y" * 100_000)
            second.settimeout(30)
            reply = second.recv(4096)
            assert reply.startswith(b"HTTP/1.1 429") and b"retry-after" in reply.lower()
            second.close()
        finally:
            slow.close()
        wait_until(lambda: gateway.status()["body_bytes_held"] == 0, 10, "the budget free")
        padding = "x" * 99_000
        served = requests.post(gateway.url + "/v1/chat/completions", timeout=30, json={
            "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": padding}]})
        assert served.status_code == 200
        assert gateway.metric("pd_gateway_admissions_total", result="rejected_bodies") == 1


# --- 7. the smaller ones ----------------------------------------------------------------------

def test_a_client_cannot_forge_a_line_of_the_text_log(fresh_engines, gateway_factory):
    """vLLM's 404 quotes the model a client sent; the gateway logs what the engine answered.
    A model name with a newline stays inside its line, escaped."""
    p, d = fresh_engines
    gateway = gateway_factory([p.url], [d.url])
    forged = "2026-12-05 00:00:00,000 1 ERROR gateway.admin [-]: admin token rotated"
    reply = requests.post(gateway.url + "/v1/chat/completions", timeout=30, json={
        "model": f"nope\n{forged}\r\n{forged}", "messages": [{"role": "user", "content": "hi"}]})
    assert reply.status_code == 404
    wait_until(lambda: "nope\\n2026" in gateway.log(), 10, "the engine's answer logged")
    assert not any(line.startswith(forged) for line in gateway.log().splitlines())


def test_the_installed_gateway_holds_no_emulator_and_needs_no_tooling():
    """The emulator (whose /faults anyone can call) and the dev tooling stay in the checkout:
    the wheel's packages are the ones setup.cfg's find: names, and nothing in them imports
    what is left out."""
    import ast
    import configparser
    import pathlib

    import setuptools

    root = pathlib.Path(__file__).resolve().parents[1]
    config = configparser.ConfigParser()
    config.read(root / "setup.cfg")
    include = config["options.packages.find"]["include"].replace(",", " ").split()
    packages = setuptools.find_packages(str(root), include=include)
    assert packages and all(p == "gateway" or p.startswith("gateway.") for p in packages)
    imported = set()
    for package in packages:
        for path in (root / package.replace(".", "/")).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    imported.add(node.module.split(".")[0])
                elif isinstance(node, ast.Import):
                    imported.update(alias.name.split(".")[0] for alias in node.names)
    assert not imported & {"emulator", "devtools", "bench", "tests", "openai"}


def test_a_gthread_worker_always_keeps_a_thread_beyond_its_turns():
    """Turns and relays share a gthread worker's threads: whatever --max-turns says, one thread
    stays free for the requests relays wait on (and refusals, /health); one thread with
    several forwarding workers is refused at start."""
    from gateway.app import create_app
    from gateway.config import Settings, SettingsError

    for max_turns, limit in [(0, 6), (20, 7), (3, 3)]:
        app = create_app(Settings(engine_metrics_interval=0, worker_class="gthread", threads=8, max_turns=max_turns,
                                  release_rate=0))
        try:
            assert app.extensions["pd_gateway"].gateway.admission.limit == limit
        finally:
            app.extensions["pd_gateway"].close()
    with pytest.raises(SettingsError, match="--threads must be 2"):
        Settings(worker_class="gthread", threads=1, workers=2)
    Settings(worker_class="gthread", threads=1, workers=2, affinity=False)   # nothing relayed


def test_health_answers_503_degraded_when_no_d_is_usable(app, client):
    """What README promises load balancers: 200 ok, or 503 with status degraded."""
    gateway = app.extensions["pd_gateway"].gateway
    assert (client.get("/health").status_code, client.get("/health").get_json()) \
        == (200, {"status": "ok"})
    gateway.decode.instances[0].down = True          # as a failed connection marks it
    reply = client.get("/health")
    assert (reply.status_code, reply.get_json()) == (503, {"status": "degraded"})
