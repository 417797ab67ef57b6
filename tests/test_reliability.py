"""Faults: failover, breakers, mid-stream deaths, timeouts, graceful shutdown. (Clients that go
away: tests/test_cancellation.py.)"""

from __future__ import annotations

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from devtools import sse, workload
from emulator.process import EmulatorProcess, wait_until
from tests.helpers.servers import MODEL, gateway_process, health, starts_processes, two_of_each

pytestmark = pytest.mark.processes  # engines and gateways, every test


@pytest.fixture(scope="module")
@starts_processes
def pair_of_each():
    with two_of_each(11) as engines:
        yield engines


@pytest.fixture
@starts_processes
def engines2(pair_of_each):
    ps, ds = pair_of_each
    for engine in ps + ds:
        if not engine.running:
            engine.start()
        engine.set_fault("none")
        engine.reset_stats()
    return ps, ds


@pytest.mark.parametrize("fault", ["refused", "error500", "hang"])
def test_a_failing_prefill_is_retried_on_the_other(engines2, fault):
    ps, ds = engines2
    if fault == "refused":
        ps[1].stop()
    else:
        ps[1].set_fault(fault)
    with gateway_process([p.url for p in ps], [d.url for d in ds], read_timeout=1) as gateway:
        convs = workload.run(gateway.url, conversations=40, turns=5, concurrency=8)
        assert workload.errors(convs) == []
        hits, later = workload.later_hits(convs)
        print(f"\nP[1] {fault}: 200 turns, 0 errors, {hits}/{later} later turns hit")
        assert sum(p.stats()["wrong_reuse"] for p in ps if p.running) == 0
        state = health(gateway)["prefill"][1]["state"]
        assert state == ("down" if fault == "refused" else "open")


@pytest.mark.parametrize("fault", ["refused", "error500", "dies_after_its_pull"])
def test_a_failing_decode_is_retried_on_the_other(engines2, fault):
    ps, ds = engines2
    if fault == "refused":
        ds[1].stop()
    elif fault == "dies_after_its_pull":
        # Non-streamed: D reads P's blocks, then loses the connection before any response.
        ds[1].set_fault("die_after", tokens=0)
    else:
        ds[1].set_fault(fault)
    with gateway_process([p.url for p in ps], [d.url for d in ds]) as gateway:
        convs = workload.run(
            gateway.url,
            conversations=40,
            turns=5,
            concurrency=8,
            stream=fault != "dies_after_its_pull",
        )
        assert workload.errors(convs) == []
        hits, later = workload.later_hits(convs)
        assert sum(p.stats()["wrong_reuse"] for p in ps) == 0
        # The retried D got P's params only where the failed one never got the request
        # (refused); otherwise it prefilled itself, with no params (params with neither flag
        # would leak its blocks on vLLM 0.33): never a pull of blocks already read, and nothing
        # kept, so that conversation's next turn misses.
        d0 = ds[0].stats()
        assert d0["failed_pulls"] + d0["stale_pulls"] == 0 and d0["leaked_leases"] == 0
        local = d0["plain_requests"]
        assert later == 160 and hits >= later - local
        if fault == "refused":
            assert local == 0
        else:
            assert local > 0 and d0["computed_prompt_tokens"] > 0


def sse_events(response) -> tuple[list, float]:
    """Events of a streamed reply and the seconds from the first event to the end."""
    timed = sse.timed_events(response)
    end = time.monotonic()
    return [event for _, event in timed], (end - timed[0][0] if timed else 0.0)


@pytest.mark.parametrize("fault, code", [("die_after", 502), ("error_after", 500)])
def test_decode_failing_mid_stream_ends_with_an_error_event(
    fresh_engines, gateway_factory, fault, code
):
    """D dies mid-stream (its connection cut: 502) or fails during generation as vLLM does
    (content, then `{"error": ...}` and [DONE] in the same chunked stream: 500). The client gets
    the content, the gateway's error event (no engine detail) and [DONE] at once; nothing is
    stored for the next turn."""
    p, d = fresh_engines
    gateway = gateway_factory([p.url], [d.url])
    messages = [{"role": "user", "content": f"{fault} please"}]
    d.set_fault(fault, tokens=3, count=1)
    response = requests.post(
        gateway.url + "/v1/chat/completions",
        stream=True,
        timeout=10,
        json={
            "model": MODEL,
            "messages": messages,
            "stream": True,
            "max_tokens": 10,
            "conversation_id": fault,
        },
    )
    events, tail = sse_events(response)
    assert events[-1] == "[DONE]" and "error" in events[-2]
    assert events[-2]["error"]["code"] == code
    assert "emulated" not in json.dumps(events[-2])  # the engine's words stay inside
    contents = [e["choices"][0]["delta"].get("content") for e in events[:-2] if e.get("choices")]
    assert len([c for c in contents if c]) == 3
    assert tail < 1.0
    follow = messages + [
        {"role": "assistant", "content": sse.reply(events)},
        {"role": "user", "content": "x"},
    ]
    again = requests.post(
        gateway.url + "/v1/chat/completions",
        timeout=10,
        json={"model": MODEL, "messages": follow, "conversation_id": fault},
    )
    assert again.headers["X-Gateway-Cache"] == "miss"  # nothing was stored


def test_hung_prefill_gives_504(fresh_engines, gateway_factory):
    p, d = fresh_engines
    gateway = gateway_factory([p.url], [d.url], read_timeout=1)
    p.set_fault("hang")
    response = requests.post(
        gateway.url + "/v1/chat/completions",
        timeout=10,
        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
    )
    assert response.status_code == 504
    assert response.json()["error"]["code"] == 504


def test_hung_decode_mid_stream_and_total_deadline_give_error_events():
    with (
        EmulatorProcess("prefill", bidirectional_kv_xfer=True, host="127.0.0.17", itl_ms=1) as p,
        EmulatorProcess("decode", bidirectional_kv_xfer=True, host="127.0.0.18", itl_ms=1) as d,
    ):
        d.set_fault("stall_after", tokens=2)  # silent after two tokens, until the gateway leaves
        for settings, code in (({"read_timeout": 1}, 504), ({"total_timeout": 1.5}, 504)):
            with gateway_process([p.url], [d.url], **settings) as gateway:
                response = requests.post(
                    gateway.url + "/v1/chat/completions",
                    stream=True,
                    timeout=10,
                    json={
                        "model": MODEL,
                        "stream": True,
                        "max_tokens": 5,
                        "messages": [{"role": "user", "content": "x"}],
                    },
                )
                events, _ = sse_events(response)
                # D says nothing after its second token: the 504 event is the timeout's.
                assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == code, settings


@pytest.mark.parametrize("worker_class", ["gevent", "gthread"])
def test_sigterm_lets_streams_in_flight_finish(worker_class):
    with (
        EmulatorProcess("prefill", bidirectional_kv_xfer=True, host="127.0.0.19", itl_ms=1) as p,
        EmulatorProcess("decode", bidirectional_kv_xfer=True, host="127.0.0.20", itl_ms=200) as d,
    ):
        with gateway_process(
            [p.url], [d.url], worker_class=worker_class, graceful_timeout=15
        ) as gateway:

            def stream(n):
                response = requests.post(
                    gateway.url + "/v1/chat/completions",
                    stream=True,
                    timeout=20,
                    json={
                        "model": MODEL,
                        "stream": True,
                        "max_tokens": 10,
                        "messages": [{"role": "user", "content": f"stream {n}"}],
                    },
                )
                return sse_events(response)[0]

            with ThreadPoolExecutor(6) as pool:
                futures = [pool.submit(stream, n) for n in range(6)]
                wait_until(lambda: d.stats()["streams_in_flight"] == 6, 10, "streams open")
                gateway.process.send_signal(signal.SIGTERM)
                results = [f.result() for f in futures]
            assert gateway.process.wait(20) == 0
            for events in results:
                assert events[-1] == "[DONE]"
                assert not any(isinstance(e, dict) and "error" in e for e in events)
                assert sum(1 for e in events if isinstance(e, dict) and e.get("choices")) == 11


@pytest.mark.parametrize("worker_class", ["gevent", "gthread"])
def test_sigterm_does_not_wait_out_idle_keep_alive_connections(fresh_engines, worker_class):
    """With the default 75 s keep-alive, an idle client connection and the workers' own pooled
    connections to each other's private listeners must not hold a graceful stop."""
    p, d = fresh_engines
    with (
        gateway_process(
            [p.url],
            [d.url],
            worker_class=worker_class,
            workers=2,
            keepalive=75,
            graceful_timeout=60,
        ) as gateway,
        requests.Session() as client,
    ):
        # A forwarded turn leaves the forwarding worker's connection to its peer idle in its
        # pool.
        body = {"model": MODEL, "messages": [{"role": "user", "content": "idle"}]}
        with gateway.forwarded(body) as arrived, ThreadPoolExecutor(1) as pool:
            turn = pool.submit(
                requests.post, gateway.url + "/v1/chat/completions", json=body, timeout=10
            )
            arrived()
            assert turn.result().status_code == 200
        for n in range(4):
            with requests.post(
                gateway.url + "/v1/chat/completions",
                timeout=10,
                json={"model": MODEL, "messages": [{"role": "user", "content": f"idle {n}"}]},
            ) as response:
                assert response.status_code == 200
        assert client.get(gateway.url + "/health", timeout=10).status_code == 200  # kept alive
        assert gateway.metric("pd_gateway_forwarded_total", result="sent") >= 1
        started = time.monotonic()
        gateway.process.send_signal(signal.SIGTERM)
        assert gateway.process.wait(60) == 0
        stopped_in = time.monotonic() - started
    # The bound is generous against a loaded machine; waiting out keep-alive takes 75 s.
    assert stopped_in < 20, stopped_in
