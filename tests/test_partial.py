"""Partial reuse, in process: the checkpoints that find K, the cut of D's params, the entries
that carry them, and the key a client that drops reasoning still finds. End to end against
the emulator: tests/test_partial_e2e.py."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.reuse.conversation import identify
from gateway.reuse.kv_params import clean_params
from gateway.reuse.partial import checkpoints, cut, held_digests, shared_tokens
from gateway.reuse.store import Entry, decode, encode

BS = 16


def sequence(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1 << 31) for _ in range(n)]


def d_params(held: int, groups: list | None = None) -> dict:
    return {
        "remote_block_ids": groups if groups is not None else [list(range(1, -(-held // BS) + 1))],
        "remote_engine_id": "e",
        "remote_request_id": "r",
        "remote_host": "h",
        "remote_port": 5601,
        "remote_num_tokens": held,
    }


@given(prompt=st.integers(1, 3000), reply=st.integers(1, 1200))
def test_checkpoints_are_dense_before_the_prompts_end_and_never_beyond_what_d_holds(prompt, reply):
    held = prompt + reply - 1
    points = checkpoints(prompt, held, BS)
    assert points == sorted(set(points)) and all(1 <= p <= held // BS for p in points)
    end = prompt // BS
    assert set(range(max(1, end - 15), min(end, held // BS) + 1)) <= set(points)
    assert len(points) <= 16 + 2 * 12 + 1  # dense, then doubling both ways


@settings(max_examples=200)
@given(
    prompt=st.integers(20, 2000),
    reply=st.integers(2, 600),
    seed=st.integers(0, 1 << 20),
    back=st.integers(0, 400),
    extra=st.integers(1, 300),
)
def test_k_is_the_largest_shared_checkpoint_and_exact_near_the_prompts_end(
    prompt, reply, seed, back, extra
):
    ids = sequence(prompt + reply, seed)
    held = prompt + reply - 1
    digest, prefixes = held_digests(ids[:prompt], ids[prompt:], held, BS)
    shared = max(0, prompt - back)  # where the new prompt departs
    new = ids[:shared] + [x + 1 for x in ids[shared : shared + extra]]
    k = shared_tokens(prefixes, held, new, BS)
    assert k % BS == 0 and k <= shared and k < len(new)
    assert k in [0] + [p * BS for p in checkpoints(prompt, held, BS)]
    if back < 15 * BS and shared // BS * BS < len(new):
        assert k == shared // BS * BS  # the dense region: exact
    assert new[:k] == ids[:k]


def test_the_full_digest_is_the_one_a_whole_entry_is_verified_with():
    ids = sequence(500, 1)
    digest, _ = held_digests(ids[:400], ids[400:], 499, BS)
    digest_off, none = held_digests(ids[:400], ids[400:], 499, 0)
    assert digest == digest_off and none is None
    # Incomplete ids (a parser swallowed some) are never trusted.
    assert held_digests(ids[:400], ids[401:], 499, BS) == (None, None)


def test_checkpoints_of_another_block_size_find_nothing():
    ids = sequence(600, 2)
    _, prefixes = held_digests(ids[:500], ids[500:], 599, BS)
    assert shared_tokens(prefixes, 599, ids[:300] + [1] * 50, BS) == 288
    assert shared_tokens(prefixes, 599, ids[:300] + [1] * 50, 32) == 0
    assert shared_tokens(prefixes, 800, ids[:300] + [1] * 50, BS) == 0  # other checkpoints


def test_the_cut_keeps_the_first_blocks_and_says_so_in_remote_num_tokens():
    params = d_params(1000)
    assert cut(params, 512, BS) == {
        **params,
        "remote_num_tokens": 512,
        "remote_block_ids": [list(range(1, 33))],
    }


@pytest.mark.parametrize(
    "params, k",
    [
        (d_params(1000, [list(range(1, 64)), list(range(100, 105))]), 512),  # two groups (hybrid)
        (d_params(1000, [list(range(1, 33))]), 256),  # 32-token blocks
        (d_params(1000, [[0, 0, 0] + list(range(4, 64))]), 256),  # null blocks: a window
        (d_params(1000), 500),  # not whole blocks
        (d_params(1000), 1008),  # beyond what D holds
        (d_params(1000), 0),
    ],
)
def test_no_cut_where_the_read_would_not_be_position_exact(params, k):
    assert cut(params, k, BS) is None


def test_entries_with_checkpoints_pack_and_unpack_and_without_stay_version_1():
    ids = sequence(300, 3)
    digest, prefixes = held_digests(ids[:250], ids[250:], 299, BS)
    params = {**d_params(299), "remote_registration_generation": 2}
    entry = Entry(params, "http://d", "ab" * 16, 4, False, digest, 123.0, prefixes)
    assert decode(encode(entry)) == entry
    plain = Entry(params, "http://d", "ab" * 16, 4, True, None, 123.0)
    assert encode(plain)[0] == 1 and decode(encode(plain)) == plain
    assert encode(entry)[0] == 2


def test_ds_registration_generation_goes_back_to_p():
    """P re-handshakes after D registered its KV cache again only if it sees the newer
    generation (vLLM 0.33 nixl/pull_worker.py ~L145-151)."""
    params = {**d_params(100), "remote_registration_generation": 3}
    assert clean_params(params)["remote_registration_generation"] == 3
    assert clean_params({**params, "remote_registration_generation": -1}) is None


def test_an_entry_whose_reply_reasoned_is_found_whether_or_not_the_client_echoes_it():
    history = [{"role": "user", "content": "why"}]
    reply = {"role": "assistant", "content": "because", "reasoning_content": "let me think"}
    first = identify({"model": "m", "messages": history}, {}, None)
    key, digest, length = first.after(reply)
    for echoed in (
        reply,
        {"role": "assistant", "content": "because"},
        {"role": "assistant", "content": "because", "reasoning": "let me think"},
    ):
        follow = identify(
            {"model": "m", "messages": history + [echoed, {"role": "user", "content": "and"}]},
            {},
            None,
        )
        assert key in follow.lookups() and follow.extends(digest, length)
    # Other content is another history, reasoning or not.
    other = identify(
        {
            "model": "m",
            "messages": history
            + [
                {"role": "assistant", "content": "since", "reasoning_content": "let me think"},
                {"role": "user", "content": "and"},
            ],
        },
        {},
        None,
    )
    assert key not in other.lookups() and not other.extends(digest, length)


def test_reasoning_a_reply_never_had_makes_its_entry_need_a_token_check():
    """An entry whose reply did not reason is plain; a request that echoes that reply with
    reasoning added reaches it only through the digest without reasoning, so the digest cannot
    vouch for its tokens: the entry comes out of the store as not plain (token-verified)."""
    from gateway.flow.disagg import Disagg
    from gateway.reuse.store import LocalStore

    history = [{"role": "user", "content": "why"}]
    reply = {"role": "assistant", "content": "because"}
    key, digest, length = identify({"model": "m", "messages": history}, {}, None).after(reply)
    store = LocalStore(100, 60)
    disagg = Disagg(store, None, None, None, releaser=object())
    for echoed, plain in ((reply, True), ({**reply, "reasoning_content": "made up"}, False)):
        store.put(key, Entry(d_params(100), "http://d", digest, length, plain=True))
        follow = identify(
            {"model": "m", "messages": history + [echoed, {"role": "user", "content": "and"}]},
            {},
            None,
        )
        found = disagg.take_entry(follow)
        assert found is not None and found.plain is plain
