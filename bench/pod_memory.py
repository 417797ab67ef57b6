"""Resident memory (ps) of the gateway as deploy/kubernetes runs it (4 gevent workers, a Redis
store, client keys, JSON logs, the metrics listener): the master and each worker idle, at their
peak under multi-turn load from the emulated engines, and the growth of the worker that takes
one big body of short messages (the worst case per byte, README "Big bodies"). The figures of
docs/operating.md's memory arithmetic.

    python -m bench.pod_memory [--conversations 256] [--body-mib 28]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import threading
import time

import requests

from devtools import procstat, workload
from devtools.processes import GatewayProcess, RedisProcess
from emulator.process import EmulatorProcess, free_port

KEY = "tenant"


def rss_mib(pids: list[int]) -> dict[int, int]:
    """Each live process's resident memory, as ps reports it."""
    out = subprocess.run(
        ["ps", "-o", "pid=,rss=", "-p", ",".join(map(str, pids))], capture_output=True, text=True
    ).stdout
    return {int(pid): int(kib) // 1024 for pid, kib in (line.split() for line in out.splitlines())}


class Peaks:
    """The highest resident memory of `pids` while in use, sampled every 0.2 s."""

    def __init__(self, pids: list[int]) -> None:
        self.peak = dict.fromkeys(pids, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample)

    def _sample(self) -> None:
        while not self._stop.is_set():
            for pid, mib in rss_mib(list(self.peak)).items():
                self.peak[pid] = max(self.peak[pid], mib)
            time.sleep(0.2)

    def __enter__(self) -> Peaks:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        time.sleep(0.5)
        self._stop.set()
        self._thread.join()


class KeyedConversation(workload.Conversation):
    def headers(self) -> dict:
        return {**super().headers(), "Authorization": f"Bearer {KEY}"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--conversations", type=int, default=256, help="conversations at once, 5 turns each"
    )
    parser.add_argument(
        "--body-mib",
        type=float,
        default=28,
        help="the big body's messages, in MiB (JSON adds ~10%%)",
    )
    args = parser.parse_args(argv)
    redis = RedisProcess()
    try:
        with (
            EmulatorProcess(
                "prefill", host="127.0.0.88", itl_ms=5, bidirectional_kv_xfer=True
            ) as p,
            EmulatorProcess("decode", host="127.0.0.89", itl_ms=5, bidirectional_kv_xfer=True) as d,
            GatewayProcess(
                [p.url],
                [d.url],
                workers=4,
                worker_class="gevent",
                store=redis.url,
                api_keys=KEY,
                log_format="json",
                metrics_port=free_port("127.0.0.1"),
                metrics_host="127.0.0.1",
            ) as gateway,
        ):
            master = gateway.process.pid
            workers = procstat.children(master)
            time.sleep(5)  # the probes and the engines' /metrics read once
            idle = rss_mib([master, *workers])
            print(f"idle: master {idle[master]} MiB, workers {[idle[w] for w in workers]} MiB")
            conversations = [
                KeyedConversation(
                    url=gateway.url,
                    first_words=300,
                    turn_words=(120, 160),
                    max_tokens=64,
                    explicit=False,
                )
                for _ in range(args.conversations)
            ]
            started = time.monotonic()
            with Peaks([master, *workers]) as load:
                workload.drive(conversations, turns=5, concurrency=args.conversations)
            hits, later = workload.later_hits(conversations)
            print(
                f"{args.conversations} conversations at once, 5 turns each, in "
                f"{time.monotonic() - started:.0f} s: {len(workload.errors(conversations))} "
                f"errors, {hits}/{later} later turns hit"
            )
            print(
                f"peak under load: master {load.peak[master]} MiB, workers "
                f"{[load.peak[w] for w in workers]} MiB"
            )
            count = int(args.body_mib * 2**20 // 40)
            body = json.dumps(
                {
                    "model": workload.MODEL,
                    "max_tokens": 1,
                    "messages": [
                        {"role": ("user", "assistant")[i % 2], "content": f"hi {i}"}
                        for i in range(count)
                    ],
                }
            ).encode()
            before = rss_mib(workers)
            with Peaks(workers) as big:
                reply = requests.post(
                    gateway.url + "/v1/chat/completions",
                    data=body,
                    timeout=600,
                    headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
                )
            grew = {w: big.peak[w] - before[w] for w in workers}
            worker = max(grew, key=grew.get)
            size = len(body) / 2**20
            print(
                f"a {size:.1f} MiB body of {count:,} messages (answered {reply.status_code}): "
                f"its worker {before[worker]} -> {big.peak[worker]} MiB, "
                f"+{grew[worker]} MiB, {grew[worker] / size:.1f}x the body"
            )
    finally:
        redis.stop()


if __name__ == "__main__":
    main()
