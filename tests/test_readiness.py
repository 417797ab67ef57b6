"""Engines as they are: every engine probed from the start (GET /health, then /v1/models), the
gateway ready only once a P and a D of some model answered, a turn no D answers for refused
before P is called, and a D that keeps no blocks found out at run time (gateway/engines/
instances.py, gateway/flow/disagg.py)."""

from __future__ import annotations

import pytest
import requests
import responses

from devtools import sse
from emulator.process import EmulatorProcess, free_port, wait_until
from gateway.app import create_app
from gateway.config import Settings
from gateway.engines.instances import Pool, Prober
from gateway.support.errors import ServiceUnavailable
from tests.helpers.payloads import CHAT, D_URL, MESSAGES, P_URL
from tests.helpers.servers import MODEL, gateway_process
from tests.helpers.transport import ResponsesTransport


def _probed(*urls: str) -> Pool:
    pool = Pool("decode", list(urls))
    pool.probed = True
    return pool


# --- what a probe decides ---------------------------------------------------------------------


def test_an_instance_is_ready_only_once_it_answered_a_probe():
    pool = _probed("http://d:1")
    (d,) = pool.instances
    assert not pool.ready(d) and not pool.any_ready()
    assert pool.servable() and pool.choose("k") is d  # not known unable: may be tried
    pool.probed_now(d, True)
    assert pool.ready(d) and pool.any_ready() and d.state(0) == "up"
    pool.probed_now(d, False, "no answer to GET /health")
    assert pool.ready(d)  # one probe missed: a busy engine may miss one
    pool.probed_now(d, False, "no answer to GET /health")
    assert not pool.ready(d) and d.down and not pool.servable()
    with pytest.raises(ServiceUnavailable, match="no decode instance answers its health check"):
        pool.choose("k")
    pool.probed_now(d, True)  # back: chosen again
    assert pool.ready(d) and not d.down and pool.choose("k") is d


def test_a_request_that_an_engine_answers_makes_it_ready_again():
    pool = _probed("http://d:1")
    (d,) = pool.instances
    pool.probed_now(d, False, "no answer to GET /health")  # never answered: at once
    assert not pool.servable()
    pool.succeeded(d)  # a request it answered after all
    assert pool.ready(d) and pool.servable() and d.answered is True


def test_without_probes_an_instance_not_marked_down_is_ready():
    """--probe-interval 0: engines are taken as ready until a request to one fails."""
    pool = Pool("decode", ["http://d:1"])
    (d,) = pool.instances
    assert pool.ready(d) and pool.servable()
    pool.failed(d, unreachable=True)
    assert not pool.ready(d) and pool.choose("k") is d  # every one down: tried anyway


def test_a_request_failure_is_tried_again_until_a_probe_confirms_it():
    """One refused connection marks an engine down at once (and wakes the prober); until a
    probe finds it not answering, a turn with no other engine still tries it."""
    pool = _probed("http://d:1", "http://d:2")
    one, two = pool.instances
    for instance in (one, two):
        pool.probed_now(instance, True)
    woken = []
    pool.on_down = lambda: woken.append(1)
    pool.failed(one, unreachable=True)
    assert woken == [1] and pool.choose("k", exclude=[two]) is one
    for _ in range(2):  # it answered before: given up after two probes
        pool.probed_now(one, False, "no answer to GET /health")
    assert pool.choose("k") is two
    assert pool.choose("k", exclude=[two]) is two  # never the one known not to answer


def test_an_engine_of_another_model_is_not_ready():
    pool = Pool("decode", ["http://d:1"], model="llama")
    answers = {"served": ["qwen"]}
    prober = Prober(
        lambda instance: True, [pool], interval=1.0, models=lambda instance: answers["served"]
    )
    pool.probed = True
    (d,) = pool.instances
    prober.probe_one(pool, d)
    assert not pool.ready(d) and d.why == "serves qwen, not llama"
    assert pool.report()[0]["why"] == "serves qwen, not llama"
    answers["served"] = ["llama", "llama-lora"]  # restarted with the right model
    prober.probe_one(pool, d)
    assert pool.ready(d) and d.served == ("llama", "llama-lora")


def test_each_probe_round_asks_every_engine_and_the_models_only_of_one_that_came_back():
    pools = [_probed("http://p:1"), _probed("http://d:1", "http://d:2")]
    up = {"http://p:1": True, "http://d:1": True, "http://d:2": False}
    asked_models = []

    def models(instance):
        asked_models.append(instance.url)
        return ["m"]

    prober = Prober(lambda instance: up[instance.url], pools, interval=1.0, models=models)
    prober.probe_all()
    assert asked_models == ["http://p:1", "http://d:1"]
    prober.probe_all()  # answered before: not asked again
    assert asked_models == ["http://p:1", "http://d:1"]
    up["http://d:2"] = True
    prober.probe_all()
    assert asked_models[-1] == "http://d:2" and all(
        pool.ready(i) for pool in pools for i in pool.instances
    )


@responses.activate
def test_a_turn_no_d_answers_for_is_refused_before_p_is_called(store):
    """responses refuses any call not registered: P is never called."""
    app = create_app(
        Settings(
            prefill=[P_URL],
            decode=[D_URL],
            worker_class="gthread",
            threads=8,
            release_rate=0,
            engine_metrics_interval=0,
            probe_interval=0,
        ),
        store=store,
        transport=ResponsesTransport(),
    )
    gateway = app.extensions["pd_gateway"].gateway
    try:
        gateway.decode.probed = True
        gateway.decode.probed_now(gateway.decode.instances[0], False, "no answer to GET /health")
        reply = app.test_client().post(CHAT, json={"model": "m", "messages": MESSAGES})
        assert reply.status_code == 503
        assert reply.get_json()["error"] == {
            "message": "no decode instance answers its health check",
            "type": "service_unavailable",
            "param": None,
            "code": 503,
        }
        assert len(responses.calls) == 0
    finally:
        app.extensions["pd_gateway"].close()


# --- a real gateway, real engines, real sockets -------------------------------------------------

HOSTS = ("127.0.0.170", "127.0.0.171")  # P, D


def _status(gateway) -> dict:
    return requests.get(
        gateway.url + "/admin/status",
        timeout=5,
        headers={"Authorization": f"Bearer {gateway.admin_token}"},
    ).json()


@pytest.mark.processes
def test_a_gateway_is_not_ready_until_its_engines_answer_and_refuses_turns_before_p():
    """The D's URL has nothing listening (a mistyped URL, or a D not started yet): /health is
    503 and pd_gateway_engine_up 0 before any client asks; a turn gets 503 and P never sees it.
    Once the D starts, the gateway is ready within a probe interval, and serves."""
    d_port = free_port(HOSTS[1], 2)  # its HTTP port and its KV port
    d_url = f"http://{HOSTS[1]}:{d_port}"
    with (
        EmulatorProcess("prefill", host=HOSTS[0], itl_ms=1, bidirectional_kv_xfer=True) as p,
        gateway_process([p.url], [d_url], probe_interval=0.2, ready=False) as gateway,
    ):
        # The first probe round has found the D not answering and the P answering (each
        # probed on its own: driven, not waited for).
        def probed() -> bool:
            status = _status(gateway)
            return status["decode"][0]["state"] == "down" and status["prefill"][0]["ready"] is True

        wait_until(probed, 10, "the probes to find the D down and the P ready")
        health = requests.get(gateway.url + "/health", timeout=5)
        assert health.status_code == 503 and health.json() == {"status": "degraded"}
        assert gateway.metric("pd_gateway_engine_up", role="decode") == 0
        assert gateway.metric("pd_gateway_engine_up", role="prefill") == 1
        reply = requests.post(
            gateway.url + "/v1/chat/completions",
            timeout=10,
            json={"model": MODEL, "messages": MESSAGES},
        )
        assert reply.status_code == 503 and reply.json()["error"]["code"] == 503
        assert "no decode instance answers" in reply.json()["error"]["message"]
        assert p.stats()["requests"] == 0
        with EmulatorProcess(
            "decode",
            host=HOSTS[1],
            port=d_port,
            kv_port=d_port + 1,
            itl_ms=1,
            bidirectional_kv_xfer=True,
        ):
            wait_until(
                lambda: requests.get(gateway.url + "/health", timeout=5).status_code == 200,
                10,
                "the gateway to be ready",
            )
            assert gateway.metric("pd_gateway_engine_up", role="decode") == 1
            assert _status(gateway)["decode"][0]["models"] == [MODEL]
            # What it says of its KV cache (vllm:cache_config_info), read once a second.
            wait_until(
                lambda: gateway.metric("pd_gateway_engine_kv_blocks", role="decode") == 20000,
                10,
                "the D's /metrics to be read",
            )
            assert gateway.metric("pd_gateway_engine_block_size", role="decode") == 16
            assert (
                f"decode[0] ({d_url}): KV block size 16, 20000 blocks, prefix caching on"
                in gateway.log()
            )
            reply = requests.post(
                gateway.url + "/v1/chat/completions",
                timeout=10,
                json={"model": MODEL, "messages": MESSAGES},
            )
            assert reply.status_code == 200


@pytest.mark.processes
@pytest.mark.parametrize("stream", [False, True])
def test_a_d_without_bidirectional_transfer_is_found_out_said_once_and_counted(stream):
    """vLLM's default: D keeps nothing after a turn and returns no kv_transfer_params
    (nixl/pull_scheduler.py ~L232-233). The gateway says so once, names the setting, counts
    every such turn, shows it in /admin/status, and stores nothing for it."""
    with (
        EmulatorProcess("prefill", host=HOSTS[0], itl_ms=1, bidirectional_kv_xfer=True) as p,
        EmulatorProcess("decode", host=HOSTS[1], itl_ms=1) as d,
        gateway_process([p.url], [d.url]) as gateway,
    ):
        messages = list(MESSAGES)
        for _ in range(3):
            reply = requests.post(
                gateway.url + "/v1/chat/completions",
                timeout=10,
                json={"model": MODEL, "messages": messages, "stream": stream},
            )
            assert reply.status_code == 200 and reply.headers["X-Gateway-Cache"] == "miss"
            text = (
                sse.reply(sse.events(reply.content))
                if stream
                else reply.json()["choices"][0]["message"]["content"]
            )
            messages += [
                {"role": "assistant", "content": text},
                {"role": "user", "content": "and then?"},
            ]
        wait_until(
            lambda: gateway.metric("pd_gateway_decode_kept_nothing_total", engine="decode[0]") == 3,
            10,
            "the third turn's count",
        )
        (status,) = _status(gateway)["decode"]
        assert status["keeps_blocks"] is False and status["turns_kept_nothing"] == 3
        assert gateway.metric("pd_gateway_entries_total", event="stored") == 0
        assert gateway.log().count("finished a turn without kv_transfer_params") == 1
        assert "bidirectional_kv_xfer" in gateway.log()
        assert d.stats()["kv_lease_blocks"] == 0 and p.stats()["hits"] == 0
