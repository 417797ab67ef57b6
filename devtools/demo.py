"""`make run`: emulated (or real) engines, the gateway under gunicorn, and a live multi-turn
chat."""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import time

import requests
from openai import OpenAI
from openai.types.chat import ChatCompletionMessageParam

# A development entry point, run from a checkout (`make run`), like the tooling it uses:
# nothing in the gateway package imports devtools or the emulator.
from devtools.processes import GatewayProcess
from emulator.process import EmulatorProcess

QUESTIONS = [
    "Tell me about disaggregated prefill and decode in a few words",
    "Why does the decode instance keep its KV blocks after the turn",
    "And what does the prefill instance do with them on the next turn",
    "What happens if I edit an earlier message",
    "Thanks, summarise the conversation",
]


def chat(gateway: GatewayProcess, model: str) -> None:
    """Five turns through the gateway, and what P did with each, as the gateway's own /metrics
    say it (so the same with real engines): P's prompt tokens, those it did not compute (its own
    prefix cache, and what it read of the blocks D kept after the last turn), and whether it
    read D's blocks (vLLM reads them only when D holds 64 tokens or more beyond P's own cache:
    the replies here are 80 tokens long)."""
    client = OpenAI(base_url=gateway.url + "/v1", api_key="demo-key")
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "You are a terse assistant."}
    ]

    def counters() -> dict:
        return {
            "prompt": gateway.metric("pd_gateway_prefill_tokens_total", kind="prompt"),
            "cached": gateway.metric("pd_gateway_prefill_tokens_total", kind="cached"),
            **{
                result: gateway.metric("pd_gateway_kv_reads_total", result=result)
                for result in ("read", "recomputed", "own_cache", "unreported")
            },
        }

    print(
        f"\n{'turn':>4}  {'cache':5}  {'TTFT ms':>8}  {'P prompt':>8}  {'P cached':>8}  "
        f"{'D blocks':10}  reply"
    )
    for turn, question in enumerate(QUESTIONS, 1):
        messages.append({"role": "user", "content": question})
        before = counters()
        start = time.perf_counter()
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=messages, stream=True, max_tokens=80
        )
        ttft, reply = None, []
        for chunk in raw.parse():
            if chunk.choices and chunk.choices[0].delta.content:
                ttft = ttft or (time.perf_counter() - start) * 1000
                reply.append(chunk.choices[0].delta.content)
        text = "".join(reply)
        messages.append({"role": "assistant", "content": text})
        after = counters()
        delta = {k: int(after[k] - before[k]) for k in after}
        read = next((k for k in ("read", "recomputed", "own_cache", "unreported") if delta[k]), "-")
        print(
            f"{turn:>4}  {raw.headers.get('X-Gateway-Cache', '?'):5}  {ttft or 0:8.1f}  "
            f"{delta['prompt']:>8}  {delta['cached']:>8}  {read:10}  {text.strip()[:40]}..."
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prefill", nargs="+", help="real P URLs (default: start an emulator)")
    parser.add_argument("--decode", nargs="+", help="real D URLs (default: start an emulator)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args(argv)
    if bool(args.prefill) != bool(args.decode):
        parser.error("give both --prefill and --decode (real engines), or neither (emulated)")
    with contextlib.ExitStack() as stack:
        emulated = not args.prefill
        if args.prefill and args.decode:
            prefill, decode = args.prefill, args.decode
        else:
            # Distinct loopback addresses: D reaches P only because the gateway rewrites
            # remote_host ("localhost" as vLLM reports it) to P's real address.
            # Bidirectional transfer on, as the README's `vllm serve` command has it; the rest
            # vLLM's defaults (prefix caching on, kv_recompute_threshold 64).
            p = stack.enter_context(
                EmulatorProcess("prefill", bidirectional_kv_xfer=True, host="127.0.0.2")
            )
            d = stack.enter_context(
                EmulatorProcess("decode", bidirectional_kv_xfer=True, host="127.0.0.3")
            )
            prefill, decode = [p.url], [d.url]
            print(f"emulated prefill engine on {p.url}, decode engine on {d.url}")
        # The preflight an operator runs first (README, "The vLLM engines"): whether reuse
        # will work with these engines, and what fixes it where it will not.
        print(f"\n$ pd-gateway check --prefill {' '.join(prefill)} --decode {' '.join(decode)}")
        checked = subprocess.run(
            [
                sys.executable,
                "-m",
                "gateway.cli",
                "check",
                "--prefill",
                *prefill,
                "--decode",
                *decode,
            ]
        )
        if checked.returncode:
            print("\n(reuse will not work with these engines, as it says; the demo goes on)")
        gateway = stack.enter_context(
            GatewayProcess(prefill, decode, port=args.port, workers=args.workers)
        )
        print(f"gateway (gunicorn) on {gateway.url}, logs in {gateway.log_path}")
        model = requests.get(gateway.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        chat(gateway, model)
        print(
            f"\nThe gateway keeps serving on {gateway.url} (OpenAI API at {gateway.url}/v1); "
            f"Ctrl-C stops it{' and the emulated engines' if emulated else ''}."
        )
        try:
            while gateway.process.poll() is None:
                time.sleep(0.5)
        except KeyboardInterrupt:
            print("\nstopping")


if __name__ == "__main__":
    main()
