"""What a longer history costs the gateway's own code per turn, in process, without the noise of
a loaded machine: the steps that grow with the history (parse and validate the body, identify the
conversation, write P's and D's bodies), timed over many repetitions of one turn.

    .venv/bin/python -m bench.history_cost [--sizes 1,10,100] [--repeat 200]

The bytes still have to cross the sockets (client to gateway, gateway to P and D): the kernel's
share, the same for any proxy, is in the full runs (`make bench`, "Growth").
"""

from __future__ import annotations

import argparse
import time

from devtools.workload import benchmark_conversation
from gateway.engines.instances import Instance
from gateway.parse import CHAT, parse
from gateway.reuse.conversation import identify, root_key
from gateway.reuse.kv_params import decode_body, prefill_body
from gateway.support import jsonio

P = Instance("http://127.0.0.2:8100", "prefill", 0)
P_REPLY = {
    "kv_transfer_params": {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [list(range(70))],
        "remote_engine_id": "e",
        "remote_request_id": "r",
        "remote_host": "localhost",
        "remote_port": 1,
    }
}


def body_of(kb: int, ids: bool) -> bytes:
    conv = benchmark_conversation("history-cost", 0, ids=ids, history_bytes=kb * 1024)
    conv.ask()
    return jsonio.dumps(conv.body())


def turn(raw: bytes, headers: dict) -> None:
    """The history-dependent steps of one turn, in the order the gateway runs them."""
    request = parse(CHAT, raw)
    args = (request.body, headers, request.conversation_id)
    root_key(*args)  # the owner worker (several workers only)
    identity = identify(*args)
    identity.lookups()
    jsonio.dumps(prefill_body(request.wire, None))
    jsonio.dumps(decode_body(request.wire, P_REPLY, P))


def cpu_per_turn(raw: bytes, headers: dict, repeat: int) -> float:
    turn(raw, headers)
    started = time.process_time()
    for _ in range(repeat):
        turn(raw, headers)
    return (time.process_time() - started) / repeat * 1000


def table(sizes: tuple[int, ...] = (1, 3, 10, 30, 100), repeat: int = 200) -> str:
    """Markdown: the history-dependent CPU of one turn by history size, with and without ids."""
    lines = [
        "| history KB | ids | gateway CPU ms/turn | more than at the smallest |",
        "|---|---|---|---|",
    ]
    for ids in (True, False):
        headers = {"X-Session-ID": "bench"} if ids else {}
        base = None
        for kb in sizes:
            ms = cpu_per_turn(body_of(kb, ids), headers, repeat)
            base = ms if base is None else base
            lines.append(f"| {kb} | {'yes' if ids else 'no'} | {ms:.3f} | {ms - base:+.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,3,10,30,100", help="history sizes in KB")
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args(argv)
    print(table(tuple(int(s) for s in args.sizes.split(",")), args.repeat))


if __name__ == "__main__":
    main()
