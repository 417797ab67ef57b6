"""Bounded headless load run: emulated P and D, the gateway under gunicorn, locust's chat users."""
from __future__ import annotations

import argparse
import contextlib
import csv
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCUSTFILE = ROOT / "locustfile.py"
# The locustfile's rows (not imported: importing locust patches this process with gevent)
CHAT_ROW = ("POST", "chat turn")
TTFT = ("TTFT", "time to first token")
TPOT = ("TPOT", "time per output token")


@dataclass
class LoadResult:
    """What one locust run measured, read back from its CSV files."""

    returncode: int
    turns: int = 0                 # streamed chat turns sent
    failures: int = 0              # failed turns plus errors raised inside users
    turns_per_s: float = 0.0
    turn_p50: float | None = None  # ms, a whole turn (to its [DONE])
    ttft_p50: float | None = None
    ttft_p99: float | None = None
    tpot_p50: float | None = None
    stats: dict = field(default_factory=dict)     # locust's stats rows by (Type, Name)
    problems: list = field(default_factory=list)  # failure and exception lines

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.failures == 0 and self.turns > 0


def run_locust(host: str, users: int, spawn_rate: float, duration: str, csv_prefix: Path,
               extra: list[str] = (), timeout: float = 600,
               locustfile: Path = LOCUSTFILE) -> LoadResult:
    """Run `locustfile` headless and bounded against `host`, from its own directory, and read
    its CSV output.

    locust runs in its own process: it monkey-patches the whole interpreter with gevent.
    `--stop-timeout` lets turns in flight at the deadline finish instead of being cut.
    """
    csv_prefix.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "locust", "-f", str(locustfile), "--headless",
               "--host", host, "-u", str(users), "-r", str(spawn_rate), "-t", duration,
               "--stop-timeout", "10", "--only-summary", "--csv", str(csv_prefix),
               "--loglevel", "WARNING", *extra]
    # Not check=True: a failed run (locust exits 1 on any failure) is read like a good one.
    done = subprocess.run(command, cwd=locustfile.parent, timeout=timeout,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
    result = LoadResult(done.returncode)
    rows = result.stats = {(r["Type"], r["Name"]): r for r in _rows(csv_prefix, "stats")}
    chat = rows.get(CHAT_ROW)
    if chat:
        result.turns = int(chat["Request Count"])
        result.failures = int(chat["Failure Count"])
        result.turns_per_s = float(chat["Requests/s"])
        result.turn_p50 = _ms(chat["50%"])
    ttft = rows.get(TTFT)
    if ttft:
        result.ttft_p50, result.ttft_p99 = _ms(ttft["50%"]), _ms(ttft["99%"])
    if TPOT in rows:
        result.tpot_p50 = _ms(rows[TPOT]["50%"])
    result.problems = [f"{r['Occurrences']} x {r['Name']}: {r['Error']}"
                       for r in _rows(csv_prefix, "failures")]
    exceptions = _rows(csv_prefix, "exceptions")
    result.failures += sum(int(r["Count"]) for r in exceptions)
    result.problems += [f"{r['Count']} x exception {r['Message']}" for r in exceptions]
    if done.returncode != 0 and not result.problems:
        result.problems.append(done.stdout[-3000:])
    return result


def _rows(prefix: Path, kind: str) -> list[dict]:
    path = Path(f"{prefix}_{kind}.csv")
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _ms(value: str) -> float | None:
    return None if value in ("", "N/A") else float(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--users", type=int, default=300)
    parser.add_argument("--spawn-rate", type=float, default=50, help="users started per second")
    parser.add_argument("--duration", default="60s", help="locust -t, e.g. 60s or 2m")
    parser.add_argument("--turns", type=int, default=5, help="turns per conversation")
    parser.add_argument("--workload", default="short", choices=("short", "long"),
                        help="the locustfile's: short replies P recomputes, long ones it reads")
    parser.add_argument("--max-tokens", type=int, help="default: the workload's")
    parser.add_argument("--think", type=float, nargs=2, default=(0.5, 1.5), metavar=("MIN", "MAX"))
    parser.add_argument("--itl-ms", type=float, default=10, help="emulated inter-token latency")
    parser.add_argument("--workers", type=int, default=1, help="gateway gunicorn workers")
    parser.add_argument("--worker-class", default="gevent", choices=("gevent", "gthread"))
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "load",
                        help="directory for locust's CSV files")
    args = parser.parse_args(argv)

    from emulator.process import EmulatorProcess
    from devtools.processes import GatewayProcess

    with contextlib.ExitStack() as stack:
        # Distinct loopback addresses: D reaches P only through the gateway's remote_host rewrite.
        p = stack.enter_context(EmulatorProcess("prefill", bidirectional_kv_xfer=True, host="127.0.0.2", itl_ms=args.itl_ms))
        d = stack.enter_context(EmulatorProcess("decode", bidirectional_kv_xfer=True, host="127.0.0.3", itl_ms=args.itl_ms))
        gateway = stack.enter_context(GatewayProcess(
            [p.url], [d.url], workers=args.workers, worker_class=args.worker_class,
            log_level="warning"))
        print(f"gateway {gateway.url} ({args.workers} {args.worker_class} worker(s)), "
              f"P {p.url}, D {d.url}, itl {args.itl_ms} ms; "
              f"{args.users} users for {args.duration}", flush=True)
        result = run_locust(gateway.url, args.users, args.spawn_rate, args.duration,
                            args.out / "locust",
                            ["--turns", str(args.turns), "--workload", args.workload,
                             *(["--max-tokens", str(args.max_tokens)] if args.max_tokens else []),
                             "--think", *map(str, args.think)])
        prefill = p.stats()
    print(f"turns {result.turns}  failures {result.failures}  "
          f"turns/s {result.turns_per_s:.1f}")
    print(f"turn (to [DONE]): p50 {result.turn_p50} ms  "
          f"time to first token: p50 {result.ttft_p50} ms  p99 {result.ttft_p99} ms  "
          f"time per output token: p50 {result.tpot_p50} ms")
    print(f"P: {prefill['hits']} KV hits of {prefill['requests']} prefills, "
          f"wrong reuse {prefill['wrong_reuse']}")
    print(f"CSV files: {args.out}")
    for line in result.problems:
        print("problem:", line)
    return 0 if result.ok and prefill["wrong_reuse"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
