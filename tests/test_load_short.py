"""A short bounded locust run: 30 multi-turn streaming users for 15 s, and not one failure; the
locustfile as an operator runs it against a production gateway (alone, with a client key, each
turn timed to its [DONE], long replies that make P read D's blocks); and the benchmark's OpenAI
SDK load generator."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys

import pytest

from devtools import ROOT
from devtools.locust_runs import CHAT_ROW, LOCUSTFILE, TPOT, run_locust
from tests.helpers.servers import gateway_process, starts_processes

# Found without importing it: importing locust monkey-patches this whole process with gevent.
needs_locust = pytest.mark.skipif(
    importlib.util.find_spec("locust") is None,
    reason="locust is not installed: pip install -e '.[test,load]'",
)


@needs_locust
def test_short_load_run_has_no_failures(fresh_engines, gateway_factory, tmp_path):
    p, d = fresh_engines
    # A gateway of its own (its settings key), so the conversations it stores stay out of
    # other tests' counts; warnings only, as under real load.
    gateway = gateway_factory([p.url], [d.url], log_level="warning")
    result = run_locust(
        gateway.url,
        users=30,
        spawn_rate=30,
        duration="15s",
        csv_prefix=tmp_path / "locust",
        extra=["--turns", "3", "--think", "0.2", "0.6"],
        timeout=120,
    )
    assert result.ok, result.problems
    # At least one turn per user per 1.5 s: a stalled gateway would not reach it.
    assert result.turns >= 30 * 15 / 1.5
    assert result.ttft_p50 is not None and result.ttft_p99 is not None
    prefill = p.stats()
    # Later turns reused D's blocks (the users fail a turn that is not a hit), never wrongly.
    assert prefill["hits"] > 0 and prefill["wrong_reuse"] == 0


ITL_MS = 5
KEY = "load-key"
KV_READS = ("read", "recomputed", "own_cache", "unreported")


@pytest.fixture(scope="module")
@starts_processes
def keyed():
    """Engines on vLLM's defaults (prefix caching, kv_recompute_threshold 64), the gateway with
    a client key."""
    from emulator.process import EmulatorProcess

    with (
        EmulatorProcess(
            "prefill", bidirectional_kv_xfer=True, host="127.0.0.92", itl_ms=ITL_MS
        ) as p,
        EmulatorProcess(
            "decode", bidirectional_kv_xfer=True, host="127.0.0.93", itl_ms=ITL_MS
        ) as d,
        gateway_process([p.url], [d.url], api_keys=KEY, log_level="warning") as gateway,
    ):
        yield p, d, gateway


@pytest.fixture
@starts_processes
def alone(tmp_path, monkeypatch):
    """locustfile.py copied into a directory of its own, as an operator who installed
    pd-gateway has it: neither devtools nor the emulator can be imported there."""
    monkeypatch.delenv("PYTHONPATH", raising=False)
    for name in ("LOCUST_API_KEY", "OPENAI_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    here = tmp_path / "alone"
    here.mkdir()
    shutil.copy(LOCUSTFILE, here)
    found = subprocess.run(
        [
            sys.executable,
            "-c",
            "import importlib.util as u; print([u.find_spec(m) for m in ('devtools', 'emulator')])",
        ],
        cwd=here,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert found.strip() == "[None, None]"
    return here / "locustfile.py"


def run_alone(locustfile, gateway, *extra: str, duration: str = "5s") -> tuple:
    """Four users of three-turn conversations; the run and what P did with D's blocks (the
    gateway's pd_gateway_kv_reads_total, by result) while it ran."""
    before = {r: gateway.metric("pd_gateway_kv_reads_total", result=r) for r in KV_READS}
    result = run_locust(
        gateway.url,
        users=4,
        spawn_rate=4,
        duration=duration,
        csv_prefix=locustfile.parent / "out" / "locust",
        locustfile=locustfile,
        extra=["--turns", "3", "--think", "0.1", "0.3", *extra],
        timeout=90,
    )
    reads = {r: gateway.metric("pd_gateway_kv_reads_total", result=r) - before[r] for r in KV_READS}
    return result, reads


@needs_locust
def test_the_locustfile_runs_alone_with_the_key_from_the_environment(keyed, alone, monkeypatch):
    """Short replies: later turns send P D's blocks, which P recomputes (under the threshold).
    Each turn is timed to its [DONE]: 16 tokens, at least 15 inter-token waits."""
    p, d, gateway = keyed
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    result, reads = run_alone(alone, gateway)
    assert result.ok, result.problems
    assert reads["recomputed"] > 0 and reads["read"] == reads["own_cache"] == 0
    assert float(result.stats[CHAT_ROW]["Min Response Time"]) >= 15 * ITL_MS
    assert result.ttft_p50 is not None and TPOT in result.stats


@needs_locust
def test_the_long_workload_makes_every_later_turns_p_read_ds_blocks(keyed, alone):
    """128-token replies: D holds more than the threshold beyond P's cache, so P reads it."""
    p, d, gateway = keyed
    p.reset_stats()
    result, reads = run_alone(alone, gateway, "--api-key", KEY, "--workload", "long")
    assert result.ok, result.problems
    assert reads["read"] > 0 and reads["recomputed"] == reads["own_cache"] == 0
    assert p.stats()["hits"] == reads["read"] and p.stats()["wrong_reuse"] == 0
    assert float(result.stats[CHAT_ROW]["Min Response Time"]) >= 127 * ITL_MS


@needs_locust
def test_without_the_key_every_turn_fails(keyed, alone):
    p, d, gateway = keyed
    result, _ = run_alone(alone, gateway, duration="2s")
    assert result.returncode != 0 and result.turns > 0 and result.failures == result.turns
    assert all("HTTP 401" in problem for problem in result.problems), result.problems


def test_the_sdk_load_generator_holds_conversations_through_the_openai_sdk(
    fresh_engines, gateway_factory, tmp_path
):
    """bench.sdk_load (the history runs' OpenAI SDK clients, no conversation ids): every turn
    answered, and each later turn a conversation the gateway recognised (P read D's blocks)."""
    p, d = fresh_engines
    # A gateway of its own (its settings key): no other test's conversations in its store.
    gateway = gateway_factory([p.url], [d.url], log_level="error")
    out = tmp_path / "sdk.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.sdk_load",
            "--url",
            gateway.url,
            "--salt",
            "t",
            "--concurrency",
            "2",
            "--conversations",
            "3",
            "--turns",
            "3",
            "--duration",
            "60",
            "--history-bytes",
            "1024",
            "--out",
            str(out),
        ],
        check=True,
        timeout=90,
        cwd=ROOT,
    )
    result = json.loads(out.read_text())
    assert result["errors"] == [] and len(result["turns"]) == 9
    prefill = p.stats()
    assert prefill["hits"] == 6 and prefill["wrong_reuse"] == 0
