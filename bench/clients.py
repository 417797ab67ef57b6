"""What the benchmark's load generators (bench.loadgen, bench.sdk_load) share: their command
line and their results file. (Nothing here imports gevent: bench.sdk_load runs threads.)"""

from __future__ import annotations

import argparse
import json
import resource
import time


def arguments(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--url", required=True)
    parser.add_argument("--concurrency", type=int, required=True, help="conversations in flight")
    parser.add_argument("--conversations", type=int, required=True, help="in all")
    parser.add_argument("--turns", type=int, required=True)
    parser.add_argument("--duration", type=float, required=True, help="no turn starts after this")
    parser.add_argument("--salt", required=True)
    parser.add_argument("--ids", action="store_true", help="send conversation_id and X-Session-ID")
    parser.add_argument(
        "--history-bytes",
        type=int,
        default=0,
        help="start each conversation from this much earlier history (growth runs)",
    )
    parser.add_argument("--out", required=True)
    return parser


def write_results(path: str, started: float, turns: list[dict], errors: list[str]) -> None:
    """The run's turns and errors, and the client's own CPU (bench.measure reads them)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    with open(path, "w") as out:
        json.dump(
            {
                "started": started,
                "ended": time.monotonic(),
                "turns": turns,
                "errors": errors,
                "cpu_s": usage.ru_utime + usage.ru_stime,
            },
            out,
        )
