"""Engine-reported load against in-flight counts alone: three gateway processes share 2 P and
2 D; D2's KV memory is nearly full of another tenant's idle chats (each pinned for its next turn,
vLLM's 480 s), D1 has room. Each gateway sees only its own in-flight counts; the engines' own
reports (/metrics, --engine-metrics-interval) see D2 fill.

Then two models through one gateway (--models-file): conversations of each, and what crossed.

    python -m bench.engine_load [--conversations 24] [--turns 4]

Prints D queue wait (the emulator's wait for KV memory, per D request that got its memory; those
whose client gave up first are counted apart), TTFT (client; a turn that timed out counts as its
timeout), hit rate and errors per mode.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import requests

from devtools.processes import GatewayProcess, models_toml
from emulator.process import EmulatorProcess

MODEL = "emulated-model"
D2_BLOCKS = 1000  # D2's KV cache: 16,000 tokens
TIMEOUT = 20.0  # a turn that waits longer is an error (a client's read timeout)


def turn(url: str, messages: list, model: str = MODEL) -> tuple[float | None, str, str]:
    """One streamed turn: (TTFT, X-Gateway-Cache, reply); TTFT None on an error."""
    started = time.monotonic()
    reply, ttft = "", None
    try:
        with requests.post(
            url + "/v1/chat/completions",
            stream=True,
            timeout=TIMEOUT,
            json={"model": model, "messages": messages, "max_tokens": 32, "stream": True},
        ) as response:
            if response.status_code != 200:
                return None, "error", ""
            for line in response.iter_lines():
                if not line.startswith(b"data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return None, "error", ""
                ttft = ttft or time.monotonic() - started
                for choice in event.get("choices") or ():
                    reply += (choice.get("delta") or {}).get("content") or ""
            return ttft, response.headers.get("X-Gateway-Cache", "?"), reply
    except requests.RequestException:
        return None, "error", ""


def conversation(url: str, turns: int, model: str = MODEL) -> list[tuple[float | None, str]]:
    messages = [
        {
            "role": "system",
            "content": f"session {uuid.uuid4().hex} " + "you answer questions about the sea " * 30,
        },
        {"role": "user", "content": "tell me about tides"},
    ]
    out = []
    for n in range(turns):
        ttft, cache, reply = turn(url, messages, model)
        out.append((ttft, cache))
        if ttft is None:
            break
        messages += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": f"and question {n}?"},
        ]
    return out


def p99(values: list[float]) -> float:
    return (
        statistics.quantiles(values, n=100, method="inclusive")[98]
        if len(values) > 1
        else (values[0] if values else float("nan"))
    )


def fill(p: EmulatorProcess, d2: EmulatorProcess, usage: float) -> None:
    """Another tenant's one-turn chats on D2 (a gateway of their own) until D2's KV cache is
    `usage` full: each keeps its blocks pinned for a next turn that does not come."""
    with GatewayProcess([p.url], [d2.url], engine_metrics_interval=0) as other:
        while d2.stats()["kv_cache_usage"] < usage:
            assert conversation(other.url, 1)[0][0] is not None


def run_mode(interval: float, args) -> dict:
    flags = dict(bidirectional_kv_xfer=True, itl_ms=5)
    engines = [
        EmulatorProcess("prefill", host="127.0.0.190", **flags),
        EmulatorProcess("prefill", host="127.0.0.191", **flags),
        EmulatorProcess("decode", host="127.0.0.192", **flags),
        EmulatorProcess(
            "decode",
            host="127.0.0.193",
            kv_capacity_blocks=D2_BLOCKS,
            max_model_len=D2_BLOCKS * 16,
            **flags,
        ),
    ]
    p1, p2, d1, d2 = engines
    gateways = []
    try:
        fill(p1, d2, args.fill)
        filled = d2.stats()["kv_cache_usage"]
        for engine in engines:
            engine.reset_stats()
        gateways = [
            GatewayProcess([p1.url, p2.url], [d1.url, d2.url], engine_metrics_interval=interval)
            for _ in range(3)
        ]
        time.sleep(max(interval * 3, 0.1))  # a first report in each (a benchmark may wait)
        with ThreadPoolExecutor(args.concurrency) as pool:
            results = list(
                pool.map(
                    lambda i: conversation(gateways[i % 3].url, args.turns),
                    range(args.conversations),
                )
            )
        turns = [t for c in results for t in c]
        # A turn that timed out counts as its timeout: it waited at least that long.
        ttfts = [(TIMEOUT if t is None else t) * 1000 for t, _ in turns]
        waits = {d.url: [r["kv_wait_ms"] for r in d.recent_requests()] for d in (d1, d2)}
        later = [c for c in results for _, c in c[1:]]
        return {
            "filled": filled,
            "turns": len(turns),
            "errors": sum(t is None for t, _ in turns),
            "ttft_p50": statistics.median(ttfts),
            "ttft_p99": p99(ttfts),
            "hit_rate": sum(c == "hit" for c in later) / max(1, len(later)),
            "d1_turns": len(waits[d1.url]),
            "d2_turns": len(waits[d2.url]),
            "wait_p99": p99(waits[d1.url] + waits[d2.url]),
            "wait_max": max(waits[d1.url] + waits[d2.url]),
            "gave_up": sum(d.stats()["aborted_streams"] for d in (d1, d2)),
            "wrong_reuse": sum(e.stats()["wrong_reuse"] for e in engines),
        }
    finally:
        for gateway in gateways:
            gateway.stop()
        for engine in engines:
            engine.stop()


def two_models(args) -> dict:
    flags = dict(bidirectional_kv_xfer=True, itl_ms=1)
    engines = [
        EmulatorProcess("prefill", host="127.0.0.194", model="chat", **flags),
        EmulatorProcess("decode", host="127.0.0.195", model="chat", **flags),
        EmulatorProcess("prefill", host="127.0.0.196", model="coder", **flags),
        EmulatorProcess("decode", host="127.0.0.197", model="coder", **flags),
    ]
    p1, d1, p2, d2 = engines
    try:
        with tempfile.NamedTemporaryFile("w", suffix=".toml") as models:
            models.write(
                models_toml(
                    chat={"prefill": [p1.url], "decode": [d1.url]},
                    coder={"prefill": [p2.url], "decode": [d2.url]},
                )
            )
            models.flush()
            with (
                GatewayProcess([], [], models_file=models.name, workers=2) as gateway,
                ThreadPoolExecutor(args.concurrency) as pool,
            ):
                results = list(
                    pool.map(
                        lambda i: (
                            i % 2,
                            conversation(gateway.url, args.turns, ("chat", "coder")[i % 2]),
                        ),
                        range(args.conversations),
                    )
                )
        out = {}
        for index, name in enumerate(("chat", "coder")):
            later = [c for m, conv in results if m == index for _, c in conv[1:]]
            out[name] = {
                "turns": sum(len(conv) for m, conv in results if m == index),
                "hit_rate": sum(c == "hit" for c in later) / max(1, len(later)),
            }
        stats = [e.stats() for e in engines]
        out["bad_requests"] = sum(s["bad_requests"] for s in stats)  # a wrong model: 404
        out["wrong_reuse"] = sum(s["wrong_reuse"] for s in stats)
        out["d_completed"] = [stats[1]["completed"], stats[3]["completed"]]
        return out
    finally:
        for engine in engines:
            engine.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument(
        "--fill",
        type=float,
        default=0.90,
        help="D2's KV cache usage before the run (another tenant's idle chats)",
    )
    args = parser.parse_args(argv)
    print(
        f"3 gateway processes, 2 P, 2 D (D2: {D2_BLOCKS} blocks, filled to >= {args.fill:.0%} "
        f"by idle chats), {args.conversations} conversations x {args.turns} turns, "
        f"{args.concurrency} at a time, turns time out at {TIMEOUT:.0f} s"
    )
    print(
        "| choice | D2 filled | turns | errors | TTFT p50 ms | TTFT p99 ms | hit rate (turns 2+) "
        "| D turns D1/D2 | D queue wait p99 ms | max ms | D requests given up waiting "
        "| wrong reuse |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for label, interval in (("in-flight counts alone", 0.0), ("engine-reported load, 0.5 s", 0.5)):
        r = run_mode(interval, args)
        print(
            f"| {label} | {r['filled']:.1%} | {r['turns']} | {r['errors']} | "
            f"{r['ttft_p50']:.0f} | {r['ttft_p99']:.0f} | {r['hit_rate']:.0%} | "
            f"{r['d1_turns']}/{r['d2_turns']} | {r['wait_p99']:.0f} | {r['wait_max']:.0f} | "
            f"{r['gave_up']} | {r['wrong_reuse']} |"
        )
    models = two_models(args)
    print(f"two models through one gateway: {json.dumps(models)}")


if __name__ == "__main__":
    main()
