"""Redis memory per conversation entry: one primary against a cluster (3 primaries), the
benchmark's 1,100-token entries (69 block ids in a run, D's params as vLLM 0.33 exports them),
one D. Prints bytes per entry from `used_memory` before and after.

    python -m bench.store_memory [--entries 20000]
"""

from __future__ import annotations

import argparse
import uuid

from devtools.processes import RedisClusterProcesses, RedisProcess
from gateway.reuse.store import Entry, RedisClusterStore, RedisStore


def entry(n: int) -> Entry:
    params = {
        "remote_block_ids": [list(range(1000 + n, 1069 + n))],
        "remote_engine_id": str(uuid.uuid4()),
        "remote_request_id": f"chatcmpl-{uuid.uuid4().hex}",
        "remote_host": "10.0.0.7",
        "remote_port": 5601,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": 1100,
        "remote_blocks_expiry_time": 12345.6,
        "transfer_mode": "pull",
        "remote_registration_generation": 0,
    }
    return Entry(params, "http://10.0.0.7:8200", uuid.uuid4().hex, 4, True, uuid.uuid4().hex)


def used(clients) -> int:
    return sum(int(c.info("memory")["used_memory"]) for c in clients)


def measure(store, clients, entries: int) -> float:
    before = used(clients)
    for n in range(entries):
        store.put(uuid.uuid4().hex, entry(n), uuid.uuid4().hex)
    return (used(clients) - before) / entries


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=20_000)
    args = parser.parse_args(argv)
    single = RedisProcess("127.0.0.1")
    try:
        per = measure(RedisStore(single.url, ttl=3600, timeout=5), [single.client], args.entries)
        print(f"one primary: {per:.0f} bytes an entry, {per * 100_000 / 1e6:.1f} MB per 100k")
    finally:
        single.stop()
    cluster = RedisClusterProcesses("127.0.0.1")
    try:
        primaries = [
            n.client
            for n in cluster.nodes.values()
            if n.client.info("replication")["role"] == "master"
        ]
        per = measure(RedisClusterStore(cluster.url, ttl=3600, timeout=5), primaries, args.entries)
        print(
            f"cluster (3 primaries, summed; replicas hold as much again): {per:.0f} bytes "
            f"an entry, {per * 100_000 / 1e6:.1f} MB per 100k"
        )
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
