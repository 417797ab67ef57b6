"""A store that answers in 2 s: TTFT of turns through a gateway whose Redis is paused
(CLIENT PAUSE, renewed so it never answers in time) against the same turns with Redis
answering. Every take gives up at --store-timeout: the turn is a miss, never a wait.

    python -m bench.slow_store [--turns 40]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import uuid

import requests

from devtools.processes import GatewayProcess, RedisProcess
from emulator.process import EmulatorProcess


def turns(url: str, count: int) -> list[tuple[float, str]]:
    out = []
    for _conversation in range(count):
        messages = [{"role": "user", "content": f"slow store {uuid.uuid4().hex}"}]
        for _ in range(2):  # a first turn and a follow-up: a take, then a put
            started = time.monotonic()
            reply = ""
            with requests.post(
                url + "/v1/chat/completions",
                stream=True,
                timeout=60,
                json={
                    "model": "emulated-model",
                    "messages": messages,
                    "max_tokens": 8,
                    "stream": True,
                },
            ) as response:
                ttft = None
                for line in response.iter_lines():
                    if not line.startswith(b"data: {"):
                        continue
                    ttft = ttft or time.monotonic() - started
                    for choice in json.loads(line[6:]).get("choices") or ():
                        reply += (choice.get("delta") or {}).get("content") or ""
                cache = response.headers["X-Gateway-Cache"]
            out.append((ttft, cache))
            messages += [
                {"role": "assistant", "content": reply},
                {"role": "user", "content": "and then"},
            ]
    return out


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=40)
    args = parser.parse_args(argv)
    redis = RedisProcess("127.0.0.1")
    flags = dict(bidirectional_kv_xfer=True, itl_ms=1)
    try:
        with (
            EmulatorProcess("prefill", host="127.0.0.180", **flags) as p,
            EmulatorProcess("decode", host="127.0.0.181", **flags) as d,
            GatewayProcess([p.url], [d.url], store=redis.url) as gateway,
        ):
            for label, paused in (("store answering", False), ("store answering in 2 s", True)):
                stop = threading.Event()

                def pause(stop: threading.Event = stop) -> None:
                    while not stop.is_set():
                        redis.client.execute_command("CLIENT", "PAUSE", "2000")
                        stop.wait(1.8)

                pauser = threading.Thread(target=pause) if paused else None
                if pauser:
                    pauser.start()
                try:
                    result = turns(gateway.url, args.turns // 2)
                finally:
                    stop.set()
                    if pauser:
                        pauser.join()
                ttfts = [t * 1000 for t, _ in result]
                hits = sum(c == "hit" for _, c in result)
                print(
                    f"{label}: {len(result)} turns, {hits} hits, TTFT p50 "
                    f"{statistics.median(ttfts):.0f} ms, p99 {p99(ttfts):.0f} ms, max "
                    f"{max(ttfts):.0f} ms",
                    flush=True,
                )
                time.sleep(2.1)  # the last pause runs out
    finally:
        redis.stop()


if __name__ == "__main__":
    main()
