"""Emulator test fixtures: in-process engines from the factory, and a real P/D pair of processes."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from emulator.app import create_app
from emulator.config import EngineConfig
from emulator.engine import Engine
from emulator.process import EmulatorProcess
from tests.helpers.emulator import PD, STUB, parse_sse
from tests.helpers.servers import starts_processes


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
        engine = Engine(
            EngineConfig(**settings),
            clock=clock,
            sleep=clock.sleep,
            background=lambda fn, *args: fn(*args),
        )
        return Api(engine, clock, create_app(engine).test_client())

    return make


@pytest.fixture
def sse():
    return parse_sse


@pytest.fixture(scope="session")
@starts_processes
def pd_processes():
    # Distinct loopback addresses: remote_host "localhost" (127.0.0.1) reaches neither engine.
    # Not vLLM's default: bidirectional transfer on, as a P/D gateway's engines run.
    with (
        EmulatorProcess(
            "prefill",
            host="127.0.0.2",
            prefill_ms_per_token=0.01,
            itl_ms=1,
            output_tokens=6,
            bidirectional_kv_xfer=True,
        ) as p,
        EmulatorProcess(
            "decode",
            host="127.0.0.3",
            prefill_ms_per_token=0.01,
            itl_ms=1,
            output_tokens=6,
            bidirectional_kv_xfer=True,
        ) as d,
    ):
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
