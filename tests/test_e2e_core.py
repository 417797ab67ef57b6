"""The core flow end to end: OpenAI SDK -> gateway under gunicorn -> emulated P and D processes."""

from __future__ import annotations

import uuid

import pytest
import requests
from openai import OpenAI

from tests.helpers.servers import MODEL, TURNS, chat_turns, starts_processes


@pytest.fixture(params=["gevent", "gthread"])
@starts_processes
def gateway(request, fresh_engines, gateway_factory):
    p, d = fresh_engines
    return gateway_factory([p.url], [d.url], worker_class=request.param)


def sdk(gateway, **headers) -> OpenAI:
    return OpenAI(
        base_url=gateway.url + "/v1", api_key="test-key", default_headers=headers, max_retries=0
    )


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "nonstream"])
@pytest.mark.parametrize("explicit", [True, False], ids=["conversation_id", "no_id"])
def test_chat_turns_after_the_first_hit(gateway, fresh_engines, stream, explicit):
    p, d = fresh_engines
    caches = chat_turns(sdk(gateway), stream, explicit)
    assert caches == ["miss"] + ["hit"] * (TURNS - 1)
    stats = p.stats()
    assert stats["hits"] == TURNS - 1
    assert stats["wrong_reuse"] == 0 and d.stats()["wrong_reuse"] == 0
    assert d.stats()["completed"] == TURNS


@pytest.mark.parametrize("header", ["X-Conversation-Id", "X-Session-ID"])
def test_id_headers_link_turns(gateway, fresh_engines, header):
    p, _ = fresh_engines
    caches = chat_turns(sdk(gateway, **{header: uuid.uuid4().hex}), True, explicit=False)
    assert caches[1:] == ["hit"] * (TURNS - 1)
    assert p.stats()["hits"] == TURNS - 1 and p.stats()["wrong_reuse"] == 0


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "nonstream"])
def test_completions_turns_with_an_id_hit(gateway, fresh_engines, stream):
    p, d = fresh_engines
    client = sdk(gateway)
    # Unique: the engines' prefix caches outlive a test, and P would find the whole history
    # of an earlier run's identical turns in its own cache (reading nothing from D).
    prompt = f"once upon a time {uuid.uuid4().hex} in a land of disaggregated engines"
    cid = uuid.uuid4().hex
    for turn in range(TURNS):
        result = client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=6,
            stream=stream,
            extra_body={"conversation_id": cid},
        )
        if stream:
            chunks = list(result)
            assert all("kv_transfer_params" not in c.to_json() for c in chunks)
            text = "".join(c.choices[0].text for c in chunks if c.choices)
        else:
            assert "kv_transfer_params" not in result.to_json()
            text = result.choices[0].text
        prompt = prompt + text + f" and then chapter {turn}"
    assert p.stats()["hits"] == TURNS - 1
    assert p.stats()["wrong_reuse"] == 0


def test_models_and_health(gateway):
    client = sdk(gateway)
    assert [m.id for m in client.models.list()] == [MODEL]
    assert requests.get(gateway.url + "/health", timeout=5).json() == {"status": "ok"}
    health = gateway.status()
    assert health["status"] == "ok"
    assert [i["state"] for i in health["prefill"] + health["decode"]] == ["up", "up"]


def test_metrics_sum_every_worker(fresh_engines, gateway_factory):
    import requests

    from devtools import workload

    p, d = fresh_engines
    gateway = gateway_factory([p.url], [d.url], workers=2)
    convs = workload.run(gateway.url, conversations=10, turns=3, concurrency=4)
    assert workload.errors(convs) == []
    text = requests.get(gateway.url + "/metrics", timeout=5).text
    counts = {}
    for line in text.splitlines():
        if line.startswith("pd_gateway_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            counts[labels] = float(value)
    assert sum(counts.values()) == 30
    assert sum(v for k, v in counts.items() if 'cache="hit"' in k) == 20
    assert "pd_gateway_time_to_first_byte_seconds_bucket" in text


def test_the_metrics_directory_made_at_start_is_removed_at_exit(
    fresh_engines, tmp_path, monkeypatch
):
    """Without PROMETHEUS_MULTIPROC_DIR the master makes its own directory; its exit removes it."""
    from tests.helpers.servers import gateway_process

    p, d = fresh_engines
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where the gateway's mkdtemp puts it
    with gateway_process([p.url], [d.url], workers=2) as gateway:
        made = list(tmp_path.glob("pd-gateway-metrics-*"))
        assert len(made) == 1
    assert gateway.process.returncode == 0
    assert not made[0].exists()


def test_keep_alive_connection_serves_many_streams(gateway):
    """Back-to-back streams on one kept-alive connection (the disconnect watcher must not
    touch a socket the next request is being read from)."""
    import requests

    session = requests.Session()
    for i in range(40):
        response = session.post(
            gateway.url + "/v1/chat/completions",
            timeout=10,
            json={
                "model": MODEL,
                "stream": True,
                "max_tokens": 2,
                "messages": [{"role": "user", "content": f"keep alive {i}"}],
            },
        )
        assert response.status_code == 200 and response.content.endswith(b"data: [DONE]\n\n")


def test_a_connection_close_stream_ends_with_its_last_event(gateway):
    """A client that sends `Connection: close` (HTTP/1.0 clients, load tools) sees the socket
    close as soon as the stream ends. Under gevent the close used to wait for the loop's next
    wake (the request's watcher still polled the socket: gevent defers the close), 0.1-0.5 s
    after every stream; the watcher now stops with the request. Five streams, the median
    close against a bound well under the old delay and far over the new one (~0.1 ms)."""
    import json
    import socket
    import statistics
    import time

    host, port = gateway.url.split("//")[1].rsplit(":", 1)
    delays = []
    for _ in range(5):
        body = json.dumps(
            {
                "model": MODEL,
                "stream": True,
                "max_tokens": 4,
                "messages": [{"role": "user", "content": uuid.uuid4().hex}],
            }
        ).encode()
        with socket.create_connection((host, int(port)), timeout=30) as client:
            client.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\n"
                b"Content-Type: application/json\r\nConnection: close\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body) + body
            )
            received, done_at = b"", None
            while True:
                chunk = client.recv(65536)
                if not chunk:
                    break
                received += chunk
                if done_at is None and b"data: [DONE]" in received:
                    done_at = time.monotonic()
            delays.append(time.monotonic() - done_at)
        assert received.startswith(b"HTTP/1.1 200")
    print("\nclosed after the last event (ms):", [round(d * 1000, 1) for d in delays])
    assert statistics.median(delays) < 0.05
