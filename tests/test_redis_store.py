"""A Redis store shared by several gateways: any of them serves any turn, forwarding is off."""

from __future__ import annotations

import itertools

import pytest

from devtools import workload
from devtools.processes import RedisProcess
from tests.helpers.servers import gateway_process


@pytest.mark.parametrize("worker_class", ["gevent", "gthread"])
def test_two_gateways_share_conversations_through_redis(fresh_engines, redis_server, worker_class):
    p, d = fresh_engines
    redis_server.client.flushdb()
    with (
        gateway_process(
            [p.url], [d.url], store=redis_server.url, workers=2, worker_class=worker_class
        ) as one,
        gateway_process(
            [p.url], [d.url], store=redis_server.url, workers=2, worker_class=worker_class
        ) as two,
    ):
        health = one.status()
        assert health["store"] == "redis" and health["reachable"] and not health["affinity"]
        # Every turn goes to the other gateway, on a new connection, with no id at all.
        convs = [workload.Conversation(one.url, explicit=False) for _ in range(30)]
        hosts = {c.cid: itertools.cycle([one.url, two.url]) for c in convs}
        workload.drive(convs, turns=4, before_turn=lambda c: setattr(c, "url", next(hosts[c.cid])))
        hits, later = workload.later_hits(convs)
        assert workload.errors(convs) == []
        assert hits == later == 90, (hits, later)
        assert p.stats()["hits"] == 90 and p.stats()["wrong_reuse"] == 0
        for gateway in (one, two):
            assert gateway.metric("pd_gateway_forwarded_total") == 0
        print(f"\n{worker_class}: two gateways x 2 workers on one Redis: {hits}/{later} hit")


def test_redis_going_away_costs_hits_not_requests(fresh_engines):
    p, d = fresh_engines
    server = RedisProcess()  # its own, to stop and restart it
    try:
        with gateway_process([p.url], [d.url], store=server.url, workers=2) as gateway:
            convs = [workload.Conversation(gateway.url) for _ in range(10)]
            workload.drive(convs, turns=2)
            server.stop()
            workload.drive(convs, turns=2)
            assert workload.errors(convs) == []
            assert [c.caches for c in convs] == [["miss", "hit", "miss", "miss"]] * 10
            health = gateway.status()
            assert health["status"] == "ok" and health["reachable"] is False
            assert gateway.metric("pd_gateway_store_errors_total", operation="take") > 0
            # Back, empty (its scripts gone too): the workers reconnect and reuse resumes.
            server.start()
            workload.drive(convs, turns=2)
            assert workload.errors(convs) == []
            assert [c.caches[4:] for c in convs] == [["miss", "hit"]] * 10
    finally:
        server.stop()
