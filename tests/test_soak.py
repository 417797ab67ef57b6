"""Soak under chaos (marked slow: `make soak`, or `pytest -m slow tests/test_soak.py`).

Four gateway workers over two P and two D engines. Client threads run mixed multi-turn traffic
(streamed or not, with ids or not, chat or completions, some abandoned mid-stream, some with an
edited history) while a chaos thread keeps faulting one engine at a time: HTTP 500, a slow first
byte, a hang, down, and D dying mid-stream. With one faulty engine at a time every fault before
the first byte must be retried out of sight, so the only client-visible failure allowed is the
final SSE error event of a stream whose D died under it. Then the faults stop, and the gateway
must be whole again: every instance up, nothing in flight or leaked, every later turn a hit.

SOAK_SECONDS sets the length of the chaos phase (default 120).
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

import pytest
import requests

from devtools import sse, workload
from emulator.process import wait_until
from tests.helpers.servers import MODEL, gateway_process, two_of_each

pytestmark = [pytest.mark.slow, pytest.mark.processes]

SECONDS = float(os.environ.get("SOAK_SECONDS", "120"))
CLIENTS = 24
WORKERS = 4


@dataclass
class Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    counts: Counter = field(default_factory=Counter)
    problems: list = field(default_factory=list)  # anything a client must never see

    def add(self, what: str, problem: str | None = None) -> None:
        with self.lock:
            self.counts[what] += 1
            if problem:
                self.problems.append(problem)


def words(n: int) -> str:
    return " ".join(random.choices(["kv", "block", "token", "prefill", "decode", "cache"], k=n))


def check_stream(response, abandon: bool, tally: Tally) -> str | None:
    """The reply text, or None if the stream ended with an error event or was abandoned."""
    text, events, failed = [], 0, False
    for event in sse.iter_events(response):
        raw = json.dumps(event)
        if "kv_transfer_params" in raw or "remote_" in raw:
            tally.add("leak", f"engine detail in {raw[:200]}")
        if event == sse.DONE:
            return None if failed else "".join(text)
        if failed:
            tally.add("after_error", f"an event after the error event: {raw[:200]}")
        if "error" in event:
            tally.add("error_event")
            failed = True
            continue
        events += 1
        if abandon and events == 2:
            tally.add("abandoned")
            return None
        text.append(sse.content(event))
    tally.add("truncated", "a stream ended without [DONE]")
    return None


def one_turn(url: str, conversation: dict, tally: Tally) -> None:
    chat = conversation["chat"]
    stream = random.random() < 0.7
    abandon = stream and random.random() < 0.08
    body = {"model": MODEL, "max_tokens": random.choice([4, 8, 16]), "stream": stream}
    if chat:
        body["messages"] = conversation["messages"]
    else:
        body["prompt"] = conversation["prompt"]
    if conversation["id"]:
        body["conversation_id"] = conversation["id"]
    if chat and len(conversation["messages"]) > 2 and random.random() < 0.05:
        edited = json.loads(json.dumps(conversation["messages"]))
        edited[0]["content"] += " (edited)"
        body["messages"] = edited  # must be a miss, never a wrong reuse
    path = "/v1/chat/completions" if chat else "/v1/completions"
    try:
        with requests.post(
            url + path,
            json=body,
            stream=stream,
            timeout=30,
            headers={"Connection": "close"} if random.random() < 0.5 else {},
        ) as r:
            if r.status_code != 200:
                tally.add(f"http_{r.status_code}", f"HTTP {r.status_code}: {r.text[:200]}")
                return
            tally.add(r.headers.get("X-Gateway-Cache", "none"))
            if stream:
                text = check_stream(r, abandon, tally)
            else:
                if b"kv_transfer_params" in r.content or b"remote_" in r.content:
                    tally.add("leak", f"engine detail in {r.content[:200]!r}")
                choice = r.json()["choices"][0]
                text = choice["message"]["content"] if chat else choice["text"]
    except requests.RequestException as exc:
        tally.add("exception", f"{type(exc).__name__}: {exc}"[:300])
        return
    if text is None:
        return
    if chat:
        conversation["messages"] += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": words(20)},
        ]
    else:
        conversation["prompt"] += text + " " + words(20)


def client(url: str, deadline: float, tally: Tally) -> None:
    while time.monotonic() < deadline:
        chat = random.random() < 0.9
        conversation = {
            "chat": chat,
            "id": uuid.uuid4().hex if not chat or random.random() < 0.5 else None,
            "messages": [{"role": "user", "content": words(200)}],
            "prompt": words(200),
        }
        for _ in range(random.randint(2, 8)):
            if time.monotonic() >= deadline:
                return
            one_turn(url, conversation, tally)


READ_TIMEOUT = 1.5
KEEPALIVE = 5


def chaos(prefills, decodes, deadline: float, injected: Counter) -> None:
    """Fault one engine at a time: clear the last fault, and let the requests it touched finish
    their retry (a hang holds one up to the read timeout) before faulting the next engine. A
    request that meets two faulty engines of one role is a 502 by design."""
    faults = [
        ("error500", {"count": 3}),
        ("slow", {"delay_s": 0.4, "count": 3}),
        ("hang", {"max_s": 5, "count": 1}),
        ("down", {}),
    ]
    while time.monotonic() < deadline:
        engine = random.choice(prefills + decodes)
        mode, options = random.choice(
            faults + ([("die_after", {"tokens": 2, "count": 1})] if engine in decodes else [])
        )
        engine.set_fault(mode, **options)
        injected[(engine.role, mode)] += 1
        time.sleep(random.uniform(0.5, 1.5))  # pacing the chaos, not waiting for a result
        engine.set_fault("none")
        time.sleep(READ_TIMEOUT + 0.5)


def worker_reports(gateway) -> list[dict]:
    return [gateway.status(port=gateway.port + 1 + slot, debug=True) for slot in range(WORKERS)]


@pytest.mark.timeout(SECONDS + 300)
@pytest.mark.parametrize("worker_class", ["gevent", "gthread"])
def test_soak_under_chaos(worker_class):
    with two_of_each(60) as (prefills, decodes):
        gateway = gateway_process(
            [e.url for e in prefills],
            [e.url for e in decodes],
            workers=WORKERS,
            worker_class=worker_class,
            read_timeout=READ_TIMEOUT,
            breaker_cooldown=2,
            probe_interval=0.5,
            keepalive=KEEPALIVE,
        )
        try:
            for slot in range(WORKERS):
                wait_until(
                    lambda slot=slot: requests.get(
                        f"http://127.0.0.1:{gateway.port + 1 + slot}/health", timeout=2
                    ),
                    20,
                    f"worker {slot}",
                )
            before = worker_reports(gateway)
            tally, injected = Tally(), Counter()
            deadline = time.monotonic() + SECONDS
            threads = [
                threading.Thread(target=client, args=(gateway.url, deadline, tally))
                for _ in range(CLIENTS)
            ]
            threads.append(
                threading.Thread(target=chaos, args=(prefills, decodes, deadline, injected))
            )
            for t in threads:
                t.start()
            for t in threads:
                t.join(SECONDS + 120)
            print(
                f"\n{worker_class} soak {SECONDS:.0f} s: {dict(tally.counts)}; "
                f"faults {dict(injected)}"
            )
            assert tally.problems == [], tally.problems[:10]
            # Only a D dying under a stream may reach a client, once per fault.
            assert tally.counts["error_event"] <= injected[("decode", "die_after")]
            assert sum(p.stats()["wrong_reuse"] for p in prefills) == 0

            # Whole again: every instance up, nothing in flight, no leak, and reuse works.
            def recovered():
                reports = worker_reports(gateway)
                return all(
                    i["state"] == "up" and i["inflight"] == 0
                    for r in reports
                    for i in r["prefill"] + r["decode"]
                )

            wait_until(recovered, 15, "every instance up with nothing in flight")
            convs = workload.run(gateway.url, conversations=40, turns=3)
            hits, later = workload.later_hits(convs)
            assert workload.errors(convs) == [] and hits == later == 80, (hits, later)
            # Nothing leaked: once kept-alive connections have timed out (KEEPALIVE), every
            # worker is back to the threads and greenlets it booted with.
            live = lambda r: (r["pid"], r["watchers"], r["threads"], r["greenlets"])  # noqa: E731
            booted = [live(r) for r in before]
            seen = []
            try:
                wait_until(
                    lambda: (
                        seen.append([live(r) for r in worker_reports(gateway)])
                        or seen[-1] == booted
                    ),
                    KEEPALIVE + 20,
                    "workers back to their boot state",
                )
            except RuntimeError:
                raise AssertionError(
                    f"(pid, watchers, threads, greenlets) at boot {booted}, now {seen[-1]}"
                ) from None
            print(f"recovery: {hits}/{later} later turns hit; workers back to {booted}")
        finally:
            gateway.stop()
