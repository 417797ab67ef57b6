"""Clients that go away mid-turn: the engine call in progress ends at once (P's during a prefill,
whatever the body size; D's stream mid-reply), nothing is stored for the turn, D is never
called for a turn whose client left before its first byte, a forwarded turn is not served
again where it landed, the disconnect is counted, and a chaos run with long bodies leaves
nothing in flight."""

from __future__ import annotations

import socket
import time
import uuid

import pytest
import requests

from emulator.process import EmulatorProcess, wait_until
from tests.helpers.servers import MODEL, gateway_process, health, metric, open_and_abandon

pytestmark = pytest.mark.processes  # engines and gateways, every test


def history_of(size: int) -> list[dict]:
    """A chat of about `size` bytes of JSON: long histories are this gateway's workload."""
    words = " ".join(["history"] * (size // 8))
    return [{"role": "user", "content": f"{uuid.uuid4().hex} {words}"}]


def live_tasks(gateway) -> tuple[int, int, int, int]:
    """(request watchers, threads, greenlets, requests in flight) in the gateway's worker."""
    report = gateway.status(debug=True)
    inflight = sum(i["inflight"] for i in report["prefill"] + report["decode"])
    return report["watchers"], report["threads"], report["greenlets"], inflight


def settle(gateway, before: tuple[int, int, int, int]) -> None:
    """Wait until no watcher or engine call is left and threads and greenlets are back."""
    seen = []

    def settled():
        seen.append(live_tasks(gateway))
        watchers, threads, greenlets, inflight = seen[-1]
        return watchers == 0 and inflight == 0 and threads <= before[1] and greenlets <= before[2]

    try:
        wait_until(settled, 5, "tasks to end")
    except RuntimeError:
        raise AssertionError(f"leak: before {before}, after {seen[-1]}") from None


# --- a client gone while P computes or mid-stream: the engine call closes -----------------------


@pytest.mark.parametrize("worker_class", ["gevent", "gthread"])
def test_client_disconnect_during_prefill_closes_the_engine_call(worker_class):
    # Engines of its own: the shared ones also get releases from the session's other gateways
    # (entries that expire), which P counts among its requests.
    with (
        EmulatorProcess("prefill", bidirectional_kv_xfer=True, host="127.0.0.17", itl_ms=1) as p,
        EmulatorProcess("decode", bidirectional_kv_xfer=True, host="127.0.0.18", itl_ms=1) as d,
        gateway_process([p.url], [d.url], worker_class=worker_class) as gateway,
    ):
        requests.post(
            gateway.url + "/v1/chat/completions",
            timeout=10,  # warm up (gthread pool)
            json={"model": MODEL, "messages": [{"role": "user", "content": "warm"}]},
        )
        before, stored = live_tasks(gateway), health(gateway)["conversations"]
        p.set_fault("hang")
        open_and_abandon(
            gateway,
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "h"}],
                "stream": True,
                "conversation_id": "gone",
            },
            lambda sock: wait_until(lambda: p.stats()["requests"] == 2, 10, "P call"),
        )
        # A hung P answers nothing until the gateway closes its connection (its read timeout is
        # minutes away): closed within the wait, the disconnect closed it.
        wait_until(lambda: p.stats()["fault_responses"] == 1, 5, "P connection closed")
        p.set_fault("none")
        assert d.stats()["requests"] == 1  # only the warm-up
        settle(gateway, before)
        assert health(gateway)["conversations"] == stored  # nothing stored for it


@pytest.mark.parametrize("worker_class", ["gevent", "gthread"])
def test_client_disconnect_mid_stream_closes_the_decode_stream(worker_class):
    with (
        EmulatorProcess("prefill", bidirectional_kv_xfer=True, host="127.0.0.15", itl_ms=1) as p,
        EmulatorProcess("decode", bidirectional_kv_xfer=True, host="127.0.0.16", itl_ms=1) as d,
        gateway_process([p.url], [d.url], worker_class=worker_class) as gateway,
    ):
        # Warm up, so gthread's pool has its request thread before we count.
        _ = requests.post(
            gateway.url + "/v1/chat/completions",
            timeout=10,
            json={
                "model": MODEL,
                "max_tokens": 1,
                "stream": True,
                "messages": [{"role": "user", "content": "warm"}],
            },
        ).content
        before, stored = live_tasks(gateway), health(gateway)["conversations"]

        def first_event(sock):
            sock.settimeout(10)
            received = b""
            while b"data: " not in received:
                chunk = sock.recv(65536)
                assert chunk, received
                received += chunk

        # D sends one token, then nothing until its client leaves: no later write of the
        # gateway's can find the client gone, only the disconnect watcher can close D.
        d.set_fault("stall_after", tokens=1)
        open_and_abandon(
            gateway,
            {
                "model": MODEL,
                "stream": True,
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "slow"}],
            },
            first_event,
        )
        wait_until(lambda: d.stats()["aborted_streams"] == 1, 10, "D stream aborted")
        d.set_fault("none")
        settle(gateway, before)
        assert health(gateway)["conversations"] == stored  # nothing stored for it


@pytest.mark.parametrize("size", [1_000, 36_000, 200_000], ids=["1KB", "36KB", "200KB"])
@pytest.mark.parametrize("worker_class", ["gevent", "gthread"])
def test_a_client_gone_during_prefill_stops_the_turn(
    fresh_engines, gateway_factory, worker_class, size
):
    p, d = fresh_engines
    gateway = gateway_factory([p.url], [d.url], worker_class=worker_class)
    p.set_fault("hang")
    open_and_abandon(
        gateway,
        {"model": MODEL, "messages": history_of(size), "stream": True},
        lambda sock: wait_until(lambda: p.stats()["requests"] == 1, 10, "P call"),
    )
    wait_until(lambda: p.stats()["fault_responses"] == 1, 5, "P connection closed")
    p.set_fault("none")
    assert d.stats()["requests"] == 0


def test_a_disconnect_noticed_by_the_watcher_is_counted_as_a_disconnect():
    from emulator.process import EmulatorProcess

    with (
        EmulatorProcess("prefill", bidirectional_kv_xfer=True, host="127.0.0.17", itl_ms=1) as p,
        EmulatorProcess("decode", bidirectional_kv_xfer=True, host="127.0.0.18", itl_ms=3000) as d,
        gateway_process([p.url], [d.url]) as gateway,
    ):

        def first_event(sock):
            sock.settimeout(10)
            received = b""
            while b"data: " not in received:
                received += sock.recv(65536)

        open_and_abandon(
            gateway,
            {
                "model": MODEL,
                "stream": True,
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "slow"}],
            },
            first_event,
        )
        wait_until(lambda: d.stats()["aborted_streams"] == 1, 5, "D stream aborted")
        wait_until(
            lambda: metric(gateway, "pd_gateway_client_disconnects_total") == 1,
            5,
            "the disconnect counted",
        )
        assert metric(gateway, "pd_gateway_errors_total", stage="stream") == 0


# --- a failed forward propagates; only an owner that is away is served here ---------------------


def test_a_client_gone_while_forwarded_is_not_served_again_locally(fresh_engines):
    p, d = fresh_engines
    with gateway_process([p.url], [d.url], workers=2) as gateway:
        p.set_fault("hang")
        for sent in (1, 2):
            body = {
                "model": MODEL,
                "stream": True,
                "messages": history_of(2000),
                "conversation_id": f"c{sent}",
            }
            with gateway.forwarded(body) as arrived:
                open_and_abandon(
                    gateway,
                    body,
                    lambda sock, n=sent: (
                        arrived(),
                        wait_until(lambda: p.stats()["requests"] >= n, 10, "P call"),
                    ),
                )
            wait_until(lambda n=sent: p.stats()["fault_responses"] == n, 5, "the P call closed")
        assert metric(gateway, "pd_gateway_forwarded_total", result="failed") == 2
        # A forwarded request whose client left is not re-run here (before: a second P call).
        assert p.stats()["requests"] == sent
        p.set_fault("none")
        assert d.stats()["requests"] == 0


# --- a short chaos run with long bodies ---------------------------------------------------------

CHAOS_SECONDS = 12


def _client(url: str, deadline: float, rng, outcome: dict) -> None:
    """Long chats; some abandoned before their first byte, some mid-stream, the rest read."""
    import json as jsonlib

    while time.monotonic() < deadline:
        xid = uuid.uuid4().hex
        size = rng.choice([1_000, 36_000, 200_000])
        body = {"model": MODEL, "stream": True, "max_tokens": 8, "messages": history_of(size)}
        if size > 1_000 and rng.random() < 0.4:  # P needs >= 0.45 s for these
            raw = jsonlib.dumps(body).encode()
            with socket.create_connection(url.split("//")[1].split(":")) as sock:
                sock.sendall(
                    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Request-Id: %s\r\n"
                    b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                    % (xid.encode(), len(raw), raw)
                )
                time.sleep(0.05)  # gone while P computes (no byte yet)
            outcome["abandoned"].append(xid)
            continue
        try:
            response = requests.post(
                url + "/v1/chat/completions",
                json=body,
                stream=True,
                timeout=30,
                headers={"X-Request-Id": xid},
            )
            if rng.random() < 0.15:
                next(response.iter_content(64), None)  # the first bytes, then gone
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

    with (
        EmulatorProcess(
            "prefill",
            bidirectional_kv_xfer=True,
            host="127.0.0.19",
            itl_ms=2,
            prefill_ms_per_token=0.1,
        ) as p,
        EmulatorProcess("decode", bidirectional_kv_xfer=True, host="127.0.0.20", itl_ms=20) as d,
        gateway_process([p.url], [d.url], workers=2, worker_class=worker_class) as gateway,
    ):
        outcome = {"abandoned": [], "failures": [], "statuses": [], "error_events": 0}
        deadline = time.monotonic() + CHAOS_SECONDS
        faults = []

        def chaos():
            rng = random.Random(7)
            while time.monotonic() < deadline:
                engine, fault = rng.choice(
                    [
                        (p, {"mode": "error500"}),
                        (d, {"mode": "error500"}),
                        (d, {"mode": "die_after", "tokens": 2}),
                    ]
                )
                engine.set_fault(count=1, **fault)
                faults.append(fault["mode"])
                time.sleep(1.5)

        threads = [
            threading.Thread(
                target=_client, args=(gateway.url, deadline, random.Random(i), outcome)
            )
            for i in range(6)
        ] + [threading.Thread(target=chaos)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        print(
            f"\n{worker_class}: {len(outcome['abandoned'])} abandoned in prefill, "
            f"{len(faults)} faults, statuses {outcome['statuses']}, "
            f"{outcome['error_events']} error events"
        )
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
            wait_until(
                lambda slot=slot: (
                    lambda r: (
                        r["watchers"] == 0
                        and sum(i["inflight"] for i in r["prefill"] + r["decode"]) == 0
                    )
                )(gateway.status(port=gateway.port + 1 + slot)),
                10,
                f"worker {slot} idle",
            )
        assert p.stats()["wrong_reuse"] == 0


# Under gevent the watch is the event loop's own watchers; run where gevent has patched
# threading, as in a gevent worker (a script of its own: this process is not patched).
UNDER_GEVENT = """
from gevent import monkey; monkey.patch_all()
import socket, sys, time
import gevent
from gateway.engines.watch import NOT_WAITING, Watch
{body}
"""


def under_gevent(body: str) -> str:
    import subprocess
    import sys
    import textwrap

    done = subprocess.run(
        [sys.executable, "-c", UNDER_GEVENT.format(body=textwrap.dedent(body))],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_under_gevent_a_stream_silent_after_its_client_took_bytes_is_cut_at_its_read_timeout():
    """The timer fired while the client was taking bytes (not waiting for D): the next look must
    come within the read timeout, not at the far total deadline."""
    print(
        under_gevent("""
        watch = Watch(None, time.monotonic() + 600)      # a total deadline far away
        watch.keep_quiet_limit(0.05, "D")
        watch.heard_at = NOT_WAITING
        watch._tick()                  # the timer's fire, while the client takes bytes
        watch.heard_at = time.monotonic()                # now waiting for D, which is silent
        bound = time.monotonic() + 30
        while not (watch.silent or watch.expired) and time.monotonic() < bound:
            gevent.sleep(0.01)
        assert watch.silent and not watch.expired, (watch.silent, watch.expired)
        watch.stop()
        assert Watch.live == 0, Watch.live
    """)
    )


def test_under_gevent_a_client_gone_cuts_and_a_closed_socket_is_let_go():
    out = under_gevent("""
        ours, client = socket.socketpair()
        watch = Watch(ours, None)
        assert Watch.live == 1
        client.close()
        bound = time.monotonic() + 30
        while not watch.gone and time.monotonic() < bound:
            gevent.sleep(0.01)
        assert watch.gone and Watch.live == 0, (watch.gone, Watch.live)
        watch.stop()
        ours, client = socket.socketpair()
        watch = Watch(ours, None)
        ours.close()                   # closed before the watch stopped: gevent tells it so
        bound = time.monotonic() + 30
        while Watch.live and time.monotonic() < bound:
            gevent.sleep(0.01)
        assert not watch.gone and Watch.live == 0, (watch.gone, Watch.live)
        watch.stop()
        print("ok")
    """)
    assert out == "ok"
