"""locust runs, bounded and headless, read back from their CSV files: `make load` (bench.load) and
tests/test_load_short.py run locustfile.py through it."""

from __future__ import annotations

import csv
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from devtools import ROOT

LOCUSTFILE = Path(ROOT) / "locustfile.py"
# The locustfile's rows (not imported: importing locust patches this process with gevent)
CHAT_ROW = ("POST", "chat turn")
TTFT = ("TTFT", "time to first token")
TPOT = ("TPOT", "time per output token")


@dataclass
class LoadResult:
    """What one locust run measured, read back from its CSV files."""

    returncode: int
    turns: int = 0  # streamed chat turns sent
    failures: int = 0  # failed turns plus errors raised inside users
    turns_per_s: float = 0.0
    turn_p50: float | None = None  # ms, a whole turn (to its [DONE])
    ttft_p50: float | None = None
    ttft_p99: float | None = None
    tpot_p50: float | None = None
    stats: dict = field(default_factory=dict)  # locust's stats rows by (Type, Name)
    problems: list = field(default_factory=list)  # failure and exception lines

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.failures == 0 and self.turns > 0


def run_locust(
    host: str,
    users: int,
    spawn_rate: float,
    duration: str,
    csv_prefix: Path,
    extra: Sequence[str] = (),
    timeout: float = 600,
    locustfile: Path = LOCUSTFILE,
) -> LoadResult:
    """Run `locustfile` headless and bounded against `host`, from its own directory, and read
    its CSV output.

    locust runs in its own process: it monkey-patches the whole interpreter with gevent.
    `--stop-timeout` lets turns in flight at the deadline finish instead of being cut.
    """
    csv_prefix.parent.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(locustfile),
        "--headless",
        "--host",
        host,
        "-u",
        str(users),
        "-r",
        str(spawn_rate),
        "-t",
        duration,
        "--stop-timeout",
        "10",
        "--only-summary",
        "--csv",
        str(csv_prefix),
        "--loglevel",
        "WARNING",
        *extra,
    ]
    # Not check=True: a failed run (locust exits 1 on any failure) is read like a good one.
    done = subprocess.run(
        command,
        cwd=locustfile.parent,
        timeout=timeout,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        check=False,
    )
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
    result.problems = [
        f"{r['Occurrences']} x {r['Name']}: {r['Error']}" for r in _rows(csv_prefix, "failures")
    ]
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
