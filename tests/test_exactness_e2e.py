"""Exact reuse end to end: every template behaviour of the emulator, OpenAI SDK clients that echo
reasoning and clients that do not, a gateway under gunicorn. P's `wrong_reuse` counts a pull
whose tokens are not a prefix of P's prompt; it must stay 0 whatever the template does."""

from __future__ import annotations

import uuid

import pytest
import requests

from devtools.exactness import MODES, TENANTS, measure
from tests.helpers.servers import MODEL

pytestmark = pytest.mark.processes  # engines and gateways, every test

BY_NAME = {m.name: m for m in MODES}


def rate(row: dict) -> float:
    return row["hits"] / row["later"] if row["later"] else 0.0


@pytest.mark.parametrize("mode", [m.name for m in MODES])
def test_no_template_makes_p_read_the_wrong_blocks(mode):
    conversations, turns = 3, 4
    result = measure(BY_NAME[mode], {}, conversations, turns, first_host=60)
    rows = result["rows"]
    print(
        f"\n{mode}: "
        + ", ".join(f"{k} {v['hits']}/{v['later']}" for k, v in rows.items())
        + f"; wrong_reuse {result['wrong_reuse']}; /tokenize {result['tokenize']}; "
        f"{result['checks']}"
    )
    assert [e for row in rows.values() for e in row["errors"]] == []
    assert result["wrong_reuse"] == 0
    if mode == "plain":  # digests alone; the template probed once by each tenant
        assert all(rate(row) == 1.0 for row in rows.values())
        assert result["tokenize"] == 3 * TENANTS
    if mode in ("system-last", "empty-think"):  # no prefix to reuse, and the gateway knows it
        assert sum(row["hits"] for row in rows.values()) == 0
    checks = result["checks"]
    if mode in ("tools-verbatim", "reasoning-kept"):
        # Token verification brings reasoning and tool-call turns back where the template keeps
        # them.
        assert checks.get("verified", 0) > 0, checks
    if mode == "tools-verbatim":
        assert checks.get("mismatch", 0) == 0, checks
    if mode == "reasoning-kept":
        # A client that strips reasoning finds its entry too (stored without the reasoning);
        # D's blocks hold the reasoning its prompt lacks: refused on tokens, never read whole.
        assert checks.get("mismatch", 0) + checks.get("partial", 0) > 0, checks
    if mode in ("tools-rerendered", "reasoning-dropped"):
        # ...and keeps them out where it does not: the tokens were checked and differ.
        assert checks.get("mismatch", 0) > 0, checks
    if mode == "completions":  # glued continuations miss, spaced ones hit
        spaced = turns // 2  # turns 2 and 4 follow a spaced continuation
        assert all(row["hits"] == conversations * spaced for row in rows.values())


@pytest.mark.parametrize("mode", ["reasoning-dropped", "system-last", "completions"])
def test_verification_off_still_reads_nothing_wrong_where_it_can_tell(mode):
    """verify_reuse off trusts digests for plain turns: reasoning and tool calls still miss, and
    completions keep the token-boundary rule; only a template that rewrites text (system-last)
    is beyond what off can see, which is why auto probes templates."""
    result = measure(
        BY_NAME[mode], {"verify_reuse": "off"}, conversations=3, turns=4, first_host=64
    )
    assert result["tokenize"] == 0
    if mode == "system-last":
        assert result["wrong_reuse"] > 0  # the documented cost of off
    else:
        assert result["wrong_reuse"] == 0


def test_always_verifies_every_reuse_and_still_hits_plain_chat():
    result = measure(
        BY_NAME["plain"], {"verify_reuse": "always"}, conversations=3, turns=4, first_host=68
    )
    assert result["wrong_reuse"] == 0
    later = sum(row["later"] for row in result["rows"].values())
    assert sum(row["hits"] for row in result["rows"].values()) == later
    assert result["tokenize"] == later  # one /tokenize per reuse, no probe


def chat(gateway, messages, **extra):
    response = requests.post(
        gateway.url + "/v1/chat/completions",
        timeout=30,
        json={"model": MODEL, "messages": messages, **extra},
    )
    assert response.status_code == 200, response.text
    return response.headers["X-Gateway-Cache"], response.json()["choices"][0]["message"]["content"]


def test_prompt_fields_outside_the_allowlist_keep_conversations_apart(
    fresh_engines, gateway_factory
):
    """Two users with the same history but different cache_salt (vLLM's per-user prefix-cache
    isolation) never share an entry; sampling options do not split a conversation."""
    p, d = fresh_engines
    gateway = gateway_factory([p.url], [d.url])
    history = [{"role": "user", "content": f"shared question {uuid.uuid4().hex}"}]
    _, reply = chat(gateway, history, cache_salt="alice")
    follow = history + [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "more"},
    ]
    # Same words (the emulator is deterministic, like temperature 0): only the salt differs.
    assert chat(gateway, follow, cache_salt="bob")[0] == "miss"
    assert chat(gateway, follow, cache_salt="alice", temperature=0.3)[0] == "hit"
    assert p.stats()["wrong_reuse"] == 0


def test_truncated_prompts_are_never_reused(fresh_engines, gateway_factory):
    p, d = fresh_engines
    gateway = gateway_factory([p.url], [d.url])
    history = [{"role": "user", "content": " ".join(["long"] * 40) + uuid.uuid4().hex}]
    _, reply = chat(gateway, history, truncate_prompt_tokens=20)
    follow = history + [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "more"},
    ]
    assert chat(gateway, follow, truncate_prompt_tokens=20)[0] == "miss"
    assert p.stats()["wrong_reuse"] == 0
