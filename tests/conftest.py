"""Shared fixtures: apps from the factory, a fake clock, and real servers on free ports."""
from __future__ import annotations

import contextlib

import pytest

from devtools.workload import MODEL  # noqa: F401  (the tests' model name)
from gateway.app import create_app
from gateway.config import Settings
from gateway.reuse.store import LocalStore

P_URL = "http://10.9.0.1:8100"
D_URL = "http://10.9.0.2:8200"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(clock: FakeClock) -> LocalStore:
    return LocalStore(maxsize=100, ttl=450, timer=clock)


@pytest.fixture
def app(store: LocalStore):
    # Unroutable example hosts: only `responses` mocks answer them. Reuse on digests alone
    # (no /tokenize calls, no token ids) unless a test asks for verification.
    # Background releases and reads of the engines' /metrics off (release_rate=0,
    # engine_metrics_interval=0, here and in every app whose engine calls a test pins with
    # `responses`): they would interleave with the calls pinned. tests/test_release.py checks
    # what is dropped, tests/test_fast_path.py the release itself, tests/test_d_memory.py both
    # end to end; tests/test_engine_load.py the reads.
    settings = Settings(prefill=[P_URL], decode=[D_URL], worker_class="gthread", threads=8,
                        max_body_bytes=4096, verify_reuse="off", release_rate=0,
                        engine_metrics_interval=0)
    app = create_app(settings, store=store)
    yield app
    # Its prober would go on probing an instance marked down, into later tests' mocks.
    app.extensions["pd_gateway"].close()


@pytest.fixture
def client(app):
    return app.test_client()


# --- real servers -----------------------------------------------------------------------------
# Engines on distinct loopback addresses: a pull only works if the gateway rewrote remote_host.
P_HOST, D_HOST = "127.0.0.2", "127.0.0.3"


@contextlib.contextmanager
def two_of_each(first_host: int):
    """Two P and two D engines on 127.0.0.N..N+3, so each pull names its engine's host."""
    from emulator.process import EmulatorProcess
    with contextlib.ExitStack() as stack:
        engines = [stack.enter_context(EmulatorProcess(role, bidirectional_kv_xfer=True, host=f"127.0.0.{first_host + i}",
                                                       itl_ms=1))
                   for i, role in enumerate(["prefill", "prefill", "decode", "decode"])]
        yield engines[:2], engines[2:]


@pytest.fixture(scope="session")
def engines():
    from emulator.process import EmulatorProcess
    # Not vLLM's defaults: bidirectional transfer on (what the gateway is for), and
    # kv_recompute_threshold 0, so that P reads whatever D holds beyond its own cache and every
    # reuse shows in P's counters (with 64, short replies are recomputed: tests/test_kv_truth.py).
    with EmulatorProcess("prefill", bidirectional_kv_xfer=True, host=P_HOST, itl_ms=1,
                         recompute_threshold=0) as p, \
            EmulatorProcess("decode", bidirectional_kv_xfer=True, host=D_HOST, itl_ms=1,
                            recompute_threshold=0) as d:
        yield p, d


def reset(engines):
    """Engines shared by several tests, as a test finds them: no fault, counters at zero."""
    for engine in engines:
        engine.set_fault("none")
        engine.reset_stats()
    return engines


@pytest.fixture
def fresh_engines(engines):
    return reset(engines)


def gateway_process(prefill, decode, **settings):
    from devtools.processes import GatewayProcess
    return GatewayProcess(prefill, decode, **settings)


@pytest.fixture(scope="session")
def gateway_factory():
    """Start gateways under gunicorn, shared by settings; all stopped at the session's end."""
    started = {}

    def start(prefill, decode, **settings):
        # No background releases unless a test asks: these gateways live the whole session, and
        # as their entries expire (store_ttl) they would release them into the shared engines,
        # whose request counts other tests wait on.
        settings.setdefault("release_rate", 0)
        key = (tuple(prefill), tuple(decode), tuple(sorted(settings.items())))
        if key not in started:
            started[key] = gateway_process(prefill, decode, **settings)
        return started[key]

    yield start
    for gateway in started.values():
        gateway.stop()


@pytest.fixture(scope="session")
def redis_server():
    from devtools.processes import RedisProcess
    server = RedisProcess()
    yield server
    server.stop()
