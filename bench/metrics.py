"""Figures of one run: client timings matched to the engines' own timestamps, CPU, tokens,
errors."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass


@dataclass
class Measured:
    """What the harness collected around one load run of one system at one concurrency."""

    system: str
    conversations: int
    load: dict  # bench.loadgen output
    engine_stats: dict  # role -> GET /stats after the run
    engine_records: dict  # role -> GET /stats/requests after the run
    proxy_cpu_s: float
    engine_cpu_s: float
    machine_busy: float  # all CPUs busy share during the run, 0..1 (includes other users)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def match(turns: list[dict], records: list[dict]) -> list[dict | None]:
    """For each client turn, the engine record of the same prompt length that arrived in its window.

    The seed mints its own request ids, so ids can't link the two sides; a prompt length (unique
    per conversation by construction, see devtools.workload) plus "arrived between send and first
    token" does. Both sides read CLOCK_MONOTONIC of the same machine.
    """
    by_length: dict[int, list[dict]] = defaultdict(list)
    for record in sorted(records, key=lambda r: r["arrival"]):
        if record["outcome"] == "completed":
            by_length[record["prompt_tokens"]].append(record)
    found: list[dict | None] = []
    for turn in turns:
        pool = by_length.get(turn["prompt_tokens"], [])
        pick = next((r for r in pool if turn["sent"] <= r["arrival"] <= turn["first"]), None)
        if pick is not None:
            pool.remove(pick)
        found.append(pick)
    return found


def engine_ttft(prefill: dict | None, decode: dict) -> float:
    """Seconds of a turn's TTFT spent inside the engines: P's whole request, then D's prefill."""
    return (decode["prefill_ms"] + (prefill["total_ms"] if prefill else 0.0)) / 1000


def added_ttft(m: Measured) -> tuple[list[float], float]:
    """Per-turn proxy-added TTFT (s), and the share of turns matched to engine records."""
    turns = m.load["turns"]
    decodes = match(turns, m.engine_records.get("decode", []))
    has_prefill = bool(m.engine_records.get("prefill"))  # the nginx relay never calls P
    prefills = match(turns, m.engine_records["prefill"]) if has_prefill else [None] * len(turns)
    added = [
        turn["first"] - turn["sent"] - engine_ttft(prefill, decode)
        for turn, prefill, decode in zip(turns, prefills, decodes, strict=True)
        if decode is not None and (prefill is not None or not has_prefill)
    ]
    return added, len(added) / len(turns) if turns else 0.0


def added_itl(turns: list[dict], itl_ms: float) -> float:
    """Mean gap between content deltas at the client minus the engine's configured gap (ms).

    D's own gaps can't be read per token, and its records' span includes its request parsing;
    the configured gap is the floor, and the nginx relay shows how much D itself overshoots it.
    """
    gaps = [
        (t["last"] - t["first"]) / (t["content_events"] - 1)
        for t in turns
        if t["content_events"] > 1
    ]
    return sum(gaps) / len(gaps) * 1000 - itl_ms if gaps else float("nan")


def summarize(m: Measured, itl_ms: float) -> dict:
    """One table row: the figures of issue 7 for one system at one concurrency."""
    turns = m.load["turns"]
    n = len(turns)
    elapsed = m.load["ended"] - m.load["started"]
    ttft = [t["first"] - t["sent"] for t in turns]
    added, matched = added_ttft(m)
    events = sum(t["events"] for t in turns)
    p, d = m.engine_stats.get("prefill", {}), m.engine_stats["decode"]
    computed = p.get("computed_prompt_tokens", 0) + d["computed_prompt_tokens"]
    ideal = sum(t["ideal_computed"] for t in turns)
    ms = 1000.0
    return {
        "system": m.system,
        "conversations": m.conversations,
        "turns": n,
        "errors": len(m.load["errors"]),
        "first_error": (m.load["errors"] or [""])[0],
        "ttft_p50_ms": percentile(ttft, 50) * ms,
        "ttft_p99_ms": percentile(ttft, 99) * ms,
        "added_ttft_p50_ms": percentile(added, 50) * ms,
        "added_ttft_p99_ms": percentile(added, 99) * ms,
        "added_itl_ms": added_itl(turns, itl_ms),
        "matched": matched,
        "turns_per_s": n / elapsed if elapsed > 0 else 0.0,
        "events_per_core_s": events / m.proxy_cpu_s if m.proxy_cpu_s > 0 else float("nan"),
        "cpu_ms_per_turn": m.proxy_cpu_s / n * ms if n else float("nan"),
        "computed_tokens": computed,
        "ideal_tokens": ideal,
        "computed_over_ideal": computed / ideal if ideal else float("nan"),
        "pulled_per_turn": d["pulled_tokens"] / n if n else 0.0,
        "hit_rate": p.get("hits", 0) / n if n else 0.0,
        "proxy_cpu_s": m.proxy_cpu_s,
        "engine_cpu_s": m.engine_cpu_s,
        "client_cpu_s": m.load["cpu_s"],
        "elapsed_s": elapsed,
        "machine_busy": m.machine_busy,
        # The client's share of one core: near 100 % it, not the proxy, would set the pace.
        "client_core_share": m.load["cpu_s"] / elapsed if elapsed > 0 else float("nan"),
    }
