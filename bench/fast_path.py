"""The decode-only fast path: TTFT, prefill work on P and D, and D's blocks nobody reads.

Multi-turn chat over emulated engines (1 P, 1 D, a gateway of one gevent worker): C concurrent
conversations of T turns on a history of about 1,000 tokens, each follow-up N words. With the
fast path on, a follow-up below `--fast-path-tokens` goes to the D that holds its history;
off, every turn pays P and two KV transfers. The emulator's cost model: P and D compute prompt
tokens at the same cost, one request after another (throughput-bound); a local prefill on D
stalls D's streams meanwhile (the upper bound of what chunked prefill costs them).

    python -m bench.fast_path [--conversations 8] [--turns 6] [--sizes 8 32 128 512 2048]

Each size runs twice, fast path off and on (threshold above the follow-up), on fresh engines.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import requests

from devtools import sse
from devtools.processes import GatewayProcess
from devtools.workload import MODEL
from emulator.process import EmulatorProcess, wait_until
from emulator.tokens import VOCAB

# vLLM's defaults (prefix caching, kv_recompute_threshold 64) with bidirectional transfer on.
ENGINE = {
    "itl_ms": 10,
    "prefill_ms_per_token": 0.1,
    "pull_ms_per_block": 0.05,
    "max_model_len": 200_000,
    "bidirectional_kv_xfer": True,
}
HISTORY_WORDS = 1000
ON = 1 << 20  # a threshold above any follow-up: every follow-up takes the fast path


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(VOCAB) for _ in range(count))


def conversation(url: str, follow_up: int, turns: int, seed: int) -> dict:
    """One conversation: TTFT and inter-token gaps of every turn after the first (seconds)."""
    rng = random.Random(seed)
    messages = [
        {"role": "user", "content": f"{seed} {time.time_ns()} " + words(rng, HISTORY_WORDS)}
    ]
    out = {"ttft": [], "gaps": [], "hits": 0, "decode_only": 0}
    session = requests.Session()
    for turn in range(turns):
        timed = sse.timed_turn(
            session,
            url + "/v1/chat/completions",
            body={"model": MODEL, "messages": messages, "max_tokens": 32, "stream": True},
        )
        text = timed.text
        if turn:
            out["ttft"].append(timed.ttft)
            out["gaps"] += timed.gaps
            out["hits"] += timed.headers.get("X-Gateway-Cache") == "hit"
            out["decode_only"] += timed.headers.get("X-Gateway-Path", "").startswith("decode-only")
        messages += [
            {"role": "assistant", "content": text.strip()},
            {"role": "user", "content": words(rng, follow_up)},
        ]
    return out


def pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] * 1000


def measure(follow_up: int, threshold: int, conversations: int, turns: int) -> dict:
    with (
        EmulatorProcess("prefill", **ENGINE) as p,
        EmulatorProcess("decode", **ENGINE) as d,
        GatewayProcess([p.url], [d.url], workers=1, fast_path_tokens=threshold) as gateway,
    ):
        with ThreadPoolExecutor(conversations) as pool:
            runs = list(
                pool.map(
                    lambda i: conversation(gateway.url, follow_up, turns, i), range(conversations)
                )
            )
        # The leases that decode-only turns left unread are released in the background: at
        # most one a conversation stays, the entry its last turn left (none after a
        # decode-only turn, which keeps nothing on D).
        wait_until(lambda: d.stats()["kv_leases"] <= conversations, 20, "the releases")
        ps, ds = p.stats(), d.stats()
    later = conversations * (turns - 1)
    ttft = [t for r in runs for t in r["ttft"]]
    gaps = [g for r in runs for g in r["gaps"]]
    return {
        "follow_up": follow_up,
        "fast_path": "on" if threshold else "off",
        "ttft_p50": pct(ttft, 50),
        "ttft_p99": pct(ttft, 99),
        "itl_p99": pct(gaps, 99),
        "hits": f"{sum(r['hits'] for r in runs)}/{later}",
        "decode_only": f"{sum(r['decode_only'] for r in runs)}/{later}",
        "p_computed": ps["computed_prompt_tokens"],
        "d_computed": ds["computed_prompt_tokens"],
        "d_stall_ms": round(ds["decode_stall_seconds"] * 1000),
        "wrong_reuse": ps["wrong_reuse"] + ds["wrong_reuse"],
        "d_leaked": ds["leaked_leases"],
        "d_leases_held": ds["kv_leases"],
        "d_blocks_held": ds["kv_lease_blocks"] + ds["leaked_blocks"],
    }


COLUMNS = (
    "follow_up",
    "fast_path",
    "ttft_p50",
    "ttft_p99",
    "itl_p99",
    "hits",
    "decode_only",
    "p_computed",
    "d_computed",
    "d_stall_ms",
    "wrong_reuse",
    "d_leaked",
    "d_leases_held",
    "d_blocks_held",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=[8, 32, 128, 512, 2048],
        help="words per follow-up message",
    )
    args = parser.parse_args()
    print(
        f"{args.conversations} conversations x {args.turns} turns, history "
        f"~{HISTORY_WORDS} words, 32-token replies; engines {ENGINE}; ms"
    )
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for size in args.sizes:
        for threshold in (0, ON):
            row = measure(size, threshold, args.conversations, args.turns)
            print(
                "| "
                + " | ".join(
                    f"{row[c]:.1f}" if isinstance(row[c], float) else str(row[c]) for c in COLUMNS
                )
                + " |",
                flush=True,
            )


if __name__ == "__main__":
    main()
