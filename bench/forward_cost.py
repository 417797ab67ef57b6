"""The cost of forwarding a request to its owner worker: added time to first token and CPU.

Two workers; every turn is sent straight to one worker's private port, either the owner's
(served there) or the other worker's (forwarded once to the owner). The same conversations,
interleaved, so both see the same engines and load. Prints p50/p99 TTFT of each path, their
difference, and gateway CPU per turn of each path.

    .venv/bin/python -m bench.forward_cost [--turns 400] [--max-tokens 100]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid

import requests

from devtools.procstat import cpu_seconds, tree
from devtools import sse
from devtools.processes import GatewayProcess
from devtools.workload import MODEL
from gateway.front.owners import owner
from gateway.reuse.conversation import identify
from emulator.process import EmulatorProcess, wait_until


def ttft(url: str, body: dict) -> float:
    """Seconds to the first content event of one streamed turn (the stream is read to its end)."""
    started = time.monotonic()
    with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=60) as r:
        r.raise_for_status()
        timed = sse.timed_events(r)
    first = next((arrived for arrived, event in timed if sse.content(event)), None)
    return first - started if first is not None else float("nan")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=400, help="turns per path")
    parser.add_argument("--max-tokens", type=int, default=100,
                        help="tokens per reply: every one is one more event to relay")
    args = parser.parse_args(argv)
    with EmulatorProcess("prefill", bidirectional_kv_xfer=True, host="127.0.0.2", itl_ms=1) as p, \
            EmulatorProcess("decode", bidirectional_kv_xfer=True, host="127.0.0.3", itl_ms=1) as d, \
            GatewayProcess([p.url], [d.url], workers=2) as gateway:
        ports = [gateway.port + 1, gateway.port + 2]
        for port in ports:
            wait_until(lambda: requests.get(f"http://127.0.0.1:{port}/health").ok, 20, "worker")
        workers = tree(gateway.process.pid)[1:]
        samples: dict[str, list[float]] = {"direct": [], "forwarded": []}
        cpu: dict[str, float] = {"direct": 0.0, "forwarded": 0.0}
        for _ in range(args.turns):
            cid = uuid.uuid4().hex
            slot = owner(identify({}, {}, cid).root, 2)
            for path, port in (("direct", ports[slot]), ("forwarded", ports[1 - slot])):
                body = {"model": MODEL, "stream": True, "max_tokens": args.max_tokens,
                        "conversation_id": cid,
                        "messages": [{"role": "user", "content": f"{path} {cid}"}]}
                before = cpu_seconds(workers)
                samples[path].append(ttft(f"http://127.0.0.1:{port}", body))
                cpu[path] += cpu_seconds(workers) - before
        report = {}
        for path, values in samples.items():
            report[path] = {"ttft_p50_ms": 1000 * statistics.median(values),
                            "ttft_p99_ms": 1000 * percentile(values, 0.99),
                            "cpu_ms_per_turn": 1000 * cpu[path] / args.turns}
        report["added"] = {k: report["forwarded"][k] - report["direct"][k]
                           for k in report["direct"]}
        print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
