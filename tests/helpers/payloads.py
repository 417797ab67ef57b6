"""Engines pinned at the wire with `responses`: the unroutable engine URLs of conftest's `app`,
the kv_transfer_params and replies P and D give, D's streams, and a /tokenize that renders with
the emulator's template (so the token ids are the ones a real engine's would be)."""

from __future__ import annotations

import json

import requests

from emulator.tokens import EOS, Template, token_ids

# Unroutable example hosts: only `responses` mocks answer them.
P_URL = "http://10.9.0.1:8100"
D_URL = "http://10.9.0.2:8200"

CHAT = "/v1/chat/completions"
MISS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]


def pinned_app(store, **settings):
    """An app whose engine calls go to `responses` (conftest's `app`, with `settings` on top): P_URL
    and D_URL, reuse on digests alone (no /tokenize calls, no token ids), and background releases,
    reads of the engines' /metrics and probes off (they would interleave with the calls pinned).
    Call its `extensions["pd_gateway"].close()` when done: its prober would go on probing."""
    from gateway.app import create_app
    from gateway.config import Settings
    from tests.helpers.transport import ResponsesTransport

    pinned = {
        "prefill": [P_URL],
        "decode": [D_URL],
        "worker_class": "gthread",
        "threads": 8,
        "verify_reuse": "off",
        "release_rate": 0,
        "engine_metrics_interval": 0,
        "probe_interval": 0,
    }
    return create_app(
        Settings(**{**pinned, **settings}), store=store, transport=ResponsesTransport()
    )


def p_params(n=1):
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[1, 2]],
        "remote_engine_id": f"p-engine-{n}",
        "remote_request_id": f"p-req-{n}",
        "remote_host": "localhost",
        "remote_port": 5600,
        "tp_size": 1,
        "remote_num_tokens": 20,
    }


def d_params(n=1):
    return {
        "do_remote_prefill": False,
        "do_remote_decode": True,
        "remote_block_ids": [[7, 8, 9]],
        "remote_engine_id": f"d-engine-{n}",
        "remote_request_id": f"d-req-{n}",
        "remote_host": "localhost",
        "remote_port": 5700,
        "tp_size": 1,
        "remote_num_tokens": 40,
        "remote_blocks_expiry_time": 123.5,
    }


def p_reply(params):
    return {
        "id": "chatcmpl-x",
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "a"},
                "finish_reason": "length",
            }
        ],
        "usage": {"prompt_tokens": 20, "completion_tokens": 1, "total_tokens": 21},
        "kv_transfer_params": params,
    }


def sse(*events) -> bytes:
    return b"".join(
        b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n"
        for e in events
    )


def chat_events(words, params, placement="final", finish="stop"):
    events = [
        {
            "id": "c",
            "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            ],
        }
    ]
    events += [
        {"id": "c", "choices": [{"index": 0, "delta": {"content": w}, "finish_reason": None}]}
        for w in words
    ]
    final = {
        "id": "c",
        "choices": [{"index": 0, "delta": {}, "finish_reason": finish, "stop_reason": None}],
    }
    if placement == "final":
        final["kv_transfer_params"] = params
    events.append(final)
    if placement == "separate":
        events.append({"kv_transfer_params": params})
    return sse(*events, b"[DONE]")


def client_events(body: bytes) -> list:
    out = []
    for block in body.split(b"\n\n"):
        if block.startswith(b"data: "):
            payload = block[6:]
            out.append(payload.decode() if payload == b"[DONE]" else json.loads(payload))
    return out


def _refused() -> requests.ConnectionError:
    """What requests raises for a refused connection: the OS error is in the cause chain."""
    exc = requests.ConnectionError("Max retries exceeded with url: /v1/chat/completions")
    exc.__cause__ = ConnectionRefusedError(111, "Connection refused")
    return exc


REFUSED = _refused()


# --- exact reuse: token ids as an engine with the emulator's template reports them ------------


def tokenizer(template: Template, calls: list):
    """A /tokenize mock rendering chat bodies with `template`; records each body."""

    def tokenize(request):
        body = json.loads(request.body)
        calls.append(body)
        tokens = template.render(
            body["messages"],
            body.get("tools"),
            add_generation_prompt=body.get("add_generation_prompt", True),
            continue_final_message=body.get("continue_final_message", False),
            kwargs=body.get("chat_template_kwargs"),
        )
        return (
            200,
            {},
            json.dumps(
                {
                    "count": len(tokens),
                    "max_model_len": 4096,
                    "tokens": token_ids(tokens),
                    "token_strs": None,
                }
            ),
        )

    return tokenize


def d_stream(
    prompt: list[str],
    steps: list[tuple[dict | None, str]],
    with_ids: bool,
    params_n: int = 1,
    lossy: bool = False,
) -> bytes:
    """D's stream as vLLM sends it: a role chunk, one chunk per (delta, token), EOS on the
    finish chunk; with ids, the prompt's on the role chunk and each token's on its chunk (a
    swallowed token's delta is {} then, or it is left out when `lossy`, vLLM before #29074)."""
    held = len(prompt) + len(steps)  # prompt + generated (EOS included) - 1
    events = [
        {
            "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            ],
            "prompt_token_ids": token_ids(prompt) if with_ids else None,
        }
    ]
    for delta, token in steps:
        if delta is None and (not with_ids or lossy):
            continue
        events.append(
            {
                "choices": [
                    {
                        "index": 0,
                        "delta": delta or {},
                        "finish_reason": None,
                        "token_ids": token_ids([token]) if with_ids else None,
                    }
                ]
            }
        )
    events.append(
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": ""},
                    "finish_reason": "stop",
                    "token_ids": token_ids([EOS]) if with_ids else None,
                }
            ],
            "kv_transfer_params": {**d_params(params_n), "remote_num_tokens": held},
        }
    )
    return sse(*events, b"[DONE]")


PLAIN = [({"content": "fine"}, "fine"), ({"content": " thanks"}, "thanks")]
