"""One load run against one started system: the load generator process, CPU and engine counters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

from bench.metrics import Measured
from bench.systems import Engines, Running
from devtools import procstat

CLIENT_GRACE_S = 150  # a run's turns may outlive its duration by one request timeout (120 s)


@dataclass(frozen=True)
class Load:
    """What the client does: `concurrency` conversations in flight, `turns` each, until
    `duration`."""

    concurrency: int
    conversations: int
    turns: int
    duration: float
    ids: bool = True
    history_bytes: int = 0
    sdk: bool = False  # OpenAI SDK clients (bench.sdk_load: turns and errors only, no timings)

    def argv(self, url: str, salt: str, out: str) -> list[str]:
        generator = "bench.sdk_load" if self.sdk else "bench.loadgen"
        argv = [
            sys.executable,
            "-m",
            generator,
            "--url",
            url,
            "--salt",
            salt,
            "--out",
            out,
            "--concurrency",
            str(self.concurrency),
            "--conversations",
            str(self.conversations),
            "--turns",
            str(self.turns),
            "--duration",
            str(self.duration),
            "--history-bytes",
            str(self.history_bytes),
        ]
        return argv + (["--ids"] if self.ids else [])


def run_load(
    system: str, running: Running, engines: Engines, load: Load, salt: str, out_dir: str
) -> Measured:
    """Drive `load` at `running` and collect everything bench.metrics needs."""
    for engine in engines:
        engine.reset_stats()
    # After start-up, so gunicorn's and nginx's workers exist; a Redis store counts as proxy.
    proxy = procstat.tree(running.pid) + list(running.helpers)
    out = os.path.join(out_dir, f"load-{salt}.json")
    before = (
        procstat.cpu_seconds(proxy),
        procstat.cpu_seconds(engines.pids()),
        procstat.machine_ticks(),
    )
    subprocess.run(
        load.argv(running.url, salt, out), check=True, timeout=load.duration + CLIENT_GRACE_S
    )
    after = (
        procstat.cpu_seconds(proxy),
        procstat.cpu_seconds(engines.pids()),
        procstat.machine_ticks(),
    )
    with open(out) as f:
        result = json.load(f)
    roles = {engine.role: engine for engine in engines}
    (busy0, total0), (busy1, total1) = before[2], after[2]
    return Measured(
        system=system,
        conversations=load.concurrency,
        load=result,
        engine_stats={role: e.stats() for role, e in roles.items()},
        engine_records={role: e.recent_requests() for role, e in roles.items()},
        proxy_cpu_s=after[0] - before[0],
        engine_cpu_s=after[1] - before[1],
        machine_busy=(busy1 - busy0) / max(1, total1 - total0),
    )
