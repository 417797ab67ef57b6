"""Exact reuse under real chat templates, the harness: each template mode of the emulator on a P and
a D of its own, OpenAI SDK clients of each kind (echoing reasoning or not, streaming or not, with
an id or not) holding conversations through a gateway under gunicorn; per mode and client kind,
the later turns that hit and P's `wrong_reuse`. tests/test_exactness_e2e.py asserts on it and
`python -m bench.exactness` prints it."""

from __future__ import annotations

import contextlib
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import requests
from openai import OpenAI, Stream
from openai.types.chat import ChatCompletion

from devtools.workload import MODEL

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "search the notes",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
            },
        },
    }
]


@dataclass(frozen=True)
class Mode:
    """One template behaviour: the engines' flags and what the clients send with it."""

    name: str
    engine: dict
    request: dict = field(default_factory=dict)
    chat: bool = True
    note: str = ""


TENANTS = 3  # the clients' keys: each its own tenant (its own template probes)
MODES = (
    Mode("plain", {}, note="default template: keeps the prefix"),
    Mode(
        "reasoning-dropped",
        {"reasoning_share": 0.5, "template_quirks": "drop_reasoning"},
        note="Qwen3/R1: reasoning of earlier turns not rendered",
    ),
    Mode(
        "reasoning-kept",
        {"reasoning_share": 0.5},
        note="template renders echoed reasoning as generated",
    ),
    Mode(
        "tools-rerendered",
        {"tool_call_share": 0.5, "template_quirks": "tool_json"},
        {"tools": TOOLS},
        note="tool calls re-rendered from parsed JSON",
    ),
    Mode(
        "tools-verbatim",
        {"tool_call_share": 0.5},
        {"tools": TOOLS},
        note="tool-call arguments rendered verbatim",
    ),
    Mode(
        "system-last",
        {"template_quirks": "system_last"},
        note="Mistral: system prompt moved into the last user message",
    ),
    Mode(
        "empty-think",
        {"template_quirks": "empty_think"},
        {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}},
        note="Qwen3 enable_thinking=false: empty think block in the generation prompt",
    ),
    Mode("completions", {}, chat=False, note="a reply continued with and without a space"),
)


@dataclass
class Client:
    """What a client does with replies: echo reasoning back or not; stream or not; send an id."""

    name: str
    echo_reasoning: bool = True
    stream: bool = True
    explicit_id: bool = False


CLIENTS = (
    Client("sdk-echo"),
    Client("strip-reasoning", echo_reasoning=False),
    Client("non-stream-echo", stream=False),
    Client("id-header", explicit_id=True),
)


@dataclass
class Outcome:
    """X-Gateway-Cache of each turn of one conversation, and its errors."""

    caches: list = field(default_factory=list)
    errors: list = field(default_factory=list)

    def later(self) -> tuple[int, int]:
        """(hits, turns) after the first, which has nothing to reuse."""
        later = self.caches[1:]
        return later.count("hit"), len(later)


def assistant_message(delta_parts: dict, echo_reasoning: bool) -> dict:
    """The reply as a client sends it back next turn: the reasoning only if it echoes it."""
    message: dict = {"role": "assistant", "content": delta_parts["content"] or None}
    if delta_parts["tool_calls"]:
        message["tool_calls"] = delta_parts["tool_calls"]
    if echo_reasoning and delta_parts["reasoning"]:
        message[delta_parts["reasoning_key"]] = delta_parts["reasoning"]
    return message


def _collect_stream(stream) -> dict:
    parts: dict[str, Any] = {
        "content": "",
        "reasoning": "",
        "reasoning_key": "reasoning",
        "tool_calls": [],
    }
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        parts["content"] += delta.content or ""
        extra = delta.model_extra or {}
        for key in ("reasoning", "reasoning_content"):
            if extra.get(key):
                parts["reasoning"] += extra[key]
                parts["reasoning_key"] = key
        for call in delta.tool_calls or ():
            known = {c["index"]: c for c in parts["tool_calls"]}
            if call.index not in known:
                parts["tool_calls"].append(
                    {
                        "index": call.index,
                        "id": call.id,
                        "type": "function",
                        "function": {
                            "name": call.function.name or "",
                            "arguments": call.function.arguments or "",
                        },
                    }
                )
            else:
                known[call.index]["function"]["arguments"] += call.function.arguments or ""
    for call in parts["tool_calls"]:
        call.pop("index")
    return parts


def chat_conversation(url: str, mode: Mode, client: Client, turns: int, seed: int) -> Outcome:
    """One conversation of `turns` turns; a tool call is answered with a tool result."""
    sdk = OpenAI(
        base_url=url + "/v1", api_key=f"tenant-{seed % TENANTS}", max_retries=0, timeout=60
    )
    outcome = Outcome()
    messages: list[Any] = [
        {"role": "system", "content": "answer briefly"},
        # Which replies reason or call a tool follows from the prompt (the emulator's
        # shares hash it): the same prompts each run give the same turns, so what a run
        # exercises does not change from run to run. Each run has engines of its own.
        {"role": "user", "content": f"conversation of {client.name} number {seed}"},
    ]
    extra = dict(mode.request.get("extra_body") or {})
    headers = {"X-Conversation-Id": uuid.uuid4().hex} if client.explicit_id else {}
    kwargs = {k: v for k, v in mode.request.items() if k != "extra_body"}
    try:
        for turn in range(turns):
            raw = sdk.chat.completions.with_raw_response.create(
                model=MODEL,
                messages=messages,
                stream=client.stream,
                extra_body=extra or None,
                extra_headers=headers or None,
                **kwargs,
            )
            outcome.caches.append(raw.headers.get("X-Gateway-Cache"))
            if client.stream:
                parts = _collect_stream(raw.parse())
            else:
                completion = raw.parse()
                assert isinstance(completion, ChatCompletion)  # not a stream
                dumped = completion.choices[0].message.model_dump(exclude_none=True)
                key = "reasoning" if "reasoning" in dumped else "reasoning_content"
                parts = {
                    "content": dumped.get("content") or "",
                    "reasoning": dumped.get(key) or "",
                    "reasoning_key": key,
                    "tool_calls": dumped.get("tool_calls") or [],
                }
            messages.append(assistant_message(parts, client.echo_reasoning))
            if parts["tool_calls"]:
                messages += [
                    {"role": "tool", "tool_call_id": c["id"], "content": f"result {turn}"}
                    for c in parts["tool_calls"]
                ]
            else:
                messages.append({"role": "user", "content": f"and then {turn}"})
    except Exception as exc:  # recorded: the caller asserts there are none
        outcome.errors.append(repr(exc))
    return outcome


def completions_conversation(url: str, client: Client, turns: int, seed: int) -> Outcome:
    """Prompt + reply, continued with a space (a token boundary) on even turns and glued to the
    reply's last word on odd ones: after a stop D holds that word, and the glued word is another
    token, so the next prompt is not a token prefix of what D holds although its text is."""
    sdk = OpenAI(
        base_url=url + "/v1", api_key=f"tenant-{seed % TENANTS}", max_retries=0, timeout=60
    )
    outcome = Outcome()
    prompt = f"story {uuid.uuid4().hex} number {seed} begins"
    try:
        for turn in range(turns):
            raw = sdk.completions.with_raw_response.create(
                model=MODEL,
                prompt=prompt,
                stream=client.stream,
                extra_body={"conversation_id": f"c-{seed}-{client.name}"},
            )
            outcome.caches.append(raw.headers.get("X-Gateway-Cache"))
            parsed = raw.parse()
            text = (
                "".join(c.choices[0].text for c in parsed if c.choices)
                if isinstance(parsed, Stream)  # as client.stream asked
                else parsed.choices[0].text
            )
            prompt += text + (" more" if turn % 2 == 0 else "ly and so on")
    except Exception as exc:
        outcome.errors.append(repr(exc))
    return outcome


@contextlib.contextmanager
def mode_engines(mode: Mode, first_host: int):
    """A P and a D engine with the mode's template behaviour, on 127.0.0.N and N+1."""
    from emulator.process import EmulatorProcess

    # kv_recompute_threshold 0 (vLLM's is 64): P reads whatever the gateway lets it, so what
    # is measured is the gateway's decision, not the threshold hiding it behind short replies.
    flags = {"itl_ms": 1, "output_tokens": 6, "recompute_threshold": 0, **mode.engine}
    with (
        EmulatorProcess(
            "prefill", bidirectional_kv_xfer=True, host=f"127.0.0.{first_host}", **flags
        ) as p,
        EmulatorProcess(
            "decode", bidirectional_kv_xfer=True, host=f"127.0.0.{first_host + 1}", **flags
        ) as d,
    ):
        yield p, d


def run_mode(
    url: str, mode: Mode, conversations: int, turns: int, clients=CLIENTS
) -> dict[str, dict]:
    """Every client kind holds `conversations` conversations at once through the gateway."""
    if not mode.chat:
        clients = [c for c in clients if not c.explicit_id][:2]  # ids always: conversation_id
    jobs = [(client, i) for client in clients for i in range(conversations)]

    def one(job):
        client, i = job
        if mode.chat:
            return client.name, chat_conversation(url, mode, client, turns, i)
        return client.name, completions_conversation(url, client, turns, i)

    rows = {c.name: {"hits": 0, "later": 0, "errors": []} for c in clients}
    with ThreadPoolExecutor(8) as pool:
        for name, outcome in pool.map(one, jobs):
            hits, later = outcome.later()
            rows[name]["hits"] += hits
            rows[name]["later"] += later
            rows[name]["errors"] += outcome.errors
    return rows


def measure(
    mode: Mode, settings: dict, conversations: int, turns: int, first_host: int = 40
) -> dict:
    """Start the mode's engines and a gateway with `settings`; run every client kind."""
    from devtools.processes import GatewayProcess

    with (
        mode_engines(mode, first_host) as (p, d),
        GatewayProcess([p.url], [d.url], **settings) as gateway,
    ):
        rows = run_mode(gateway.url, mode, conversations, turns)
        p_stats, d_stats = p.stats(), d.stats()
        checks = reuse_checks(gateway.url)
    return {
        "rows": rows,
        "wrong_reuse": p_stats["wrong_reuse"],
        "p_hits": p_stats["hits"],
        "tokenize": p_stats["tokenize_requests"] + d_stats["tokenize_requests"],
        "checks": checks,
    }


def reuse_checks(url: str) -> dict[str, float]:
    """pd_gateway_reuse_checks_total by result, from the gateway's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(url + "/metrics", timeout=10).text
    return {
        sample.labels["result"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "pd_gateway_reuse_checks"
        for sample in family.samples
        if sample.name.endswith("_total")
    }
