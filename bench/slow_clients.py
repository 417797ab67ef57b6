"""Trickling clients against one gateway worker: how long /health and a normal turn take.

Each trickling client opens a connection and sends its request a piece at a time, each piece
well within --client-timeout: a header line every `--every` seconds (`head`), or its head and
then a body byte every `--every` seconds (`body`). With 16 and 64 of them on one worker of each
class (gthread with --threads 8, gevent with --worker-connections 256), /health and one normal
turn are timed every second for `--seconds`, and what became of the trickling clients is told
(cut at --request-timeout, or still open).

    python -m bench.slow_clients [--seconds 20] [--every 1.5] [--request-timeout 10]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import threading
import time

import requests

from devtools.processes import GatewayProcess
from emulator.process import EmulatorProcess

MODEL = "emulated-model"
HEAD = [
    b"POST /v1/chat/completions HTTP/1.1\r\n",
    b"Host: x\r\n",
    b"Content-Type: application/json\r\n",
    b"Content-Length: 100000\r\n",
] + [b"X-Filler-%d: %s\r\n" % (n, b"y" * 20) for n in range(90)]


def trickle(
    host: str, port: int, kind: str, every: float, stop: threading.Event, cut: list
) -> None:
    """One client: its request a piece every `every` seconds until `stop` or the gateway
    closes the connection (then the time it lasted goes to `cut`)."""
    started = time.monotonic()
    sock = socket.create_connection((host, port))
    pieces = HEAD if kind == "head" else [b"".join(HEAD) + b"\r\n{"] + [b" "] * 100_000
    try:
        for piece in pieces:
            sock.sendall(piece)
            sock.settimeout(every)
            try:
                sock.recv(4096)  # an answer (408) or the close: cut
                cut.append(time.monotonic() - started)
                return
            except TimeoutError:
                pass
            if stop.is_set():
                return
    except OSError:
        cut.append(time.monotonic() - started)
    finally:
        sock.close()


def timed(call) -> float:
    started = time.monotonic()
    try:
        ok = call()
    except requests.RequestException:
        ok = False
    return (time.monotonic() - started) if ok else float("inf")


def run(worker_class: str, clients: int, kind: str, args) -> dict:
    sizing = {"threads": 8} if worker_class == "gthread" else {"worker_connections": 256}
    with (
        EmulatorProcess("prefill", host="127.0.0.230", itl_ms=1, bidirectional_kv_xfer=True) as p,
        EmulatorProcess("decode", host="127.0.0.231", itl_ms=1, bidirectional_kv_xfer=True) as d,
        GatewayProcess(
            [p.url],
            [d.url],
            worker_class=worker_class,
            request_timeout=args.request_timeout,
            **sizing,
        ) as gateway,
    ):
        stop, cut = threading.Event(), []
        threads = [
            threading.Thread(
                target=trickle,
                daemon=True,
                args=(gateway.host, gateway.port, kind, args.every, stop, cut),
            )
            for _ in range(clients)
        ]
        for thread in threads:
            thread.start()
        time.sleep(1)
        health, turns = [], []
        until = time.monotonic() + args.seconds
        while time.monotonic() < until:
            health.append(timed(lambda: requests.get(gateway.url + "/health", timeout=30).ok))
            turns.append(
                timed(
                    lambda: (
                        requests.post(
                            gateway.url + "/v1/chat/completions",
                            timeout=30,
                            json={
                                "model": MODEL,
                                "max_tokens": 8,
                                "messages": [{"role": "user", "content": "hello"}],
                            },
                        ).ok
                    )
                )
            )
            time.sleep(1)
        stop.set()
        for thread in threads:
            thread.join(args.every + 5)
        return {"health": health, "turns": turns, "cut": cut}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--every", type=float, default=1.5)
    parser.add_argument("--request-timeout", type=float, default=10)
    parser.add_argument("--clients", default="16,64")
    parser.add_argument("--workers", default="gthread,gevent")
    parser.add_argument("--kinds", default="head,body")
    args = parser.parse_args()
    print(
        "| worker | trickling | clients | /health p50 / max (s) | turn p50 / max (s) | cut "
        "(when, s) |"
    )
    print("|---|---|---|---|---|---|")
    for worker_class in args.workers.split(","):
        for kind in args.kinds.split(","):
            for clients in map(int, args.clients.split(",")):
                got = run(worker_class, clients, kind, args)
                cut = got["cut"]
                print(
                    f"| {worker_class} | {kind} | {clients} | "
                    f"{statistics.median(got['health']):.3f} / {max(got['health']):.3f} | "
                    f"{statistics.median(got['turns']):.3f} / {max(got['turns']):.3f} | "
                    f"{len(cut)} of {clients}"
                    + (f" ({min(cut):.0f}-{max(cut):.0f})" if cut else "")
                    + " |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
