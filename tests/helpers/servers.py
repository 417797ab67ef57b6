"""Real processes for the end-to-end tests: emulated engines, gateways under gunicorn, and what
the tests ask of them (a metric, a worker's children, a raw request abandoned, five chat turns)."""

from __future__ import annotations

import contextlib
import http.server
import json
import socket
import uuid

import requests

from devtools.workload import MODEL  # noqa: F401  (the tests' model name)


def starts_processes(fixture_function):
    """Tags a fixture that starts processes (itself, or through a factory such as
    gateway_factory): every test that uses it is marked `processes` (tests/conftest.py).
    Under @pytest.fixture."""
    fixture_function.starts_processes = True
    return fixture_function


@contextlib.contextmanager
def two_of_each(first_host: int):
    """Two P and two D engines on 127.0.0.N..N+3, so each pull names its engine's host."""
    from emulator.process import EmulatorProcess

    with contextlib.ExitStack() as stack:
        engines = [
            stack.enter_context(
                EmulatorProcess(
                    role, bidirectional_kv_xfer=True, host=f"127.0.0.{first_host + i}", itl_ms=1
                )
            )
            for i, role in enumerate(["prefill", "prefill", "decode", "decode"])
        ]
        yield engines[:2], engines[2:]


def reset(engines):
    """Engines shared by several tests, as a test finds them: no fault, counters at zero."""
    for engine in engines:
        engine.set_fault("none")
        engine.reset_stats()
    return engines


def gateway_process(prefill, decode, **settings):
    from devtools.processes import GatewayProcess

    return GatewayProcess(prefill, decode, **settings)


def health(gateway) -> dict:
    return gateway.status()


def metric(gateway, name: str, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(gateway.url + "/metrics", timeout=5).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def workers_of(gateway) -> set[int]:
    pid = gateway.process.pid
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return {int(child) for child in f.read().split()}


def open_and_abandon(gateway, body: dict, after, port: int | None = None) -> None:
    """Send a request on a raw socket (to `port`, a worker's private one, if given), wait for
    `after(sock)`, then close the connection."""
    raw = json.dumps(body).encode()
    sock = socket.create_connection((gateway.host, port or gateway.port))
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
        b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(raw), raw)
    )
    after(sock)
    sock.close()


TURNS = 5


def chat_turns(client, stream: bool, explicit: bool) -> list[str]:
    """Five turns of one conversation; returns the cache header of each turn."""
    messages = [
        {"role": "system", "content": "you are terse"},
        {"role": "user", "content": "first question about kv blocks"},
    ]
    extra = {"conversation_id": uuid.uuid4().hex} if explicit else {}
    caches = []
    for turn in range(TURNS):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, stream=stream, max_tokens=8, extra_body=extra
        )
        caches.append(raw.headers["X-Gateway-Cache"])
        if stream:
            chunks = list(raw.parse())
            for chunk in chunks:
                assert "kv_transfer_params" not in chunk.to_json()
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        else:
            reply = raw.parse()
            assert "kv_transfer_params" not in reply.to_json()
            assert reply.usage.completion_tokens == 8
            text = reply.choices[0].message.content
        assert text
        messages += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": f"follow up number {turn}"},
        ]
    return caches


class QuietHandler(http.server.BaseHTTPRequestHandler):
    """A hand-made engine for one test: `answer` sends one reply; no access log."""

    def answer(self, status: int, body: bytes = b"", headers: dict | None = None) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass
