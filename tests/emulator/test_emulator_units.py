"""Emulator units: chat template and tokens, leases and prefix cache, the KV port, settings,
faults."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest
from hypothesis import given
from hypothesis import strategies as st
from werkzeug.test import Client

from emulator.config import ROLES, EngineConfig, build_parser, config_from_args
from emulator.faults import Fault, FaultState, parse_fault_spec
from emulator.kvport import create_kv_app
from emulator.kvstore import BlockPool, LeaseGone, LeaseMismatch, LeaseStore
from emulator.tokens import EOS, VOCAB, generate, render_chat, render_completion, reply_text


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# --- chat template and tokens -------------------------------------------------------------------

words = st.lists(st.sampled_from(["hi", "there", "kv", "cache", "a", "b"]), max_size=12)
messages = st.lists(
    st.builds(
        lambda role, ws: {"role": role, "content": " ".join(ws)},
        st.sampled_from(["system", "user", "assistant", "tool"]),
        words,
    ),
    min_size=1,
    max_size=5,
)


@given(messages, messages, st.integers(min_value=1, max_value=20))
def test_echoed_reply_makes_the_next_prompt_extend_the_decoded_sequence(history, more, count):
    prompt = render_chat(history)
    reply = generate(prompt, count)
    # What D holds after a stop (prompt + words; EOS has no KV yet) or after length (one word less).
    held_after_stop = prompt + reply
    next_prompt = render_chat(
        history + [{"role": "assistant", "content": reply_text("chat", reply)}] + more
    )
    assert next_prompt[: len(held_after_stop)] == held_after_stop
    assert next_prompt[len(held_after_stop)] == EOS


@given(st.text(alphabet="ab \n", min_size=1), st.integers(min_value=1, max_value=10), words)
def test_completion_continuation_extends_the_prompt(prompt, count, more):
    tokens = render_completion(prompt)
    reply = generate(tokens, count)
    follow_up = prompt + reply_text("completion", reply) + " " + " ".join(more)
    assert render_completion(follow_up)[: len(tokens) + count] == tokens + reply


def test_content_parts_render_like_a_string():
    as_parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "hello  big"}, {"type": "text", "text": "world"}],
        }
    ]
    as_string = [{"role": "user", "content": "hello big world"}]
    assert (
        render_chat(as_parts)
        == render_chat(as_string)
        == ["<|user|>", "hello", "big", "world", EOS, "<|assistant|>"]
    )


def test_names_tools_and_tool_calls_are_extra_words():
    plain = render_chat([{"role": "user", "content": "x"}])
    rich = render_chat(
        [{"role": "user", "content": "x", "name": "bob"}], tools=[{"type": "function"}]
    )
    assert len(rich) > len(plain) and "name=bob" in rich and rich[0] == "<|tools|>"


def test_generation_is_deterministic_and_depends_on_the_prompt():
    assert generate(["a", "b"], 8) == generate(["a", "b"], 8)
    assert generate(["a", "b"], 3) == generate(["a", "b"], 8)[:3]
    assert generate(["a", "b"], 8) != generate(["a", "c"], 8)
    assert set(generate(["a"], 200)) <= set(VOCAB)


# --- KV memory: the block pool, leases, the prefix cache ---------------------------------------


def test_prefix_cache_matches_whole_blocks_up_to_the_limit():
    pool = BlockPool(block_size=4, capacity=100)
    hashes = pool.hashes(list("abcdefghij"))  # two full blocks; "ij" is never cached
    pool.free(blocks := pool.allocate([], 3))
    pool.commit(blocks := pool.allocate([], 3), hashes)
    assert pool.match(pool.hashes(list("abcdefghijkl")), 3) == 2
    assert pool.match(pool.hashes(list("abcdefgh")), (8 - 1) // 4) == 1  # last token: computed
    assert pool.match(pool.hashes(list("abcXefgh")), 2) == 0  # hashes chain: one change breaks it
    assert pool.match(pool.hashes(list("abcdefgh"), salt="tenant-b"), 2) == 0
    assert BlockPool(4, 100, caching=False).match(hashes, 2) == 0
    pool.free(blocks)
    assert pool.match(hashes, 2) == 2 and pool.used == 0  # freed blocks stay findable


def test_blocks_in_use_are_never_evicted_and_a_full_pool_refuses():
    pool = BlockPool(block_size=2, capacity=4)
    held = pool.allocate([], 2)
    pool.commit(held, pool.hashes(list("aabb")))
    assert pool.allocate([], 3) is None and pool.used == 2  # nothing changed
    assert pool.allocate([], 2) is not None and pool.usage() == 1.0
    assert pool.match(pool.hashes(list("aabb")), 2) == 2


def test_free_cached_blocks_are_evicted_least_recently_freed_first_tail_first():
    pool = BlockPool(block_size=2, capacity=4)
    old, new = pool.hashes(list("aabb")), pool.hashes(list("ccdd"))
    for hashes in (old, new):
        blocks = pool.allocate([], 2)
        pool.commit(blocks, hashes)
        pool.free(blocks)
    assert pool.cached == 4 and pool.used == 0
    pool.free(pool.allocate([], 1))  # one fresh block evicts the oldest sequence's tail
    assert pool.match(old, 2) == 1 and pool.match(new, 2) == 2
    reused = pool.allocate(new, 2)  # a hit references the cached blocks, evicting others
    assert reused is not None and pool.match(old, 2) == 0 and pool.used == 4


def test_a_tracked_lease_is_freed_by_its_notification_or_its_ttl():
    clock = FakeClock()
    pool = BlockPool(block_size=4, capacity=10)
    store = LeaseStore(block_size=4, clock=clock, on_free=lambda lease: pool.free(lease.blocks))
    read = store.put("read", tuple("abcdefghij"), 30, blocks=pool.allocate([], 3))
    late = store.put("late", tuple("abcd"), 480, blocks=pool.allocate([], 1))
    assert len(read.block_ids) == 3 and pool.used == 4
    assert store.get("read").read([read.block_ids[1]], 4) == list("efgh")
    assert store.notify("read") is read and pool.used == 1
    with pytest.raises(LeaseGone):
        store.get("read")
    clock.now += 479.999
    assert store.held()["kv_leases"] == 1
    clock.now += 0.001
    assert store.held() == {
        "kv_leases": 0,
        "kv_lease_blocks": 0,
        "kv_lease_blocks_peak": 4,
        "leaked_leases": 0,
        "leaked_blocks": 0,
        "leases_expired_unread": 1,
    }
    assert pool.used == 0 and late.expires_at == 100.0 + 480
    store.reset_peak()
    assert store.held()["kv_lease_blocks_peak"] == 0


def test_an_untracked_lease_is_never_freed():
    """vLLM 0.33 (nixl/pull_worker.py ~L97-121, ~L670-681): no expiry, notifications ignored."""
    clock = FakeClock()
    pool = BlockPool(block_size=4, capacity=10)
    store = LeaseStore(block_size=4, clock=clock, on_free=lambda lease: pool.free(lease.blocks))
    lease = store.put("leak", tuple("abcdefgh"), None, blocks=pool.allocate([], 2))
    assert store.notify("leak") is None
    clock.now += 10**6
    assert store.get("leak").read(list(lease.block_ids), 4) == list("abcdefgh")
    assert store.held()["leaked_blocks"] == 2 and pool.used == 2


def test_a_lease_read_names_only_its_own_blocks():
    store = LeaseStore(block_size=4, clock=FakeClock())
    lease = store.put("req", tuple("abcdefgh"), 30)
    with pytest.raises(LeaseMismatch):
        lease.read([999], 4)
    assert lease.read([lease.block_ids[1], lease.block_ids[0]], 4) == list("efghabcd")


# --- KV port ------------------------------------------------------------------------------------


@pytest.fixture
def kv():
    store = LeaseStore(block_size=4, clock=FakeClock())
    return store, Client(create_kv_app("engine-A", store))


def _pull(client, **body):
    response = client.post("/kv/pull", json=body)
    return response.status_code, json.loads(response.get_data())


def test_kv_port_reads_the_named_blocks_then_frees_the_lease(kv):
    store, client = kv
    lease = store.put("r1", tuple("abcdefghij"), 30)
    status, body = _pull(
        client,
        remote_engine_id="engine-A",
        remote_request_id="r1",
        block_ids=list(lease.block_ids[1:]),
    )
    assert status == 200
    assert body["tokens"] == list("efghij") and body["num_blocks"] == 2
    status, body = _pull(
        client, remote_engine_id="engine-A", remote_request_id="r1", block_ids=[lease.block_ids[0]]
    )
    assert status == 404 and "already read" in body["error"]


def test_kv_port_refuses_the_wrong_engine_or_blocks_without_freeing(kv):
    store, client = kv
    lease = store.put("r1", ("a",), 30)
    assert (
        _pull(client, remote_engine_id="engine-B", remote_request_id="r1", block_ids=[])[0] == 409
    )
    assert (
        _pull(
            client,
            remote_engine_id="engine-A",
            remote_request_id="r1",
            block_ids=[lease.block_ids[0] + 1],
        )[0]
        == 409
    )
    assert (
        client.post(
            "/kv/release", json={"remote_engine_id": "engine-A", "remote_request_id": "r1"}
        ).status_code
        == 200
    )
    assert len(store) == 0


def test_kv_port_rejects_malformed_requests_without_freeing(kv):
    store, client = kv
    store.put("r1", ("a",), 30)
    assert client.post("/kv/pull", data=b"{nope").status_code == 400
    assert client.post("/kv/pull", json={"remote_engine_id": "engine-A"}).status_code == 400
    assert (
        _pull(client, remote_engine_id="engine-A", remote_request_id="r1", block_ids="all")[0]
        == 400
    )
    assert client.get("/kv/pull").status_code == 404
    assert len(store) == 1


# --- settings and faults ------------------------------------------------------------------------


@pytest.mark.parametrize("role", ROLES)
def test_defaults_are_vllms_whatever_the_role(role):
    """vLLM 0.33.0: enable_prefix_caching (config/cache.py ~L257), kv_lease_duration 30,
    kv_recompute_threshold 64, decoder_kv_blocks_ttl 480 (nixl/base_scheduler.py ~L82-185)."""
    config = EngineConfig(role=role, port=9000)
    assert config.kv_port == 10000 and config.enable_prefix_caching is True
    assert (config.kv_lease_duration, config.decoder_kv_blocks_ttl) == (30.0, 480.0)
    assert config.recompute_threshold == 64 and config.kv_capacity_blocks == 20_000


def test_every_config_field_is_a_flag():
    flags = {a.dest for a in build_parser()._actions} - {"help"}
    assert flags == {f.name for f in fields(EngineConfig)}


@pytest.mark.parametrize(
    "overrides, flag",
    [
        ({"block_size": 0}, "--block-size"),
        ({"stream_params": "both"}, "--stream-params"),
        ({"kv_port": 9000}, "--kv-port"),
        ({"itl_ms": -1}, "--itl-ms"),
        ({"role": "router"}, "--role"),
        ({"port": 65000}, "--kv-port"),
        ({"template_quirks": "nope"}, "--template-quirks"),
        ({"reasoning_share": 1.5}, "--reasoning-share"),
        ({"log_level": "loud"}, "--log-level"),
        ({"kv_capacity_blocks": 100}, "--kv-capacity-blocks"),
        ({"max_num_seqs": 9000}, "--max-num-seqs"),
        (
            {"enable_chunked_prefill": False, "max_num_batched_tokens": 100},
            "--max-num-batched-tokens",
        ),
    ],
)
def test_bad_settings_name_the_flag(overrides, flag):
    with pytest.raises(ValueError, match=flag):
        EngineConfig(**{"role": "decode", "port": 9000, **overrides})


def test_cli_parses_flags_and_fault_spec(capsys):
    config = config_from_args(
        [
            "--role",
            "prefill",
            "--port",
            "9100",
            "--itl-ms",
            "3",
            "--fault",
            "die_after,tokens=3",
            "--stream-params",
            "separate",
        ]
    )
    assert (config.role, config.kv_port, config.itl_ms) == ("prefill", 10100, 3.0)
    assert config.fault == Fault(mode="die_after", tokens=3)
    with pytest.raises(SystemExit):
        config_from_args(["--role", "decode", "--port", "9100", "--fault", "explode"])
    assert "fault mode must be one of" in capsys.readouterr().err
    config = config_from_args(
        [
            "--role",
            "decode",
            "--port",
            "9100",
            "--access-log",
            "--template-quirks",
            "drop_reasoning,tool_json",
        ]
    )
    assert config.access_log is True and config.template_quirks == ("drop_reasoning", "tool_json")
    assert config_from_args(["--role", "decode", "--port", "9100"]).access_log is False
    for argv, flag in (
        (["--role", "decode", "--port", "x"], "--port"),
        (["--role", "router", "--port", "9100"], "--role"),
        (["--port", "9100"], "--role"),
    ):
        with pytest.raises(SystemExit):
            config_from_args(argv)
        assert flag in capsys.readouterr().err


def test_fault_validation_and_count():
    assert parse_fault_spec("slow,delay_s=2.5") == Fault(mode="slow", delay_s=2.5)
    for bad in (
        {"mode": "boom"},
        {"mode": "slow", "delay": 1},
        {"mode": "slow", "delay_s": -1},
        {"mode": "slow", "delay_s": "x"},
        ["down"],
    ):
        with pytest.raises(ValueError):
            Fault.from_dict(bad)
    state = FaultState(Fault(mode="error500", count=2))
    assert [state.take().mode for _ in range(3)] == ["error500", "error500", "none"]
