"""CPU time and resident memory of processes (and their children) from /proc, and machine load."""

from __future__ import annotations

import os

TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None  # exited
    # The command name may hold spaces and parentheses: fields start after the last ")".
    return text[text.rindex(")") + 2 :].split()


def children(pid: int) -> list[int]:
    """Direct children of `pid` (gunicorn's workers, nginx's workers)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(int(entry))
            if fields and int(fields[1]) == pid:
                found.append(int(entry))
    return found


def tree(pid: int) -> list[int]:
    """`pid` and its descendants, parents first."""
    pids, i = [pid], 0
    while i < len(pids):
        pids += children(pids[i])
        i += 1
    return pids


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU of the live processes among `pids`."""
    total = 0
    for pid in pids:
        fields = _stat(pid)
        if fields:
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / TICK


def cpu_split(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of one process."""
    fields = _stat(pid) or ["0"] * 13
    return int(fields[11]) / TICK, int(fields[12]) / TICK


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def machine_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot; the difference of two readings gives load."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)
