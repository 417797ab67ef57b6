"""What a benchmark's figures were measured on: the commit and the machine, for the doc's runs."""

from __future__ import annotations

import os
import platform
import subprocess

from devtools import ROOT


def revision() -> str:
    """The commit measured, and whether gateway/ had uncommitted changes when it ran."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()

    dirty = git("status", "--porcelain", "--", "gateway")
    head = git("log", "-1", "--format=%h of %cs") or "unknown (not a git checkout)"
    return f"commit `{head}`" + (" plus uncommitted changes in `gateway/`" if dirty else "")


def machine() -> str:
    with open("/proc/cpuinfo") as f:
        model = next(
            (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
            platform.machine(),
        )
    with open("/proc/meminfo") as f:
        mem_gib = int(f.readline().split()[1]) / 2**20
    return f"{os.cpu_count()} CPUs ({model}), {mem_gib:.0f} GiB, Linux {platform.release()}"
