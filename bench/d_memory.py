"""D's memory under many short conversations: what the gateway leaves pinned on D, and whether new
turns wait for D's KV memory (docs/d-memory.md).

1 P and 1 D emulated with vLLM's defaults (prefix caching, kv_recompute_threshold 64,
decoder_kv_blocks_ttl 480 s) but bidirectional transfer on, D's KV cache bounded at
`--d-capacity` blocks; a gateway of one gevent worker. N conversations, each stopping after 1 to 3
turns (a long first question, then short follow-ups), C at a time; D's /stats sampled while they
run. Each configuration on fresh engines:

- `pinned off, releases off`: the gateway before the budget and releases (every turn's blocks
  stay pinned on D until its TTL);
- `fixed budget`: `--pinned-blocks N` and releases on (the budget before it was derived);
- `defaults`: the budget derived from D's reports (`--pinned-blocks auto`), releases on;
- `defaults, fast path`: the same with `--fast-path-tokens 64`.

    python -m bench.d_memory [--conversations 1000] [--arrivals 20] [--concurrency 16]
                             [--d-capacity 6000] [--budget 2000] [--configs 1,2]

A configuration whose D fills up stops starting conversations after 48 failed turns (its D stays
full until its TTL, 480 s): `conversations` says how many it started.
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import requests

from devtools import sse
from devtools.processes import GatewayProcess
from devtools.workload import MODEL
from emulator.process import EmulatorProcess, wait_until
from emulator.tokens import VOCAB

TIMEOUT = 15.0  # a turn that waits longer for D's memory is counted as failed


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(VOCAB) for _ in range(count))


STOP_AFTER_FAILURES = 48  # D is full and stays full (480 s): no new conversation starts


def conversation(url: str, index: int, salt: str, failures: list, start_at: float) -> dict:
    rng = random.Random(f"{salt}/{index}")
    time.sleep(max(0.0, start_at - time.monotonic()))  # arrivals at a steady rate
    turns = 1 + index % 3
    messages = [{"role": "user", "content": f"{salt} {index} " + words(rng, 150)}]
    out = {"ttft": [], "later": 0, "hits": 0, "errors": 0, "started": False}
    if len(failures) >= STOP_AFTER_FAILURES:
        return out
    out["started"] = True
    session = requests.Session()
    for turn in range(turns):
        try:
            timed = sse.timed_turn(
                session,
                url + "/v1/chat/completions",
                timeout=TIMEOUT,
                body={"model": MODEL, "messages": messages, "max_tokens": 32, "stream": True},
            )
        except Exception:  # a turn that waited past TIMEOUT, or failed: the conversation ends
            out["errors"] += 1
            failures.append(index)
            return out
        out["ttft"].append(timed.ttft)
        if turn:
            out["later"] += 1
            out["hits"] += timed.headers.get("X-Gateway-Cache") == "hit"
        messages += [
            {"role": "assistant", "content": timed.text.strip()},
            {"role": "user", "content": words(rng, 6)},
        ]
    return out


class Sampler:
    """D's pinned blocks, memory use and waiting requests, every 0.1 s, while a run lasts."""

    def __init__(self, d: EmulatorProcess) -> None:
        self.d = d
        self.peak = {"pinned": 0, "used": 0, "waiting": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            stats = self.d.stats()
            now = {
                "pinned": stats["kv_lease_blocks"] + stats["leaked_blocks"],
                "used": stats["kv_blocks_used"],
                "waiting": stats["requests_waiting"],
            }
            self.peak = {k: max(v, now[k]) for k, v in self.peak.items()}

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return self.peak


def measure(label: str, settings: dict, args: argparse.Namespace) -> dict:
    engine = {"itl_ms": 2, "prefill_ms_per_token": 0.02, "bidirectional_kv_xfer": True}
    # vLLM refuses a cache that cannot hold one request of max_model_len: a small D, a shorter one.
    context = min(32768, args.d_capacity * 16)
    with (
        EmulatorProcess("prefill", max_model_len=context, **engine) as p,
        EmulatorProcess(
            "decode", kv_capacity_blocks=args.d_capacity, max_model_len=context, **engine
        ) as d,
        GatewayProcess([p.url], [d.url], workers=1, **settings) as gateway,
    ):
        sampler = Sampler(d)
        started = time.monotonic()
        failures: list = []
        with ThreadPoolExecutor(args.concurrency) as pool:
            runs = list(
                pool.map(
                    lambda i: conversation(
                        gateway.url, i, label, failures, started + i / args.arrivals
                    ),
                    range(args.conversations),
                )
            )
        seconds = time.monotonic() - started
        if settings.get("release_rate", 1):
            # What the releases still queued will free (at most --release-rate a second).
            last = [-1.0]  # the counter at the previous look

            def settled() -> bool:
                now = gateway.metric("pd_gateway_releases_total")
                done, last[0] = now == last[0], now
                return done

            wait_until(lambda: d.stats()["requests_running"] == 0, 30, "D to settle")
            wait_until(lambda: settled() or time.sleep(1), 120, "the releases to drain")
        peak = sampler.stop()
        ps, ds = p.stats(), d.stats()
        released = gateway.metric("pd_gateway_releases_total", result="released")
    ttft = sorted(t for r in runs for t in r["ttft"])
    later = sum(r["later"] for r in runs)
    return {
        "system": label,
        "conversations": sum(r["started"] for r in runs),
        "turns": len(ttft),
        "failed": sum(r["errors"] for r in runs),
        "seconds": round(seconds, 1),
        "ttft_p50": round(statistics.median(ttft) * 1000, 1) if ttft else "-",
        "ttft_p99": round(ttft[int(len(ttft) * 0.99) - 1] * 1000, 1) if ttft else "-",
        "later_hits": f"{sum(r['hits'] for r in runs)}/{later}",
        # The exact peak (the emulator counts it as leases come and go), and what never leaves.
        "d_pinned_peak": max(peak["pinned"], ds["kv_lease_blocks_peak"] + ds["leaked_blocks"]),
        "d_used_peak": peak["used"],
        "d_waiting_peak": peak["waiting"],
        "d_wait_s": round(ds["kv_wait_seconds"], 2),
        "d_pinned_end": ds["kv_lease_blocks"] + ds["leaked_blocks"],
        "leaked_leases": ds["leaked_leases"],
        "released": int(released),
        "wrong_reuse": ps["wrong_reuse"] + ds["wrong_reuse"],
    }


COLUMNS = (
    "system",
    "conversations",
    "turns",
    "failed",
    "seconds",
    "ttft_p50",
    "ttft_p99",
    "later_hits",
    "d_pinned_peak",
    "d_used_peak",
    "d_waiting_peak",
    "d_wait_s",
    "d_pinned_end",
    "leaked_leases",
    "released",
    "wrong_reuse",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--conversations", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument(
        "--arrivals", type=float, default=20.0, help="new conversations a second, at most"
    )
    parser.add_argument("--d-capacity", type=int, default=6000, help="D's KV cache in blocks")
    parser.add_argument(
        "--budget", type=int, default=2000, help="--pinned-blocks of the fixed-budget configuration"
    )
    parser.add_argument(
        "--configs",
        help="comma separated numbers of the configurations to run "
        "(0 pinned off, 1 fixed budget, 2 defaults, 3 defaults with the fast "
        "path); all by default",
    )
    args = parser.parse_args()
    configs = [
        ("pinned off, releases off", {"pinned_blocks": 0, "release_rate": 0}),
        (f"fixed budget {args.budget:,}", {"pinned_blocks": args.budget}),
        ("defaults (budget from D's reports)", {}),
        ("defaults, fast path", {"fast_path_tokens": 64}),
    ]
    if args.configs:
        configs = [configs[int(i)] for i in args.configs.split(",")]
    print(
        f"{args.conversations} conversations of 1-3 turns (150-word question, 6-word "
        f"follow-ups, 32-token replies), {args.arrivals:g} new a second, at most "
        f"{args.concurrency} at a time; D: "
        f"{args.d_capacity} blocks of 16; fixed budget {args.budget} blocks; turn timeout "
        f"{TIMEOUT} s"
    )
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for label, settings in configs:
        row = measure(label, settings, args)
        print("| " + " | ".join(str(row[c]) for c in COLUMNS) + " |", flush=True)


if __name__ == "__main__":
    main()
