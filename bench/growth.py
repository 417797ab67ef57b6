"""Growth runs: gateway CPU per turn against history length and cached conversations; memory."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from dataclasses import dataclass

import requests

from bench.measure import Load, run_load
from bench.systems import (
    PROXY_HOST,
    Engines,
    Running,
    System,
    quiet_ports,
    slug,
    start,
    stop_process,
)
from devtools import procstat
from devtools.fill import FILL_ENV
from emulator.process import wait_until
from gateway.config import Settings


@dataclass(frozen=True)
class GrowthPlan:
    history_kb: tuple[int, ...]
    cached: tuple[int, ...]
    conversations: int  # per point, HISTORY_CONCURRENCY in flight for history, 8 for cached
    turns: int
    # Runs of each system at each history size, a point their median: one 160-turn run moved
    # by some 15 % from run to run here, as much as the gateway's own cuts.
    history_repeats: int = 1


# As many conversations in flight as OpenAI SDK clients in the comparison with vllm-router that
# issue 30 names (16 concurrent, 32-token replies, every history length).
HISTORY_CONCURRENCY = 16


QUICK = GrowthPlan(history_kb=(1, 10, 100), cached=(0, 10_000, 100_000), conversations=8, turns=2)
FULL = GrowthPlan(
    history_kb=(1, 3, 10, 30, 100),
    cached=(0, 1_000, 10_000, 30_000, 100_000),
    conversations=32,
    turns=5,
    history_repeats=3,
)
# Driven by OpenAI SDK clients as well as by bench.loadgen: the clients of issue 30's comparison
# (which send no conversation ids; a new connection every turn, bench.sdk_load).
SDK_SYSTEMS = ("gateway, no ids", "vllm-router")
SDK_SUFFIX = ", OpenAI SDK"
HISTORY_SYSTEMS = (
    System("gateway, ids", "gateway", True, {"workers": 1}),
    System("gateway, no ids", "gateway", False, {"workers": 1}),
    System("seed, ids", "seed", True),
    System("vllm-router", "router", True),
)


def cpu_ms_per_turn(measured) -> float:
    turns = len(measured.load["turns"])
    return measured.proxy_cpu_s / turns * 1000 if turns else float("nan")


def history_growth(
    plan: GrowthPlan,
    systems: list[System],
    engines: Engines,
    out_dir: str,
    repeats: int | None = None,
) -> list[dict]:
    """Proxy CPU per turn for conversations that start with 1 KB .. 100 KB of history.

    Every system runs beside the others, and at each size they take turns (`repeats` times
    each, the plan's by default: a point is the median of its runs, with their range), so that
    each ratio compares runs made on the same machine at the same time. The systems of
    SDK_SYSTEMS are driven by OpenAI SDK clients too (bench.sdk_load), rows of their own."""
    repeats = repeats or plan.history_repeats
    variants = [(system.label, system, False) for system in systems] + [
        (f"{system.label}{SDK_SUFFIX}", system, True)
        for system in systems
        if system.label in SDK_SYSTEMS
    ]
    running: dict[str, Running] = {}
    try:
        for system in systems:
            running[system.label] = start(system, engines, out_dir)
            # Unmeasured first: a system's first turns pay for connections, first-use code and
            # (the gateway) its template probes, which belong to no history size.
            run_load(
                system.label,
                running[system.label],
                engines,
                Load(
                    concurrency=HISTORY_CONCURRENCY,
                    conversations=HISTORY_CONCURRENCY,
                    turns=2,
                    duration=60,
                    ids=system.ids,
                    history_bytes=1024,
                ),
                f"hist-warm-{slug(system.label)}",
                out_dir,
            )
        rows = []
        for kb in plan.history_kb:
            runs: dict[str, list] = {label: [] for label, _, _ in variants}
            for repeat in range(repeats):
                for label, system, sdk in variants:
                    load = Load(
                        concurrency=HISTORY_CONCURRENCY,
                        conversations=plan.conversations,
                        turns=plan.turns,
                        duration=60,
                        ids=system.ids,
                        history_bytes=kb * 1024,
                        sdk=sdk,
                    )
                    runs[label].append(
                        run_load(
                            label,
                            running[system.label],
                            engines,
                            load,
                            f"hist{kb}k-{slug(label)}-{repeat}",
                            out_dir,
                        )
                    )
            for label, _, sdk in variants:
                cpu = sorted(cpu_ms_per_turn(m) for m in runs[label])
                rows.append(
                    {
                        "system": label,
                        "history_kb": kb,
                        "client": "OpenAI SDK" if sdk else "loadgen",
                        "cpu_ms_per_turn": statistics.median(cpu),
                        "cpu_range": f"{cpu[0]:.2f}–{cpu[-1]:.2f}",
                        "turns": sum(len(m.load["turns"]) for m in runs[label]),
                        "errors": sum(len(m.load["errors"]) for m in runs[label]),
                    }
                )
        return rows
    finally:
        for each in running.values():
            each.stop()


def start_filled(engines: Engines, entries: int, log_dir: str) -> Running:
    """A one-worker gevent gateway whose store holds `entries` synthetic entries before any turn."""
    port = quiet_ports(1)
    settings = Settings.from_args(
        [
            "--host",
            PROXY_HOST,
            "--port",
            str(port),
            "--workers",
            "1",
            "--prefill",
            engines.prefill.url,
            "--decode",
            engines.decode.url,
        ]
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    env.update(settings.to_env(), **{FILL_ENV: str(entries)})
    log_path = os.path.join(log_dir, f"gateway-fill-{entries}.log")
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "-c", "python:bench.gunicorn_fill"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://{PROXY_HOST}:{port}"
    # /health answers only once the worker has filled its store and started serving.
    wait_until(
        lambda: requests.get(url + "/health", timeout=2).status_code in (200, 503),
        120,
        "filled gateway",
        process,
        log_path,
    )
    return Running(url, process, lambda: stop_process(process))


def cache_growth(plan: GrowthPlan, engines: Engines, out_dir: str) -> list[dict]:
    """Proxy CPU per turn and worker RSS with 0 .. 100k conversations already cached."""
    rows = []
    for entries in plan.cached:
        running = start_filled(engines, entries, out_dir)
        try:
            worker = procstat.children(running.pid)[0]
            rss_filled = procstat.rss_bytes(worker)
            load = Load(
                concurrency=8, conversations=plan.conversations, turns=plan.turns, duration=60
            )
            m = run_load("gateway, ids", running, engines, load, f"cached{entries}", out_dir)
            rows.append(
                {
                    "entries": entries,
                    "cpu_ms_per_turn": cpu_ms_per_turn(m),
                    "rss_mb_filled": rss_filled / 2**20,
                    "rss_mb_after": procstat.rss_bytes(worker) / 2**20,
                    "turns": len(m.load["turns"]),
                    "errors": len(m.load["errors"]),
                }
            )
        finally:
            running.stop()
    return rows
