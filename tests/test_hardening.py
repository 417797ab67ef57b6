"""Hardening: cancellation with long bodies, connections shared between requests, forwarding
failures, entry expiry, what the public port shows, and the smaller items of the same review."""
from __future__ import annotations

import contextvars
import signal
import socket
import time
import uuid

import pytest
import requests
import responses

from emulator.process import wait_until
from tests.helpers.servers import MODEL, gateway_process, metric, open_and_abandon


def history_of(size: int) -> list[dict]:
    """A chat of about `size` bytes of JSON: long histories are this gateway's workload."""
    words = " ".join(["history"] * (size // 8))
    return [{"role": "user", "content": f"{uuid.uuid4().hex} {words}"}]


# --- 1. a client gone during a long prefill, whatever the body size -------------------------

@pytest.mark.parametrize("size", [1_000, 36_000, 200_000], ids=["1KB", "36KB", "200KB"])
@pytest.mark.parametrize("worker_class", ["gevent", "gthread"])
def test_a_client_gone_during_prefill_stops_the_turn(fresh_engines, gateway_factory,
                                                     worker_class, size):
    p, d = fresh_engines
    gateway = gateway_factory([p.url], [d.url], worker_class=worker_class)
    p.set_fault("hang")
    open_and_abandon(gateway, {"model": MODEL, "messages": history_of(size), "stream": True},
                     lambda sock: wait_until(lambda: p.stats()["requests"] == 1, 10, "P call"))
    closed_at = time.monotonic()
    wait_until(lambda: p.stats()["fault_responses"] == 1, 5, "P connection closed")
    assert time.monotonic() - closed_at < 1.0
    p.set_fault("none")
    assert d.stats()["requests"] == 0


# --- 2. one request's disconnect never cuts another request's engine connection ---------------

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


# --- 3. a failed forward propagates; only an owner that is away is served here ---------------

def test_a_client_gone_while_forwarded_is_not_served_again_locally(fresh_engines):
    p, d = fresh_engines
    with gateway_process([p.url], [d.url], workers=2) as gateway:
        p.set_fault("hang")
        for sent in (1, 2):
            body = {"model": MODEL, "stream": True, "messages": history_of(2000),
                    "conversation_id": f"c{sent}"}
            with gateway.forwarded(body) as arrived:
                open_and_abandon(gateway, body, lambda sock, n=sent: (
                    arrived(), wait_until(lambda: p.stats()["requests"] >= n, 10, "P call")))
            wait_until(lambda: p.stats()["fault_responses"] == sent, 5, "the P call closed")
        assert metric(gateway, "pd_gateway_forwarded_total", result="failed") == 2
        # A forwarded request whose client left is not re-run here (before: a second P call).
        assert p.stats()["requests"] == sent
        p.set_fault("none")
        assert d.stats()["requests"] == 0


# --- 4. an entry keeps its own expiry when it is put back ------------------------------------

def test_a_put_back_entry_keeps_its_expiry_locally(clock):
    from gateway.reuse.store import Entry, LocalStore
    store = LocalStore(maxsize=10, ttl=450, timer=clock)
    store.put("k", Entry({"a": 1}, "http://d", "h", 1))
    clock.advance(400)
    entry = store.take("k")
    store.put("k", entry)                    # e.g. another history under the same id
    clock.advance(60)                        # 460 s after D kept the blocks: they are gone
    assert store.take("k") is None


def test_a_put_back_entry_keeps_its_expiry_in_redis(redis_server):
    from gateway.reuse.store import Entry, RedisStore
    store = RedisStore(redis_server.url, ttl=450, timeout=2)
    key = uuid.uuid4().hex
    store.put(key, Entry({"a": 1}, "http://d", "h", 1))
    entry = store.take(key)
    entry = type(entry)(**{**entry.__dict__, "expires_at": time.time() + 5})   # 445 s later
    store.put(key, entry)
    assert 0 < redis_server.client.pttl(RedisStore.PREFIX + key) <= 5000


# --- 5. the public port shows status only ------------------------------------------------------

def test_public_health_is_status_only_and_the_report_needs_the_admin_token(fresh_engines):
    p, d = fresh_engines
    with gateway_process([p.url], [d.url], admin_token="s3cret") as gateway:
        public = requests.get(gateway.url + "/health", timeout=5)
        assert public.status_code == 200 and public.json() == {"status": "ok"}
        assert p.url.split("//")[1] not in requests.get(gateway.url + "/health?debug=1").text
        assert requests.get(gateway.url + "/admin/status", timeout=5).status_code == 401
        wrong = {"Authorization": "Bearer s3cres"}
        assert requests.get(gateway.url + "/admin/status", headers=wrong).status_code == 401
        report = requests.get(gateway.url + "/admin/status", timeout=5,
                              headers={"Authorization": "Bearer s3cret"}).json()
        assert report["prefill"][0]["url"] == p.url and "watchers" in report
    with gateway_process([p.url], [d.url], admin_token="") as gateway:   # no token: no report
        assert requests.get(gateway.url + "/admin/status", timeout=5).status_code == 404


# --- 6. the smaller items -----------------------------------------------------------------------

def test_an_unexpected_exception_never_leaks_an_in_flight_count():
    from gateway.flow.disagg import Disagg
    from gateway.reuse.store import LocalStore
    from gateway.engines.instances import Pool
    pool = Pool("prefill", ["http://10.9.0.1:8100"])
    disagg = Disagg(LocalStore(10, 450), None, pool, pool)

    def bug(instance, failure):
        raise KeyError("a bug")

    with pytest.raises(KeyError):
        disagg._attempt(pool, "k", None, bug)
    assert pool.instances[0].inflight == 0


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


@responses.activate
def test_models_asks_healthy_instances_first_with_a_short_timeout():
    from gateway.service import Gateway
    from gateway.config import Settings
    gateway = Gateway(Settings(engine_metrics_interval=0, prefill=["http://10.9.0.1:8100"],
                               decode=["http://10.9.0.2:8200", "http://10.9.0.3:8200"]))
    try:
        gateway.decode.failed(gateway.decode.instances[0], unreachable=True)
        responses.get("http://10.9.0.3:8200/v1/models", json={"object": "list", "data": []})
        assert gateway.models() == {"object": "list", "data": []}
        (call,) = responses.calls
        assert call.request.url.startswith("http://10.9.0.3:8200")
        assert call.request.req_kwargs["timeout"][1] <= 5
    finally:
        gateway.close()


def test_a_disconnect_noticed_by_the_watcher_is_counted_as_a_disconnect():
    from emulator.process import EmulatorProcess
    with EmulatorProcess("prefill", bidirectional_kv_xfer=True, host="127.0.0.17", itl_ms=1) as p, \
            EmulatorProcess("decode", bidirectional_kv_xfer=True, host="127.0.0.18", itl_ms=3000) as d, \
            gateway_process([p.url], [d.url]) as gateway:
        def first_event(sock):
            sock.settimeout(10)
            received = b""
            while b"data: " not in received:
                received += sock.recv(65536)

        open_and_abandon(gateway, {"model": MODEL, "stream": True, "max_tokens": 5,
                                   "messages": [{"role": "user", "content": "slow"}]}, first_event)
        wait_until(lambda: d.stats()["aborted_streams"] == 1, 5, "D stream aborted")
        wait_until(lambda: metric(gateway, "pd_gateway_client_disconnects_total") == 1, 5,
                   "the disconnect counted")
        assert metric(gateway, "pd_gateway_errors_total", stage="stream") == 0


def test_after_ttou_no_request_waits_for_a_worker_that_is_gone(fresh_engines):
    from bench import procstat
    from devtools import workload
    p, d = fresh_engines
    with gateway_process([p.url], [d.url], workers=3) as gateway:
        convs = workload.run(gateway.url, conversations=12, turns=1, concurrency=6)
        gateway.process.send_signal(signal.SIGTTOU)
        wait_until(lambda: len(procstat.children(gateway.process.pid)) == 2, 30, "2 workers")
        started = time.monotonic()
        workload.drive(convs, turns=2, concurrency=6)
        assert workload.errors(convs) == []
        # Before: requests owned by the stopped worker's slot waited --owner-wait (3 s) for it,
        # then were served where they landed ("away").
        assert metric(gateway, "pd_gateway_forwarded_total", result="away") == 0
        assert time.monotonic() - started < 3.0
        assert p.stats()["wrong_reuse"] == 0


# --- 7. a short chaos run over 1-3 with long bodies ---------------------------------------------

CHAOS_SECONDS = 12


def _client(url: str, deadline: float, rng, outcome: dict) -> None:
    """Long chats; some abandoned before their first byte, some mid-stream, the rest read."""
    import json as jsonlib
    while time.monotonic() < deadline:
        xid = uuid.uuid4().hex
        size = rng.choice([1_000, 36_000, 200_000])
        body = {"model": MODEL, "stream": True, "max_tokens": 8, "messages": history_of(size)}
        if size > 1_000 and rng.random() < 0.4:     # P needs >= 0.45 s for these
            raw = jsonlib.dumps(body).encode()
            with socket.create_connection(url.split("//")[1].split(":")) as sock:
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Request-Id: %s\r\n"
                             b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                             % (xid.encode(), len(raw), raw))
                time.sleep(0.05)                      # gone while P computes (no byte yet)
            outcome["abandoned"].append(xid)
            continue
        try:
            response = requests.post(url + "/v1/chat/completions", json=body, stream=True,
                                     timeout=30, headers={"X-Request-Id": xid})
            if rng.random() < 0.15:
                next(response.iter_content(64), None)     # the first bytes, then gone
                response.close()
                continue
            data = response.content
        except requests.RequestException as exc:
            outcome["failures"].append(repr(exc))
            continue
        if response.status_code != 200:
            outcome["statuses"].append(response.status_code)
        elif not data.endswith(b"data: [DONE]\n\n"):
            outcome["failures"].append(f"{xid}: stream ended without [DONE]")
        elif b'"error"' in data:
            outcome["error_events"] += 1


@pytest.mark.parametrize("worker_class", ["gevent", "gthread"])
def test_chaos_with_long_bodies_leaves_nothing_behind(worker_class):
    import random
    import threading
    from emulator.process import EmulatorProcess
    with EmulatorProcess("prefill", bidirectional_kv_xfer=True, host="127.0.0.19", itl_ms=2, prefill_ms_per_token=0.1) as p, \
            EmulatorProcess("decode", bidirectional_kv_xfer=True, host="127.0.0.20", itl_ms=20) as d, \
            gateway_process([p.url], [d.url], workers=2, worker_class=worker_class) as gateway:
        outcome = {"abandoned": [], "failures": [], "statuses": [], "error_events": 0}
        deadline = time.monotonic() + CHAOS_SECONDS
        faults = []

        def chaos():
            rng = random.Random(7)
            while time.monotonic() < deadline:
                engine, fault = rng.choice([(p, {"mode": "error500"}), (d, {"mode": "error500"}),
                                            (d, {"mode": "die_after", "tokens": 2})])
                engine.set_fault(count=1, **fault)
                faults.append(fault["mode"])
                time.sleep(1.5)

        threads = [threading.Thread(target=_client, args=(gateway.url, deadline,
                                                          random.Random(i), outcome))
                   for i in range(6)] + [threading.Thread(target=chaos)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        print(f"\n{worker_class}: {len(outcome['abandoned'])} abandoned in prefill, "
              f"{len(faults)} faults, statuses {outcome['statuses']}, "
              f"{outcome['error_events']} error events")
        assert outcome["failures"] == []
        # Only injected faults show: one request each at most (a 500 on P then a retry on the
        # only P gives 502; a D death mid-stream gives a final error event).
        assert len(outcome["statuses"]) + outcome["error_events"] <= len(faults)
        assert set(outcome["statuses"]) <= {502}
        # 1 and 3: a client gone before its first byte never costs a D call, forwarded or not.
        wait_until(lambda: d.stats()["streams_in_flight"] == 0, 10, "D streams closed")
        called = {r["request_id"].split("-")[1]: r for r in d.recent_requests()}
        leaked = [called[x] for x in outcome["abandoned"] if x in called]
        if leaked:
            print(leaked[:3])
            print(open(gateway.log_path).read()[-3000:])
        assert not leaked
        assert len(outcome["abandoned"]) > 0
        # 2: nothing left: no engine call in flight, no watcher, in either worker.
        for slot in range(2):
            wait_until(lambda: (lambda r: r["watchers"] == 0 and sum(
                i["inflight"] for i in r["prefill"] + r["decode"]) == 0)(
                    gateway.status(port=gateway.port + 1 + slot)), 10, f"worker {slot} idle")
        assert p.stats()["wrong_reuse"] == 0
