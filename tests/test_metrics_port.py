"""The metrics listener (--metrics-port, gateway/metrics_port.py): /metrics of every worker and
the gateway's /health, open with client keys on, one per gunicorn master, nothing else there;
`pd-gateway` under gunicorn, gevent and gthread, real engines (the emulator) and real clients."""

from __future__ import annotations

import socket

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from emulator.process import EmulatorProcess, free_port, wait_until
from gateway.config import Settings
from gateway.options import SettingsError
from tests.helpers.servers import MODEL, gateway_process

HOSTS = ("127.0.0.80", "127.0.0.81")


def _requests_total(text: str) -> float:
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "pd_gateway_requests_total"
    )


def _conversations_of_each_worker(gateway) -> list[dict]:
    """One conversation owned by each worker slot: their turns run in both workers."""
    owned: dict[int, dict] = {}
    for n in range(100):
        body = {
            "model": MODEL,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": f"conversation {n}"}],
        }
        owned.setdefault(gateway.owner_port(body), body)
        if len(owned) == gateway.workers:
            return list(owned.values())
    raise AssertionError("no conversation for some worker slot in 100")


@pytest.mark.processes
@pytest.mark.parametrize("worker_class", ["gevent", "gthread"])
def test_the_metrics_port_serves_every_workers_metrics_and_health_with_no_key(worker_class):
    metrics_port = free_port("127.0.0.1")
    with (
        EmulatorProcess("prefill", host=HOSTS[0], itl_ms=1) as p,
        EmulatorProcess("decode", host=HOSTS[1], itl_ms=1) as d,
        gateway_process(
            [p.url],
            [d.url],
            workers=2,
            worker_class=worker_class,
            api_keys="tenant",
            metrics_port=metrics_port,
            metrics_host="127.0.0.1",
        ) as gateway,
    ):
        listener = f"http://127.0.0.1:{metrics_port}"
        bodies = _conversations_of_each_worker(gateway)
        for body in bodies:
            reply = requests.post(
                gateway.url + "/v1/chat/completions",
                json=body,
                timeout=10,
                headers={"Authorization": "Bearer tenant"},
            )
            assert reply.status_code == 200
        # Whichever worker takes the connection, its /metrics counts the turns of both.
        for _ in range(6):
            scrape = requests.get(
                listener + "/metrics", timeout=10, headers={"Connection": "close"}
            )
            assert scrape.status_code == 200
            assert scrape.headers["Content-Type"].startswith("text/plain")
            assert _requests_total(scrape.text) == len(bodies)
        # The gateway's port keeps its rule: with client keys on, /metrics is the operator's.
        assert requests.get(gateway.url + "/metrics", timeout=10).status_code == 401
        assert _requests_total(
            requests.get(
                gateway.url + "/metrics",
                timeout=10,
                headers={"Authorization": f"Bearer {gateway.admin_token}"},
            ).text
        ) == len(bodies)
        health = requests.get(listener + "/health", timeout=10)
        same = requests.get(gateway.url + "/health", timeout=10)
        assert (
            (health.status_code, health.json())
            == (same.status_code, same.json())
            == (200, {"status": "ok"})
        )
        # Nothing else is served there: not the API (which would need no key there), not the
        # admin routes. No engine was called.
        served = p.stats()["requests"]
        for method, path in (
            ("POST", "/v1/chat/completions"),
            ("GET", "/v1/models"),
            ("GET", "/admin/status"),
            ("GET", "/"),
        ):
            refused = requests.request(
                method,
                listener + path,
                json=bodies[0],
                timeout=10,
                headers={"Authorization": "Bearer tenant"},
            )
            assert refused.status_code == 404, path
            assert refused.json()["error"]["code"] == 404
        assert p.stats()["requests"] == served
        wrong = requests.post(listener + "/metrics", timeout=10)
        assert wrong.status_code == 405 and wrong.headers["Allow"] == "GET, HEAD"


@pytest.mark.processes
def test_the_metrics_ports_health_is_the_gateways_readiness():
    """503 while no D answers the gateway's probes, as on --port; 200 once one does."""
    d_port = free_port(HOSTS[1], 2)  # its HTTP port and its KV port
    metrics_port = free_port("127.0.0.1")
    with (
        EmulatorProcess("prefill", host=HOSTS[0], itl_ms=1) as p,
        gateway_process(
            [p.url],
            [f"http://{HOSTS[1]}:{d_port}"],
            probe_interval=0.2,
            ready=False,
            metrics_port=metrics_port,
        ) as gateway,
    ):
        listener = f"http://127.0.0.1:{metrics_port}"

        def both() -> list[tuple[int, dict]]:
            answers = [requests.get(url + "/health", timeout=5) for url in (listener, gateway.url)]
            return [(a.status_code, a.json()) for a in answers]

        assert both() == [(503, {"status": "degraded"})] * 2
        with EmulatorProcess("decode", host=HOSTS[1], port=d_port, kv_port=d_port + 1):
            wait_until(
                lambda: both() == [(200, {"status": "ok"})] * 2,
                10,
                "both /health answers to be ready",
            )


@pytest.mark.processes
def test_a_metrics_port_taken_stops_the_gateway_saying_which():
    """Taken even by a socket that would share it (SO_REUSEPORT, another gateway of this user):
    scrapes split between two gateways would be wrong without a word."""
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(
            RuntimeError,
            match=f"cannot listen for metrics on 127.0.0.1:{port} "
            r"\(--metrics-host, --metrics-port\)",
        ):
            with gateway_process(
                ["http://127.0.0.1:9"], ["http://127.0.0.1:9"], metrics_port=port, ready=False
            ):
                pass


def test_the_metrics_port_is_a_port_of_its_own():
    assert Settings(port=8000, metrics_port=9100).metrics_address == ("0.0.0.0", 9100)
    assert Settings(host="10.0.0.5", metrics_port=9100).metrics_address == ("10.0.0.5", 9100)
    assert Settings(metrics_port=9100, metrics_host="127.0.0.1").metrics_address == (
        "127.0.0.1",
        9100,
    )
    assert Settings().metrics_address is None
    with pytest.raises(SettingsError, match="--metrics-port 8000 is --port"):
        Settings(port=8000, metrics_port=8000)
