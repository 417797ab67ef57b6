"""Engines that come and go, end to end: real gunicorn (2 workers) over emulated engines, with
instances added and removed while conversations run, by the admin endpoint and by DNS (a DNS
server on loopback standing in for a Kubernetes headless Service)."""

from __future__ import annotations

import contextlib
import re
import socket
import threading

import pytest
import requests

from devtools import workload
from devtools.dns import LoopbackDNS
from emulator.process import EmulatorProcess, free_port, wait_until
from tests.helpers.servers import gateway_process

pytestmark = pytest.mark.processes  # engines and gateways, every test

ITL_MS = 15  # streams of 8 tokens last about 120 ms: some are on an engine when it goes
MAX_TOKENS = 8


def admin(gateway, method: str, **body) -> requests.Response:
    return requests.request(
        method,
        gateway.url + "/admin/instances",
        json=body or None,
        timeout=10,
        headers={"Authorization": f"Bearer {gateway.admin_token}"},
    )


def worker_sets(gateway, workers: int = 2) -> list[dict]:
    """Each worker's instance URLs by role, asked on its private listener."""
    out = []
    for slot in range(workers):
        report = gateway.status(port=gateway.port + 1 + slot)
        out.append({role: sorted(i["url"] for i in report[role]) for role in ("prefill", "decode")})
    return out


def metric(gateway, name: str, **labels) -> float:
    text = requests.get(gateway.url + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def paths_since(gateway, reason: str) -> float:
    return metric(gateway, "pd_gateway_turn_paths_total", path="two-stage", reason=reason)


def conversations(gateway, count: int) -> list[workload.Conversation]:
    return [workload.Conversation(gateway.url, max_tokens=MAX_TOKENS) for _ in range(count)]


@pytest.mark.parametrize("worker_class", ["gevent", "gthread"])
def test_engines_added_and_removed_while_conversations_run(worker_class):
    with contextlib.ExitStack() as stack:
        engines = [
            stack.enter_context(
                EmulatorProcess(
                    role, bidirectional_kv_xfer=True, host=f"127.0.0.{40 + i}", itl_ms=ITL_MS
                )
            )
            for i, role in enumerate(["prefill", "prefill", "decode", "decode", "decode"])
        ]
        p1, p2, d1, d2, d3 = engines
        gateway = stack.enter_context(
            gateway_process(
                [p1.url],
                [d1.url, d2.url],
                workers=2,
                worker_class=worker_class,
                admin_instance_hosts="127.0.0.0/24",
            )
        )
        for slot in range(2):
            wait_until(
                lambda slot=slot: gateway.status(port=gateway.port + 1 + slot), 20, f"slot {slot}"
            )
        convs = conversations(gateway, 40)
        workload.drive(convs, 2, concurrency=8)  # entries on D1 and D2
        assert workload.errors(convs) == []
        before = sum(c.caches[1:].count("hit") for c in convs)
        on_d1 = d1.stats()["completed"]
        assert on_d1 > 0 and d2.stats()["completed"] > 0

        # While turns 3-5 run: add D3 and P2, remove D1 with streams on it.
        running = threading.Thread(
            target=workload.drive, args=(convs, 3), kwargs={"concurrency": 8}
        )
        running.start()
        wait_until(lambda: d1.stats()["streams_in_flight"] > 0, 20, "a stream on D1")
        added = admin(gateway, "POST", role="decode", url=d3.url)
        removed = admin(gateway, "DELETE", role="decode", url=d1.url)
        added_p = admin(gateway, "POST", role="prefill", url=p2.url)
        running.join(120)
        assert not running.is_alive()
        assert (added.status_code, removed.status_code, added_p.status_code) == (201, 200, 201)
        for reply in (added, removed, added_p):
            assert reply.json()["workers_pending"] == [], reply.json()  # both workers have it
        assert (
            worker_sets(gateway)
            == [{"prefill": sorted([p1.url, p2.url]), "decode": sorted([d2.url, d3.url])}] * 2
        )
        assert workload.errors(convs) == []  # the streams on D1 finished too
        d1_done = d1.stats()["completed"]

        # D1 is stopped, as a pod removed from service is; its entries miss without touching it.
        d1.stop()
        workload.drive(convs, 2, concurrency=8)
        assert workload.errors(convs) == []
        last = [c.caches[-1] for c in convs]
        assert last.count("hit") == len(convs), last  # every conversation hits again
        p_hits = p1.stats()["hits"] + p2.stats()["hits"]
        gone = paths_since(gateway, "decode_gone")
        print(
            f"\n{worker_class}: {sum(len(c.caches) for c in convs)} turns, 0 errors; later "
            f"turns before the change {before}/{40}, decode_gone misses {gone:.0f}, last "
            f"turn hits {last.count('hit')}/{len(convs)}; P hits {p_hits} (P2 "
            f"{p2.stats()['hits']}), D3 completed {d3.stats()['completed']}, D1 served "
            f"{d1_done - on_d1} turns during the change"
        )
        assert gone > 0 and metric(gateway, "pd_gateway_entries_total", event="gone") == gone
        assert p2.stats()["hits"] > 0 and d3.stats()["completed"] > 0
        assert sum(e.stats()["wrong_reuse"] for e in (p1, p2, d2, d3)) == 0
        assert p1.stats()["kv_load_errors"] + p2.stats()["kv_load_errors"] == 0
        assert metric(gateway, "pd_gateway_instance_changes_total", source="admin") == 6


def _shared_port(hosts: list[str]) -> int:
    """Two consecutive ports free on every host in `hosts` (one URL, one port, per-pod hosts)."""
    for _ in range(20):
        base = free_port(hosts[0], 2)
        try:
            for host in hosts[1:]:
                for port in (base, base + 1):
                    with socket.socket() as sock:
                        sock.bind((host, port))
        except OSError:
            continue
        return base
    raise RuntimeError("no shared free ports")


def test_a_dns_name_is_re_resolved_into_one_instance_per_address():
    hosts = ["127.0.0.51", "127.0.0.52"]
    port = _shared_port(hosts)
    with contextlib.ExitStack() as stack:
        dns = stack.enter_context(LoopbackDNS())
        p = stack.enter_context(
            EmulatorProcess("prefill", bidirectional_kv_xfer=True, host="127.0.0.50", itl_ms=1)
        )
        d1, d2 = (
            stack.enter_context(
                EmulatorProcess(
                    "decode",
                    bidirectional_kv_xfer=True,
                    host=h,
                    port=port,
                    kv_port=port + 1,
                    itl_ms=1,
                )
            )
            for h in hosts
        )
        dns.set("decode.pods.test", [hosts[0]])
        gateway = stack.enter_context(
            gateway_process(
                [p.url],
                [f"http://decode.pods.test:{port}"],
                workers=2,
                resolve_nameserver=dns.nameserver,
                resolve_interval=0.2,
            )
        )

        def decode_sets():
            return [s["decode"] for s in worker_sets(gateway)]

        assert decode_sets() == [[d1.url]] * 2  # the name, resolved before the first turn
        convs = conversations(gateway, 20)
        workload.drive(convs, 2, concurrency=8)
        assert workload.errors(convs) == [] and d2.stats()["requests"] == 0

        dns.set("decode.pods.test", hosts)  # a pod joins
        wait_until(lambda: decode_sets() == [sorted([d1.url, d2.url])] * 2, 10, "D2 everywhere")
        fresh = conversations(gateway, 20)
        workload.drive(convs + fresh, 2, concurrency=8)
        assert workload.errors(convs + fresh) == []
        assert [c.caches[-1] for c in convs].count("hit") == len(convs)  # still on D1, hitting
        assert d2.stats()["completed"] > 0  # new conversations spread onto D2

        dns.set("decode.pods.test", [hosts[1]])  # D1's pod goes
        wait_until(lambda: decode_sets() == [[d2.url]] * 2, 10, "D1 gone everywhere")
        d1.stop()
        workload.drive(convs + fresh, 2, concurrency=8)
        assert workload.errors(convs + fresh) == []
        assert [c.caches[-1] for c in convs + fresh].count("hit") == 40
        gone = paths_since(gateway, "decode_gone")
        assert gone > 0

        dns.failing = True  # DNS fails: the last set stays
        failed = metric(gateway, "pd_gateway_resolutions_total", result="failed")
        wait_until(
            lambda: metric(gateway, "pd_gateway_resolutions_total", result="failed") >= failed + 4,
            10,
            "failed lookups counted",
        )
        workload.drive(convs, 1, concurrency=8)
        assert workload.errors(convs) == [] and decode_sets() == [[d2.url]] * 2
        assert [c.caches[-1] for c in convs].count("hit") == len(convs)
        assert p.stats()["wrong_reuse"] == 0 and d2.stats()["wrong_reuse"] == 0
        assert p.stats()["kv_load_errors"] == 0
        print(
            f"\nDNS: D2 joined and D1 left with 40 conversations running: 0 errors, "
            f"decode_gone misses {gone:.0f}, P hits {p.stats()['hits']}; "
            f"{dns.queries} DNS queries"
        )
        assert re.search(r"resolving http://decode\.pods\.test:\d+ failed", gateway.log())
