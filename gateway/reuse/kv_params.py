"""D's kv_transfer_params as the gateway speaks them: the stub P gets on a miss, the allowlist
kept for the next turn, and the P and D bodies that carry them.
(The contract, field by field with its vLLM sources: docs/pd-protocol.md.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeGuard

from gateway.engines.instances import Instance

# What P gets on a miss: compute everything and keep the blocks for D to pull (vLLM's stub).
MISS_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# A D that must compute the prompt itself (a decode-only turn, or P's blocks perhaps read by a
# D that failed) gets no kv_transfer_params at all. Params with neither flag set would make
# vLLM 0.33 keep the request's blocks and never free them: its connector never tracked the
# request, so no TTL reaps it and no reader's notification is accepted
# (nixl/pull_scheduler.py ~L119-125, nixl/pull_worker.py ~L97-121, ~L670-681).
# Fields P must not see: it generates exactly one token, never streams.
PREFILL_DROPPED = ("max_completion_tokens", "min_tokens", "min_completion_tokens", "stream_options")


def is_count(value: object) -> TypeGuard[int]:
    """A count of tokens (or anything): an int of 0 or more, never a bool (which isinstance
    takes for an int: True would count 1)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _int(low: int, high: int | None = None) -> Callable[[Any], bool]:
    return lambda v: is_count(v) and v >= low and (high is None or v <= high)


def _block_ids(value: Any) -> bool:
    # Every turn checks D's whole list (a 10k-token history holds 600+ ids): in C, not per id.
    return (
        isinstance(value, list)
        and bool(value)
        and all(
            isinstance(group, list)
            and (
                not group
                or (set(map(type, group)) == {int} and min(group) >= 0 and max(group) < 2**63)
            )
            for group in value
        )
    )


def _text(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= 512


# D's kv_transfer_params as the gateway keeps them: known fields only, each checked, because
# they go back to P verbatim next turn (llm-d's required-field list plus vLLM's extras).
REQUIRED_PARAMS = {
    "remote_block_ids": _block_ids,
    "remote_engine_id": _text,
    "remote_request_id": _text,
    "remote_port": _int(1, 65535),
}
OPTIONAL_PARAMS = {
    "remote_host": _text,
    "tp_size": _int(1),
    "dcp_size": _int(1),
    "pp_size": _int(1),
    "remote_num_tokens": _int(0),
    "remote_blocks_expiry_time": lambda v: (
        v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))
    ),
    "transfer_mode": _text,
    "remote_control_host": _text,
    "remote_control_port": _int(1, 65535),
    # P re-handshakes with a D that registered its KV cache again (after a
    # sleep) only when it sees a newer generation (nixl/pull_worker.py
    # ~L145-151, vLLM 0.33): dropped, P would read the old registration.
    "remote_registration_generation": _int(0),
}


def clean_params(params: Any) -> dict | None:
    """The allowlisted, type-checked copy of D's params, or None if they are malformed."""
    if not isinstance(params, dict):
        return None
    if not all(name in params and check(params[name]) for name, check in REQUIRED_PARAMS.items()):
        return None
    clean = {name: params[name] for name in REQUIRED_PARAMS}
    for name, check in OPTIONAL_PARAMS.items():
        if name in params:
            if not check(params[name]):
                return None
            clean[name] = params[name]
    return clean


def prefill_body(body: dict, params: dict | None) -> dict:
    """P's body: one token, not streamed, and D's `params` to read (a hit) or vLLM's stub."""
    out = {k: v for k, v in body.items() if k not in PREFILL_DROPPED}
    out.update(stream=False, max_tokens=1)
    if params is None:
        out["kv_transfer_params"] = dict(MISS_PARAMS)
    else:
        out["kv_transfer_params"] = {**params, "do_remote_decode": True, "do_remote_prefill": False}
    return out


def decode_body(body: dict, prefill_reply: dict, prefill: Instance) -> dict:
    params = prefill_reply.get("kv_transfer_params")
    if not isinstance(params, dict):
        # P kept nothing to pull: D must decode on its own, never with P-bound params.
        return body
    # vLLM reports its side channel as "localhost"; D must reach the P that actually holds them.
    return {**body, "kv_transfer_params": {**params, "remote_host": prefill.host}}
