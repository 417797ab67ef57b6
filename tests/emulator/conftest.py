"""Emulator test fixtures: in-process engines from the factory, and a real P/D pair of processes."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import requests

from devtools import sse as sse_client
from emulator.app import create_app
from emulator.config import EngineConfig
from emulator.engine import Engine
from emulator.process import EmulatorProcess

# What a gateway sends P on turn 1 (vLLM's disagg_proxy_multiturn.py).
STUB = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None}


@pytest.fixture
def stub() -> dict:
    return dict(STUB)


class TickingClock:
    """A fake monotonic clock that the injected sleep advances, so no test really waits."""

    def __init__(self) -> None:
        self.now = 5000.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


@dataclass
class Api:
    engine: Engine
    clock: TickingClock
    client: object = field(repr=False)

    def post(self, path: str, body: object, **kwargs: object):
        return self.client.post(path, json=body, **kwargs)


@pytest.fixture
def make_api():
    """Build an in-process engine + Flask test client; keyword args override EngineConfig."""

    def make(**overrides: object) -> Api:
        clock = TickingClock()
        settings = {"role": "decode", "port": 18200, "itl_ms": 2.0, "output_tokens": 4, **overrides}
        # Background work (a read notification) runs at once: no hub runs in these tests.
        engine = Engine(EngineConfig(**settings), clock=clock, sleep=clock.sleep,
                        background=lambda fn, *args: fn(*args))
        return Api(engine, clock, create_app(engine).test_client())

    return make


def parse_sse(raw: bytes) -> list:
    """SSE body -> list of decoded JSON events, with "[DONE]" kept as the string."""
    assert raw.endswith(b"\n\n"), raw[-200:]
    events = sse_client.events(raw)
    assert len(events) == raw.count(b"\n\n"), raw    # every block is one data event
    return events


@pytest.fixture
def sse():
    return parse_sse


def stream_params(events: list) -> dict | None:
    """D's kv_transfer_params from a stream, wherever the engine placed them."""
    for event in events:
        if isinstance(event, dict) and event.get("kv_transfer_params"):
            return event["kv_transfer_params"]
    return None


@dataclass
class PD:
    """A prefill and a decode process on different loopback addresses, driven by hand like a gateway."""

    p: EmulatorProcess
    d: EmulatorProcess

    def prefill(self, messages: list, params: dict | None = None, **extra: object) -> requests.Response:
        body = {"model": "emulated-model", "messages": messages, "max_tokens": 1, "stream": False,
                "kv_transfer_params": params if params is not None else STUB, **extra}
        return requests.post(self.p.url + "/v1/chat/completions", json=body, timeout=10)

    def decode(self, messages: list, p_params: dict | None, **extra: object) -> requests.Response:
        body = {"model": "emulated-model", "messages": messages, "stream": True,
                "kv_transfer_params": p_params, **extra}
        # stream=True on the client side too, so a test can read (or abandon) the body incrementally.
        return requests.post(self.d.url + "/v1/chat/completions", json=body, timeout=10, stream=True)

    def turn(self, messages: list, d_params: dict | None = None,
             **decode_extra: object) -> tuple[str, dict]:
        """One full turn as the gateway runs it; returns D's reply text and D's params.
        `decode_extra` goes into D's body (max_tokens=100: a reply long enough that the next
        turn's P reads it rather than recompute it, past kv_recompute_threshold)."""
        if d_params is None:
            p_in = STUB
        else:  # the previous turn's D params, flags flipped, host rewritten to D's address
            p_in = {**d_params, "do_remote_decode": True, "do_remote_prefill": False,
                    "remote_host": self.d.host}
        p_response = self.prefill(messages, p_in)
        assert p_response.status_code == 200, p_response.text
        p_params = {**p_response.json()["kv_transfer_params"], "remote_host": self.p.host}
        d_response = self.decode(messages, p_params, **decode_extra)
        assert d_response.status_code == 200, d_response.text
        events = parse_sse(d_response.content)
        reply = sse_client.reply(events)
        params = stream_params(events)
        assert params is not None, events
        return reply, params


@pytest.fixture(scope="session")
def pd_processes():
    # Distinct loopback addresses: remote_host "localhost" (127.0.0.1) reaches neither engine.
    # Not vLLM's default: bidirectional transfer on, as a P/D gateway's engines run.
    with EmulatorProcess("prefill", host="127.0.0.2", prefill_ms_per_token=0.01, itl_ms=1,
                         output_tokens=6, bidirectional_kv_xfer=True) as p, \
            EmulatorProcess("decode", host="127.0.0.3", prefill_ms_per_token=0.01, itl_ms=1,
                            output_tokens=6, bidirectional_kv_xfer=True) as d:
        yield p, d


@pytest.fixture
def pd(pd_processes):
    p, d = pd_processes
    for engine in (p, d):
        engine.set_fault("none")
        engine.reset_stats()
    yield PD(p, d)
    for engine in (p, d):
        engine.set_fault("none")
