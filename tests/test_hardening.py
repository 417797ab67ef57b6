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

from gateway.launch import wait_until
from tests.conftest import MODEL, gateway_process
from tests.test_reliability import open_and_abandon


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
    from gateway.errors import GatewayError
    from gateway.upstream import Instance, Upstream, Watch
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
        for i in range(6):    # about half land on the non-owner and are forwarded
            open_and_abandon(gateway, {"model": MODEL, "stream": True,
                                       "messages": history_of(2000), "conversation_id": f"c{i}"},
                             lambda sock, n=i + 1: wait_until(
                                 lambda: p.stats()["requests"] >= n, 10, "P call"))
        wait_until(lambda: p.stats()["fault_responses"] == 6, 5, "every P call closed")
        forwarded = metric(gateway, "pd_gateway_forwarded_total")
        assert forwarded > 0
        # A forwarded request whose client left is not re-run here (today: a second P call).
        assert p.stats()["requests"] == 6
        p.set_fault("none")
        assert d.stats()["requests"] == 0


def metric(gateway, name: str, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    text = requests.get(gateway.url + "/metrics", timeout=5).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


# --- 4. an entry keeps its own expiry when it is put back ------------------------------------

def test_a_put_back_entry_keeps_its_expiry_locally(clock):
    from gateway.store import Entry, LocalStore
    store = LocalStore(maxsize=10, ttl=450, timer=clock)
    store.put("k", Entry({"a": 1}, "http://d", "h", 1))
    clock.advance(400)
    entry = store.take("k")
    store.put("k", entry)                    # e.g. another history under the same id
    clock.advance(60)                        # 460 s after D kept the blocks: they are gone
    assert store.take("k") is None


def test_a_put_back_entry_keeps_its_expiry_in_redis(redis_server):
    from gateway.store import Entry, RedisStore
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
