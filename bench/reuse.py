"""Where reading D's blocks pays: pd-gateway beside vllm-router (cache_aware, its default, and
round robin) and the seed proxy, over engines with vLLM's defaults (docs/BENCHMARKS.md, first
section).

Every system gets fresh engines, 2 P and 2 D emulated with vLLM 0.33's defaults: prefix caching
on, kv_recompute_threshold 64, decoder_kv_blocks_ttl 480 s, a KV cache of a stated size. What
differs is what each system's users run: the gateway and the seed need bidirectional KV transfer
(`bidirectional_kv_xfer`, the README's `vllm serve` command), vllm-router runs standard P/D (D
keeps nothing after a turn). The axes that decide the answer:

- reply length: 32, 256, 1,024 tokens;
- how many conversations are live and how long each thinks between turns (0, or 2 s while 64
  conversations take turns: vLLM evicts by use, not by time, so a think time turns P's cache
  over only through the other conversations' turns meanwhile);
- P's KV cache against the live conversations' histories: room for twice them (`fits`), or a
  quarter of them (`4x over`).

Per row: prompt tokens computed (P + D, and the turns whose P read D's blocks), TTFT p50/p99,
D's pinned blocks at their peak (kept for a next turn), D's wait for KV memory, errors.

    python -m bench.reuse [--quick] [--systems gateway,vllm-router] [--replies 32,256]
                          [--scenarios 1,2]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit


from bench import venvs
from bench.metrics import percentile
from bench.systems import slug, stop_process, _spawn
from devtools.processes import GatewayProcess
from devtools.workload import FIRST_WORDS, TURN_WORDS
from emulator.process import EmulatorProcess, free_port

HOSTS = ("127.0.0.80", "127.0.0.81", "127.0.0.82", "127.0.0.83")   # P, P, D, D
PROXY_HOST = "127.0.0.1"
# Small engine timings so a run is about the KV economy: 2 ms a token, 0.05 ms a computed prompt
# token (a 1,000-token miss costs 50 ms), 0.05 ms a pulled block.
ENGINE = {"itl_ms": 2, "prefill_ms_per_token": 0.05, "pull_ms_per_block": 0.05,
          "max_model_len": 16384}
D_CAPACITY = 20_000            # blocks of 16 per D: the emulator's default (an 8B model, 80 GB)
TURNS = 6
BLOCK = 16


@dataclass(frozen=True)
class System:
    label: str
    kind: str                  # gateway | router | seed
    bidirectional: bool
    ids: bool = False
    argv: tuple = ()
    settings: tuple = ()       # the gateway's, as (name, value) pairs


SYSTEMS = {
    "gateway": System("pd-gateway", "gateway", True),
    # The fixed budget every D had before it was derived from D's reports (docs/d-memory.md).
    "gateway-static": System("pd-gateway (--pinned-blocks 8192)", "gateway", True,
                             settings=(("pinned_blocks", 8192),)),
    "vllm-router": System("vllm-router (cache_aware)", "router", False),
    "vllm-router-rr": System("vllm-router (round_robin)", "router", False,
                             argv=("--policy", "round_robin")),
    "seed": System("seed proxy (ids)", "seed", True, ids=True),
}


@dataclass(frozen=True)
class Scenario:
    label: str
    live: int                  # conversations in flight at once
    think: float               # seconds between a reply and the next question
    p_cache: float             # P's cache as a share of the live conversations' histories


SCENARIOS = (Scenario("16 live, no think, P cache fits", 16, 0.0, 2.0),
             Scenario("64 live, think 2 s, P cache fits", 64, 2.0, 2.0),
             Scenario("64 live, think 2 s, P cache 4x over", 64, 2.0, 0.25))
REPLIES = (32, 256, 1024)
# What `make bench` runs; gateway-static on ask (docs/d-memory.md compares the two budgets).
DEFAULT_SYSTEMS = ("gateway", "vllm-router", "vllm-router-rr", "seed")


def history_blocks(reply: int) -> int:
    """Blocks of a conversation's longest prompt (its last turn), template tokens included."""
    words = FIRST_WORDS + 64 + (TURNS - 1) * (max(TURN_WORDS) + 16) + (TURNS - 1) * (reply + 4)
    return math.ceil(words / BLOCK)


def p_capacity(scenario: Scenario, reply: int) -> int:
    """Each P's cache: its half of the live conversations' histories times the scenario's
    share, and never less than one request of max_model_len (vLLM's own floor)."""
    wanted = scenario.live * history_blocks(reply) / 2 * scenario.p_cache
    return max(ENGINE["max_model_len"] // BLOCK, math.ceil(wanted))


@contextlib.contextmanager
def cluster(system: System, scenario: Scenario, reply: int):
    flags = {**ENGINE, "bidirectional_kv_xfer": system.bidirectional}
    with contextlib.ExitStack() as stack:
        engines = [stack.enter_context(EmulatorProcess(
            role, host=host, advertise_host=host, **flags,
            kv_capacity_blocks=p_capacity(scenario, reply) if role == "prefill" else D_CAPACITY))
            for role, host in zip(("prefill", "prefill", "decode", "decode"), HOSTS)]
        yield engines[:2], engines[2:]


@contextlib.contextmanager
def started(system: System, prefills: list, decodes: list, log_dir: str):
    """The system in front of the engines; yields its URL."""
    if system.kind == "gateway":
        with GatewayProcess([p.url for p in prefills], [d.url for d in decodes],
                            host=PROXY_HOST, workers=1, **dict(system.settings)) as gateway:
            yield gateway.url
        return
    port = free_port(PROXY_HOST, 2)
    url = f"http://{PROXY_HOST}:{port}"
    log = os.path.join(log_dir, f"{slug(system.label)}.log")
    if system.kind == "router":
        argv = [venvs.ROUTER.bin("vllm-router"), "--host", PROXY_HOST, "--port", str(port),
                "--vllm-pd-disaggregation", "--kv-connector", "nixl",
                *[a for p in prefills for a in ("--prefill", p.url)],
                *[a for d in decodes for a in ("--decode", d.url)],
                "--prometheus-host", PROXY_HOST, "--prometheus-port", str(port + 1),
                "--worker-startup-timeout-secs", "20", *system.argv]
    else:
        hosts = lambda engines: [urlsplit(e.url).hostname for e in engines]   # noqa: E731
        ports = lambda engines: [str(urlsplit(e.url).port) for e in engines]  # noqa: E731
        argv = [venvs.SEED.python(), venvs.seed_script(), "--host", PROXY_HOST, "--port", str(port),
                "--prefiller-hosts", *hosts(prefills), "--prefiller-ports", *ports(prefills),
                "--decoder-hosts", *hosts(decodes), "--decoder-ports", *ports(decodes)]
    process = _spawn(argv, log, url, "/health")
    try:
        yield url
    finally:
        stop_process(process)


class Sampler:
    """The Ds' pinned blocks (kept for a next turn) at their peak, sampled every 0.2 s."""

    def __init__(self, decodes: list) -> None:
        self.decodes = decodes
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            pinned = 0
            for d in self.decodes:
                stats = d.stats()
                pinned += stats["kv_lease_blocks"] + stats["leaked_blocks"]
            self.peak = max(self.peak, pinned)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def run(system: System, scenario: Scenario, reply: int, out_dir: str) -> dict:
    with cluster(system, scenario, reply) as (prefills, decodes), \
            started(system, prefills, decodes, out_dir) as url:
        out = os.path.join(out_dir, f"reuse-{slug(system.label)}-{scenario.live}-"
                                    f"{scenario.p_cache}-{reply}.json")
        salt = f"{system.kind}-{scenario.live}-{scenario.p_cache}-{reply}-{time.time_ns()}"
        argv = [sys.executable, "-m", "bench.loadgen", "--url", url, "--salt", salt,
                "--out", out, "--concurrency", str(scenario.live),
                "--conversations", str(scenario.live), "--turns", str(TURNS),
                "--duration", "300", "--think", str(scenario.think)]
        sampler = Sampler(decodes)
        subprocess.run(argv + (["--ids"] if system.ids else []), check=True, timeout=600,
                       env={**os.environ, "BENCH_REPLY_WORDS": str(reply)})
        pinned = sampler.stop()
        stats = [e.stats() for e in (*prefills, *decodes)]
    with open(out) as f:
        load = json.load(f)
    turns = load["turns"]
    ttft = [t["first"] - t["sent"] for t in turns]
    p_stats, d_stats = stats[:2], stats[2:]
    computed = sum(s["computed_prompt_tokens"] for s in stats)
    prompt = sum(t["prompt_tokens"] for t in turns)
    return {"scenario": scenario.label, "reply": reply, "system": system.label,
            "turns": len(turns), "errors": len(load["errors"]),
            "computed": computed, "prompt": prompt,
            "read_turns": sum(s["hits"] for s in p_stats),
            "ttft_p50_ms": round(percentile(ttft, 50) * 1000, 1),
            "ttft_p99_ms": round(percentile(ttft, 99) * 1000, 1),
            "d_pinned_peak": pinned,
            "d_wait_s": round(sum(s["kv_wait_seconds"] for s in d_stats), 2),
            "wrong_reuse": sum(s["wrong_reuse"] for s in stats),
            "p_capacity": p_capacity(scenario, reply)}


COLUMNS = ("scenario", "reply", "system", "turns", "errors", "computed", "read_turns",
           "ttft_p50_ms", "ttft_p99_ms", "d_pinned_peak", "d_wait_s", "wrong_reuse")
HEADINGS = {"reply": "reply tokens", "computed": "prompt tokens computed (P + D)",
            "read_turns": "turns P read D's blocks", "ttft_p50_ms": "TTFT p50 ms",
            "ttft_p99_ms": "TTFT p99 ms", "d_pinned_peak": "D pinned blocks (peak)",
            "d_wait_s": "D memory wait s", "wrong_reuse": "wrong reuse"}


def table(rows: list[dict]) -> str:
    head = "| " + " | ".join(HEADINGS.get(c, c) for c in COLUMNS) + " |"
    lines = [head, "|" + "---|" * len(COLUMNS)]
    for row in rows:
        cells = [f"{row[c]:,}" if isinstance(row[c], int) and c != "reply" else str(row[c])
                 for c in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    """One line per scenario and reply length: the gateway against vllm-router's default."""
    by = {(r["scenario"], r["reply"], r["system"]): r for r in rows}
    lines = []
    for (scenario, reply, system), ours in by.items():
        if system != SYSTEMS["gateway"].label:
            continue
        peer = by.get((scenario, reply, SYSTEMS["vllm-router"].label))
        if peer is None or not ours["computed"]:
            continue
        lines.append(
            f"- {scenario}, {reply}-token replies: the gateway computed "
            f"{ours['computed']:,} prompt tokens, vllm-router (cache_aware) "
            f"{peer['computed']:,} ({peer['computed'] / ours['computed']:.2f}x); TTFT p50 "
            f"{ours['ttft_p50_ms']} against {peer['ttft_p50_ms']} ms, p99 {ours['ttft_p99_ms']} "
            f"against {peer['ttft_p99_ms']} ms; P read D's blocks on {ours['read_turns']} of "
            f"{ours['turns']} turns; D's pinned blocks peaked at {ours['d_pinned_peak']:,} "
            f"(vllm-router: {peer['d_pinned_peak']:,}).")
    return "\n".join(lines)


def available(keys: list[str], notes: list[str]) -> list[System]:
    problems = {"router": venvs.ROUTER.ensure(), "seed": venvs.seed_problem()}
    out = []
    for key in keys:
        system = SYSTEMS[key]
        problem = problems.get(system.kind)
        if problem:
            notes.append(f"{system.label} was skipped: {problem}")
        else:
            out.append(system)
    return out


def measure(keys: list[str], scenarios, replies, out_dir: str) -> tuple[list[dict], list[str]]:
    notes: list[str] = []
    os.makedirs(out_dir, exist_ok=True)
    systems = available(keys, notes)
    rows = []
    for scenario in scenarios:
        for reply in replies:
            for system in systems:
                row = run(system, scenario, reply, out_dir)
                rows.append(row)
                print(f"{scenario.label:>36} {reply:>5} {system.label:>26}: "
                      f"{row['computed']:>8,} computed, {row['read_turns']:>3} read, "
                      f"TTFT p50 {row['ttft_p50_ms']:>7} ms p99 {row['ttft_p99_ms']:>7} ms, "
                      f"D pinned {row['d_pinned_peak']:>6,}, {row['errors']} errors", flush=True)
    return rows, notes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="32- and 256-token replies, "
                        "two scenarios")
    parser.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                        help=f"comma separated, of {', '.join(SYSTEMS)}")
    parser.add_argument("--replies", help="comma separated reply lengths")
    parser.add_argument("--scenarios", help="comma separated scenario numbers (0, 1, 2)")
    parser.add_argument("--out", default=tempfile.mkdtemp(prefix="bench-reuse-"))
    args = parser.parse_args(argv)
    scenarios = (tuple(SCENARIOS[int(i)] for i in args.scenarios.split(",")) if args.scenarios
                 else (SCENARIOS[0], SCENARIOS[2]) if args.quick else SCENARIOS)
    replies = (tuple(int(r) for r in args.replies.split(",")) if args.replies
               else (32, 256) if args.quick else REPLIES)
    os.makedirs(args.out, exist_ok=True)
    rows, notes = measure(args.systems.split(","), scenarios, replies, args.out)
    print("\n" + table(rows))
    for note in notes:
        print("note:", note)
    with open(os.path.join(args.out, "reuse.json"), "w") as f:
        json.dump({"rows": rows, "notes": notes}, f, indent=1)


if __name__ == "__main__":
    main()
