"""Operating it in production: admission control (a bound on turns in flight, 429 with
Retry-After before any engine is called, a burst past capacity refused in part without
deadlocking forwarding workers), client API keys, and the one cleanup a reply owes whatever
becomes of it."""

from __future__ import annotations

import json
import logging
import os
import selectors
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests
import responses

from emulator.process import EmulatorProcess, wait_until
from tests.helpers.payloads import (
    CHAT,
    D_URL,
    MESSAGES,
    P_URL,
    chat_events,
    d_params,
    p_params,
    p_reply,
    pinned_app,
)
from tests.helpers.servers import MODEL, gateway_process, metric
from tests.helpers.transport import ResponsesTransport


def _body(n: int, **extra) -> dict:
    return {
        "model": MODEL,
        "stream": True,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": f"turn {n}"}],
        **extra,
    }


def _chat(gateway, n: int, **extra) -> requests.Response:
    return requests.post(gateway.url + CHAT, timeout=20, json=_body(n, **extra))


def _events(response: requests.Response) -> list:
    return [line[6:] for line in response.iter_lines() if line.startswith(b"data: ")]


# --- admission control ------------------------------------------------------------------------


@pytest.mark.processes
@pytest.mark.parametrize("worker_class", ["gevent", "gthread"])
def test_a_worker_at_its_limit_refuses_with_429_and_never_cuts_its_streams(worker_class):
    with (
        EmulatorProcess("prefill", bidirectional_kv_xfer=True, host="127.0.0.41", itl_ms=1) as p,
        EmulatorProcess("decode", bidirectional_kv_xfer=True, host="127.0.0.42", itl_ms=150) as d,
        gateway_process(
            [p.url],
            [d.url],
            worker_class=worker_class,
            max_turns=2,
            admission_queue=1,
            admission_wait=0.02,
            retry_after=3,
        ) as gateway,
    ):
        with ThreadPoolExecutor(2) as pool:
            streams = [
                pool.submit(lambda n: _events(_chat(gateway, n, stream=True)), n) for n in range(2)
            ]
            wait_until(lambda: d.stats()["streams_in_flight"] == 2, 10, "two streams open")
            p_before = p.stats()["requests"]
            # Refused by the OpenAI SDK as a client sees it (its own retries off).
            client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="k", max_retries=0)
            for n in range(4):
                with pytest.raises(openai.RateLimitError) as refused:
                    client.chat.completions.create(
                        model=MODEL,
                        max_tokens=4,
                        messages=[{"role": "user", "content": f"refused {n}"}],
                    )
                response = refused.value.response
                assert response.headers["Retry-After"] == "3"
                error = response.json()["error"]
                assert error["code"] == 429 and error["type"] == "rate_limit_exceeded"
                assert "2 turns in flight" in error["message"]
            assert p.stats()["requests"] == p_before  # no engine was called for them
            for future in streams:  # never cut to make room
                events = future.result()
                assert events[-1] == b"[DONE]" and not any(b'"error"' in e for e in events)
        # Their places are free again: a turn goes through, and nothing is held.
        assert _chat(gateway, 9, stream=False).status_code == 200
        report = gateway.status()
        assert report["turns_in_flight"] == 0 and report["turns_waiting"] == 0
        assert metric(gateway, "pd_gateway_admissions_total", result="admitted") == 3
        refused_total = metric(
            gateway, "pd_gateway_admissions_total", result="rejected_waited"
        ) + metric(gateway, "pd_gateway_admissions_total", result="rejected_queue_full")
        assert refused_total == 4


def test_a_waiting_turn_takes_a_place_that_frees_up(clock):
    """The wait queue: a turn that arrives at the limit gets the next free place."""
    import threading

    from gateway.front.admission import Admission
    from gateway.support.errors import Overloaded

    admission = Admission(limit=1, queue=1, wait=10.0, retry_after=1)
    admission.enter()
    entered = threading.Event()
    waiter = threading.Thread(target=lambda: (admission.enter(), entered.set()))
    waiter.start()
    wait_until(lambda: admission.waiting == 1, 5, "a turn waiting")
    with pytest.raises(Overloaded):  # the queue is full: refused at once
        admission.enter()
    admission.leave()
    waiter.join(5)
    assert entered.is_set() and admission.inflight == 1 and admission.waiting == 0


@pytest.mark.processes
def test_a_429_is_relayed_through_forwarding_with_its_retry_after():
    """The owner worker admits or refuses a conversation's turns; a worker that forwards one
    passes the owner's 429 on, Retry-After included."""
    with (
        EmulatorProcess("prefill", bidirectional_kv_xfer=True, host="127.0.0.43", itl_ms=1) as p,
        EmulatorProcess("decode", bidirectional_kv_xfer=True, host="127.0.0.44", itl_ms=100) as d,
        gateway_process([p.url], [d.url], workers=2, max_turns=1, admission_queue=0) as gw,
    ):
        with ThreadPoolExecutor(2) as pool:
            # The owner's one place, held for 60 x 100 ms: sent to its private listener, which
            # serves what lands there. (Through the public port the other worker may get it and
            # relay it, its one relay place then taken: the next request refused there.)
            owner = f"http://{gw.host}:{gw.owner_port(_body(0))}{gw.prefix}"
            held = pool.submit(
                lambda: _events(
                    requests.post(owner + CHAT, timeout=20, json=_body(0, max_tokens=60))
                )
            )
            wait_until(lambda: d.stats()["streams_in_flight"] == 1, 10, "the stream open")
            before = metric(gw, "pd_gateway_forwarded_total", result="sent")
            with gw.forwarded(_body(0)) as arrived:
                try_ = pool.submit(_chat, gw, 0)
                arrived()
            refused = try_.result()
            assert refused.status_code == 429
            assert refused.headers["Retry-After"] == "1"
            assert refused.json()["error"]["code"] == 429
            assert d.stats()["streams_in_flight"] == 1, "the held stream ended too soon"
            assert metric(gw, "pd_gateway_forwarded_total", result="sent") == before + 1
            assert held.result()[-1] == b"[DONE]"


def test_a_gthread_worker_always_keeps_a_thread_beyond_its_turns():
    """Turns and relays share a gthread worker's threads: whatever --max-turns says, one thread
    stays free for the requests relays wait on (and refusals, /health); one thread with
    several forwarding workers is refused at start."""
    from gateway.app import create_app
    from gateway.config import Settings, SettingsError

    for max_turns, limit in [(0, 6), (20, 7), (3, 3)]:
        app = create_app(
            Settings(
                engine_metrics_interval=0,
                probe_interval=0,
                worker_class="gthread",
                threads=8,
                max_turns=max_turns,
                release_rate=0,
            ),
            transport=ResponsesTransport(),
        )
        try:
            assert app.extensions["pd_gateway"].gateway.admission.limit == limit
        finally:
            app.extensions["pd_gateway"].close()
    with pytest.raises(SettingsError, match="--threads must be 2"):
        Settings(worker_class="gthread", threads=1, workers=2)
    Settings(worker_class="gthread", threads=1, workers=2, affinity=False)  # nothing relayed


BURST = 128


def _burst_request(i: int, host: str, port: int) -> bytes:
    body = json.dumps(
        {
            "model": MODEL,
            "stream": True,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": f"burst conversation {i}"}],
        }
    )
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        f"Connection: close\r\n\r\n{body}"
    ).encode()


@pytest.mark.parametrize("workers", [1, 4])
@pytest.mark.parametrize("worker_class", ["gthread", "gevent"])
def test_a_burst_past_capacity_gets_refusals_and_health_answers(
    fresh_engines, worker_class, workers
):
    """128 streams at once on workers of 8 threads (or 32 connections): every turn is either
    admitted (held at P, which hangs) or refused with 429, and /health answers while they are
    held. Before, a request relayed to its owner held a thread and no place: 4 gthread workers
    filled every thread with relays whose owners' requests queued behind them, for good."""
    p, _ = fresh_engines
    p.set_fault("hang", max_s=120)  # every admitted turn is held until its client leaves
    sizing = {"threads": 8} if worker_class == "gthread" else {"worker_connections": 32}
    # Probes off: /health then says whether the worker answers, which is what this tests, not
    # whether a P holding 128 hung requests on a loaded machine answered two probes in time.
    with gateway_process(
        [p.url],
        [fresh_engines[1].url],
        worker_class=worker_class,
        workers=workers,
        probe_interval=0,
        **sizing,
    ) as gateway:
        host, port = "127.0.0.1", gateway.port
        clients = [socket.create_connection((host, port)) for _ in range(BURST)]
        selector = selectors.DefaultSelector()
        replies: dict[socket.socket, bytes] = {}
        try:
            for i, sock in enumerate(clients):
                sock.sendall(_burst_request(i, host, port))
                selector.register(sock, selectors.EVENT_READ)
                replies[sock] = b""
            ended: list[int] = []  # statuses of the replies that ended

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
                        ended.append(int(replies[sock].split(b" ", 2)[1]) if replies[sock] else 0)
                return len(ended) + p.stats()["requests"] == BURST

            # Bounded for a deadlock's sake only: settled in well under a second when it works.
            wait_until(
                settled,
                60,
                "every turn of the burst admitted or refused",
                gateway.process,
                gateway.log_path,
            )
            admitted = p.stats()["requests"]
            assert set(ended) <= {429} and admitted + len(ended) == BURST
            assert ended, "a burst of 128 on these workers is refused in part"
            for _ in range(5):  # the admitted turns are still held
                assert requests.get(gateway.url + "/health", timeout=10).status_code == 200
            print(f"\n{worker_class} x{workers}: {admitted} admitted, {len(ended)} x 429")
        finally:
            for sock in clients:
                sock.close()
            selector.close()
        # Their clients gone, the held turns end: no place stays taken.
        wait_until(
            lambda: p.stats()["fault_responses"] == p.stats()["requests"],
            30,
            "P's held requests ended",
        )
        p.set_fault("none")


# --- the one cleanup a reply owes -------------------------------------------------------------


@responses.activate
def test_a_stream_dropped_before_its_first_byte_still_releases_d_and_its_place(store):
    """A host app whose after_request raises drops the gateway's response unsent: D's count,
    the engine connection, the admission place and the watcher must still be released."""
    app = pinned_app(store, max_turns=1, admission_queue=0)

    @app.after_request
    def broken(response):
        if response.mimetype == "text/event-stream":
            raise RuntimeError("a host hook that fails")
        return response

    responses.post(P_URL + CHAT, json=p_reply(p_params()))
    responses.post(
        D_URL + CHAT, body=chat_events(["a"], d_params()), content_type="text/event-stream"
    )
    try:
        client = app.test_client()
        for _ in range(3):  # with one place, a leak would make the second one a 429
            reply = client.post(CHAT, json={"messages": MESSAGES, "stream": True})
            assert reply.status_code == 500
        gateway = app.extensions["pd_gateway"].gateway
        assert gateway.admission.inflight == 0
        assert gateway.decode.instances[0].inflight == 0
    finally:
        app.extensions["pd_gateway"].close()


@responses.activate
def test_a_stream_a_host_rewraps_is_served_whole(store):
    """A host's after_request may put our stream in a response of its own: it must arrive."""
    from flask import Response

    app = pinned_app(store, max_turns=1, admission_queue=0)

    @app.after_request
    def rewrap(response):
        if response.mimetype == "text/event-stream":
            return Response(response.response, headers=response.headers)
        return response

    responses.post(P_URL + CHAT, json=p_reply(p_params()))
    responses.post(
        D_URL + CHAT, body=chat_events(["a", "b"], d_params()), content_type="text/event-stream"
    )
    try:
        reply = app.test_client().post(CHAT, json={"messages": MESSAGES, "stream": True})
        assert reply.status_code == 200 and reply.data.endswith(b"data: [DONE]\n\n")
        assert b'"content":"b"' in reply.data.replace(b" ", b"")
    finally:
        app.extensions["pd_gateway"].close()


@responses.activate
def test_a_failing_engine_stream_close_still_releases_the_place(client, monkeypatch):
    from gateway.engines.upstream import Stream

    def broken_close(self):
        raise OSError("close failed")

    monkeypatch.setattr(Stream, "close", broken_close)
    responses.post(P_URL + CHAT, json=p_reply(p_params()))
    responses.post(
        D_URL + CHAT, body=chat_events(["a"], d_params()), content_type="text/event-stream"
    )
    gateway = client.application.extensions["pd_gateway"].gateway
    reply = client.post(CHAT, json={"messages": MESSAGES, "stream": True}, buffered=False)
    next(iter(reply.response))  # the first bytes, then the client goes
    reply.close()
    assert gateway.admission.inflight == 0 and gateway.decode.instances[0].inflight == 0


@responses.activate
def test_a_request_id_does_not_outlive_its_request(client):
    from gateway.support import logs

    responses.post(P_URL + CHAT, json=p_reply(p_params()))
    responses.post(
        D_URL + CHAT, body=chat_events(["a"], d_params()), content_type="text/event-stream"
    )
    reply = client.post(
        CHAT, json={"messages": MESSAGES, "stream": True}, headers={"X-Request-Id": "req-1"}
    )
    assert reply.status_code == 200 and reply.data.endswith(b"[DONE]\n\n")
    reply.close()
    assert logs.REQUEST_ID.get() == "-"


# --- client API keys ----------------------------------------------------------------------------


@responses.activate
def test_api_keys_guard_the_openai_routes_and_metrics_but_not_health(store, caplog):
    app = pinned_app(store, api_keys=["key-alpha", "key-beta"], admin_token="adm")
    responses.post(P_URL + CHAT, json=p_reply(p_params()))
    responses.post(
        D_URL + CHAT,
        json={
            "id": "x",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "ok"},
                    "finish_reason": "stop",
                }
            ],
            "kv_transfer_params": d_params(),
        },
    )
    try:
        client = app.test_client()
        body = {"messages": MESSAGES}
        with caplog.at_level(logging.DEBUG):
            for headers, status in (
                ({}, 401),
                ({"Authorization": "Bearer key-alph"}, 401),
                ({"Authorization": "Basic key-alpha"}, 401),
                ({"Authorization": "Bearer key-beta"}, 200),
                ({"Authorization": "bearer key-alpha"}, 200),
            ):
                reply = client.post(CHAT, json=body, headers=headers)
                assert reply.status_code == status, headers
                if status == 401:
                    assert reply.json["error"]["type"] == "authentication_error"
                    assert reply.headers["WWW-Authenticate"] == "Bearer"
            assert client.get("/v1/models").status_code == 401
        assert "key-alph" not in caplog.text and "key-beta" not in caplog.text
        # The engines never see the client's key.
        assert all("Authorization" not in call.request.headers for call in responses.calls)
        assert len(responses.calls) == 4  # P and D of the two admitted turns only
        assert client.get("/health").status_code == 200
        assert client.get("/metrics").status_code == 401
        assert (
            client.get("/metrics", headers={"Authorization": "Bearer key-beta"}).status_code == 401
        )
        assert client.get("/metrics", headers={"Authorization": "Bearer adm"}).status_code == 200
    finally:
        app.extensions["pd_gateway"].close()


def test_keys_split_on_commas_and_spaces_however_given():
    from gateway.config import Settings

    argv = ["--api-keys", "k1,k2", "k3"]
    assert Settings.from_args(argv, environ={}).api_keys == ["k1", "k2", "k3"]
    assert Settings(api_keys=["a,b", "c d"]).api_keys == ["a", "b", "c", "d"]
    assert Settings.from_env({"GATEWAY_API_KEYS": "x, y"}).api_keys == ["x", "y"]


def test_without_keys_nothing_changes(client):
    assert client.get("/metrics").status_code == 200
    assert not client.application.extensions["pd_gateway"].gateway.api_keys.enabled


def test_a_keys_file_is_reread_when_it_changes(tmp_path, clock):
    from gateway.front.auth import ApiKeys
    from gateway.support.errors import Unauthorized

    path = tmp_path / "keys"
    path.write_text("# the team's keys\nold-key\n\n")
    keys = ApiKeys([], str(path), clock=clock)
    keys.check("Bearer old-key")
    path.write_text("new-key\n")
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))  # a distinct mtime
    keys.check("Bearer old-key")  # within the second: not looked at yet
    clock.advance(1.0)
    with pytest.raises(Unauthorized):
        keys.check("Bearer old-key")
    keys.check("Bearer new-key")
    # Revocation fails closed: emptied (or comments only), deleted, unreadable: no key of it.
    for revoke in (lambda: path.write_text("# nobody\n"), path.unlink):
        revoke()
        clock.advance(1.0)
        with pytest.raises(Unauthorized):
            keys.check("Bearer new-key")
        path.write_text("new-key\n")
        os.utime(path, ns=(time.time_ns(), time.time_ns() + 3 * 10**9))
        clock.advance(1.0)
        keys.check("Bearer new-key")
    path.chmod(0)
    clock.advance(1.0)
    if os.geteuid() != 0:  # root reads anything
        with pytest.raises(Unauthorized):
            keys.check("Bearer new-key")
    assert ApiKeys(["from-settings"], str(tmp_path / "none"), clock=clock).enabled


def test_each_key_is_its_own_tenant():
    from gateway.reuse.conversation import identify

    body = {"model": MODEL, "messages": MESSAGES}
    one = identify(body, {"Authorization": "Bearer key-alpha"}, None)
    two = identify(body, {"Authorization": "Bearer key-beta"}, None)
    assert one.root != two.root
    assert not set(one.lookups()) & set(two.lookups())


@pytest.mark.processes
def test_api_keys_end_to_end_with_a_keys_file(tmp_path):
    """Real gunicorn, the OpenAI SDK: a key added to the file works without a restart, and
    the conversation cache survives (later turns still hit)."""
    path = tmp_path / "keys"
    path.write_text("first-key\n")
    with (
        EmulatorProcess("prefill", bidirectional_kv_xfer=True, host="127.0.0.45", itl_ms=1) as p,
        EmulatorProcess("decode", bidirectional_kv_xfer=True, host="127.0.0.46", itl_ms=1) as d,
        gateway_process([p.url], [d.url], api_keys_file=str(path)) as gateway,
    ):

        def turn(key, history):
            client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, max_tokens=6, messages=history, extra_body={"conversation_id": "c1"}
            )
            reply = raw.parse().choices[0].message
            return raw.headers["X-Gateway-Cache"], history + [
                {"role": "assistant", "content": reply.content}
            ]

        history = [{"role": "user", "content": "hello"}]
        cache, history = turn("first-key", history)
        assert cache == "miss"
        with pytest.raises(openai.AuthenticationError):
            turn("second-key", history)
        path.write_text("first-key\nsecond-key\n")
        os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))

        def accepted():
            try:
                return turn("second-key", [{"role": "user", "content": "other"}])
            except openai.AuthenticationError:
                return None

        wait_until(accepted, 10, "the new key accepted")
        cache, history = turn("first-key", history + [{"role": "user", "content": "more"}])
        assert cache == "hit"  # the worker was not restarted: its cache is whole
        assert p.stats()["wrong_reuse"] == 0 and json.dumps(history)


@pytest.mark.parametrize("salting, shared", [("auto", False), ("off", True)])
def test_tenants_do_not_share_the_engines_prefix_caches(
    fresh_engines, gateway_factory, salting, shared
):
    """A document one tenant sent does not make another's prefill faster (a timing probe of
    what the other sent) unless salting is off; the engines' own counters say so."""
    p, d = fresh_engines
    gateway = gateway_factory(
        [p.url], [d.url], api_keys="key-alpha,key-beta", tenant_cache_salt=salting
    )
    document = f"confidential {uuid.uuid4().hex} " + " ".join(f"clause{i}" for i in range(300))

    def ask(key: str) -> dict:
        reply = requests.post(
            gateway.url + "/v1/chat/completions",
            timeout=30,
            headers={"Authorization": f"Bearer {key}"},
            json={
                "model": MODEL,
                "max_tokens": 4,
                "messages": [{"role": "user", "content": document}],
            },
        )
        assert reply.status_code == 200, reply.text
        return next(r for r in reversed(p.recent_requests()) if r["kind"] == "chat")

    assert ask("key-alpha")["local_prefix_tokens"] == 0
    beta = ask("key-beta")
    assert (beta["local_prefix_tokens"] > 300) == shared
    assert ask("key-alpha")["local_prefix_tokens"] > 300  # a tenant still hits its own
