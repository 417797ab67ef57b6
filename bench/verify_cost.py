"""What token-verified reuse costs: TTFT and gateway CPU per turn, verify_reuse off, auto, always.

Plain multi-turn chat over emulated engines, histories of about 1k, 10k and 50k tokens: with
`off` a turn reuses on its history digest; with `always` D also returns its token ids (hashed by
the gateway, stripped before the client) and every reuse is checked by a /tokenize call on P.
The difference is the price of verification. The emulator's /tokenize is Python rendering and
hashing words, not a Rust tokenizer, so its share of the TTFT is shown apart.

    python -m bench.verify_cost [--conversations 4] [--turns 5] [--sizes 1000 10000 50000]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import requests

from devtools import procstat, sse
from devtools.processes import GatewayProcess
from devtools.workload import MODEL
from emulator.process import EmulatorProcess
from emulator.tokens import VOCAB

# Not vLLM's defaults: P without a prefix cache and kv_recompute_threshold 0, so that every
# reuse is a read of D's blocks whose proof is what this measures.
ENGINE = {
    "itl_ms": 8,
    "prefill_ms_per_token": 0.02,
    "pull_ms_per_block": 0.05,
    "max_model_len": 200_000,
    "recompute_threshold": 0,
}


def conversation(url: str, size: int, turns: int, seed: int) -> tuple[list[float], int]:
    """TTFT of every turn after the first (seconds), and how many of those hit."""
    rng = random.Random(seed)
    messages = [
        {
            "role": "user",
            "content": " ".join(rng.choice(VOCAB) for _ in range(size))
            + f" {seed} {time.time_ns()}",
        }
    ]
    ttfts, hits = [], 0
    session = requests.Session()
    for turn in range(turns):
        timed = sse.timed_turn(
            session,
            url + "/v1/chat/completions",
            timeout=120,
            body={"model": MODEL, "messages": messages, "max_tokens": 32, "stream": True},
        )
        text = timed.text
        if turn:
            ttfts.append(timed.ttft)
            hits += timed.headers.get("X-Gateway-Cache") == "hit"
        messages += [
            {"role": "assistant", "content": text.strip()},
            {"role": "user", "content": " ".join(rng.choice(VOCAB) for _ in range(20))},
        ]
    return ttfts, hits


def percentile(values: list[float], q: float) -> float:
    return (
        statistics.quantiles(values, n=100, method="inclusive")[q - 1]
        if len(values) > 1
        else values[0]
    )


def measure(
    p: EmulatorProcess, d: EmulatorProcess, mode: str, size: int, conversations: int, turns: int
) -> dict:
    with GatewayProcess([p.url], [d.url], verify_reuse=mode, workers=1) as gateway:
        conversation(gateway.url, 50, 2, seed=-1)  # warm up (and probe the template)
        worker = procstat.children(gateway.process.pid)[0]
        p.reset_stats()
        cpu0 = procstat.cpu_seconds([worker])
        with ThreadPoolExecutor(conversations) as pool:
            results = list(
                pool.map(lambda i: conversation(gateway.url, size, turns, i), range(conversations))
            )
        cpu = procstat.cpu_seconds([worker]) - cpu0
        tokenize = p.stats()["tokenize_requests"]
    ttfts = [t for r, _ in results for t in r]
    return {
        "ttft_p50": percentile(ttfts, 50) * 1000,
        "ttft_p99": percentile(ttfts, 99) * 1000,
        "cpu_ms": cpu / (conversations * turns) * 1000,
        "hits": sum(h for _, h in results),
        "later": len(ttfts),
        "tokenize": tokenize,
    }


def tokenize_ms(p: EmulatorProcess, size: int) -> float:
    """The emulator's own /tokenize time for one prompt of `size` words (median of 5)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": " ".join(["alpha"] * size)}]}
    times = []
    for _ in range(5):
        started = time.perf_counter()
        requests.post(p.url + "/tokenize", json=body, timeout=60).raise_for_status()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10_000, 50_000])
    args = parser.parse_args(argv)
    print(
        f"{args.conversations} conversations at once x {args.turns} turns; TTFT of turns 2+; "
        "gateway CPU per turn (1 gevent worker)"
    )
    print(
        "| history tokens | verify_reuse | hits | TTFT p50 ms | TTFT p99 ms | gateway CPU ms/turn "
        "| /tokenize calls | emulator /tokenize ms |"
    )
    print("|---|---|---|---|---|---|---|---|")
    with (
        EmulatorProcess(
            "prefill",
            bidirectional_kv_xfer=True,
            host="127.0.0.2",
            enable_prefix_caching=False,
            **ENGINE,
        ) as p,
        EmulatorProcess("decode", bidirectional_kv_xfer=True, host="127.0.0.3", **ENGINE) as d,
    ):
        for size in args.sizes:
            own = tokenize_ms(p, size)
            for mode in ("off", "auto", "always"):
                m = measure(p, d, mode, size, args.conversations, args.turns)
                print(
                    f"| {size:,} | {mode} | {m['hits']}/{m['later']} | {m['ttft_p50']:.1f} | "
                    f"{m['ttft_p99']:.1f} | {m['cpu_ms']:.2f} | {m['tokenize']} | "
                    f"{own if mode == 'always' else 0:.1f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
