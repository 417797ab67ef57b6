"""Admission control under overload (`python -m bench.overload`): one gevent worker with
`--max-turns C` over the emulated engines, offered C, 2C and 5C conversations in flight (a
refused turn is sent again after its Retry-After, as the OpenAI SDK does), 5C whose clients
ignore Retry-After (again after ~0.1 s), and 5C without admission control.

Prints, per run: admitted turns and their TTFT p50/p99, refused turns and the time to their
429 (p50, p99, max, share within 50 ms), other errors, clients stuck at the end, and what the
gateway and D still hold afterwards. Writes bench/out/overload.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from bench.systems import ENGINE_TIMING, PROXY_HOST, Engines, quiet_ports
from devtools import ROOT, procstat
from devtools.processes import GatewayProcess


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_one(
    engines: Engines,
    label: str,
    offered: int,
    duration: float,
    out_dir: str,
    backoff: float,
    **settings,
) -> dict:
    port = quiet_ports(2)
    with GatewayProcess(
        [engines.prefill.url],
        [engines.decode.url],
        host=PROXY_HOST,
        port=port,
        workers=1,
        **settings,
    ) as gateway:
        out = os.path.join(out_dir, f"overload-{label}.json")
        tree = procstat.tree(gateway.process.pid)
        cpu_before = procstat.cpu_seconds(tree)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "bench.overload_client",
                "--url",
                gateway.url,
                "--concurrency",
                str(offered),
                "--duration",
                str(duration),
                "--salt",
                f"overload-{label}",
                "--out",
                out,
                "--backoff",
                str(backoff),
            ],
            check=True,
            timeout=duration + 200,
            cwd=ROOT,
        )
        cpu = procstat.cpu_seconds(tree) - cpu_before
        with open(out) as f:
            result = json.load(f)
        status = gateway.status()
    d = engines.decode.stats()
    turns, refused = result["turns"], result["refused"]
    ttft = [t["ttft"] * 1000 for t in turns]
    wait = [r["seconds"] * 1000 for r in refused]
    return {
        "run": label,
        "offered": offered,
        "admitted": len(turns),
        "ttft_p50_ms": _pct(ttft, 0.5),
        "ttft_p99_ms": _pct(ttft, 0.99),
        "hits": sum(t["hit"] for t in turns),
        "refused": len(refused),
        "refusal_p50_ms": _pct(wait, 0.5),
        "refusal_p99_ms": _pct(wait, 0.99),
        "refusal_max_ms": max(wait, default=float("nan")),
        "refused_within_50ms": sum(w <= 50 for w in wait),
        "retry_after": sorted({r["retry_after"] for r in refused}),
        "gateway_cpu_s": cpu,
        "errors": len(result["errors"]),
        "first_error": (result["errors"] or [""])[0],
        "stuck_clients": result["stuck"],
        "gateway_turns_in_flight_after": status.get("turns_in_flight"),
        "d_streams_in_flight_after": d["streams_in_flight"],
    }


COLUMNS = (
    "run",
    "offered",
    "admitted",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "hits",
    "refused",
    "refusal_p50_ms",
    "refusal_p99_ms",
    "refusal_max_ms",
    "refused_within_50ms",
    "gateway_cpu_s",
    "errors",
    "stuck_clients",
    "gateway_turns_in_flight_after",
    "d_streams_in_flight_after",
)


def table(rows: list[dict]) -> str:
    def cell(value) -> str:
        return f"{value:.1f}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(r[c]) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--capacity", type=int, default=16, help="--max-turns of the worker")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of load per run")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "out"))
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    c = args.capacity
    engines = Engines.start(**ENGINE_TIMING)
    rows = []
    try:
        limited = {"max_turns": c, "admission_queue": max(1, c // 4), "admission_wait": 0.01}
        plan = (
            ("1x", c, limited, 0.0),
            ("2x", 2 * c, limited, 0.0),
            ("5x", 5 * c, limited, 0.0),
            ("5x, clients ignore Retry-After (0.1 s)", 5 * c, limited, 0.1),
            ("5x, no admission control", 5 * c, {"max_turns": 100_000}, 0.0),
        )
        for n, (label, offered, settings, backoff) in enumerate(plan):
            engines.prefill.reset_stats()
            engines.decode.reset_stats()
            rows.append(
                run_one(engines, f"run{n}", offered, args.duration, args.out, backoff, **settings)
            )
            rows[-1]["run"] = label
            print(table(rows[-1:]), flush=True)
    finally:
        engines.stop()
    base = rows[0]["ttft_p99_ms"]
    print("\n" + table(rows))
    for row in rows[1:]:
        print(f"{row['run']}: admitted TTFT p99 {row['ttft_p99_ms'] / base:.2f}x the 1x run's")
    with open(os.path.join(args.out, "overload.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
