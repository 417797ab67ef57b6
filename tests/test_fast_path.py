"""The decode-only fast path: short follow-ups go to the D that holds the history, no P call.

End to end with the OpenAI SDK, the gateway under gunicorn and emulated engines (which count
which path each request took and any wrong reuse); the refusals (D down, overloaded, failing,
an unproven entry) are pinned at the wire with `responses`.
"""

from __future__ import annotations

import json
import uuid

import pytest
import requests
import responses
from openai import OpenAI
from responses import matchers

from emulator.process import wait_until
from tests.helpers.payloads import (
    D_URL,
    MISS,
    P_URL,
    PLAIN,
    chat_events,
    d_params,
    d_stream,
    p_params,
    p_reply,
    tokenizer,
)
from tests.helpers.servers import MODEL
from tests.helpers.transport import ResponsesTransport

CHAT = "/v1/chat/completions"
LONG = " ".join(f"detail{i}" for i in range(300))  # ~2,700 characters: far above 64 tokens


def path_of(headers) -> str:
    return headers["X-Gateway-Path"]


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "nonstream"])
def test_short_follow_ups_skip_prefill_and_long_ones_do_not(fresh_engines, gateway_factory, stream):
    p, d = fresh_engines
    gateway = gateway_factory([p.url], [d.url], fast_path_tokens=64, access_log=True)
    client = OpenAI(base_url=gateway.url + "/v1", api_key="k", max_retries=0)
    # Unique: P's prefix cache outlives a test and would hold an earlier run's identical turns.
    messages = [
        {"role": "system", "content": f"you are terse {uuid.uuid4().hex}"},
        {"role": "user", "content": "first question about kv blocks"},
    ]
    follow_ups = ["and in Python?", "why?", LONG, "thanks, and then?"]
    seen = []

    def prefills() -> int:  # P's chat requests (releases are completions, in the background)
        return sum(r["kind"] == "chat" for r in p.recent_requests())

    for turn in range(len(follow_ups) + 1):
        p_before = prefills()
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, stream=stream, max_tokens=6
        )
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
        else:
            text = raw.parse().choices[0].message.content
        seen.append(
            (
                path_of(raw.headers),
                raw.headers["X-Gateway-Cache"],
                raw.headers["X-Gateway-KV"],
                prefills() - p_before,
            )
        )
        if turn < len(follow_ups):
            messages += [
                {"role": "assistant", "content": text},
                {"role": "user", "content": follow_ups[turn]},
            ]
    # X-Gateway-KV: a decode-only turn's history came from D's own cache; P read the long
    # turn's (its reply of 6 tokens is under vLLM's threshold, but its history holds more).
    assert seen == [
        ("two-stage; reason=no_entry", "miss", "none", 1),
        ("decode-only; reason=short", "hit", "own-cache", 0),
        # A decode-only turn keeps nothing on D: the next is a two-stage miss, both
        # engines' prefix caches serving most of its prompt.
        ("two-stage; reason=no_entry", "miss", "none", 1),
        ("two-stage; reason=long", "hit", "read", 1),
        ("decode-only; reason=short", "hit", "own-cache", 0),
    ]
    p_stats, d_stats = p.stats(), d.stats()
    assert p_stats["wrong_reuse"] == 0 and d_stats["wrong_reuse"] == 0
    assert p_stats["hits"] == 1
    assert (d_stats["plain_requests"], d_stats["remote_prefill_requests"]) == (2, 3)
    assert d_stats["decode_only_requests"] == d_stats["leaked_leases"] == 0
    # A decode-only turn computed only its new tokens and the partial block before them (the
    # prefix cache holds whole blocks of 16); the rest came from D's prefix cache.
    local = [r for r in d.recent_requests() if r["pulled_tokens"] == 0]
    assert len(local) == 2
    assert all(
        0 < r["local_prefix_tokens"] and r["computed_prompt_tokens"] < 16 + 16 for r in local
    ), local
    assert local[-1]["prompt_tokens"] > 300 and local[-1]["computed_prompt_tokens"] < 16
    metrics = requests.get(gateway.url + "/metrics", timeout=10).text
    assert (
        f'pd_gateway_turn_paths_total{{model="{MODEL}",path="decode-only",reason="short"}}'
        in metrics
    )

    # The access log says the same, one line per turn, with the instances and the outcome
    # (written when the turn's stream closes, which may come just after the client's [DONE]).
    def lines() -> list[str]:
        return [line for line in gateway.log().splitlines() if " turn " in line]

    wait_until(
        lambda: (
            sum(
                "path=decode-only reason=short prefill=- decode=decode[0]" in line
                and "outcome=completed" in line
                for line in lines()
            )
            >= 2
        ),
        10,
        "the access log lines of the decode-only turns",
    )
    assert any("path=two-stage reason=long prefill=prefill[0]" in line for line in lines())


def test_off_by_default(fresh_engines, gateway_factory):
    p, d = fresh_engines
    gateway = gateway_factory([p.url], [d.url])
    cid = uuid.uuid4().hex
    body = {
        "model": MODEL,
        "max_tokens": 4,
        "conversation_id": cid,
        "messages": [{"role": "user", "content": "hello there"}],
    }
    first = requests.post(gateway.url + CHAT, json=body, timeout=30).json()
    body["messages"] += [first["choices"][0]["message"], {"role": "user", "content": "more?"}]
    reply = requests.post(gateway.url + CHAT, json=body, timeout=30)
    assert reply.headers["X-Gateway-Path"] == "two-stage; reason=fast_path_off"
    assert reply.headers["X-Gateway-Cache"] == "hit" and p.stats()["requests"] == 2


# --- the refusals, at the wire -----------------------------------------------------------
D2_URL = "http://10.9.0.3:8200"
MESSAGES = [{"role": "user", "content": "hi there"}]
TURN2 = MESSAGES + [
    {"role": "assistant", "content": "hello world"},
    {"role": "user", "content": "more"},
]


def fast_app(store, release_rate: float = 0):
    """An app with two Ds and the fast path on; background releases off unless asked for
    (they would interleave with the calls these tests pin)."""
    from gateway.app import create_app
    from gateway.config import Settings

    return create_app(
        Settings(
            engine_metrics_interval=0,
            probe_interval=0,
            prefill=[P_URL],
            decode=[D_URL, D2_URL],
            worker_class="gthread",
            verify_reuse="off",
            fast_path_tokens=64,
            release_rate=release_rate,
        ),
        store=store,
        transport=ResponsesTransport(),
    )


@pytest.fixture
def fast_client(store):
    app = fast_app(store)
    yield app.test_client(), app.extensions["pd_gateway"].gateway
    app.extensions["pd_gateway"].close()


def no_entry(client, d_url: str) -> None:
    """A first turn whose D (the one at `d_url`) leaves its params for the next turn."""
    responses.post(P_URL + CHAT, json=p_reply(p_params(1)))
    responses.post(
        d_url + CHAT,
        body=chat_events(["hello", " world"], d_params(1)),
        content_type="text/event-stream",
    )
    reply = client.post(
        CHAT, json={"model": "m", "messages": MESSAGES, "stream": True, "conversation_id": "c1"}
    )
    assert reply.status_code == 200 and reply.headers["X-Gateway-Path"].startswith("two-stage")
    responses.calls.reset()


def second_turn(client):
    return client.post(
        CHAT, json={"model": "m", "messages": TURN2, "stream": True, "conversation_id": "c1"}
    )


def _root():
    from gateway.reuse.conversation import identify

    return identify({"model": "m", "messages": MESSAGES}, {}, "c1").root


@responses.activate
def test_a_short_turn_goes_to_its_d_alone_and_its_entry_is_released(store):
    from gateway.flow.release import PROMPT

    app = fast_app(store, release_rate=1000)
    client, gateway = app.test_client(), app.extensions["pd_gateway"].gateway
    try:
        holder = gateway.decode.choose(_root())  # where a new conversation's turn 1 lands
        no_entry(client, holder.url)
        # No P call and no params at all: D prefills locally from its prefix cache and keeps
        # nothing (params with neither flag would pin its blocks for good on vLLM 0.33).
        responses.post(
            holder.url + CHAT,
            body=chat_events([" ok"], None),
            content_type="text/event-stream",
            match=[matchers.json_params_matcher({"model": "m", "messages": TURN2, "stream": True})],
        )
        # The blocks D kept after turn 1 will not be read: a P that reads none of them (0
        # tokens) makes D free them.
        released = {
            **d_params(1),
            "remote_host": holder.host,
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_num_tokens": 0,
        }
        responses.post(
            P_URL + "/v1/completions",
            json=p_reply(p_params(9)),
            match=[
                matchers.json_params_matcher(
                    {
                        "prompt": PROMPT,
                        "max_tokens": 1,
                        "stream": False,
                        "kv_transfer_params": released,
                    }
                )
            ],
        )
        reply = second_turn(client)
        assert reply.status_code == 200, reply.data
        assert reply.headers["X-Gateway-Path"] == "decode-only; reason=short"
        assert len(responses.calls) == 1  # not before the turn is over: D may still wait
        reply.close()  # the server closes the reply after the stream
        wait_until(lambda: len(responses.calls) == 2, 10, "the release")
        assert [c.request.url for c in responses.calls] == [
            holder.url + CHAT,
            P_URL + "/v1/completions",
        ]
        assert responses.calls[1].response.status_code == 200
    finally:
        app.extensions["pd_gateway"].close()


@pytest.mark.parametrize(
    "trouble,reason",
    [("down", "decode_down"), ("overloaded", "decode_overloaded"), ("failing", "decode_failed")],
)
@responses.activate
def test_a_turn_whose_d_is_in_trouble_takes_the_two_stage_path(fast_client, trouble, reason):
    client, gateway = fast_client
    holder = gateway.decode.choose(_root())
    other = next(i for i in gateway.decode.instances if i is not holder)
    no_entry(client, holder.url)
    if trouble == "down":
        holder.down = True
    elif trouble == "overloaded":
        holder.inflight = 10  # others idle: 10 > 2 x (0 + 1)
    else:
        responses.post(holder.url + CHAT, status=503, json={"error": {"message": "busy"}})
    # After a failed decode-only call its blocks are not trusted: a miss; else P reads them.
    p_params_in = (
        MISS
        if trouble == "failing"
        else {
            **d_params(1),
            "remote_host": holder.host,
            "do_remote_decode": True,
            "do_remote_prefill": False,
        }
    )
    responses.post(
        P_URL + CHAT,
        json=p_reply(p_params(2)),
        match=[
            matchers.json_params_matcher(
                {
                    "model": "m",
                    "messages": TURN2,
                    "stream": False,
                    "max_tokens": 1,
                    "kv_transfer_params": p_params_in,
                }
            )
        ],
    )
    responses.post(
        other.url + CHAT, body=chat_events([" ok"], d_params(2)), content_type="text/event-stream"
    )
    reply = second_turn(client)
    assert reply.status_code == 200, reply.data
    assert reply.headers["X-Gateway-Path"] == f"two-stage; reason={reason}"
    assert any(c.request.url == P_URL + CHAT for c in responses.calls)


@responses.activate
def test_an_entry_the_two_stage_path_would_not_read_is_not_read_by_the_fast_path(fast_client):
    # verify_reuse off: a reasoning reply is never reused, so no decode-only turn either.
    client, gateway = fast_client
    holder = gateway.decode.choose(_root())
    responses.post(P_URL + CHAT, json=p_reply(p_params(1)))
    events = [
        {"choices": [{"index": 0, "delta": {"reasoning_content": "hmm"}, "finish_reason": None}]},
        {
            "choices": [{"index": 0, "delta": {"content": "hello world"}, "finish_reason": "stop"}],
            "kv_transfer_params": d_params(1),
        },
    ]
    responses.post(
        holder.url + CHAT,
        content_type="text/event-stream",
        body=b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
        + b"data: [DONE]\n\n",
    )
    client.post(
        CHAT, json={"model": "m", "messages": MESSAGES, "stream": True, "conversation_id": "c1"}
    )
    responses.calls.reset()
    responses.post(
        P_URL + CHAT,
        json=p_reply(p_params(2)),
        match=[
            matchers.json_params_matcher(
                {
                    "model": "m",
                    "messages": [
                        *MESSAGES,
                        {"role": "assistant", "content": "hello world", "reasoning_content": "hmm"},
                        TURN2[-1],
                    ],
                    "stream": False,
                    "max_tokens": 1,
                    "kv_transfer_params": MISS,
                }
            )
        ],
    )
    responses.post(
        holder.url + CHAT, body=chat_events([" ok"], d_params(2)), content_type="text/event-stream"
    )
    echoed = [
        *MESSAGES,
        {"role": "assistant", "content": "hello world", "reasoning_content": "hmm"},
        TURN2[-1],
    ]
    reply = client.post(
        CHAT, json={"model": "m", "messages": echoed, "stream": True, "conversation_id": "c1"}
    )
    assert reply.headers["X-Gateway-Path"] == "two-stage; reason=unproven"
    assert reply.headers["X-Gateway-Cache"] == "miss"


@responses.activate
def test_a_failed_tokenize_on_d_leaves_the_proof_to_p(store):
    # verify_reuse always: the decode-only check tokenizes on D; when that fails, the two-stage
    # path proves the entry on P instead of taking the refusal as final.
    from emulator.tokens import Template
    from gateway.app import create_app
    from gateway.config import Settings

    app = create_app(
        Settings(
            release_rate=0,
            engine_metrics_interval=0,
            probe_interval=0,
            prefill=[P_URL],
            decode=[D_URL],
            worker_class="gthread",
            verify_reuse="always",
            fast_path_tokens=64,
        ),
        store=store,
        transport=ResponsesTransport(),
    )
    client = app.test_client()
    try:
        responses.add_callback(
            responses.POST, P_URL + "/tokenize", callback=tokenizer(Template(), [])
        )
        responses.post(D_URL + "/tokenize", status=500, json={"error": {"message": "busy"}})
        responses.post(P_URL + CHAT, json=p_reply(p_params(1)))
        first = [{"role": "user", "content": "hi there"}]
        responses.post(
            D_URL + CHAT,
            body=d_stream(Template().render(first), PLAIN, True),
            content_type="text/event-stream",
        )
        client.post(CHAT, json={"model": "m", "messages": first, "stream": True})
        follow = first + [
            {"role": "assistant", "content": "fine thanks"},
            {"role": "user", "content": "more"},
        ]
        reply = client.post(CHAT, json={"model": "m", "messages": follow, "stream": True})
        assert reply.headers["X-Gateway-Path"] == "two-stage; reason=tokenize_failed"
        assert reply.headers["X-Gateway-Cache"] == "hit"
    finally:
        app.extensions["pd_gateway"].close()
