"""Where a turn's CPU goes, per turn and per event, against the bare Flask relay (the floor).

    .venv/bin/python -m bench.turn_budget --concurrency 8
    .venv/bin/python -m bench.turn_budget --concurrency 64
    .venv/bin/python -m bench.turn_budget --tables bench/out/turn-budget-c*.json
                                                # the runs' figures in one set of tables

Starts the benchmark's engines (bench.systems.Engines, bench.run's timing), then the bare Flask
relay (bench.flask_relay: one Flask view, a pooled requests.Session, D alone), the same relay
with a P call before D (the P/D floor: what any P/D proxy on this stack pays for a turn's two
engine calls) and one pd-gateway gevent worker beside them, and warms them up. At each
concurrency it drives them with the same load at two reply lengths (`--short-words`,
`--long-words`: D streams that many tokens, one SSE event each, plus its role chunk and
[DONE]), `--repeats` times; the systems take turns, run
by run (one loaded at a time, the others idle), so all see the same machine. CPU per turn comes
from /proc (user + system of the system's gunicorn master and worker, as bench.measure reads it).

Each repeat's short and long runs fit CPU per turn = a + b * events, events being the SSE events
the client received per turn: a is what a turn costs besides its events (µs), b what one relayed
event costs (µs). Medians over the repeats, with their min–max. The ratio per turn is the
gateway's CPU per turn over the floor's at the short length, repeat by repeat.

Then the gateway once more at each length under py-spy (bench.profile's sampling and rooms;
`--sample-factor` times the conversations, for more samples): each room's share of the worker's
samples times the median CPU per turn at that length, split into per turn and per event the
same way, with the floor's own a and b as a row to read against.
Prints markdown tables and keeps every run's figures in `--out` (JSON), from which `--tables`
prints them again: several runs' pooled (each run's repeats, the rooms' samples summed), so a
budget can come from a few short runs instead of one long one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from datetime import UTC, datetime

from bench import profile
from bench.measure import Load, run_load
from bench.provenance import machine, revision
from bench.systems import ENGINE_TIMING, Engines, System, slug, start
from devtools import ROOT, procstat

FLOOR = System("bare Flask relay", "flask", True)
# The same relay with a P call before D's stream (bench.flask_relay, FLASK_RELAY_PREFILL): what
# any P/D proxy on this stack pays for a turn's two engine calls, the floor's own cost of P.
PD_FLOOR = System("bare Flask P/D relay", "flask", True, options={"prefill": True})
GATEWAY_LABEL = "pd-gateway"
REPLY_ENV = "BENCH_REPLY_WORDS"  # the load generator's max_tokens (devtools.workload)


def _load(concurrency: int, words: int, args: argparse.Namespace, factor: int = 1) -> Load:
    """Short runs: twice the concurrency in conversations (at least `--short-conversations`);
    long ones, which take many times longer, as many as the concurrency (at least 8). Both with
    the same turns each, so the share of first turns (misses, for the gateway) is the same."""
    conversations = (
        max(2 * concurrency, args.short_conversations)
        if words == args.short_words
        else max(concurrency, 8)
    )
    return Load(concurrency, factor * conversations, args.turns, args.duration)


def one_run(
    label: str,
    running,
    worker: int,
    engines: Engines,
    load: Load,
    words: int,
    salt: str,
    out_dir: str,
) -> dict:
    os.environ[REPLY_ENV] = str(words)
    user0, system0 = procstat.cpu_split(worker)
    measured = run_load(label, running, engines, load, salt, out_dir)
    user1, system1 = procstat.cpu_split(worker)
    turns = measured.load["turns"]
    n = max(1, len(turns))
    return {
        "system": label,
        "concurrency": load.concurrency,
        "words": words,
        "turns": len(turns),
        "errors": len(measured.load["errors"]),
        "events": sum(t["events"] for t in turns) / n,
        "cpu_us": 1e6 * measured.proxy_cpu_s / n,
        "worker_user_us": 1e6 * (user1 - user0) / n,
        "worker_system_us": 1e6 * (system1 - system0) / n,
        "machine_busy": measured.machine_busy,
    }


def fit(short: dict, long: dict) -> tuple[float, float]:
    """(a, b) of CPU per turn = a + b * events through a short and a long run."""
    b = (long["cpu_us"] - short["cpu_us"]) / (long["events"] - short["events"])
    return short["cpu_us"] - b * short["events"], b


def measure(args: argparse.Namespace, out_dir: str) -> dict:
    gateway = replace(profile.gateway_system("gevent", 0), label=GATEWAY_LABEL)
    spy = shutil.which("py-spy", path=os.path.dirname(sys.executable))
    rate = args.rate if spy else 0
    result = {
        "runs": [],
        "rooms": [],
        "engine_timing": ENGINE_TIMING,
        "args": {k: v for k, v in vars(args).items() if k not in ("tables", "out")},
        "revision": revision(),
        "machine": machine(),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }
    engines = Engines.start(**ENGINE_TIMING)
    started = []
    reply_words = os.environ.get(REPLY_ENV)  # each run sets the load generator's reply length
    try:
        for system in (FLOOR, PD_FLOOR, gateway):
            running = start(system, engines, out_dir)
            started.append((system, running, profile.worker_pid(running.pid)))
        for concurrency in args.concurrency:
            for system, running, _ in started:
                os.environ[REPLY_ENV] = str(args.short_words)
                run_load(
                    system.label,
                    running,
                    engines,
                    Load(concurrency, concurrency, 2, 10),
                    f"warm-c{concurrency}",
                    out_dir,
                )
            for repeat in range(args.repeats):
                for words in (args.short_words, args.long_words):
                    order = started if repeat % 2 == 0 else started[::-1]
                    for system, running, worker in order:
                        salt = f"{slug(system.label)}-c{concurrency}-w{words}-r{repeat}"
                        run = one_run(
                            system.label,
                            running,
                            worker,
                            engines,
                            _load(concurrency, words, args),
                            words,
                            salt,
                            out_dir,
                        )
                        run["repeat"] = repeat
                        result["runs"].append(run)
                        print(
                            f"{system.label:>18} C={concurrency:<3} {words:4} words "
                            f"repeat {repeat}: {run['turns']:5} turns {run['errors']} errors "
                            f"{run['events']:6.1f} events/turn {run['cpu_us']:8.0f} µs/turn "
                            f"machine {run['machine_busy']:.0%} busy",
                            flush=True,
                        )
            if not rate:
                continue
            _, running, worker = started[-1]  # the gateway, started last
            for words in (args.short_words, args.long_words):
                os.environ[REPLY_ENV] = str(words)
                rooms, samples = profile.sample(
                    worker,
                    GATEWAY_LABEL,
                    running,
                    engines,
                    _load(concurrency, words, args, args.sample_factor),
                    out_dir,
                    rate,
                    os.path.join(out_dir, f"stacks-c{concurrency}-w{words}.txt"),
                )
                result["rooms"].append(
                    {
                        "concurrency": concurrency,
                        "words": words,
                        "samples": samples,
                        "rooms": dict(rooms),
                    }
                )
    finally:
        for _, running, _ in started:
            running.stop()
        engines.stop()
        os.environ.pop(REPLY_ENV, None)
        if reply_words is not None:
            os.environ[REPLY_ENV] = reply_words
    if not rate:
        print("note: py-spy is not installed (or --rate 0): no rooms, CPU per turn only")
    return result


# The tables, from the runs' figures (one measure() or several, loaded from JSON).


def _spread(values: list[float], fmt: str = "{:.0f}") -> str:
    if not values:
        return "–"
    median = statistics.median(values)
    if len(values) == 1:
        return fmt.format(median)
    return f"{fmt.format(median)} ({fmt.format(min(values))}–{fmt.format(max(values))})"


def _pairs(runs: list[dict], system: str, concurrency: int, short: int, long: int):
    """Per repeat: the system's (short run, long run)."""
    mine = [r for r in runs if r["system"] == system and r["concurrency"] == concurrency]
    for repeat in sorted({r["repeat"] for r in mine}):
        s = [r for r in mine if r["repeat"] == repeat and r["words"] == short]
        l_ = [r for r in mine if r["repeat"] == repeat and r["words"] == long]
        if s and l_:
            yield s[0], l_[0]


def fits(result: dict) -> list[dict]:
    """Per system and concurrency: CPU per turn at each length, a, b (per repeat lists)."""
    short, long = result["args"]["short_words"], result["args"]["long_words"]
    rows = []
    for concurrency in result["args"]["concurrency"]:
        for system in (FLOOR.label, PD_FLOOR.label, GATEWAY_LABEL):
            pairs = list(_pairs(result["runs"], system, concurrency, short, long))
            if not pairs:
                continue
            ab = [fit(s, l_) for s, l_ in pairs]
            rows.append(
                {
                    "system": system,
                    "concurrency": concurrency,
                    "short_words": short,
                    "long_words": long,
                    "events_short": [s["events"] for s, _ in pairs],
                    "events_long": [l_["events"] for _, l_ in pairs],
                    "cpu_short": [s["cpu_us"] for s, _ in pairs],
                    "cpu_long": [l_["cpu_us"] for _, l_ in pairs],
                    "a": [a for a, _ in ab],
                    "b": [b for _, b in ab],
                    "errors": sum(s["errors"] + l_["errors"] for s, l_ in pairs),
                    "busy": [r["machine_busy"] for p in pairs for r in p],
                }
            )
    return rows


def fit_table(results: list[dict]) -> str:
    rows = [row for result in results for row in fits(result)]
    lines = [
        "| system | C | events/turn (short, long) | CPU µs/turn, short | CPU µs/turn, long "
        "| **per turn a, µs** | **per event b, µs** | errors | machine busy |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['system']} | {r['concurrency']} | {statistics.median(r['events_short']):.0f}, "
            f"{statistics.median(r['events_long']):.0f} | {_spread(r['cpu_short'])} | "
            f"{_spread(r['cpu_long'])} | **{_spread(r['a'])}** | **{_spread(r['b'], '{:.1f}')}** | "
            f"{r['errors']} | {min(r['busy']):.0%}–{max(r['busy']):.0%} |"
        )
    lines += [
        "",
        "| ratio | C | CPU per turn, short replies | per turn a | per event b |",
        "|---|---|---|---|---|",
    ]
    for name, over, under in (
        ("pd-gateway / floor", GATEWAY_LABEL, FLOOR.label),
        ("pd-gateway / P/D floor", GATEWAY_LABEL, PD_FLOOR.label),
        ("P/D floor / floor", PD_FLOOR.label, FLOOR.label),
    ):
        for r in rows:
            if r["system"] != over:
                continue
            floor = next(
                (f for f in rows if f["system"] == under and f["concurrency"] == r["concurrency"]),
                None,
            )
            if floor is None:
                continue
            ratio = [g / f for g, f in zip(r["cpu_short"], floor["cpu_short"], strict=False)]
            ratio_a = [g / f for g, f in zip(r["a"], floor["a"], strict=False)]
            ratio_b = [g / f for g, f in zip(r["b"], floor["b"], strict=False)]
            lines.append(
                f"| {name} | {r['concurrency']} | "
                f"**{_spread(ratio, '{:.2f}')}** | {_spread(ratio_a, '{:.2f}')} | "
                f"{_spread(ratio_b, '{:.2f}')} |"
            )
    return "\n".join(lines)


def room_budget(result: dict, concurrency: int) -> list[tuple[str, float, float]] | None:
    """pd-gateway's rooms at `concurrency`: (room, a µs, b µs), largest per turn first."""
    short, long = result["args"]["short_words"], result["args"]["long_words"]
    sampled = {r["words"]: r for r in result["rooms"] if r["concurrency"] == concurrency}
    row = next(
        (
            r
            for r in fits(result)
            if r["system"] == GATEWAY_LABEL and r["concurrency"] == concurrency
        ),
        None,
    )
    if row is None or short not in sampled or long not in sampled:
        return None
    e_s, e_l = statistics.median(row["events_short"]), statistics.median(row["events_long"])
    cpu_s, cpu_l = statistics.median(row["cpu_short"]), statistics.median(row["cpu_long"])
    names = dict.fromkeys([*sampled[short]["rooms"], *sampled[long]["rooms"]])
    budget = []
    for room in names:
        us_s = cpu_s * sampled[short]["rooms"].get(room, 0) / max(1, sampled[short]["samples"])
        us_l = cpu_l * sampled[long]["rooms"].get(room, 0) / max(1, sampled[long]["samples"])
        b = (us_l - us_s) / (e_l - e_s)
        budget.append((room, us_s - b * e_s, b))
    return sorted(budget, key=lambda item: -item[1])


def budget_table(results: list[dict]) -> str:
    """Rooms down, one pair of columns (per turn, per event) per concurrency."""
    columns = []  # (concurrency, result)
    for result in results:
        for concurrency in result["args"]["concurrency"]:
            if room_budget(result, concurrency) is not None:
                columns.append((concurrency, result))
    if not columns:
        return "(no rooms: the runs were not sampled)"
    budgets = [
        dict((room, (a, b)) for room, a, b in room_budget(result, c)) for c, result in columns
    ]
    order = [room for room, _, _ in room_budget(columns[0][1], columns[0][0])]
    order += sorted({room for budget in budgets for room in budget} - set(order))
    head = (
        "| room | "
        + " | ".join(f"C={c} per turn µs | C={c} per event µs" for c, _ in columns)
        + " |"
    )
    lines = [head, "|---|" + "---|---|" * len(columns)]
    for room in order:
        cells = " | ".join(
            f"{budget.get(room, (0, 0))[0]:.0f} | {budget.get(room, (0, 0))[1]:.1f}"
            for budget in budgets
        )
        lines.append(f"| {room} | {cells} |")

    def medians(system: str, c: int, result: dict) -> tuple[float, float] | None:
        """The fit through the median CPU per turn and events per turn at each length (what
        the rooms are split from)."""
        row = next(
            (r for r in fits(result) if r["system"] == system and r["concurrency"] == c), None
        )
        if row is None:
            return None
        return fit(
            *(
                {
                    "cpu_us": statistics.median(row[f"cpu_{n}"]),
                    "events": statistics.median(row[f"events_{n}"]),
                }
                for n in ("short", "long")
            )
        )

    for system, label in (
        (GATEWAY_LABEL, "**pd-gateway, all** (sum of the rooms)"),
        (FLOOR.label, "**bare Flask relay, all** (the floor)"),
        (PD_FLOOR.label, "**bare Flask P/D relay, all** (the P/D floor)"),
    ):
        cells = []
        for c, result in columns:
            if system == GATEWAY_LABEL:
                budget = room_budget(result, c)
                cells.append(
                    f"**{sum(a for _, a, _ in budget):.0f}** | "
                    f"**{sum(b for _, _, b in budget):.1f}**"
                )
            else:
                ab = medians(system, c, result)
                cells.append(f"**{ab[0]:.0f}** | **{ab[1]:.1f}**" if ab else "– | –")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    excess = []
    for c, result in columns:
        gw, fl = medians(GATEWAY_LABEL, c, result), medians(FLOOR.label, c, result)
        excess.append(f"{gw[0] - fl[0]:+.0f} | {gw[1] - fl[1]:+.1f}" if gw and fl else "– | –")
    lines.append("| pd-gateway over the floor | " + " | ".join(excess) + " |")
    counts = "; ".join(
        f"C={c}: "
        + ", ".join(
            f"{r['words']} words {r['samples']:,} in {r.get('runs', 1)} "
            f"run{'s' * (r.get('runs', 1) > 1)}"
            for r in result["rooms"]
            if r["concurrency"] == c
        )
        for c, result in columns
    )
    return "\n".join(lines) + f"\n\npy-spy samples of the worker: {counts}."


def pooled(results: list[dict]) -> dict:
    """Several runs' figures as one: every repeat of each, the samples of each room summed."""
    lengths = {(r["args"]["short_words"], r["args"]["long_words"]) for r in results}
    if len(lengths) != 1:
        raise SystemExit(f"the runs have different reply lengths: {sorted(lengths)}")
    merged = {
        "args": {
            **results[0]["args"],
            "concurrency": sorted({c for r in results for c in r["args"]["concurrency"]}),
        },
        "runs": [
            {**run, "repeat": f"{i}.{run['repeat']}"}
            for i, r in enumerate(results)
            for run in r["runs"]
        ],
        "rooms": [],
    }
    for r in results:
        for sampled in r["rooms"]:
            into = next(
                (
                    x
                    for x in merged["rooms"]
                    if x["concurrency"] == sampled["concurrency"] and x["words"] == sampled["words"]
                ),
                None,
            )
            if into is None:
                merged["rooms"].append({**sampled, "rooms": dict(sampled["rooms"]), "runs": 1})
                continue
            into["samples"] += sampled["samples"]
            into["runs"] += 1
            for room, n in sampled["rooms"].items():
                into["rooms"][room] = into["rooms"].get(room, 0) + n
    return merged


def tables(results: list[dict]) -> str:
    """The tables of one run's figures, or of several runs' pooled (repeats, samples)."""
    runs = "; ".join(
        f"{r.get('date', '?')}, {r.get('revision', '?')}, C="
        + ",".join(map(str, r["args"]["concurrency"]))
        for r in results
    )
    merged = [pooled(results)]
    return f"Runs: {runs}.\n\n" + fit_table(merged) + "\n\n" + budget_table(merged)


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--concurrency", default="8", help="conversations in flight, comma separated (e.g. 8,64)"
    )
    parser.add_argument(
        "--short-words",
        type=int,
        default=32,
        help="max_tokens of the short runs (D streams that many events + 2)",
    )
    parser.add_argument("--long-words", type=int, default=256)
    parser.add_argument("--turns", type=int, default=4, help="turns per conversation")
    parser.add_argument(
        "--short-conversations",
        type=int,
        default=64,
        help="short runs: at least this many conversations (else twice the "
        "concurrency; long runs: the concurrency, at least 8)",
    )
    parser.add_argument(
        "--duration", type=float, default=60, help="no turn starts after this many seconds of a run"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--rate",
        type=int,
        default=1000,
        help="py-spy samples per second for the rooms (0: no rooms)",
    )
    parser.add_argument(
        "--sample-factor",
        type=int,
        default=2,
        help="the sampled runs have this many times the conversations",
    )
    parser.add_argument(
        "--out",
        help="where to keep the runs' figures (JSON); default "
        "bench/out/turn-budget-c<concurrency>-<UTC time>.json",
    )
    parser.add_argument(
        "--tables",
        nargs="+",
        metavar="JSON",
        help="print the tables of these earlier runs instead of measuring",
    )
    args = parser.parse_args(argv)
    args.concurrency = [int(c) for c in str(args.concurrency).split(",")]
    if args.long_words <= args.short_words:
        raise SystemExit("--long-words must exceed --short-words")
    return args


def run(args: argparse.Namespace) -> dict:
    """Measure as `args` says, and keep the figures (JSON) where --out says."""
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
    out = args.out or os.path.join(
        ROOT,
        "bench",
        "out",
        "turn-budget-c" + "-".join(map(str, args.concurrency)) + f"-{stamp}.json",
    )
    out_dir = tempfile.mkdtemp(prefix="pd-turn-budget-")
    clock = time.monotonic()
    result = measure(args, out_dir)
    result["minutes"] = (time.monotonic() - clock) / 60
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\n{result['minutes']:.1f} minutes; figures in {os.path.relpath(out)}\n")
    return result


def main(argv: list[str] | None = None) -> None:
    args = arguments(argv)
    if args.tables:
        results = []
        for path in args.tables:
            with open(path) as f:
                results.append(json.load(f))
        return print(tables(results))
    print(tables([run(args)]))


if __name__ == "__main__":
    main()
