"""`make bench`: gateway configurations, the seed proxy, vllm-router, an nginx relay and a bare
Flask relay over the same engines."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from importlib.metadata import version

from bench import growth, history_cost, profile, report, reuse, turn_budget, venvs
from bench.measure import Load, run_load
from bench.metrics import summarize
from bench.provenance import machine, revision
from bench.systems import ENGINE_TIMING, Engines, System, nginx_binary, start
from devtools import ROOT
from devtools.workload import REPLY_WORDS

GTHREADS = 256  # one thread per stream: enough for 256 conversations in one worker
# Admission control (--max-turns) must admit the whole offered load: 256 turns in flight in one
# worker, and with four workers each owner's share of them (rendezvous hashing is uneven), with
# the spare threads gthread needs to answer refusals and probes.
GTHREAD_X1 = {"threads": GTHREADS + GTHREADS // 4, "max_turns": GTHREADS}
GTHREAD_X4 = {"threads": GTHREADS // 2, "max_turns": GTHREADS * 3 // 8}

SYSTEMS = {
    "gw-gevent-1": System("gw gevent x1", "gateway", True, {"workers": 1}),
    "gw-gthread-1": System(
        "gw gthread x1", "gateway", True, {"workers": 1, "worker_class": "gthread", **GTHREAD_X1}
    ),
    "gw-gevent-4": System("gw gevent x4", "gateway", True, {"workers": 4}),
    "gw-gthread-4": System(
        "gw gthread x4", "gateway", True, {"workers": 4, "worker_class": "gthread", **GTHREAD_X4}
    ),
    "gw-redis-4": System(
        "gw gevent x4, Redis store", "gateway", True, {"workers": 4, "store": "redis"}
    ),
    "gw-redis-cluster-4": System(
        "gw gevent x4, Redis Cluster", "gateway", True, {"workers": 4, "store": "redis-cluster"}
    ),
    "gw-noid-1": System("gw gevent x1, no ids", "gateway", False, {"workers": 1}),
    "gw-noid-4": System("gw gevent x4, no ids", "gateway", False, {"workers": 4}),
    "seed": System("seed", "seed", True),
    "seed-noid": System("seed, no ids", "seed", False),
    "vllm-router": System("vllm-router", "router", True),
    # No tokenize requests to the engines (nothing to choose between with one P and one D).
    "vllm-router-rr": System(
        "vllm-router, round_robin", "router", True, {"argv": ("--policy", "round_robin")}
    ),
    "nginx": System("nginx -> D only", "nginx", True),
    # The design's floor (bench.flask_relay; bench.turn_budget reads the gateway against it).
    "flask": System("Flask relay -> D only", "flask", True),
}


@dataclass(frozen=True)
class Plan:
    name: str
    systems: tuple[str, ...]
    concurrencies: tuple[int, ...]
    turns: int
    duration: float  # no turn starts after this many seconds
    min_conversations: int  # low concurrencies run more conversations back to back
    growth: growth.GrowthPlan
    reuse: tuple = ()  # (scenarios, reply lengths) of bench.reuse
    turn_budget: tuple[str, ...] = ()  # bench.turn_budget's arguments; () skips it


QUICK = Plan(
    "quick",
    (
        "gw-gevent-1",
        "gw-gthread-1",
        "gw-gevent-4",
        "gw-redis-4",
        "gw-noid-1",
        "seed",
        "vllm-router",
        "nginx",
        "flask",
    ),
    (8, 64, 256),
    turns=5,
    duration=2,
    min_conversations=8,
    growth=growth.QUICK,
    reuse=((reuse.SCENARIOS[0], reuse.SCENARIOS[2]), (32,)),
)
FULL = Plan(
    "full",
    tuple(SYSTEMS),
    (8, 64, 256),
    turns=8,
    duration=60,
    min_conversations=32,
    growth=growth.FULL,
    reuse=(reuse.SCENARIOS, reuse.REPLIES),
    turn_budget=("--concurrency", "8,64"),
)


def available(plan: Plan, notes: list[str]) -> list[System]:
    """The plan's systems that can run here; what is skipped goes into the notes."""
    missing = set()
    for kind, name, problem in (
        ("seed", "The seed", venvs.seed_problem()),
        ("router", "vllm-router", venvs.ROUTER.ensure()),
    ):
        if problem:
            notes.append(f"{name} was skipped: {problem}.")
            missing.add(kind)
    if nginx_binary() is None:
        notes.append(
            "nginx was skipped: not installed and not installable here (needs root and apt)."
        )
        missing.add("nginx")
    return [SYSTEMS[key] for key in plan.systems if SYSTEMS[key].kind not in missing]


def matrix(
    plan: Plan, systems: list[System], engines: Engines, out_dir: str, notes: list[str]
) -> list[dict]:
    rows = []
    for index, system in enumerate(systems):
        try:
            running = start(system, engines, out_dir)
        except RuntimeError as exc:  # did not come up: say so, and measure the others
            notes.append(f"`{system.label}` did not start: {str(exc)[:300]}")
            continue
        try:
            for conc in plan.concurrencies:
                load = Load(
                    conc, max(conc, plan.min_conversations), plan.turns, plan.duration, system.ids
                )
                measured = run_load(
                    system.label, running, engines, load, f"{plan.name}{index}c{conc}", out_dir
                )
                row = summarize(measured, ENGINE_TIMING["itl_ms"])
                rows.append(row)
                print(
                    f"{row['system']:>22} x{conc:<3} {row['turns']:5} turns "
                    f"{row['errors']:4} errors "
                    f"TTFT p50 {row['ttft_p50_ms']:6.0f} ms  {row['turns_per_s']:6.1f} turns/s  "
                    f"{row['cpu_ms_per_turn']:5.2f} CPU ms/turn",
                    flush=True,
                )
        finally:
            running.stop()
    return rows


def versions() -> str:
    ours = ", ".join(f"{p} {version(p)}" for p in ("flask", "gunicorn", "gevent", "requests"))
    seed, router = (
        ", ".join(f"{p} {v}" for p, v in venv.versions().items()) or "not installed"
        for venv in (venvs.SEED, venvs.ROUTER)
    )
    nginx = nginx_binary()
    nginx_version = (
        subprocess.run([nginx, "-v"], capture_output=True, text=True).stderr.strip()
        if nginx
        else "not installed"
    )
    return (
        f"Python {platform.python_version()}; gateway: {ours}; seed venv: {seed} "
        f"(plain uvicorn: asyncio loop and h11, as `pip install fastapi uvicorn httpx` gives); "
        f"router venv: {router}; {nginx_version}"
    )


def cpu_rooms(plan: Plan, engines: Engines, out_dir: str, notes: list[str]) -> str:
    """bench.profile's room table for one gevent and one gthread worker (full plan; the quick
    one measures CPU per turn only)."""
    spy = shutil.which("py-spy", path=os.path.dirname(sys.executable))
    rate = 500 if spy and plan.name == "full" else 0
    if not rate:
        notes.append(
            "The room table was not sampled ("
            + ("quick plan" if spy else "py-spy is not installed")
            + "): CPU per turn only."
        )
    load = Load(16, 32, plan.turns, plan.duration)
    profiles = {
        f"gw {wc} x1": profile.measure(profile.gateway_system(wc, 16), engines, load, out_dir, rate)
        for wc in ("gevent", "gthread")
    }
    return profile.room_table(profiles)


def per_turn_budget(plan: Plan, notes: list[str]) -> str:
    """bench.turn_budget's tables (on engines of its own: the floor and one gateway worker);
    if it fails, a note says why and the rest of the run is written all the same."""
    if not plan.turn_budget:
        return f"(Not measured by the {plan.name} plan: `python -m bench.turn_budget`.)"
    try:
        return turn_budget.tables([turn_budget.run(turn_budget.arguments(list(plan.turn_budget)))])
    except (RuntimeError, OSError, subprocess.SubprocessError, ValueError, KeyError) as exc:
        notes.append(f"bench.turn_budget failed: {type(exc).__name__}: {str(exc)[:300]}")
        return "(bench.turn_budget failed in this run: see the notes at the end.)"


def history_systems(systems: list[System]) -> list[System]:
    """The history runs' systems whose kind the plan could start (the seed, vllm-router)."""
    kinds = {s.kind for s in systems}
    return [s for s in growth.HISTORY_SYSTEMS if s.kind == "gateway" or s.kind in kinds]


def partial(plan: Plan, args: argparse.Namespace) -> None:
    """A few systems at a few concurrencies, for work in progress: tables printed, no doc."""
    keys = args.systems.split(",") if args.systems else list(plan.systems)
    unknown = [k for k in keys if k not in SYSTEMS]
    if unknown:
        raise SystemExit(f"unknown systems {unknown}; known: {', '.join(SYSTEMS)}")
    concurrencies = (
        tuple(int(c) for c in args.concurrency.split(","))
        if args.concurrency
        else plan.concurrencies
    )
    plan = replace(plan, systems=tuple(keys), concurrencies=concurrencies)
    os.makedirs(args.out, exist_ok=True)
    notes: list[str] = []
    systems = available(plan, notes)
    engines = Engines.start(**ENGINE_TIMING)
    try:
        if args.history:
            history = growth.history_growth(
                plan.growth, history_systems(systems), engines, args.out, args.history_repeats
            )
        else:
            rows = matrix(plan, systems, engines, args.out, notes)
    finally:
        engines.stop()
    if args.history:
        print(
            "\n"
            + report.table(history, report.HISTORY_COLUMNS)
            + "\n\n"
            + report.table(report.history_ratios(history), report.HISTORY_RATIO_COLUMNS)
        )
    else:
        print(
            "\n"
            + report.table(rows)
            + "\n\n"
            + report.table(report.ratios(rows, systems), report.RATIO_COLUMNS)
        )
    for note in notes:
        print("note:", note)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="the < 3 minute variant")
    parser.add_argument("--doc", default=os.path.join(ROOT, "docs", "BENCHMARKS.md"))
    parser.add_argument("--plots", default=os.path.join(ROOT, "docs", "bench"))
    parser.add_argument(
        "--out", default=os.path.join(ROOT, "bench", "out"), help="raw results, logs"
    )
    parser.add_argument(
        "--systems",
        help="only these (comma separated keys of SYSTEMS); with "
        "--concurrency: a partial run that prints its tables and writes no doc",
    )
    parser.add_argument("--concurrency", help="only these concurrencies (comma separated)")
    parser.add_argument(
        "--history",
        action="store_true",
        help="with --systems: the history "
        "runs instead (the gateway, and those of the systems that are the seed "
        "or vllm-router)",
    )
    parser.add_argument(
        "--history-repeats",
        type=int,
        help="with --history: the systems take "
        "turns at each size this many times, a point being the median of its "
        "runs (default: the plan's, 3 in the full plan)",
    )
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    if args.systems or args.concurrency or args.history:
        return partial(plan, args)
    os.makedirs(args.out, exist_ok=True)
    began, load_before, clock = datetime.now(UTC), os.getloadavg(), time.monotonic()
    notes: list[str] = []
    # First, on engines of its own for every run: where reading D's blocks pays.
    reuse_rows, reuse_notes = reuse.measure(
        list(reuse.DEFAULT_SYSTEMS), *plan.reuse, os.path.join(args.out, "reuse")
    )
    notes += reuse_notes
    systems = available(plan, notes)
    engines = Engines.start(**ENGINE_TIMING)
    try:
        rows = matrix(plan, systems, engines, args.out, notes)
        history = growth.history_growth(plan.growth, history_systems(systems), engines, args.out)
        cached = growth.cache_growth(plan.growth, engines, args.out)
        rooms = cpu_rooms(plan, engines, args.out, notes)
    finally:
        engines.stop()
    notes += [
        f"`{r['system']}` at {r['conversations']} conversations: {r['errors']} errors; "
        f"the first: `{r['first_error']}`"
        for r in rows
        if r["errors"]
    ]
    ratio_rows = report.ratios(rows, systems)
    print("\n" + report.table(rows) + "\n\n" + report.table(ratio_rows, report.RATIO_COLUMNS))
    print(
        "\n"
        + report.table(history, report.HISTORY_COLUMNS)
        + "\n\n"
        + report.table(cached, report.CACHED_COLUMNS)
    )
    with open(os.path.join(args.out, f"results-{plan.name}.json"), "w") as f:
        json.dump(
            {
                "rows": rows,
                "ratios": ratio_rows,
                "history": history,
                "cached": cached,
                "reuse": reuse_rows,
            },
            f,
            indent=1,
        )
    budget = per_turn_budget(plan, notes)  # after the results are kept: it may fail
    report.plot_matrix(rows, os.path.join(args.plots, "matrix.png"))
    report.plot_growth(
        history,
        "history_kb",
        "cpu_ms_per_turn",
        "history at the first turn (KB)",
        "proxy CPU ms / turn",
        os.path.join(args.plots, "growth_history.png"),
    )
    report.plot_growth(
        cached,
        "entries",
        "cpu_ms_per_turn",
        "cached conversations",
        "gateway worker CPU ms / turn",
        os.path.join(args.plots, "growth_cached.png"),
        group=None,
    )
    report.plot_growth(
        cached,
        "entries",
        "rss_mb_filled",
        "cached conversations",
        "worker RSS (MB)",
        os.path.join(args.plots, "growth_memory.png"),
        group=None,
        scale="linear",
    )
    busy = [r["machine_busy"] for r in rows]
    report.write_doc(
        args.doc,
        args.plots,
        {
            "date": began.strftime("%Y-%m-%d %H:%M UTC"),
            "plan": plan.name,
            "command": "make bench-quick" if args.quick else "make bench",
            "minutes": f"{(time.monotonic() - clock) / 60:.1f}",
            "machine": machine(),
            "load": (
                f"load average {load_before[0]:.1f} at the start and {os.getloadavg()[0]:.1f} at "
                f"the end; all CPUs were {min(busy):.0%}–{max(busy):.0%} busy during the runs"
            ),
            "versions": versions(),
            "revision": revision(),
            "summary": "\n\n".join(
                filter(
                    None,
                    (
                        report.summary(
                            ratio_rows, f"{SYSTEMS['gw-gevent-1'].label} / {SYSTEMS[peer].label}"
                        )
                        for peer in ("seed", "vllm-router")
                    ),
                )
            ),
            "timing": ", ".join(f"`--{k.replace('_', '-')} {v}`" for k, v in ENGINE_TIMING.items()),
            "reply_words": REPLY_WORDS,
            "turns": plan.turns,
            "duration": f"{plan.duration:g}",
            "min_conversations": plan.min_conversations,
            "gthreads": GTHREAD_X1["threads"],
            "gthreads4": GTHREAD_X4["threads"],
            "gthreadturns4": GTHREAD_X4["max_turns"],
            "reuse_summary": reuse.summary(reuse_rows),
            "reuse_table": reuse.table(reuse_rows),
            "reuse_engine": ", ".join(
                f"`--{k.replace('_', '-')} {v}`" for k, v in reuse.ENGINE.items()
            ),
            "reuse_d_capacity": f"{reuse.D_CAPACITY:,}",
            "reuse_turns": reuse.TURNS,
            "table": report.table(rows, markdown=True),
            "ratios": report.table(ratio_rows, report.RATIO_COLUMNS, markdown=True),
            "history": report.table(history, report.HISTORY_COLUMNS, markdown=True)
            + "\n\n"
            + report.table(
                report.history_ratios(history), report.HISTORY_RATIO_COLUMNS, markdown=True
            ),
            "cached": report.table(cached, report.CACHED_COLUMNS, markdown=True),
            "rooms": rooms,
            "history_cost": history_cost.table(),
            "turn_budget": budget,
            "notes": "\n".join(f"- {n}" for n in notes) or "- Nothing was skipped.",
        },
    )
    print(
        f"\nwrote {os.path.relpath(args.doc, ROOT)} and plots in "
        f"{os.path.relpath(args.plots, ROOT)}/",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
