"""Conversation identity end to end: no-id clients hit, edited histories miss, tenants stay
apart."""

from __future__ import annotations

import re
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from openai import OpenAI

from devtools import sse
from tests.helpers.servers import MODEL, starts_processes


def ask(gateway, messages, auth="Bearer tenant-a", stream=True, **extra):
    """One turn over HTTP; returns (cache header, reply text, raw bytes)."""
    body = {"model": MODEL, "messages": messages, "max_tokens": 6, "stream": stream, **extra}
    response = requests.post(
        gateway.url + "/v1/chat/completions", json=body, timeout=30, headers={"Authorization": auth}
    )
    assert response.status_code == 200, response.text
    if stream:
        text = sse.reply(sse.events(response.content))
    else:
        text = response.json()["choices"][0]["message"]["content"]
    return response.headers["X-Gateway-Cache"], text, response.content


def first_turns(gateway, n=2, **kw):
    """A conversation of n finished turns: (messages so far, replies)."""
    messages = [
        {"role": "system", "content": "short answers"},
        {"role": "user", "content": f"topic {uuid.uuid4().hex}"},
    ]
    for i in range(n):
        _, text, _ = ask(gateway, messages, **kw)
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"q{i}"}]
    return messages


@pytest.fixture
@starts_processes
def gateway(fresh_engines, gateway_factory):
    p, d = fresh_engines
    return gateway_factory([p.url], [d.url])


@pytest.mark.parametrize("workers", [1, 4])
def test_stock_sdk_without_any_id_hits(fresh_engines, gateway_factory, workers):
    p, d = fresh_engines
    gateway = gateway_factory([p.url], [d.url], workers=workers)

    def conversation(n: int) -> list[str]:
        client = OpenAI(base_url=gateway.url + "/v1", api_key=f"key-{n % 3}", max_retries=0)
        messages = [{"role": "user", "content": f"conversation {n} about caches"}]
        caches = []
        for turn in range(5):
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=messages, max_tokens=6, stream=True
            )
            text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
            caches.append(raw.headers["X-Gateway-Cache"])
            messages += [
                {"role": "assistant", "content": text},
                {"role": "user", "content": f"next {turn}"},
            ]
        return caches

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(conversation, range(40)))
    later = [c for caches in results for c in caches[1:]]
    print(f"\nno ids, {workers} worker(s): {later.count('hit')}/{len(later)} later turns hit")
    assert later.count("hit") / len(later) >= 0.99
    assert p.stats()["wrong_reuse"] == 0


@pytest.mark.parametrize("explicit", [False, True], ids=["digest", "conversation_id"])
def test_every_rewritten_history_misses_and_nothing_is_reused_wrongly(
    gateway, fresh_engines, explicit
):
    p, _ = fresh_engines
    cid = uuid.uuid4().hex
    extra = {"conversation_id": cid} if explicit else {}
    messages = first_turns(gateway, 2, **extra)  # 2 turns done, a third asked
    cases = {
        "edited earlier message": [
            messages[0],
            {"role": "user", "content": "another topic"},
            *messages[2:],
        ],
        "dropped assistant reply": messages[:2] + messages[3:],
        "rewritten assistant reply": messages[:4]
        + [{"role": "assistant", "content": "no"}]
        + messages[5:],
    }
    for name, history in cases.items():
        cache, _, _ = ask(gateway, history, **extra)
        assert cache == "miss", name
    if explicit:
        # Another conversation's id with a different history.
        cache, _, _ = ask(gateway, [{"role": "user", "content": "unrelated"}] * 3, **extra)
        assert cache == "miss"
    assert p.stats()["wrong_reuse"] == 0


def test_regenerated_last_turn_misses_and_the_next_turn_hits(gateway, fresh_engines):
    p, _ = fresh_engines
    messages = first_turns(gateway, 2)
    cache, first, _ = ask(gateway, messages)
    assert cache == "hit"
    cache, regenerated, _ = ask(gateway, messages)  # "regenerate": same history again
    assert cache == "miss"
    cache, _, _ = ask(
        gateway,
        messages
        + [{"role": "assistant", "content": regenerated}, {"role": "user", "content": "go on"}],
    )
    assert cache == "hit"
    assert p.stats()["wrong_reuse"] == 0


def test_multi_part_echo_of_the_reply_is_reused(gateway, fresh_engines):
    p, _ = fresh_engines
    messages = [{"role": "user", "content": [{"type": "text", "text": "parts please"}]}]
    _, text, _ = ask(gateway, messages)
    echo = messages + [
        {"role": "assistant", "content": [{"type": "text", "text": text}]},
        {"role": "user", "content": [{"type": "text", "text": "more"}]},
    ]
    assert ask(gateway, echo)[0] == "hit"
    assert p.stats()["hits"] == 1 and p.stats()["wrong_reuse"] == 0


@pytest.mark.parametrize("explicit", [False, True], ids=["same_history", "same_id"])
def test_tenants_never_share_entries(gateway, fresh_engines, explicit):
    p, _ = fresh_engines
    extra = {"conversation_id": "shared-id"} if explicit else {}
    messages = first_turns(gateway, 1, auth="Bearer tenant-a", **extra)
    hits_before = p.stats()["hits"]
    assert ask(gateway, messages, auth="Bearer tenant-b", **extra)[0] == "miss"
    assert ask(gateway, messages, auth=None or "Bearer ", **extra)[0] == "miss"
    assert p.stats()["hits"] == hits_before
    assert ask(gateway, messages, auth="Bearer tenant-a", **extra)[0] == "hit"


def test_concurrent_requests_for_one_turn_get_the_entry_once(gateway, fresh_engines):
    messages = first_turns(gateway, 1)
    barrier = threading.Barrier(2)

    def racer(_):
        barrier.wait()
        return ask(gateway, messages)[0]

    with ThreadPoolExecutor(2) as pool:
        assert sorted(pool.map(racer, range(2))) == ["hit", "miss"]


def test_no_engine_detail_reaches_a_client(gateway, fresh_engines):
    """Params, engine ids, hosts and block ids stay inside: bodies, streams and errors."""
    p, d = fresh_engines
    secrets = [
        p.stats()["engine_id"],
        d.stats()["engine_id"],
        "kv_transfer_params",
        "remote_",
        "127.0.0.2",
        "127.0.0.3",
        str(p.kv_port),
        str(d.kv_port),
        "localhost",
    ]
    seen = []
    messages = first_turns(gateway, 1)
    seen.append(ask(gateway, messages)[2])
    seen.append(ask(gateway, messages, stream=False)[2])
    d.set_fault("error500", count=1)
    seen.append(
        requests.post(
            gateway.url + "/v1/chat/completions",
            timeout=30,
            json={"model": MODEL, "messages": messages},
        ).content
    )
    d.set_fault("die_after", tokens=2, count=1)
    seen.append(
        requests.post(
            gateway.url + "/v1/chat/completions",
            timeout=30,
            json={"model": MODEL, "messages": messages, "stream": True},
        ).content
    )
    d.set_fault("none")
    p.set_fault("error500", count=1)
    seen.append(
        requests.post(
            gateway.url + "/v1/chat/completions",
            timeout=30,
            json={"model": MODEL, "messages": messages},
        ).content
    )
    # Whole tokens only: a port such as 58711 may well occur inside a random hex request id.
    leaks = [
        re.compile(
            rb"(?<![0-9A-Za-z])"
            + re.escape(secret.encode())
            + (rb"(?![0-9A-Za-z])" if secret[-1].isalnum() else b"")
        )
        for secret in secrets
    ]
    for body in seen:
        for secret, leak in zip(secrets, leaks, strict=True):
            assert not leak.search(body), (secret, body[:300])
