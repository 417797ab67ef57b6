"""Agent loops through the SDKs: a Claude-Code-like loop on /v1/messages (anthropic SDK) and a
Codex-like loop on /v1/responses (openai SDK, chained by previous_response_id, or stateless),
per system: prompt tokens the engines computed, TTFT, turns and errors (docs/BENCHMARKS.md,
"Agent loops").

Each session: a system prompt of some 4,000 words (tool descriptions and instructions, the same
for every session, as an agent's is), four function tools, a task, then 12 turns, each a reply
that reasons and calls a tool (the emulator with reasoning_share and tool_call_share 1.0) and the
client's tool result of some 300 words appended. 8 sessions at once, streamed. TTFT is the
client's: request sent to the first content_block_delta (Messages) or first text, reasoning or
arguments delta (Responses).

Systems, each on fresh engines (2 P + 2 D, vLLM 0.33's defaults: prefix caching on,
kv_recompute_threshold 64, as bench.reuse), P's KV cache the default 20,000 blocks or the least
vLLM allows at this max_model_len (1,024 blocks, `small`):

- gateway: pd-gateway on engines with bidirectional KV transfer (its README's setup);
- gateway-noreuse: the same gateway on standard P/D engines (bidirectional_kv_xfer off, vLLM's
  default): D keeps nothing after a turn, so the gateway has nothing to reuse and every turn is
  a miss. That is "P/D without reuse" through the same edge (the seed proxy serves only chat
  completions);
- vllm-router: vllm-router 0.1.17 (cache_aware, its default) in its P/D mode on standard P/D
  engines; it passes /v1/messages and /v1/responses through its two stages as it does chat, and
  previous_response_id to P as it came (P answers 404: vLLM's store is off by default, and
  vllm-router-store shows that turning it on does not help: the response is stored by D).

    python -m bench.agent_loops [--loops messages,responses,responses-stateless]
                                [--systems gateway,gateway-noreuse,vllm-router,vllm-router-store]
                                [--p-cache default,small] [--sessions 8] [--turns 12]

Bounded: 8 x 12 turns a run, 18 runs of some 10 s each on 2 cores; JSON in bench/out/agent_loops/.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import threading
import time

from bench import venvs
from bench.metrics import percentile
from bench.reuse import HOSTS, System, started
from bench.systems import slug
from emulator.process import EmulatorProcess

MODEL = "emulated-model"
# The engines of bench.reuse, with every reply reasoning and then calling a tool.
ENGINE = {
    "itl_ms": 2,
    "prefill_ms_per_token": 0.05,
    "pull_ms_per_block": 0.05,
    "max_model_len": 16384,
    "reasoning_share": 1.0,
    "tool_call_share": 1.0,
}
D_CAPACITY = 20_000  # blocks of 16: the emulator's default (an 8B model, 80 GB)
# P's KV cache: the same default, where 8 sessions fit many times over; or, with --p-cache
# small, the least a P of max_model_len 16,384 may have (1,024 blocks: vLLM refuses to start
# below one request of max_model_len), which 4 sessions a P outgrow by their middle turns: P's
# other sessions then evict a session's history between its turns.
P_CACHES = {"default": 20_000, "small": 1_024}
MAX_TOKENS = 256  # a reply: reasoning of half of it, then the call (~140 tokens)
SYSTEM_WORDS = 4000
RESULT_WORDS = 300

SYSTEMS = {
    "gateway": System("pd-gateway", "gateway", True),
    "gateway-noreuse": System("pd-gateway, P/D without reuse", "gateway", False),
    "vllm-router": System("vllm-router (cache_aware)", "router", False),
    # The engines' own response store on (VLLM_ENABLE_RESPONSES_API_STORE=1, off by default):
    # what a chain through vllm-router needs, if P could find what D stored.
    "vllm-router-store": System("vllm-router (cache_aware), engines' store on", "router", False),
}
ENGINE_EXTRA = {"vllm-router-store": {"responses_api_store": True}}
DEFAULT_SYSTEMS = ("gateway", "gateway-noreuse", "vllm-router")
LOOPS = ("messages", "responses", "responses-stateless")

_WORDS = (
    "file",
    "path",
    "read",
    "write",
    "edit",
    "line",
    "range",
    "search",
    "pattern",
    "glob",
    "shell",
    "command",
    "output",
    "error",
    "test",
    "build",
    "commit",
    "diff",
    "branch",
    "function",
    "class",
    "module",
    "import",
    "return",
    "value",
    "string",
    "number",
    "always",
    "never",
    "before",
    "after",
    "when",
    "unless",
    "the",
    "a",
    "of",
    "to",
    "in",
)


def words(seed: str, count: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(count))


def system_prompt(salt: str) -> str:
    """An agent's instructions and tool manual: the same for every session of a run."""
    return f"You are a coding agent ({salt}). " + words(f"system-{salt}", SYSTEM_WORDS)


TOOL_NAMES = ("read_file", "edit_file", "run_shell", "search")


def tool_schema(name: str) -> dict:
    return {
        "type": "object",
        "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
        "required": ["query"],
        "description": words(f"tool-{name}", 40),
    }


def tool_result(session: str, turn: int) -> str:
    return words(f"result-{session}-{turn}", RESULT_WORDS)


class Turns:
    """Each request's TTFT and usage, and the errors, from every session's thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.turns: list[dict] = []
        self.errors: list[str] = []

    def add(self, sent: float, first: float | None, done: float, prompt: int) -> None:
        with self.lock:
            self.turns.append(
                {"ttft": (first or done) - sent, "total": done - sent, "prompt_tokens": prompt}
            )

    def fail(self, session: str, turn: int, error: BaseException) -> None:
        with self.lock:
            self.errors.append(f"{session} turn {turn}: {type(error).__name__}: {error}"[:400])


def messages_session(url: str, name: str, system: str, turns: int, out: Turns) -> None:
    """A Claude-Code-like loop: each reply's tool_use answered by a tool_result."""
    from anthropic import Anthropic

    client = Anthropic(base_url=url, api_key="bench", max_retries=0, timeout=120)
    tools = [
        {"name": n, "description": f"The {n} tool.", "input_schema": tool_schema(n)}
        for n in TOOL_NAMES
    ]
    history: list = [{"role": "user", "content": f"Task {name}: fix the failing test."}]
    for turn in range(turns):
        try:
            sent, first = time.monotonic(), None
            with client.messages.stream(
                model=MODEL, max_tokens=MAX_TOKENS, system=system, tools=tools, messages=history
            ) as events:
                for event in events:
                    if first is None and event.type == "content_block_delta":
                        first = time.monotonic()
                message = events.get_final_message()
            out.add(sent, first, time.monotonic(), message.usage.input_tokens)
            call = next(b for b in message.content if b.type == "tool_use")
        except Exception as error:  # noqa: BLE001 - counted, the session ends
            out.fail(name, turn, error)
            return
        history += [
            {"role": "assistant", "content": message.content},
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": call.id,
                        "content": tool_result(name, turn),
                    }
                ],
            },
        ]


DELTAS = (
    "response.reasoning_text.delta",
    "response.output_text.delta",
    "response.function_call_arguments.delta",
)


def responses_session(
    url: str, name: str, system: str, turns: int, out: Turns, chained: bool
) -> None:
    """A Codex-like loop: each function_call answered by a function_call_output, chained by
    previous_response_id (store on) or stateless (the whole conversation as input each turn)."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="bench", max_retries=0, timeout=120)
    tools = [
        {
            "type": "function",
            "name": n,
            "description": f"The {n} tool.",
            "parameters": tool_schema(n),
        }
        for n in TOOL_NAMES
    ]
    items: list = [{"role": "user", "content": f"Task {name}: fix the failing test."}]
    previous = None
    for turn in range(turns):
        try:
            sent, first, response = time.monotonic(), None, None
            extra = (
                ({"previous_response_id": previous} if previous else {})
                if chained
                else {"store": False}
            )
            stream = client.responses.create(
                model=MODEL,
                instructions=system,
                tools=tools,
                input=items,
                max_output_tokens=MAX_TOKENS,
                stream=True,
                **extra,
            )
            for event in stream:
                if first is None and event.type in DELTAS:
                    first = time.monotonic()
                if event.type in ("response.completed", "response.incomplete"):
                    response = event.response
                elif event.type in ("response.failed", "error"):
                    raise RuntimeError(f"{event.type}: {event}")
            if response is None:
                raise RuntimeError("the stream ended without response.completed")
            out.add(
                sent, first, time.monotonic(), response.usage.input_tokens if response.usage else 0
            )
            call = next(o for o in response.output if o.type == "function_call")
        except Exception as error:  # noqa: BLE001 - counted, the session ends
            out.fail(name, turn, error)
            return
        output = {
            "type": "function_call_output",
            "call_id": call.call_id,
            "output": tool_result(name, turn),
        }
        if chained:
            previous, items = response.id, [output]
        else:
            items = items + [o.model_dump(exclude_none=True) for o in response.output] + [output]


@contextlib.contextmanager
def engines(system: System, p_cache: int):
    key = next(k for k, v in SYSTEMS.items() if v == system)
    flags = {**ENGINE, "bidirectional_kv_xfer": system.bidirectional, **ENGINE_EXTRA.get(key, {})}
    with contextlib.ExitStack() as stack:
        started_engines = [
            stack.enter_context(
                EmulatorProcess(
                    role,
                    host=host,
                    advertise_host=host,
                    **flags,
                    kv_capacity_blocks=p_cache if role == "prefill" else D_CAPACITY,
                )
            )
            for role, host in zip(("prefill", "prefill", "decode", "decode"), HOSTS, strict=True)
        ]
        yield started_engines[:2], started_engines[2:]


def run(system: System, loop: str, sessions: int, turns: int, p_cache: int, out_dir: str) -> dict:
    salt = f"{loop}-{slug(system.label)}-{time.time_ns()}"
    system_text = system_prompt(salt)
    out = Turns()
    with (
        engines(system, p_cache) as (prefills, decodes),
        started(system, prefills, decodes, out_dir) as url,
    ):
        if loop == "messages":
            target, args = messages_session, ()
        else:
            target, args = responses_session, (loop == "responses",)
        threads = [
            threading.Thread(
                target=target,
                daemon=True,
                args=(url, f"s{i}-{salt}", system_text, turns, out, *args),
            )
            for i in range(sessions)
        ]
        began = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=max(1.0, 600 - (time.monotonic() - began)))
        seconds = time.monotonic() - began
        stats = [e.stats() for e in (*prefills, *decodes)]
    ttft = [t["ttft"] for t in out.turns]
    row = {
        "loop": loop,
        "system": system.label,
        "sessions": sessions,
        "turns": len(out.turns),
        "of": sessions * turns,
        "errors": len(out.errors),
        "computed": sum(s["computed_prompt_tokens"] for s in stats),
        "prompt": sum(t["prompt_tokens"] for t in out.turns),
        "read_turns": sum(s["hits"] for s in stats[:2]),
        "ttft_p50_ms": round(percentile(ttft, 50) * 1000, 1) if ttft else None,
        "ttft_p99_ms": round(percentile(ttft, 99) * 1000, 1) if ttft else None,
        "seconds": round(seconds, 1),
        "wrong_reuse": sum(s["wrong_reuse"] for s in stats),
        "p_cache_blocks": p_cache,
        "first_error": out.errors[0] if out.errors else "",
        "per_engine_requests": [s["requests"] for s in stats],
    }
    name = f"agents-{loop}-{slug(system.label)}-p{p_cache}.json"
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(
            {
                "row": row,
                "turns": out.turns,
                "errors": out.errors,
                "engines": [{k: s[k] for k in ENGINE_COUNTERS} for s in stats],
            },
            f,
            indent=1,
        )
    return row


# Per engine in the JSON (P, P, D, D): which engines a route reached, and how.
ENGINE_COUNTERS = (
    "requests",
    "completed",
    "bad_requests",
    "hits",
    "computed_prompt_tokens",
    "reused_prompt_tokens",
    "pulled_tokens",
    "remote_prefill_requests",
    "decode_only_requests",
    "plain_requests",
    "wrong_reuse",
)

COLUMNS = (
    "p_cache_blocks",
    "loop",
    "system",
    "turns",
    "errors",
    "computed",
    "prompt",
    "read_turns",
    "ttft_p50_ms",
    "ttft_p99_ms",
)
HEADINGS = {
    "p_cache_blocks": "P's KV cache (blocks)",
    "turns": "turns done",
    "computed": "prompt tokens computed (P + D)",
    "prompt": "prompt tokens (usage)",
    "read_turns": "turns P read D's blocks",
    "ttft_p50_ms": "TTFT p50 ms",
    "ttft_p99_ms": "TTFT p99 ms",
}


def table(rows: list[dict]) -> str:
    lines = [
        "| " + " | ".join(HEADINGS.get(c, c) for c in COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for row in rows:
        cells = []
        for c in COLUMNS:
            value = row[c]
            if c == "turns":
                cells.append(f"{value}/{row['of']}")
            elif isinstance(value, int):
                cells.append(f"{value:,}")
            else:
                cells.append("-" if value is None else str(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loops", default=",".join(LOOPS), help=f"of {', '.join(LOOPS)}")
    parser.add_argument(
        "--systems", default=",".join(DEFAULT_SYSTEMS), help=f"of {', '.join(SYSTEMS)}"
    )
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument(
        "--p-cache",
        default="default,small",
        help=f"comma separated, of {', '.join(P_CACHES)}: P's KV cache ({P_CACHES})",
    )
    parser.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "out", "agent_loops")
    )
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    notes, rows = [], []
    keys = args.systems.split(",")
    routers = [k for k in keys if SYSTEMS[k].kind == "router"]
    if routers and (problem := venvs.ROUTER.ensure()):
        notes.append(f"vllm-router was skipped: {problem}")
        keys = [k for k in keys if k not in routers]
    for cache, loop, key in itertools.product(args.p_cache.split(","), args.loops.split(","), keys):
        p_cache = P_CACHES[cache]
        row = run(SYSTEMS[key], loop, args.sessions, args.turns, p_cache, args.out)
        rows.append(row)
        print(
            f"{loop:>20} {row['system']:>32}: {row['turns']}/{row['of']} turns, "
            f"{row['errors']} errors, {row['computed']:,} computed, "
            f"{row['read_turns']} read, TTFT p50 {row['ttft_p50_ms']} p99 "
            f"{row['ttft_p99_ms']} ms, {row['seconds']} s {row['first_error'][:200]}",
            flush=True,
        )
    print("\n" + table(rows))
    for row in rows:
        if row["first_error"]:
            print(f"- {row['loop']}, {row['system']}: first error: {row['first_error']}")
    for note in notes:
        print("note:", note)
    with open(os.path.join(args.out, "agent_loops.json"), "w") as f:
        json.dump({"rows": rows, "notes": notes}, f, indent=1)


if __name__ == "__main__":
    main()
