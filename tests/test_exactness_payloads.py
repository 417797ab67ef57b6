"""Exact reuse, pinned at the wire: template probes, token ids asked of D, /tokenize checks.

The engines are `responses` mocks whose /tokenize renders with the emulator's template, so the
token ids they report are the ones a real engine's would be for that template.
"""

from __future__ import annotations

import json

import pytest
import responses

from emulator.tokens import END_THINK, EOS, THINK, Template, token_ids
from tests.helpers.payloads import (
    D_URL,
    MISS,
    P_URL,
    PLAIN,
    client_events,
    d_stream,
    p_params,
    p_reply,
    pinned_app,
    tokenizer,
)

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
# Another conversation's first turn.
OTHER = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]


@pytest.fixture
def make_client(store):
    apps = []

    def make(verify_reuse="auto"):
        apps.append(pinned_app(store, verify_reuse=verify_reuse))
        return apps[-1].test_client()

    yield make
    for app in apps:
        app.extensions["pd_gateway"].close()


REASONING = [
    (None, THINK),
    ({"reasoning": "let"}, "let"),
    ({"reasoning": " me"}, "me"),
    ({"reasoning": " think"}, "think"),
    (None, END_THINK),
    ({"content": "answer"}, "answer"),
]
REASONING_ECHO = {"role": "assistant", "content": "answer", "reasoning": "let me think"}


def turn(client, messages, close=True, **extra):
    """One streamed turn, read whole and then closed as a server closes its reply (a first
    turn's template probe runs then)."""
    reply = client.post(CHAT, json={"model": "m", "messages": messages, "stream": True, **extra})
    if close:
        reply.get_data()
        reply.close()
    return reply


@responses.activate
def test_a_template_is_probed_once_after_a_first_turn_and_plain_chat_then_pays_nothing(
    make_client,
):
    client = make_client("auto")
    calls = []
    responses.add_callback(
        responses.POST, P_URL + "/tokenize", callback=tokenizer(Template(), calls)
    )
    responses.post(P_URL + CHAT, json=p_reply(p_params()))
    prompt = Template().render(MESSAGES)
    # The template is not known yet: D is asked for the turn's ids, and sends them.
    responses.post(
        D_URL + CHAT, body=d_stream(prompt, PLAIN, with_ids=True), content_type="text/event-stream"
    )
    first = turn(client, MESSAGES, close=False)
    assert first.status_code == 200
    first.get_data()
    # A first turn has nothing to reuse: it went to P and D without waiting for a probe.
    assert calls == []
    assert [c.request.url for c in responses.calls] == [P_URL + CHAT, D_URL + CHAT]
    d_sent = json.loads(responses.calls[1].request.body)
    assert d_sent["return_token_ids"] is True
    first.close()  # once the turn is over: three renders of a fixed conversation (generation
    # prompt, reply, and the next turn)
    assert [
        (len(c["messages"]), c.get("add_generation_prompt"), c.get("continue_final_message"))
        for c in calls
    ] == [(2, None, None), (3, False, True), (4, None, None)]
    assert all(c["model"] == "m" for c in calls)
    # Turn 2 reuses on the digest: no /tokenize call, D's blocks go to P, and a safe template
    # needs no ids of D.
    responses.post(
        D_URL + CHAT,
        body=d_stream(prompt, PLAIN, with_ids=False, params_n=2),
        content_type="text/event-stream",
    )
    reply = turn(
        client,
        MESSAGES
        + [{"role": "assistant", "content": "fine thanks"}, {"role": "user", "content": "more"}],
    )
    assert reply.headers["X-Gateway-Cache"] == "hit"
    assert len(calls) == 3
    assert "return_token_ids" not in sent(D_URL + CHAT)[-1]
    assert sent(P_URL + CHAT)[-1]["kv_transfer_params"]["remote_engine_id"] == "d-engine-1"
    # A third first turn (another conversation) pays nothing either: no probe, no ids.
    responses.post(
        D_URL + CHAT, body=d_stream(prompt, PLAIN, with_ids=False), content_type="text/event-stream"
    )
    assert turn(client, OTHER).status_code == 200
    assert len(calls) == 3
    assert "return_token_ids" not in sent(D_URL + CHAT)[-1]


def sent(url: str) -> list[dict]:
    return [json.loads(c.request.body) for c in responses.calls if c.request.url == url]


def three_turns(client, template, steps, echo, lossy=False, first_ids=False):
    """Turn 1 teaches the gateway the model's ways; turn 2 gets D's ids; turn 3 is checked.
    (D answers with ids on turn 1 too if `first_ids`: the gateway asked for them.)"""
    responses.post(P_URL + CHAT, json=p_reply(p_params()))
    responses.post(
        D_URL + CHAT,
        body=d_stream(template.render(MESSAGES), steps, with_ids=first_ids),
        content_type="text/event-stream",
    )
    h2 = MESSAGES + [echo, {"role": "user", "content": "more"}]
    responses.post(
        D_URL + CHAT,
        body=d_stream(template.render(h2), steps, with_ids=True, params_n=2, lossy=lossy),
        content_type="text/event-stream",
    )
    h3 = h2 + [echo, {"role": "user", "content": "again"}]
    caches = []
    for messages in (MESSAGES, h2, h3):
        reply = turn(client, messages)
        assert reply.status_code == 200 and reply.data.endswith(b"data: [DONE]\n\n"), reply.data
        caches.append(reply.headers["X-Gateway-Cache"])
        events = client_events(reply.data)
        # Ids the gateway asked for never reach a client that did not ask for them.
        assert events[0].get("prompt_token_ids") is None
        assert all(c.get("token_ids") is None for e in events[:-1] for c in e["choices"])
    return caches, h3


@responses.activate
@pytest.mark.parametrize("quirks,expected", [((), "hit"), (("drop_reasoning",), "miss")])
def test_reasoning_turns_are_token_verified(make_client, quirks, expected):
    """D reports its ids once the gateway knows the model reasons; turn 3 is tokenized on P and
    reused only if the template kept the reasoning D generated."""
    from gateway.support import metrics

    client = make_client("auto")
    template, calls = Template(frozenset(quirks)), []
    responses.add_callback(responses.POST, P_URL + "/tokenize", callback=tokenizer(template, calls))
    # Another conversation's first turn teaches the gateway the template (probed once it is
    # over): from then on a first turn asks D for no ids.
    responses.post(P_URL + CHAT, json=p_reply(p_params()))
    responses.post(
        D_URL + CHAT,
        body=d_stream(template.render(OTHER), PLAIN, with_ids=True),
        content_type="text/event-stream",
    )
    assert turn(client, OTHER).status_code == 200
    before = {
        r: metrics.REUSE_CHECKS.labels(r)._value.get()
        for r in ("verified", "mismatch", "unverifiable")
    }
    caches, h3 = three_turns(client, template, REASONING, REASONING_ECHO)
    # Turn 2 misses: turn 1's reply had reasoning and D had not been asked for its ids.
    assert caches == ["miss", "miss", expected]
    assert ["return_token_ids" in body for body in sent(D_URL + CHAT)] == [True, False, True, True]
    assert calls[-1] == {"model": "m", "messages": h3}  # the request's own fields
    after = {r: metrics.REUSE_CHECKS.labels(r)._value.get() - before[r] for r in before}
    assert after == {
        "verified": int(expected == "hit"),
        "mismatch": int(expected == "miss"),
        "unverifiable": 1,
    }
    p_kv = sent(P_URL + CHAT)[-1]["kv_transfer_params"]
    assert (p_kv == MISS) == (expected == "miss")


@responses.activate
@pytest.mark.parametrize("quirks,expected", [((), "hit"), (("drop_reasoning",), "miss")])
def test_a_first_turn_before_the_probe_gives_its_ids_and_turn_2_is_verified(
    make_client, quirks, expected
):
    """While the template is not known yet (its probe runs once the first turn is over), D is
    asked for the first turn's ids: a reasoning reply's turn 2 is checked on tokens at once."""
    from gateway.support import metrics

    client = make_client("auto")
    template, calls = Template(frozenset(quirks)), []
    responses.add_callback(responses.POST, P_URL + "/tokenize", callback=tokenizer(template, calls))
    before = {
        r: metrics.REUSE_CHECKS.labels(r)._value.get()
        for r in ("verified", "mismatch", "unverifiable")
    }
    caches, _ = three_turns(client, template, REASONING, REASONING_ECHO, first_ids=True)
    assert caches == ["miss", expected, expected]
    assert ["return_token_ids" in body for body in sent(D_URL + CHAT)] == [True, True, True]
    after = {r: metrics.REUSE_CHECKS.labels(r)._value.get() - before[r] for r in before}
    assert after == {
        "verified": 2 * (expected == "hit"),
        "mismatch": 2 * (expected == "miss"),
        "unverifiable": 0,
    }


@responses.activate
def test_ids_with_a_gap_are_never_trusted(make_client):
    """vLLM before PR #29074 streamed no ids for tokens a parser swallowed; the count of ids
    must then fall short of what D holds, and the turn is unverifiable, not verified."""
    client = make_client("auto")
    calls = []
    responses.add_callback(
        responses.POST, P_URL + "/tokenize", callback=tokenizer(Template(), calls)
    )
    caches, _ = three_turns(client, Template(), REASONING, REASONING_ECHO, lossy=True)
    assert caches == ["miss", "miss", "miss"]
    assert len(calls) == 3  # the probe only


@responses.activate
def test_a_failing_tokenize_is_a_miss_not_an_error(make_client):
    client = make_client("always")
    responses.post(P_URL + "/tokenize", status=404, json={"error": {"message": "Not Found"}})
    caches, _ = three_turns(
        client, Template(), PLAIN, {"role": "assistant", "content": "fine thanks"}
    )
    assert caches == ["miss", "miss", "miss"]


@responses.activate
@pytest.mark.parametrize("quirks,expected", [((), "hit"), (("system_last",), "miss")])
def test_always_verifies_plain_turns_too(make_client, quirks, expected):
    client = make_client("always")
    template, calls = Template(frozenset(quirks)), []
    responses.add_callback(responses.POST, P_URL + "/tokenize", callback=tokenizer(template, calls))
    caches, _ = three_turns(
        client, template, PLAIN, {"role": "assistant", "content": "fine thanks"}, first_ids=True
    )
    # always asks D for ids from turn 1, so turn 2 is already checked.
    assert caches == ["miss", expected, expected]
    assert len(calls) == 2  # no probe: one per reuse


@responses.activate
def test_a_template_that_rewrites_earlier_text_fails_its_probe(make_client):
    client = make_client("auto")
    template, calls = Template(frozenset({"system_last"})), []
    responses.add_callback(responses.POST, P_URL + "/tokenize", callback=tokenizer(template, calls))
    caches, _ = three_turns(
        client, template, PLAIN, {"role": "assistant", "content": "fine thanks"}, first_ids=True
    )
    assert caches == ["miss", "miss", "miss"]
    assert ["return_token_ids" in body for body in sent(D_URL + CHAT)] == [True, True, True]
    assert len(calls) == 3 + 2  # probe, then each reuse checked


@responses.activate
def test_truncated_prompts_are_never_reused(client, store):
    responses.post(P_URL + CHAT, json=p_reply(p_params()))
    responses.post(
        D_URL + CHAT,
        body=d_stream(Template().render(MESSAGES), PLAIN, with_ids=False),
        content_type="text/event-stream",
    )
    turn(client, MESSAGES, truncate_prompt_tokens=100, conversation_id="c")
    assert len(store) == 0


@responses.activate
def test_token_ids_the_client_asked_for_reach_it(make_client):
    client = make_client("auto")
    responses.add_callback(responses.POST, P_URL + "/tokenize", callback=tokenizer(Template(), []))
    responses.post(P_URL + CHAT, json=p_reply(p_params()))
    prompt = Template().render(MESSAGES)
    responses.post(
        D_URL + CHAT, body=d_stream(prompt, PLAIN, with_ids=True), content_type="text/event-stream"
    )
    events = client_events(turn(client, MESSAGES, return_token_ids=True).data)
    assert events[0]["prompt_token_ids"] == token_ids(prompt)
    assert [i for e in events[1:-1] for i in e["choices"][0]["token_ids"]] == token_ids(
        ["fine", "thanks", EOS]
    )
