"""Bounded headless load run: emulated P and D, the gateway under gunicorn, locust's chat users."""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from devtools import ROOT
from devtools.locust_runs import run_locust


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--users", type=int, default=300)
    parser.add_argument("--spawn-rate", type=float, default=50, help="users started per second")
    parser.add_argument("--duration", default="60s", help="locust -t, e.g. 60s or 2m")
    parser.add_argument("--turns", type=int, default=5, help="turns per conversation")
    parser.add_argument(
        "--workload",
        default="short",
        choices=("short", "long"),
        help="the locustfile's: short replies P recomputes, long ones it reads",
    )
    parser.add_argument("--max-tokens", type=int, help="default: the workload's")
    parser.add_argument("--think", type=float, nargs=2, default=(0.5, 1.5), metavar=("MIN", "MAX"))
    parser.add_argument("--itl-ms", type=float, default=10, help="emulated inter-token latency")
    parser.add_argument("--workers", type=int, default=1, help="gateway gunicorn workers")
    parser.add_argument("--worker-class", default="gevent", choices=("gevent", "gthread"))
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(ROOT) / "bench" / "out" / "load",
        help="directory for locust's CSV files",
    )
    args = parser.parse_args(argv)

    from devtools.processes import GatewayProcess
    from emulator.process import EmulatorProcess

    with contextlib.ExitStack() as stack:
        # Distinct loopback addresses: D reaches P only through the gateway's remote_host rewrite.
        p = stack.enter_context(
            EmulatorProcess(
                "prefill", bidirectional_kv_xfer=True, host="127.0.0.2", itl_ms=args.itl_ms
            )
        )
        d = stack.enter_context(
            EmulatorProcess(
                "decode", bidirectional_kv_xfer=True, host="127.0.0.3", itl_ms=args.itl_ms
            )
        )
        gateway = stack.enter_context(
            GatewayProcess(
                [p.url],
                [d.url],
                workers=args.workers,
                worker_class=args.worker_class,
                log_level="warning",
            )
        )
        print(
            f"gateway {gateway.url} ({args.workers} {args.worker_class} worker(s)), "
            f"P {p.url}, D {d.url}, itl {args.itl_ms} ms; "
            f"{args.users} users for {args.duration}",
            flush=True,
        )
        result = run_locust(
            gateway.url,
            args.users,
            args.spawn_rate,
            args.duration,
            args.out / "locust",
            [
                "--turns",
                str(args.turns),
                "--workload",
                args.workload,
                *(["--max-tokens", str(args.max_tokens)] if args.max_tokens else []),
                "--think",
                *map(str, args.think),
            ],
        )
        prefill = p.stats()
    print(f"turns {result.turns}  failures {result.failures}  turns/s {result.turns_per_s:.1f}")
    print(
        f"turn (to [DONE]): p50 {result.turn_p50} ms  "
        f"time to first token: p50 {result.ttft_p50} ms  p99 {result.ttft_p99} ms  "
        f"time per output token: p50 {result.tpot_p50} ms"
    )
    print(
        f"P: {prefill['hits']} KV hits of {prefill['requests']} prefills, "
        f"wrong reuse {prefill['wrong_reuse']}"
    )
    print(f"CSV files: {args.out}")
    for line in result.problems:
        print("problem:", line)
    return 0 if result.ok and prefill["wrong_reuse"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
