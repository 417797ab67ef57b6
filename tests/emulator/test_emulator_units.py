"""Emulator units: chat template and tokens, leases and prefix cache, the KV port, settings, faults."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest
from hypothesis import given
from hypothesis import strategies as st
from werkzeug.test import Client

from gateway.emulator.config import DEFAULT_KV_TTL, ROLES, EngineConfig, build_parser, config_from_args
from gateway.emulator.faults import Fault, FaultState, parse_fault_spec
from gateway.emulator.kvport import create_kv_app
from gateway.emulator.kvstore import LeaseGone, LeaseMismatch, LeaseStore, PrefixCache
from gateway.emulator.tokens import EOS, VOCAB, generate, render_chat, render_completion, reply_text


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# --- chat template and tokens -------------------------------------------------------------------

words = st.lists(st.sampled_from(["hi", "there", "kv", "cache", "a", "b"]), max_size=12)
messages = st.lists(st.builds(lambda role, ws: {"role": role, "content": " ".join(ws)},
                              st.sampled_from(["system", "user", "assistant", "tool"]), words),
                    min_size=1, max_size=5)


@given(messages, messages, st.integers(min_value=1, max_value=20))
def test_echoed_reply_makes_the_next_prompt_extend_the_decoded_sequence(history, more, count):
    prompt = render_chat(history)
    reply = generate(prompt, count)
    # What D holds after a stop (prompt + words; EOS has no KV yet) or after length (one word less).
    held_after_stop = prompt + reply
    next_prompt = render_chat(history + [{"role": "assistant", "content": reply_text("chat", reply)}] + more)
    assert next_prompt[:len(held_after_stop)] == held_after_stop
    assert next_prompt[len(held_after_stop)] == EOS


@given(st.text(alphabet="ab \n", min_size=1), st.integers(min_value=1, max_value=10), words)
def test_completion_continuation_extends_the_prompt(prompt, count, more):
    tokens = render_completion(prompt)
    reply = generate(tokens, count)
    follow_up = prompt + reply_text("completion", reply) + " " + " ".join(more)
    assert render_completion(follow_up)[:len(tokens) + count] == tokens + reply


def test_content_parts_render_like_a_string():
    as_parts = [{"role": "user", "content": [{"type": "text", "text": "hello  big"},
                                             {"type": "text", "text": "world"}]}]
    as_string = [{"role": "user", "content": "hello big world"}]
    assert render_chat(as_parts) == render_chat(as_string) == [
        "<|user|>", "hello", "big", "world", EOS, "<|assistant|>"]


def test_names_tools_and_tool_calls_are_extra_words():
    plain = render_chat([{"role": "user", "content": "x"}])
    rich = render_chat([{"role": "user", "content": "x", "name": "bob"}], tools=[{"type": "function"}])
    assert len(rich) > len(plain) and "name=bob" in rich and rich[0] == "<|tools|>"


def test_generation_is_deterministic_and_depends_on_the_prompt():
    assert generate(["a", "b"], 8) == generate(["a", "b"], 8)
    assert generate(["a", "b"], 3) == generate(["a", "b"], 8)[:3]
    assert generate(["a", "b"], 8) != generate(["a", "c"], 8)
    assert set(generate(["a"], 200)) <= set(VOCAB)


# --- leases and prefix cache --------------------------------------------------------------------

def test_lease_is_handed_over_once():
    store = LeaseStore(block_size=4, ttl=30, clock=FakeClock())
    lease = store.put("req-1", tuple("abcdefghij"))
    assert len(lease.block_ids) == 3  # ceil(10 / 4)
    assert store.take("req-1", lease.block_ids) == lease
    with pytest.raises(LeaseGone):
        store.take("req-1")
    assert len(store) == 0


def test_lease_expires_after_ttl_on_the_injected_clock():
    clock = FakeClock()
    store = LeaseStore(block_size=4, ttl=30, clock=clock)
    early, late = store.put("early", ("a",)), store.put("late", ("b",))
    assert early.expires_at == clock.now + 30
    clock.now += 29.999
    assert store.take("early") == early
    clock.now += 0.001
    with pytest.raises(LeaseGone):
        store.take("late")
    assert late.block_ids != early.block_ids


def test_wrong_block_ids_do_not_free_the_lease():
    store = LeaseStore(block_size=4, ttl=30, clock=FakeClock())
    lease = store.put("req", tuple("abcdefgh"))
    with pytest.raises(LeaseMismatch):
        store.take("req", (999, 1000))
    assert store.take("req", lease.block_ids) == lease


def test_lease_store_is_bounded():
    store = LeaseStore(block_size=4, ttl=30, maxsize=3, clock=FakeClock())
    for i in range(5):
        store.put(f"r{i}", ("x",))
    assert len(store) == 3


def test_prefix_cache_matches_whole_blocks_up_to_the_limit():
    cache = PrefixCache(block_size=4, capacity_blocks=100)
    cache.insert(list("abcdefghij"))  # two full blocks; "ij" is not cached
    assert cache.match(list("abcdefghijkl"), limit=12) == 8
    assert cache.match(list("abcdefgh"), limit=7) == 4  # the last prompt token is always computed
    assert cache.match(list("abcXefgh"), limit=8) == 0  # block hashes chain: a changed block breaks it
    assert PrefixCache(block_size=4, capacity_blocks=0).match(list("abcdefgh"), 8) == 0


def test_prefix_cache_evicts_least_recently_used_blocks():
    cache = PrefixCache(block_size=2, capacity_blocks=2)
    cache.insert(list("aabb"))
    cache.insert(list("ccdd"))
    assert len(cache) == 2
    assert cache.match(list("aabb"), 4) == 0 and cache.match(list("ccdd"), 4) == 4


# --- KV port ------------------------------------------------------------------------------------

@pytest.fixture
def kv():
    store = LeaseStore(block_size=4, ttl=30, clock=FakeClock())
    return store, Client(create_kv_app("engine-A", store))


def _pull(client, **body):
    response = client.post("/kv/pull", json=body)
    return response.status_code, json.loads(response.get_data())


def test_kv_port_hands_requested_blocks_over_once(kv):
    store, client = kv
    lease = store.put("r1", tuple("abcdefghij"))
    ids = [list(lease.block_ids)]
    status, body = _pull(client, remote_engine_id="engine-A", remote_request_id="r1",
                         remote_block_ids=ids, first_block=1, num_tokens=9)
    assert status == 200
    assert body["tokens"] == list("efghi") and body["num_blocks"] == 2
    status, body = _pull(client, remote_engine_id="engine-A", remote_request_id="r1", remote_block_ids=ids)
    assert status == 404 and "already read" in body["error"]


def test_kv_port_refuses_the_wrong_engine_without_freeing(kv):
    store, client = kv
    lease = store.put("r1", ("a",))
    assert _pull(client, remote_engine_id="engine-B", remote_request_id="r1")[0] == 409
    assert _pull(client, remote_engine_id="engine-A", remote_request_id="r1",
                 remote_block_ids=[[lease.block_ids[0] + 1]])[0] == 409
    assert client.post("/kv/release", json={"remote_engine_id": "engine-A",
                                            "remote_request_id": "r1"}).status_code == 200
    assert len(store) == 0


def test_kv_port_rejects_malformed_requests_without_freeing(kv):
    store, client = kv
    store.put("r1", ("a",))
    assert client.post("/kv/pull", data=b"{nope").status_code == 400
    assert client.post("/kv/pull", json={"remote_engine_id": "engine-A"}).status_code == 400
    assert _pull(client, remote_engine_id="engine-A", remote_request_id="r1", num_tokens="all")[0] == 400
    assert client.get("/kv/pull").status_code == 404
    assert len(store) == 1


# --- settings and faults ------------------------------------------------------------------------

@pytest.mark.parametrize("role", ROLES)
def test_defaults_validate_and_follow_the_role(role):
    config = EngineConfig(role=role, port=9000)
    assert config.kv_ttl == DEFAULT_KV_TTL[role] and config.kv_port == 10000
    assert (config.prefix_cache_blocks > 0) == (role == "decode")


def test_every_config_field_is_a_flag():
    flags = {a.dest for a in build_parser()._actions} - {"help"}
    assert flags == {f.name for f in fields(EngineConfig)}


@pytest.mark.parametrize("overrides, flag", [
    ({"block_size": 0}, "--block-size"), ({"stream_params": "both"}, "--stream-params"),
    ({"kv_port": 9000}, "--kv-port"), ({"itl_ms": -1}, "--itl-ms"), ({"role": "router"}, "--role"),
    ({"port": 65000}, "--kv-port"), ({"template_quirks": "nope"}, "--template-quirks"),
    ({"reasoning_share": 1.5}, "--reasoning-share"), ({"log_level": "loud"}, "--log-level")])
def test_bad_settings_name_the_flag(overrides, flag):
    with pytest.raises(ValueError, match=flag):
        EngineConfig(**{"role": "decode", "port": 9000, **overrides})


def test_cli_parses_flags_and_fault_spec(capsys):
    config = config_from_args(["--role", "prefill", "--port", "9100", "--itl-ms", "3",
                               "--fault", "die_after,tokens=3", "--stream-params", "separate"])
    assert (config.role, config.kv_port, config.itl_ms, config.kv_ttl) == ("prefill", 10100, 3.0, 30.0)
    assert config.fault == Fault(mode="die_after", tokens=3)
    with pytest.raises(SystemExit):
        config_from_args(["--role", "decode", "--port", "9100", "--fault", "explode"])
    assert "fault mode must be one of" in capsys.readouterr().err
    config = config_from_args(["--role", "decode", "--port", "9100", "--access-log",
                               "--template-quirks", "drop_reasoning,tool_json"])
    assert config.access_log is True and config.template_quirks == ("drop_reasoning", "tool_json")
    assert config_from_args(["--role", "decode", "--port", "9100"]).access_log is False
    for argv, flag in ((["--role", "decode", "--port", "x"], "--port"),
                       (["--role", "router", "--port", "9100"], "--role"),
                       (["--port", "9100"], "--role")):
        with pytest.raises(SystemExit):
            config_from_args(argv)
        assert flag in capsys.readouterr().err


def test_fault_validation_and_count():
    assert parse_fault_spec("slow,delay_s=2.5") == Fault(mode="slow", delay_s=2.5)
    for bad in ({"mode": "boom"}, {"mode": "slow", "delay": 1}, {"mode": "slow", "delay_s": -1},
                {"mode": "slow", "delay_s": "x"}, ["down"]):
        with pytest.raises(ValueError):
            Fault.from_dict(bad)
    state = FaultState(Fault(mode="error500", count=2))
    assert [state.take().mode for _ in range(3)] == ["error500", "error500", "none"]
