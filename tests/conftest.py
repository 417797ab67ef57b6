"""Shared fixtures: apps from the factory, a fake clock, and real servers on free ports. What
tests share besides fixtures is in tests/helpers/. Two checks on the suite itself: no test
module is imported as a library, and every test that starts a process is marked `processes`."""

from __future__ import annotations

import _posixsubprocess
import ast
import contextlib
import functools
import os
import subprocess
from pathlib import Path

import pytest

# A metric label value the code emits undeclared (README's table would not list it) raises, in
# this process and in every gateway the suite starts: set before gateway.support.metrics loads.
os.environ["PD_GATEWAY_STRICT_METRICS"] = "1"

from gateway.reuse.store import LocalStore  # noqa: E402
from tests.helpers.payloads import pinned_app  # noqa: E402
from tests.helpers.servers import gateway_process, reset, starts_processes  # noqa: E402


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
    # Engine calls answered by `responses` alone (tests/helpers/payloads.pinned_app: unroutable
    # hosts, reuse on digests, background releases, /metrics reads and probes off).
    # tests/test_release.py checks what is dropped, tests/test_fast_path.py the release itself,
    # tests/test_d_memory.py both end to end; tests/test_engine_load.py the reads,
    # tests/test_readiness.py the probes.
    app = pinned_app(store, max_body_bytes=4096)
    yield app
    # Its prober would go on probing an instance marked down, into later tests' mocks.
    app.extensions["pd_gateway"].close()


@pytest.fixture
def client(app):
    return app.test_client()


@pytest.fixture(autouse=True)
def _no_watch_left_behind():
    """The test client runs the app in the test's own thread: a streamed reply a test left
    unread keeps its request's watch as the thread's current one, and once that request's
    deadline passed, any later engine call in the thread (another test's) was refused as cut.
    Each test ends with none (the test that left it has its reply; the servers serve each
    request in a greenlet or thread of its own, and close every reply)."""
    yield
    from gateway.engines.watch import _WATCH

    watch = _WATCH.get()
    if watch is not None:
        watch.stop()
        _WATCH.set(None)


# --- real servers -----------------------------------------------------------------------------
# Engines on distinct loopback addresses: a pull only works if the gateway rewrote remote_host.
P_HOST, D_HOST = "127.0.0.2", "127.0.0.3"


@pytest.fixture(scope="session")
@starts_processes
def engines():
    from emulator.process import EmulatorProcess

    # Not vLLM's defaults: bidirectional transfer on (what the gateway is for), and
    # kv_recompute_threshold 0, so that P reads whatever D holds beyond its own cache and every
    # reuse shows in P's counters (with 64, short replies are recomputed: tests/test_kv_truth.py).
    with (
        EmulatorProcess(
            "prefill", bidirectional_kv_xfer=True, host=P_HOST, itl_ms=1, recompute_threshold=0
        ) as p,
        EmulatorProcess(
            "decode", bidirectional_kv_xfer=True, host=D_HOST, itl_ms=1, recompute_threshold=0
        ) as d,
    ):
        yield p, d


@pytest.fixture(scope="session")
@starts_processes
def agent_engines():
    """Engines whose every reply reasons and, given tools, calls the first one: the agents'
    APIs' loops (tests/test_messages.py, tests/test_responses_api.py); `reset` them first."""
    from emulator.process import EmulatorProcess

    flags = dict(
        bidirectional_kv_xfer=True,
        itl_ms=1,
        recompute_threshold=0,
        reasoning_share=1.0,
        tool_call_share=1.0,
    )
    with (
        EmulatorProcess("prefill", host="127.0.0.145", **flags) as p,
        EmulatorProcess("decode", host="127.0.0.146", **flags) as d,
    ):
        yield p, d


@pytest.fixture
def fresh_engines(engines):
    return reset(engines)


@pytest.fixture(scope="session")
@starts_processes
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
    # Told to stop all at once, then waited for: one after another, their graceful stops took
    # some 20 s at the session's end.
    for gateway in started.values():
        if gateway.process.poll() is None:
            gateway.process.terminate()
    for gateway in started.values():
        gateway.stop()


@pytest.fixture(scope="session")
@starts_processes
def redis_server():
    from devtools.processes import RedisProcess

    server = RedisProcess()
    yield server
    server.stop()


# --- no test module is a library ----------------------------------------------------------------


def imports_of_test_modules(root: Path) -> list[str]:
    """Every import, in the Python files under `root`, of a test module or of a conftest.py.
    What tests share is in tests/helpers/: a test module imported as a library runs its module
    code twice under two names, and so does a conftest.py (`conftest` to pytest, `tests.conftest`
    to the test that imports it: two FakeClock classes, two sets of constants)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                # `from tests.test_x import y` names the module, `from tests import test_x` its item
                names = (
                    [node.module]
                    if _names_a_test_module(node.module)
                    else [f"{node.module}.{alias.name}" for alias in node.names]
                )
            else:
                continue
            found += [
                f"{path.relative_to(root.parent)}:{node.lineno} imports {name}"
                for name in names
                if _names_a_test_module(name)
            ]
    return found


def _names_a_test_module(name: str) -> bool:
    return any(part == "conftest" or part.startswith("test_") for part in name.split("."))


def pytest_configure(config):
    imported = imports_of_test_modules(Path(__file__).resolve().parent)
    if imported:
        raise pytest.UsageError(
            "test modules and conftest.py are not libraries (put what tests "
            "share in tests/helpers/):\n  " + "\n  ".join(imported)
        )


# --- the `processes` mark -----------------------------------------------------------------------
# A test that starts a process (an engine, a gateway, Redis, Prometheus, promtool, a fork) is
# marked `processes`: `make test-fast` runs the others, in this process alone. A test is marked
# by hand (a decorator, or a module's pytestmark), or here, when a fixture it uses is tagged
# @starts_processes. Enforced whatever runs first: a test not marked fails if it (or a fixture
# set up for it) starts a process, and any fixture that starts one untagged fails.


class ProcessNotMarked(Exception):
    pass


class _Spawns:
    """Counts the processes each fixture's setup starts, and refuses them while a test not
    marked `processes` is set up or runs (`refusing` names it)."""

    def __init__(self) -> None:
        self.started = [0]  # one count per fixture being set up, innermost last
        self.refusing: str | None = None
        self.refused: list[str] = []


_spawns = _Spawns()


def _counted(original, what: str):
    @functools.wraps(original)
    def spawn(*args, **kwargs):
        if _spawns.refusing is not None:
            message = (
                f"{_spawns.refusing} starts a process ({what}): mark it `processes` "
                "(@pytest.mark.processes), or tag the fixture that starts it "
                "@starts_processes (tests/helpers/servers.py)"
            )
            _spawns.refused.append(message)
            raise ProcessNotMarked(message)
        _spawns.started[-1] += 1
        return original(*args, **kwargs)

    return spawn


# Every way a process starts here: subprocess (and so os.popen, asyncio's subprocesses),
# multiprocessing (fork: os.fork; spawn and forkserver: _posixsubprocess), os.fork and the rest.
for _owner, _name, _what in [
    (subprocess.Popen, "_execute_child", "subprocess"),
    (_posixsubprocess, "fork_exec", "fork_exec"),
    (os, "fork", "os.fork"),
    (os, "forkpty", "os.forkpty"),
    (os, "posix_spawn", "os.posix_spawn"),
    (os, "posix_spawnp", "os.posix_spawnp"),
    (os, "system", "os.system"),
]:
    setattr(_owner, _name, _counted(getattr(_owner, _name), _what))


def _starts_processes(fixturedef) -> bool:
    return getattr(fixturedef.func, "starts_processes", False)


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(items):
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info and any(
            _starts_processes(fixturedef)
            for fixturedefs in info.name2fixturedefs.values()
            for fixturedef in fixturedefs
        ):
            item.add_marker(pytest.mark.processes)


@contextlib.contextmanager
def _refused_unless_marked(item):
    if item.get_closest_marker("processes"):
        yield
        return
    _spawns.refusing, _spawns.refused = item.nodeid, []
    try:
        yield
    finally:
        _spawns.refusing = None
    if _spawns.refused:  # raised, and caught by the code under test
        raise ProcessNotMarked(_spawns.refused[0])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with _refused_unless_marked(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with _refused_unless_marked(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    _spawns.started.append(0)
    try:
        value = yield
    finally:
        started = _spawns.started.pop()
    if started and not _starts_processes(fixturedef):
        raise ProcessNotMarked(
            f"fixture {fixturedef.argname} ({fixturedef.baseid or '.'}) "
            "starts a process: tag it @starts_processes "
            "(tests/helpers/servers.py)"
        )
    return value
