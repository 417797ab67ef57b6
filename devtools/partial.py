"""Partial reuse, the harness: per template case, OpenAI SDK clients hold conversations through a
gateway under gunicorn, and what P read of D's tokens is set against the block-aligned prefix each
later turn shares with what D holds. tests/test_partial_e2e.py asserts on it and
`python -m bench.partial` prints it."""

from __future__ import annotations

import contextlib
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import requests
from openai import OpenAI

from devtools.exactness import TOOLS, assistant_message, reuse_checks
from devtools.workload import MODEL

BLOCK = 16


@dataclass(frozen=True)
class Case:
    name: str
    engine: dict
    request: dict = field(default_factory=dict)
    echo_reasoning: bool = True


CASES = (
    Case(
        "reasoning-dropped, echoed", {"reasoning_share": 1.0, "template_quirks": "drop_reasoning"}
    ),
    Case(
        "reasoning-dropped, not echoed",
        {"reasoning_share": 1.0, "template_quirks": "drop_reasoning"},
        echo_reasoning=False,
    ),
    Case("system-last", {"template_quirks": "system_last"}),
    Case(
        "empty-think",
        {"template_quirks": "empty_think"},
        {"chat_template_kwargs": {"enable_thinking": False}},
    ),
    Case(
        "tools-rerendered",
        {"tool_call_share": 0.5, "template_quirks": "tool_json"},
        {"tools": TOOLS},
    ),
)
HYBRID = Case(
    "hybrid (sliding window 64), reasoning-dropped",
    {"reasoning_share": 1.0, "template_quirks": "drop_reasoning", "sliding_window": 64},
)


def shared_prefix(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def conversation(url: str, p_url: str, case: Case, turns: int, seed: int) -> dict:
    """One conversation; per later turn, the tokens it could read from D (block-aligned)."""
    sdk = OpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=60)
    system = "you answer briefly and plainly, citing the notes you were given " * 3
    messages: list[Any] = [
        {"role": "system", "content": system},
        {
            "role": "user",
            "content": f"conversation {uuid.uuid4().hex} number {seed} "
            + "tell me about the weather in the mountains " * 4,
        },
    ]
    out: dict[str, Any] = {"shareable": 0, "caches": [], "errors": []}
    held: list | None = None
    try:
        for turn in range(turns):
            body = {"model": MODEL, "messages": messages, **case.request}
            if held is not None:
                rendered = requests.post(p_url + "/tokenize", json=body, timeout=30).json()[
                    "tokens"
                ]
                shared = shared_prefix(held, rendered)
                # P reads at most prompt - 1; a whole entry need not end on a block.
                out["shareable"] += (
                    len(held)
                    if shared == len(held) < len(rendered)
                    else min(shared, len(rendered) - 1) // BLOCK * BLOCK
                )
            raw = sdk.chat.completions.with_raw_response.create(
                model=MODEL,
                messages=messages,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={
                    "return_token_ids": True,
                    **(
                        {"chat_template_kwargs": case.request["chat_template_kwargs"]}
                        if "chat_template_kwargs" in case.request
                        else {}
                    ),
                },
                **({"tools": case.request["tools"]} if "tools" in case.request else {}),
            )
            out["caches"].append(raw.headers.get("X-Gateway-Cache"))
            parts: dict[str, Any] = {
                "content": "",
                "reasoning": "",
                "reasoning_key": "reasoning",
                "tool_calls": [],
            }
            prompt_ids: list = []
            output_ids: list = []
            for chunk in raw.parse():
                extra = chunk.model_extra or {}
                prompt_ids = extra.get("prompt_token_ids") or prompt_ids
                if not chunk.choices:
                    continue
                choice = chunk.choices[0]
                output_ids += (choice.model_extra or {}).get("token_ids") or []
                delta = choice.delta
                parts["content"] += delta.content or ""
                parts["reasoning"] += (delta.model_extra or {}).get("reasoning") or ""
                for call in delta.tool_calls or ():
                    parts["tool_calls"].append(
                        {
                            "id": call.id,
                            "type": "function",
                            "function": {
                                "name": call.function.name,
                                "arguments": call.function.arguments,
                            },
                        }
                    )
            held = (prompt_ids + output_ids)[:-1]
            messages.append(assistant_message(parts, case.echo_reasoning))
            if parts["tool_calls"]:
                messages += [
                    {"role": "tool", "tool_call_id": c["id"], "content": f"result {turn}"}
                    for c in parts["tool_calls"]
                ]
            else:
                messages.append(
                    {
                        "role": "user",
                        "content": f"and then what about day {turn} in the valley below",
                    }
                )
    except Exception as exc:  # recorded: the caller asserts there are none
        out["errors"].append(repr(exc))
    return out


@contextlib.contextmanager
def engines(case: Case, cold: bool, first_host: int, output_tokens: int):
    from emulator.process import EmulatorProcess

    flags = {
        "itl_ms": 1,
        "output_tokens": output_tokens,
        "bidirectional_kv_xfer": True,
        **case.engine,
    }
    with (
        EmulatorProcess(
            "prefill", host=f"127.0.0.{first_host}", enable_prefix_caching=not cold, **flags
        ) as p,
        EmulatorProcess("decode", host=f"127.0.0.{first_host + 1}", **flags) as d,
    ):
        yield p, d


def measure(
    case: Case,
    cold: bool = True,
    conversations: int = 12,
    turns: int = 5,
    output_tokens: int = 24,
    settings: dict | None = None,
    first_host: int = 80,
) -> dict:
    from devtools.processes import GatewayProcess

    with (
        engines(case, cold, first_host, output_tokens) as (p, d),
        GatewayProcess([p.url], [d.url], **(settings or {})) as gateway,
    ):
        with ThreadPoolExecutor(4) as pool:
            runs = list(
                pool.map(
                    lambda i: conversation(gateway.url, p.url, case, turns, i), range(conversations)
                )
            )
        p_stats = p.stats()
        checks = reuse_checks(gateway.url)
    caches = [c for run in runs for c in run["caches"][1:]]
    return {
        "case": case.name,
        "cold": cold,
        "shareable": sum(r["shareable"] for r in runs),
        "read": p_stats["reused_prompt_tokens"],
        "local": p_stats["local_prefix_tokens"],
        "computed": p_stats["computed_prompt_tokens"],
        "wrong_reuse": p_stats["wrong_reuse"],
        "p_errors": p_stats["kv_load_errors"],
        "partial": int(checks.get("partial", 0)),
        "hits": caches.count("hit"),
        "partials": caches.count("partial"),
        "later": len(caches),
        "errors": [e for r in runs for e in r["errors"]],
    }
