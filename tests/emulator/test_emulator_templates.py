"""Template behaviours that break the prefix property, reasoning and tool calls, token ids,
/tokenize."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from devtools import sse as sse_client
from emulator.process import EmulatorProcess
from emulator.tokens import EOS, THINK, Template, generate_chat, token_ids
from tests.helpers.emulator import PD, stream_params
from tests.helpers.servers import starts_processes

words = st.lists(st.sampled_from(["hi", "there", "kv", "cache"]), min_size=1, max_size=6).map(
    " ".join
)
SYSTEM = {"role": "system", "content": "be brief"}
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]


def held_after(template: Template, history: list, gen) -> list[str]:
    """What D holds after replying to `history` with `gen` (stopped): prompt + generated."""
    return template.render(history) + gen.tokens


def echo(gen, reasoning: bool = True) -> dict:
    message = {"role": "assistant", "content": gen.content}
    if gen.reasoning and reasoning:
        message["reasoning"] = gen.reasoning
    if gen.tool_calls:
        message["tool_calls"] = gen.tool_calls
    return message


def keeps_prefix(
    template: Template, history: list, gen, following: dict, reasoning: bool = True
) -> bool:
    held = held_after(template, history, gen)
    return template.render(history + [echo(gen, reasoning), following])[: len(held)] == held


@given(words, words)
def test_the_default_template_keeps_reasoning_and_tool_calls_echoed_back(question, more):
    history = [SYSTEM, {"role": "user", "content": question}]
    template = Template()
    prompt = template.render(history, TOOLS)
    thinking = generate_chat(prompt, 4, True, reasoning_share=1.0)
    assert thinking.tokens[0] == THINK and thinking.reasoning
    assert keeps_prefix(template, history, thinking, {"role": "user", "content": more})
    # A client that drops the reasoning sends a prompt D's <think> span is not a prefix of.
    assert not keeps_prefix(
        template, history, thinking, {"role": "user", "content": more}, reasoning=False
    )
    calling = generate_chat(prompt, 4, True, tool_names=["lookup"], tool_call_share=1.0)
    assert calling.finish_reason == "tool_calls" and calling.content is None
    result = {"role": "tool", "tool_call_id": calling.tool_calls[0]["id"], "content": more}
    assert (
        template.render(history + [echo(calling), result], TOOLS)[
            : len(prompt) + len(calling.tokens)
        ]
        == prompt + calling.tokens
    )


@given(words)
def test_each_quirk_breaks_the_prefix_where_its_real_template_does(question):
    history = [SYSTEM, {"role": "user", "content": question}]
    following = {"role": "user", "content": "and then"}
    plain = Template()
    prompt = plain.render(history)
    thinking = generate_chat(prompt, 4, True, reasoning_share=1.0)
    # Qwen3/R1: the reasoning of a turn before the last user message is not rendered...
    drop = Template(frozenset({"drop_reasoning"}))
    assert not keeps_prefix(drop, history, thinking, following)
    # ...but a turn after it (a tool-call loop) keeps it.
    tool_result = {"role": "tool", "tool_call_id": "c1", "content": "42"}
    assert keeps_prefix(drop, history, thinking, tool_result)
    calling = generate_chat(prompt, 4, True, tool_names=["lookup"], tool_call_share=1.0)
    result = {"role": "tool", "tool_call_id": calling.tool_calls[0]["id"], "content": "r"}
    assert not keeps_prefix(Template(frozenset({"tool_json"})), history, calling, result)
    plain_reply = generate_chat(prompt, 4, True)
    assert keeps_prefix(plain, history, plain_reply, following)
    assert not keeps_prefix(Template(frozenset({"system_last"})), history, plain_reply, following)
    empty = Template(frozenset({"empty_think"}))
    off = {"enable_thinking": False}
    held = empty.render(history, kwargs=off) + plain_reply.tokens
    assert empty.render(history + [echo(plain_reply), following], kwargs=off)[: len(held)] != held


def test_reasoning_streams_as_vllm_with_every_token_id(make_api, sse):
    api = make_api(reasoning_share=1.0, output_tokens=4)
    body = {
        "messages": [{"role": "user", "content": "why"}],
        "stream": True,
        "return_token_ids": True,
    }
    events = sse(api.post("/v1/chat/completions", body).data)
    tokenized = api.post("/tokenize", {"messages": body["messages"]}).json
    assert events[0]["prompt_token_ids"] == tokenized["tokens"]
    deltas = [e["choices"][0]["delta"] for e in events[1:-1]]
    assert deltas[0] == {} and "reasoning" in deltas[1]  # <think> has no text: an empty delta
    ids = [i for e in events[1:-1] for i in e["choices"][0]["token_ids"]]
    generated = generate_chat(Template().render(body["messages"]), 4, True, reasoning_share=1.0)
    assert ids == token_ids(generated.tokens + [EOS])


@pytest.mark.parametrize(
    "field,keys",
    [
        ("reasoning", {"reasoning"}),
        ("reasoning_content", {"reasoning_content"}),
        ("both", {"reasoning", "reasoning_content"}),
    ],
)
def test_the_reasoning_field_follows_the_vllm_version(make_api, sse, field, keys):
    api = make_api(reasoning_share=1.0, reasoning_field=field)
    body = {"messages": [{"role": "user", "content": "why"}]}
    events = sse(api.post("/v1/chat/completions", {**body, "stream": True}).data)
    assert {k for e in events[1:-1] for k in e["choices"][0]["delta"]} - {"content"} == keys
    message = api.post("/v1/chat/completions", body).json["choices"][0]["message"]
    assert all(message[k] for k in keys)


def test_lossy_streams_leave_out_the_ids_of_swallowed_tokens(make_api, sse):
    api = make_api(reasoning_share=1.0, stream_token_ids="lossy")
    body = {
        "messages": [{"role": "user", "content": "why"}],
        "stream": True,
        "return_token_ids": True,
    }
    events = sse(api.post("/v1/chat/completions", body).data)
    ids = [i for e in events[1:-1] for i in e["choices"][0]["token_ids"]]
    usage = api.post("/v1/chat/completions", {**body, "stream": False}).json["usage"]
    assert len(ids) == usage["completion_tokens"] - 2  # <think> and </think>


def test_non_streamed_ids_and_tool_calls(make_api):
    api = make_api(tool_call_share=1.0)
    body = {
        "messages": [{"role": "user", "content": "find"}],
        "tools": TOOLS,
        "return_token_ids": True,
    }
    reply = api.post("/v1/chat/completions", body).json
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "lookup"
    assert (
        len(reply["prompt_token_ids"]) + len(choice["token_ids"])
        == reply["usage"]["prompt_tokens"] + reply["usage"]["completion_tokens"]
    )
    assert (
        api.post("/v1/chat/completions", {**body, "tool_choice": "none"}).json["choices"][0][
            "finish_reason"
        ]
        == "stop"
    )


def test_truncation_keeps_the_last_tokens(make_api):
    api = make_api()
    body = {"messages": [{"role": "user", "content": "a b c d e f g"}], "truncate_prompt_tokens": 3}
    assert api.post("/v1/chat/completions", body).json["usage"]["prompt_tokens"] == 3
    assert api.post("/tokenize", {"prompt": "a b c"}).json["tokens"] == token_ids(["a", "b", "c"])


@pytest.fixture(scope="module")
@starts_processes
def dropping_pd():
    with (
        EmulatorProcess(
            "prefill",
            host="127.0.0.2",
            itl_ms=1,
            output_tokens=4,
            reasoning_share=1.0,
            template_quirks="drop_reasoning",
            bidirectional_kv_xfer=True,
        ) as p,
        EmulatorProcess(
            "decode",
            host="127.0.0.3",
            itl_ms=1,
            output_tokens=4,
            reasoning_share=1.0,
            template_quirks="drop_reasoning",
            bidirectional_kv_xfer=True,
        ) as d,
    ):
        yield PD(p, d)


def test_p_counts_a_pull_of_tokens_its_prompt_does_not_extend_as_wrong(dropping_pd):
    """A gateway that trusts an echoed history under a reasoning-dropping template makes P read
    blocks holding <think> tokens its prompt does not have: the counter works on tokens."""
    pd = dropping_pd
    for engine in (pd.p, pd.d):
        engine.reset_stats()
    history = [{"role": "user", "content": "why is the sky blue"}]
    reply, params = pd.turn(history, max_tokens=100)  # past the recompute threshold
    assert reply
    pd.turn(
        history
        + [
            {"role": "assistant", "content": reply, "reasoning": "anything"},
            {"role": "user", "content": "and the sea " * 8},
        ],
        params,
    )
    assert pd.p.stats()["wrong_reuse"] == 1 and pd.p.stats()["hits"] == 0


def test_blocks_computed_under_another_cache_salt_are_a_wrong_read(pd):
    """vLLM mixes cache_salt into its block hashes so that salted users share nothing; a pull of
    another salt's blocks is counted as wrong even when the tokens agree."""
    history = [{"role": "user", "content": "shared question"}]
    p_params = pd.prefill(history, cache_salt="alice").json()["kv_transfer_params"]
    d = pd.decode(
        history, {**p_params, "remote_host": pd.p.host}, cache_salt="alice", max_tokens=100
    )  # long enough to be read past the recompute threshold
    events = sse_client.events(d)
    d_params = stream_params(events)
    reply = sse_client.reply(events).split()
    follow = history + [
        {"role": "assistant", "content": " ".join(reply)},
        {"role": "user", "content": "more"},
    ]
    p_in = {
        **d_params,
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_host": pd.d.host,
    }
    assert pd.prefill(follow, p_in, cache_salt="bob").status_code == 200
    assert pd.p.stats()["wrong_reuse"] == 1
