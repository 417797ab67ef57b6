"""Conversation identity: canonical digests (property-tested), lookups, prefix checks, tenants."""

from __future__ import annotations

import json
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.reuse.conversation import identify, root_key

text = st.text(max_size=30)
part = st.fixed_dictionaries({"type": st.just("text"), "text": text})
tool_call = st.fixed_dictionaries(
    {
        "id": st.text(min_size=1, max_size=8),
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": st.text(min_size=1, max_size=8), "arguments": st.text(max_size=20)}
        ),
    }
)
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant", "tool"]),
        "content": st.one_of(text, st.lists(part, min_size=1, max_size=3)),
    },
    optional={
        "name": st.text(min_size=1, max_size=8),
        "tool_calls": st.lists(tool_call, min_size=1, max_size=2),
        "tool_call_id": st.text(min_size=1, max_size=8),
    },
)
messages = st.lists(message, min_size=1, max_size=6)


def shuffled(value, rng):
    """The same JSON value with every object's keys in another order."""
    if isinstance(value, dict):
        items = list(value.items())
        rng.shuffle(items)
        return {k: shuffled(v, rng) for k, v in items}
    if isinstance(value, list):
        return [shuffled(v, rng) for v in value]
    return value


def ident(msgs, auth="Bearer a", cid=None, **extra):
    return identify({"model": "m", "messages": msgs, **extra}, {"Authorization": auth}, cid)


@settings(max_examples=200)
@given(messages, st.integers(0, 2**32), st.sampled_from([None, 1, 4]))
def test_digests_are_stable_under_key_order_and_spacing(msgs, seed, indent):
    rng = random.Random(seed)
    relaid = json.loads(
        json.dumps(shuffled(msgs, rng), indent=indent, separators=None if indent else (",", ":"))
    )
    assert ident(relaid).messages == ident(msgs).messages
    assert ident(relaid).root == ident(msgs).root


@settings(max_examples=200)
@given(
    st.one_of(
        st.fixed_dictionaries({"model": st.just("m"), "messages": messages}),
        st.fixed_dictionaries({"model": st.just("m"), "prompt": text}),
    ),
    st.sampled_from([None, "c1"]),
    st.sampled_from([{}, {"X-Session-ID": "s"}]),
)
def test_the_forwarding_root_is_the_identity_root(body, cid, headers):
    """A non-owner routes by root_key alone; the owner must arrive at the same root."""
    headers = {"Authorization": "Bearer a", **headers}
    assert root_key(body, headers, cid) == identify(body, headers, cid).root


@settings(max_examples=200)
@given(messages, st.data())
def test_any_content_change_changes_the_digest_from_there_on(msgs, data):
    i = data.draw(st.integers(0, len(msgs) - 1))
    changed = json.loads(json.dumps(msgs))
    content = changed[i]["content"]
    if isinstance(content, str):
        changed[i]["content"] = content + data.draw(st.text(min_size=1, max_size=3))
    else:
        content[-1]["text"] += data.draw(st.text(min_size=1, max_size=3))
    before, after = ident(msgs).messages, ident(changed).messages
    assert before[:i] == after[:i]
    assert all(b != a for b, a in zip(before[i:], after[i:], strict=True))


def test_text_parts_equal_the_joined_string_and_none_equals_empty():
    as_parts = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    assert ident(as_parts).messages == ident([{"role": "user", "content": "a\nb"}]).messages
    assert (
        ident([{"role": "assistant", "content": None}]).messages
        == ident([{"role": "assistant", "content": ""}]).messages
    )


def test_scope_separates_tenants_models_and_prompt_fields():
    msgs = [{"role": "user", "content": "hi"}]
    base = ident(msgs)
    assert ident(msgs, auth="Bearer b").messages != base.messages
    assert ident(msgs, model="other").messages != base.messages
    assert ident(msgs, tools=[{"type": "function"}]).messages != base.messages
    assert ident(msgs, temperature=0.5).messages == base.messages  # doesn't change the prompt
    assert ident(msgs, cid="c1").root != ident(msgs, auth="Bearer b", cid="c1").root


def test_root_is_stable_across_turns_and_lookups_go_longest_first():
    turn1 = [{"role": "system", "content": "s"}, {"role": "user", "content": "q1"}]
    turn2 = turn1 + [{"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]
    one, two = ident(turn1), ident(turn2)
    assert one.root == two.root
    key, digest, length = one.after({"role": "assistant", "content": "a1"})
    assert key == digest and length == 3
    assert two.lookups()[0] == digest
    assert two.extends(digest, length)
    edited = ident([turn2[0], {"role": "user", "content": "Q1"}] + turn2[2:])
    assert not edited.extends(digest, length)
    assert digest not in edited.lookups()


def test_explicit_ids_key_by_id_and_still_check_the_history():
    turn1 = [{"role": "user", "content": "q1"}]
    key, digest, length = ident(turn1, cid="c").after({"role": "assistant", "content": "a"})
    assert key == ident(turn1, cid="c").root
    follow = ident(
        turn1 + [{"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}], cid="c"
    )
    assert follow.lookups() == [key] and follow.extends(digest, length)
    other = ident(
        [
            {"role": "user", "content": "zz"},
            {"role": "assistant", "content": "a"},
            {"role": "user", "content": "q2"},
        ],
        cid="c",
    )
    assert not other.extends(digest, length)


def test_completion_prompts_are_checked_by_prefix():
    first = identify({"prompt": "once upon"}, {}, "c")
    key, digest, length = first.after(" a time")
    nxt = identify({"prompt": "once upon a time there"}, {}, "c")
    assert nxt.lookups() == [key] and nxt.extends(digest, length)
    assert not identify({"prompt": "twice upon a time there"}, {}, "c").extends(digest, length)
    assert identify({"prompt": "once upon"}, {}, None).after(" a time")[0] is None


def test_every_field_outside_the_allowlist_is_part_of_the_scope():
    msgs = [{"role": "user", "content": "hi"}]
    base = ident(msgs)
    for field, value in [
        ("cache_salt", "s"),
        ("reasoning_effort", "high"),
        ("mm_processor_kwargs", {"fps": 2}),
        ("tool_choice", "none"),
        ("documents", [{"text": "d"}]),
        ("a_field_vllm_adds_tomorrow", 1),
    ]:
        assert ident(msgs, **{field: value}).messages != base.messages, field
    for field, value in [
        ("temperature", 0.2),
        ("max_tokens", 9),
        ("stream", True),
        ("seed", 3),
        ("return_token_ids", True),
        ("stop", ["x"]),
        ("logprobs", True),
    ]:
        assert ident(msgs, **{field: value}).messages == base.messages, field


def test_truncated_prompts_look_up_and_leave_nothing():
    msgs = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "q2"},
    ]
    for field in ("truncate_prompt_tokens", "prompt_embeds"):
        identity = ident(msgs, **{field: 5})
        assert identity.lookups() == [] and identity.after({"role": "assistant"})[0] is None
    assert ident(msgs, truncate_prompt_tokens=None).lookups() != []


def test_completion_continuations_are_checked_at_a_token_boundary():
    first = identify({"prompt": "once upon"}, {}, "c")
    _, digest, length = first.after(" a time")
    spaced = identify({"prompt": "once upon a time there"}, {}, "c")
    glued = identify({"prompt": "once upon a timeless tale"}, {}, "c")
    newline = identify({"prompt": "once upon a time\nthere"}, {}, "c")
    assert spaced.extends(digest, length) and glued.extends(digest, length)  # same characters
    assert spaced.at_boundary(length) and newline.at_boundary(length)
    assert not glued.at_boundary(length)  # not the same tokens


def test_a_lookup_tries_at_most_the_most_recent_history_prefixes():
    """One store call per request, however long the body (issue: a million messages were a
    million Redis keys in one script)."""
    from gateway.reuse.conversation import LOOKUP_DEPTH

    messages = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(1001)
    ]
    identity = identify({"messages": messages}, {}, None)
    keys = identity.lookups()
    assert len(keys) == LOOKUP_DEPTH
    # The previous turn's entry (the history up to the last reply) is the first tried.
    assert keys[0] == identify({"messages": messages[:-1]}, {}, None).messages[-1].hex()
