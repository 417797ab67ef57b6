"""Where a turn's CPU goes: one gateway worker under the benchmark's load, sampled by py-spy.

    .venv/bin/python -m bench.profile --worker-class gevent --concurrency 16
    .venv/bin/python -m bench.profile --worker-class gthread --concurrency 16 --svg /tmp/g.svg

Starts the benchmark's engines and one gateway worker, warms it up, then runs the same load
twice: once unobserved (CPU ms per turn from /proc: the figure to compare) and once under
`py-spy record --nonblocking` (the shares). Each sample goes to the room of the innermost frame
that names one (below), so "relay" is the relay's own Python and "relay: write" the server's
write under it. Prints one table: room, share of the worker's samples, ms per turn.
"""

from __future__ import annotations

import argparse
import collections
import os
import pstats
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from bench.measure import Load, run_load
from bench.metrics import summarize
from bench.systems import ENGINE_TIMING, PROXY_HOST, Engines, Running, System, start
from devtools import procstat
from devtools.processes import GatewayProcess, Mount

CPROFILE_ENV = "BENCH_CPROFILE"  # where bench.gunicorn_cprofile writes the worker's stats

# Rooms by marks on frames ("function (path:line)"). A sample goes to the room of its innermost
# frame that names a specific room (so a socket send under the P call is the P call's, and the
# relay's own Python is "relay" while the server's write of its bytes is "relay: write"); else to
# "service" if any gateway frame is on the stack, else to the innermost of Flask and the server,
# else to gevent's hub (its loop and callbacks: waking greenlets), else "other".
SPECIFIC: list[tuple[str, tuple[str, ...]]] = [
    (
        "watcher",
        (
            "Watch._run (",
            "Watch.__init__ (",
            "Watch.stop (",
            "Watch._arm (",
            "Watch._tick (",
            "Watch._readable (",
        ),
    ),
    ("metrics", ("prometheus_client/",)),
    ("logging", ("logging/", "gateway/support/logs.py")),
    ("relay: write", ("write (gunicorn/", "write_chunk (gunicorn/", "sendall (gunicorn/")),
    ("relay: D read", ("Stream.chunks (gateway/engines/upstream.py",)),
    ("parse", ("gateway/parse.py", "_read_body (gateway/views.py")),
    ("identity", ("gateway/reuse/conversation.py",)),
    ("store", ("gateway/reuse/store/",)),
    ("exactness", ("gateway/reuse/exactness.py",)),
    ("P call", ("Disagg._prefill (gateway/flow/disagg.py",)),
    ("D call (open)", ("Upstream.open_stream (",)),
    ("relay", ("gateway/flow/reply.py", "gateway/flow/sse.py", "gateway/flow/decoded.py")),
    ("admission", ("gateway/front/admission.py",)),
]
GENERIC = [("Flask", ("flask/", "werkzeug/")), ("server", ("gunicorn/",))]


def _named(frame: str, rooms) -> str | None:
    for room, marks in rooms:
        if any(mark in frame for mark in marks):
            return room
    return None


def room_of(stack: list[str]) -> str:
    for frame in reversed(stack):  # innermost first
        room = _named(frame, SPECIFIC)
        if room is not None:
            return room
    if any("gateway/" in frame for frame in stack):
        return "service"
    for frame in reversed(stack):
        room = _named(frame, GENERIC)
        if room is not None:
            return room
    return "gevent hub" if any("gevent/" in frame for frame in stack) else "other"


def shares(raw_path: str) -> tuple[collections.Counter, int]:
    """Samples per room from py-spy's raw (collapsed) output."""
    rooms: collections.Counter = collections.Counter()
    total = 0
    with open(raw_path) as f:
        for line in f:
            stack_text, _, count = line.rstrip("\n").rpartition(" ")
            if not stack_text:
                continue
            n = int(count)
            total += n
            rooms[room_of(stack_text.split(";"))] += n
    return rooms, total


def start_profiled(options: dict, engines: Engines, stats_path: str) -> Running:
    """The gateway under bench.gunicorn_cprofile: cProfile in its worker until it exits."""
    gateway = GatewayProcess(
        [engines.prefill.url],
        [engines.decode.url],
        host=PROXY_HOST,
        mount=Mount(
            "gateway.wsgi:app", "python:bench.gunicorn_cprofile", env={CPROFILE_ENV: stats_path}
        ),
        **{k: v for k, v in options.items() if k != "workers"},
    )
    return Running(gateway.url, gateway.process, gateway.stop)


def print_calls(stats_path: str, turns: int, top: int) -> None:
    """Python function calls per turn: all of them, by module, and the most called."""
    stats = pstats.Stats(stats_path).stats
    by_function, by_module = collections.Counter(), collections.Counter()
    for (path, line, name), (_, calls, *_rest) in stats.items():
        where = path.split("site-packages/")[-1].split("python3.11/")[-1]
        label = name if where == "~" else f"{where}:{line}({name})"
        by_function[label] += calls / turns
        by_module["builtins" if where == "~" else where] += calls / turns
    print(f"{sum(by_function.values()):.0f} Python function calls per turn ({turns} turns)")
    print("by module:")
    for module, n in by_module.most_common(top):
        print(f"  {n:8.1f}  {module}")
    print("by function:")
    for label, n in by_function.most_common(top):
        print(f"  {n:8.1f}  {label}")


def count_syscalls(
    worker: int, system: System, running, engines: Engines, load: Load, out_dir: str
) -> None:
    """System calls per turn of the worker (all its threads), by `strace -c` over one run."""
    summary = os.path.join(out_dir, "strace.txt")
    tracer = subprocess.Popen(
        ["strace", "-c", "-f", "-o", summary, "-p", str(worker)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    observed = run_load(system.label, running, engines, load, "traced", out_dir)
    tracer.send_signal(2)
    tracer.wait(30)
    turns = max(1, len(observed.load["turns"]))
    print(f"traced: {turns} turns; calls per turn:")
    with open(summary) as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 5 and fields[3].isdigit():
                print(f"  {fields[-1]:<16} {int(fields[3]) / turns:8.1f}")


def worker_pid(master: int) -> int:
    workers = procstat.children(master)
    if len(workers) != 1:
        raise SystemExit(f"expected one worker under {master}, found {workers}")
    return workers[0]


@dataclass
class Profile:
    """One worker under one load: the unobserved figures, and py-spy's samples by room."""

    row: dict  # bench.metrics.summarize of the unobserved run
    user_ms: float  # the worker's user and system CPU per turn (same run)
    system_ms: float
    rooms: collections.Counter  # samples per room of the observed run
    samples: int

    def ms(self, room: str) -> float:
        return self.row["cpu_ms_per_turn"] * self.rooms[room] / max(1, self.samples)


def sample(
    worker: int,
    label: str,
    running: Running,
    engines: Engines,
    load: Load,
    out_dir: str,
    rate: int,
    raw: str,
    svg: str | None = None,
    native: bool = False,
    perf: bool = False,
) -> tuple[collections.Counter, int]:
    """py-spy on the worker during one more run of `load`: samples per room (with `perf`,
    perf record into `raw` instead, and no rooms)."""
    spy = [
        os.path.join(os.path.dirname(sys.executable), "py-spy"),
        "record",
        "--pid",
        str(worker),
        "--rate",
        str(rate),
        "--format",
        "raw",
        "--output",
        raw,
        *(["--native"] if native else ["--nonblocking"]),
    ]
    if perf:
        spy = ["perf", "record", "-e", "cpu-clock", "-g", "-p", str(worker), "-o", raw]
    spies = [subprocess.Popen(spy, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    if svg:
        spies.append(
            subprocess.Popen(
                [*spy[: spy.index("--format")], "--output", svg],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    run_load(label, running, engines, load, "observed", out_dir)
    for spy_proc in spies:
        spy_proc.send_signal(2)
        spy_proc.wait(30)
    return (collections.Counter(), 0) if perf else shares(raw)


def measure(
    system: System,
    engines: Engines,
    load: Load,
    out_dir: str,
    rate: int,
    raw: str | None = None,
    svg: str | None = None,
    native: bool = False,
    perf: bool = False,
) -> Profile:
    """Start `system`, warm it up, run `load` unobserved, then (rate > 0) under py-spy."""
    running = start(system, engines, out_dir)
    try:
        worker = worker_pid(running.pid)
        run_load(
            system.label,
            running,
            engines,
            Load(load.concurrency, load.concurrency, 2, 10, load.ids),
            "warm",
            out_dir,
        )
        user0, system0 = procstat.cpu_split(worker)
        plain = run_load(system.label, running, engines, load, "plain", out_dir)
        user1, system1 = procstat.cpu_split(worker)
        row = summarize(plain, ENGINE_TIMING["itl_ms"])
        turns = max(1, row["turns"])
        rooms, total = (
            sample(
                worker,
                system.label,
                running,
                engines,
                load,
                out_dir,
                rate,
                raw or os.path.join(out_dir, "stacks.txt"),
                svg,
                native,
                perf,
            )
            if rate
            else (collections.Counter(), 0)
        )
        return Profile(
            row, 1000 * (user1 - user0) / turns, 1000 * (system1 - system0) / turns, rooms, total
        )
    finally:
        running.stop()


def gateway_system(
    worker_class: str, concurrency: int, ids: bool = True, options: dict | None = None
) -> System:
    settings = {"workers": 1, "worker_class": worker_class, **(options or {})}
    if worker_class == "gthread":
        settings.setdefault("threads", max(64, 2 * concurrency))
    return System(f"gw {worker_class} x1", "gateway", ids, settings)


def room_table(profiles: dict[str, Profile]) -> str:
    """Markdown: per room, each profile's ms per turn and share; rooms in the first's order."""
    first = next(iter(profiles.values()))
    rooms = [room for room, _ in first.rooms.most_common()]
    rooms += sorted({r for p in profiles.values() for r in p.rooms} - set(rooms))
    head = "| room | " + " | ".join(f"{label} ms/turn | share" for label in profiles) + " |"
    lines = [head, "|---|" + "---|---|" * len(profiles)]
    for room in rooms:
        cells = " | ".join(
            f"{p.ms(room):.2f} | {100 * p.rooms[room] / max(1, p.samples):.0f}%"
            for p in profiles.values()
        )
        lines.append(f"| {room} | {cells} |")
    lines.append(
        "| **all** (unobserved run, /proc) | "
        + " | ".join(f"**{p.row['cpu_ms_per_turn']:.2f}** | 100%" for p in profiles.values())
        + " |"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker-class", default="gevent", choices=("gevent", "gthread"))
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--conversations", type=int, default=0, help="default 2x concurrency")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--duration", type=float, default=30)
    parser.add_argument("--history-bytes", type=int, default=0)
    parser.add_argument("--no-ids", action="store_true")
    parser.add_argument(
        "--reply-words",
        type=int,
        default=0,
        help="max_tokens of every turn (default: the benchmark's 32); two runs "
        "at different lengths separate per-event from per-turn CPU",
    )
    parser.add_argument(
        "--rate",
        type=int,
        default=250,
        help="py-spy samples per second (0: no sampling, the unobserved figures only)",
    )
    parser.add_argument("--svg", help="also write a flame graph here")
    parser.add_argument(
        "--native",
        action="store_true",
        help="py-spy --native: C frames too (libev, greenlet, the interpreter)",
    )
    parser.add_argument(
        "--calls",
        metavar="N",
        type=int,
        default=0,
        help="instead of sampling, run the worker under cProfile and print the "
        "N functions called most per turn (exact counts)",
    )
    parser.add_argument(
        "--perf",
        metavar="PATH",
        help="instead of py-spy, `perf record -e cpu-clock` the worker into PATH "
        "(C and kernel time too: the interpreter, gevent's loop, the GC)",
    )
    parser.add_argument(
        "--strace",
        action="store_true",
        help="count the worker's system calls per turn instead of sampling",
    )
    parser.add_argument("--raw", help="keep py-spy's collapsed stacks here")
    parser.add_argument(
        "--option", action="append", default=[], help="extra gateway setting NAME=VALUE"
    )
    args = parser.parse_args(argv)
    if args.reply_words:
        os.environ["BENCH_REPLY_WORDS"] = str(args.reply_words)  # read by the load generator
    system = gateway_system(
        args.worker_class,
        args.concurrency,
        not args.no_ids,
        dict(item.partition("=")[::2] for item in args.option),
    )
    out_dir = tempfile.mkdtemp(prefix="pd-profile-")
    load = Load(
        args.concurrency,
        args.conversations or 2 * args.concurrency,
        args.turns,
        args.duration,
        not args.no_ids,
        args.history_bytes,
    )
    engines = Engines.start(**ENGINE_TIMING)
    try:
        if args.calls or args.strace:
            return exact_counts(args, system, engines, load, out_dir)
        profile = measure(
            system,
            engines,
            load,
            out_dir,
            args.rate or bool(args.perf),
            args.perf or args.raw,
            args.svg,
            args.native,
            bool(args.perf),
        )
        print(unobserved(profile))
        if args.perf:
            return print(f"perf data in {args.perf}: perf report -i {args.perf} --no-children")
        if profile.samples:
            print(f"observed: {profile.samples} samples\n")
            print(room_table({system.label: profile}))
    finally:
        engines.stop()


def unobserved(profile: Profile) -> str:
    row = profile.row
    return (
        f"unobserved: {row['turns']} turns, {row['errors']} errors, hits "
        f"{100 * row['hit_rate']:.0f}%, CPU {row['cpu_ms_per_turn']:.2f} ms/turn, events/s/core "
        f"{row['events_per_core_s']:.0f}, added TTFT p50 {row['added_ttft_p50_ms']:.1f} ms, "
        f"TTFT p50 {row['ttft_p50_ms']:.1f} ms; the worker's user/system CPU "
        f"{profile.user_ms:.2f}/{profile.system_ms:.2f} ms/turn"
    )


def exact_counts(
    args: argparse.Namespace, system: System, engines: Engines, load: Load, out_dir: str
) -> None:
    """--calls (cProfile in the worker) or --strace (system calls of the worker)."""
    stats_path = os.path.join(out_dir, "worker.prof")
    running = (
        start_profiled(system.options, engines, stats_path)
        if args.calls
        else start(system, engines, out_dir)
    )
    try:
        worker = worker_pid(running.pid)
        run_load(
            system.label,
            running,
            engines,
            Load(load.concurrency, load.concurrency, 2, 10, load.ids),
            "warm",
            out_dir,
        )
        if args.strace:
            return count_syscalls(worker, system, running, engines, load, out_dir)
        plain = run_load(system.label, running, engines, load, "plain", out_dir)
    finally:
        running.stop()
    print_calls(stats_path, len(plain.load["turns"]) + 2 * load.concurrency, args.calls)


if __name__ == "__main__":
    main()
