"""What keeping tenants apart in the engines' prefix caches costs (--tenant-cache-salt).

With client API keys each request gets a cache_salt derived from its key, so one tenant's
cached prompt never speeds up (or reveals itself to) another's. The cost: tenants no longer
share cached prompts, such as a common system prompt. Measured over emulated engines with
vLLM's defaults (prefix caching on; 1 P, 1 D, a gateway of one gevent worker): K tenants, each
C conversations of T turns, every conversation opening with the same system prompt of S words;
tenants arrive one after another (--concurrency 1), each running its conversations in turn.
Salting on (auto, as with keys) and off.

    python -m bench.tenant_salt [--tenants 8] [--conversations 2] [--turns 3] [--system 2000]
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
from emulator.process import EmulatorProcess
from emulator.tokens import VOCAB

ENGINE = {"itl_ms": 5, "prefill_ms_per_token": 0.1, "max_model_len": 200_000}


def tenant(
    url: str, key: str, system: str, conversations: int, turns: int, seed: int
) -> list[float]:
    """A tenant's conversations, one after another: the TTFT of each first turn (seconds)."""
    rng = random.Random(seed)
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {key}"
    firsts = []
    for c in range(conversations):
        messages = [
            {"role": "system", "content": system},
            {
                "role": "user",
                "content": f"{key} {c} " + " ".join(rng.choice(VOCAB) for _ in range(20)),
            },
        ]
        for turn in range(turns):
            timed = sse.timed_turn(
                session,
                url + "/v1/chat/completions",
                body={"model": MODEL, "messages": messages, "max_tokens": 16, "stream": True},
            )
            if turn == 0:
                firsts.append(timed.ttft)
            messages += [
                {"role": "assistant", "content": timed.text.strip()},
                {"role": "user", "content": " ".join(rng.choice(VOCAB) for _ in range(12))},
            ]
    return firsts


def run(salting: str, args: argparse.Namespace) -> dict:
    keys = [f"tenant-{i}-key" for i in range(args.tenants)]
    system = " ".join(random.Random(7).choice(VOCAB) for _ in range(args.system))
    with (
        EmulatorProcess("prefill", host="127.0.0.2", **ENGINE) as p,
        EmulatorProcess("decode", host="127.0.0.3", **ENGINE) as d,
        GatewayProcess(
            [p.url], [d.url], api_keys=",".join(keys), tenant_cache_salt=salting
        ) as gateway,
    ):
        started = time.monotonic()
        with ThreadPoolExecutor(args.concurrency) as pool:
            firsts = [
                t
                for f in [
                    pool.submit(tenant, gateway.url, key, system, args.conversations, args.turns, i)
                    for i, key in enumerate(keys)
                ]
                for t in f.result()
            ]
        stats = p.stats()
        return {
            "salting": salting,
            "seconds": time.monotonic() - started,
            "computed": stats["computed_prompt_tokens"],
            "cached": stats["local_prefix_tokens"],
            "first_ttft_p50": statistics.median(firsts) * 1000,
            "first_ttft_max": max(firsts) * 1000,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--conversations", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=1, help="tenants at a time")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--system", type=int, default=2000, help="system prompt words")
    args = parser.parse_args()
    print(
        f"{args.tenants} tenants x {args.conversations} conversations x {args.turns} turns, "
        f"a shared system prompt of {args.system} words\n"
    )
    print(
        "| salting | P computed prompt tokens | P prefix-cache tokens "
        "| first-turn TTFT p50 / max (ms) |"
    )
    print("|---|---|---|---|")
    for salting in ("off", "auto"):
        r = run(salting, args)
        print(
            f"| {r['salting']} | {r['computed']:,} | {r['cached']:,} | "
            f"{r['first_ttft_p50']:.1f} / {r['first_ttft_max']:.1f} |"
        )


if __name__ == "__main__":
    main()
