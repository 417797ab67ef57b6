"""The legacy service (legacy_app.py) under its own gunicorn config, gevent and gthread, four
workers, --preload: OpenAI SDK clients through /llm, worker affinity as standalone, and the
service's own routes, error handlers, hooks and JSON style untouched."""

from __future__ import annotations

import json
import signal
import socket
from pathlib import Path

import openai
import pytest
import requests
from openai import OpenAI

from devtools import workload
from devtools.processes import GatewayProcess, Mount
from emulator.process import free_port, wait_until
from tests.helpers.servers import MODEL, chat_turns, starts_processes, workers_of

pytestmark = pytest.mark.processes  # every test here runs the legacy service under gunicorn

HERE = Path(__file__).parent
# The GATEWAY_* variables name a closed port; the engines reach the app through its own config
# (LEGACY_PD_GATEWAY_*): every turn that works shows app.config winning over the environment.
NOWHERE = ["http://127.0.0.1:9"]
WORKER_CLASSES = {"gevent": "gateway.workers.GeventWorker", "gthread": "gthread"}


def legacy_mount(worker_class: str, engines=None, workers: int = 4, **env: str) -> Mount:
    env["LEGACY_WORKER_CLASS"] = worker_class
    if engines is not None:
        env.update(
            LEGACY_PD_GATEWAY_PREFILL=json.dumps([engines[0].url]),
            LEGACY_PD_GATEWAY_DECODE=json.dumps([engines[1].url]),
        )
    return Mount(
        app="tests.embedding.legacy_app:create_app()",
        config=str(HERE / "gunicorn.conf.py"),
        prefix="/llm",
        workers=workers,
        env=env,
    )


@pytest.fixture(scope="module", params=list(WORKER_CLASSES))
@starts_processes
def legacy(request, engines):
    mount = legacy_mount(WORKER_CLASSES[request.param], engines)
    with GatewayProcess(NOWHERE, NOWHERE, mount=mount) as gateway:
        gateway.worker_class = request.param
        yield gateway


def root(gateway) -> str:
    return f"http://{gateway.host}:{gateway.port}"


def listens(gateway, port: int) -> bool:
    try:
        socket.create_connection((gateway.host, port), timeout=2).close()
        return True
    except ConnectionRefusedError:
        return False


def test_openai_sdk_turns_hit_under_the_prefix(legacy, fresh_engines):
    p, d = fresh_engines
    client = OpenAI(base_url=legacy.url + "/v1", api_key="client-key", max_retries=0)
    for stream in (True, False):
        assert chat_turns(client, stream, explicit=False) == ["miss"] + ["hit"] * 4
    assert [m.id for m in client.models.list()] == [MODEL]
    with pytest.raises(openai.BadRequestError) as failed:
        client.chat.completions.create(model=MODEL, messages="not a list")
    assert failed.value.body["param"] == "messages"  # the gateway's OpenAI envelope
    assert p.stats()["wrong_reuse"] == 0 and d.stats()["wrong_reuse"] == 0


def test_four_host_workers_keep_conversations_on_their_owner(legacy, fresh_engines):
    """The app is built in the master (--preload); each worker must build its own Gateway after
    fork, with the slot the hooks gave it. One Gateway built in the master for all (the old
    README's way) leaves forwarding off: 392 of 800 hit."""
    p, _ = fresh_engines
    convs = workload.run(legacy.url, conversations=200, turns=5, explicit=False)
    hits, later = workload.later_hits(convs)
    assert workload.errors(convs) == []
    assert later == 800 and hits / later >= 0.99, (hits, later)
    assert p.stats()["wrong_reuse"] == 0
    print(f"\nlegacy app, {legacy.worker_class}, 4 workers, no ids: {hits}/{later} later turns hit")
    # /llm/metrics sums the four workers: one worker served about a quarter of the turns.
    text = requests.get(legacy.url + "/metrics", timeout=10).text
    served = sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("pd_gateway_requests_total{")
    )
    assert served >= 1000, served
    report = legacy.status()
    assert report["affinity"] and report["pid"] != legacy.process.pid  # a worker's report
    assert listens(legacy, legacy.port + 1 + report["worker"])  # its private listener


def test_the_service_keeps_its_routes_handlers_hooks_and_json(legacy):
    base = root(legacy)
    own = requests.get(base + "/health", timeout=10)
    assert own.json()["status"] == "legacy-ok"
    assert b'\n  "pid"' in own.content  # its JSON style: indented, sorted
    assert own.json()["post_fork"].startswith("slot ")  # its post_fork ran, after pd-gateway's
    ours = requests.get(legacy.url + "/health", timeout=10)
    assert ours.content == b'{"status":"ok"}\n'  # the gateway's, compact
    assert ours.headers["X-Legacy-Service"] == "1"  # its after_request runs on ours too
    assert requests.get(base + "/api/items/7", timeout=10).status_code == 401
    key = {"X-Api-Key": "legacy-key"}
    assert requests.get(base + "/api/items/7", headers=key, timeout=10).json() == {
        "id": 7,
        "name": "item 7",
    }
    # Its 500s and 404s stay its own outside the prefix (routing errors come before any
    # blueprint); the gateway's errors are the OpenAI envelope, an unknown path under its
    # prefix among them.
    legacy_500 = requests.get(base + "/api/boom", headers=key, timeout=10)
    assert (legacy_500.status_code, legacy_500.json()) == (
        500,
        {"error": "internal", "service": "legacy"},
    )
    for path in ("/nowhere", "/llmnowhere"):
        missing = requests.get(base + path, timeout=10)
        assert (missing.status_code, missing.json()) == (
            404,
            {"error": "not found", "service": "legacy"},
        ), path
    ours_missing = requests.get(legacy.url + "/nowhere", timeout=10)
    assert ours_missing.status_code == 404
    assert "/llm/v1/chat/completions" in ours_missing.json()["error"]["message"]
    bad = requests.post(legacy.url + "/v1/chat/completions", data=b"{", timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    wrong = requests.get(
        legacy.url + "/admin/status", timeout=10, headers={"Authorization": "Bearer wrong"}
    )
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == 401


def test_sync_workers_are_refused_at_startup():
    # One thread: with more, gunicorn itself runs gthread instead of sync.
    sync = legacy_mount("sync", workers=1, GUNICORN_CMD_ARGS="--threads 1")
    with pytest.raises(RuntimeError, match="cannot run under gunicorn's sync worker"):
        with GatewayProcess(NOWHERE, NOWHERE, mount=sync):
            pass


def test_a_reload_runs_the_config_and_install_again_and_keeps_affinity(engines, fresh_engines):
    """SIGHUP makes gunicorn run the host's config file again, install(globals()) with it; the
    new workers take slots 0 and 1 and their private listeners."""
    p, _ = fresh_engines
    with GatewayProcess(
        NOWHERE, NOWHERE, mount=legacy_mount("gthread", engines, workers=2)
    ) as gateway:
        old = workers_of(gateway)
        gateway.process.send_signal(signal.SIGHUP)
        wait_until(
            lambda: len(workers_of(gateway)) == 2 and not workers_of(gateway) & old,
            60,
            "the old workers to stop",
        )
        assert [gateway.status(port=gateway.port + 1 + slot)["worker"] for slot in (0, 1)] == [0, 1]
        convs = workload.run(gateway.url, conversations=40, turns=3, explicit=False)
        hits, later = workload.later_hits(convs)
        assert workload.errors(convs) == [] and hits == later == 80, (hits, later)
        # The host's own post_fork, chained again in the new workers.
        assert requests.get(root(gateway) + "/health", timeout=10).json()["post_fork"] in (
            "slot 0",
            "slot 1",
        )
    assert p.stats()["wrong_reuse"] == 0


def test_the_metrics_listener_answers_for_the_mounted_gateway_and_never_for_the_host(
    engines, fresh_engines
):
    """GATEWAY_METRICS_PORT reaches the master through install(): /metrics and /health at the
    listener's root, whatever the app's prefix, and none of the host's routes there; after a
    reload (SIGHUP) the new workers answer it too."""
    metrics_port = free_port()
    mount = legacy_mount("gthread", engines, workers=2)
    with GatewayProcess(
        NOWHERE, NOWHERE, mount=mount, metrics_port=metrics_port, metrics_host="127.0.0.1"
    ) as gateway:
        listener = f"http://127.0.0.1:{metrics_port}"
        client = OpenAI(base_url=gateway.url + "/v1", api_key="client-key", max_retries=0)
        assert chat_turns(client, False, explicit=False) == ["miss"] + ["hit"] * 4

        def served() -> float:
            text = requests.get(listener + "/metrics", timeout=10).text
            return sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("pd_gateway_requests_total{")
            )

        assert served() == 5
        assert requests.get(listener + "/health", timeout=10).content == b'{"status":"ok"}\n'
        for path in ("/api/items/7", "/llm/health", "/llm/metrics", "/llm/v1/models"):
            assert (
                requests.get(
                    listener + path, timeout=10, headers={"X-Api-Key": "legacy-key"}
                ).status_code
                == 404
            ), path
        old = workers_of(gateway)
        gateway.process.send_signal(signal.SIGHUP)
        wait_until(
            lambda: len(workers_of(gateway)) == 2 and not workers_of(gateway) & old,
            60,
            "the old workers to stop",
        )
        assert requests.get(listener + "/health", timeout=10).status_code == 200


def test_a_metrics_port_only_the_apps_config_names_is_said_to_be_unopened(engines):
    """The master reads no app config: a metrics port set only there opens nothing, and each
    worker says so."""
    mount = legacy_mount("gthread", engines, workers=1, LEGACY_PD_GATEWAY_METRICS_PORT="9")
    with GatewayProcess(NOWHERE, NOWHERE, mount=mount) as gateway:
        assert (
            "the app's settings name a metrics port (9), but gunicorn's master opened none"
        ) in gateway.log()


def test_without_the_hooks_the_app_says_what_is_missing(engines):
    """A gunicorn config without install(): it serves, one worker on its own, and says why
    affinity and summed metrics are missing."""
    bare = Mount(
        app=legacy_mount("gthread").app,
        config="/dev/null",
        prefix="/llm",
        env={"GUNICORN_CMD_ARGS": "--worker-class gthread --threads 8"},
    )
    with GatewayProcess(NOWHERE, NOWHERE, mount=bare, ready=False) as gateway:
        assert requests.get(gateway.url + "/health", timeout=10).status_code in (200, 503)
        assert "pd-gateway runs under gunicorn without its hooks" in gateway.log()


def test_with_a_shared_redis_store_any_worker_serves_any_turn(engines, fresh_engines, redis_server):
    """GATEWAY_STORE reaches both the master (install(): no private listeners) and the app."""
    p, _ = fresh_engines
    mount = legacy_mount(WORKER_CLASSES["gevent"], engines, workers=2)
    with GatewayProcess(NOWHERE, NOWHERE, mount=mount, store=redis_server.url) as gateway:
        convs = workload.run(gateway.url, conversations=40, turns=3, explicit=False)
        hits, later = workload.later_hits(convs)
        assert workload.errors(convs) == [] and hits == later == 80, (hits, later)
        report = gateway.status()
        assert report["store"] == "redis" and report["reachable"] and not report["affinity"]
        assert not any(listens(gateway, gateway.port + 1 + slot) for slot in range(2))
    assert p.stats()["wrong_reuse"] == 0


def test_pd_gateway_itself_runs_on_the_same_hooks(fresh_engines):
    """The gateway's own config is the same install(globals()): its affinity, here on the
    oldest supported versions too (make test runs this directory in .venv-lowest)."""
    p, d = fresh_engines
    with GatewayProcess([p.url], [d.url], workers=2) as gateway:
        convs = workload.run(gateway.url, conversations=40, turns=3, explicit=False)
        hits, later = workload.later_hits(convs)
        assert workload.errors(convs) == [] and hits == later == 80, (hits, later)
