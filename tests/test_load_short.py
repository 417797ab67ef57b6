"""A short bounded locust run: 30 multi-turn streaming users for 15 s, and not one failure; and
the benchmark's OpenAI SDK load generator."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from bench.load import run_locust
from bench.systems import ROOT

# Found without importing it: importing locust monkey-patches this whole process with gevent.
needs_locust = pytest.mark.skipif(importlib.util.find_spec("locust") is None,
                                  reason="locust is not installed: pip install -e '.[test,load]'")


@needs_locust
def test_short_load_run_has_no_failures(fresh_engines, gateway_factory, tmp_path):
    p, d = fresh_engines
    # A gateway of its own (its settings key), so the conversations it stores stay out of
    # other tests' counts; warnings only, as under real load.
    gateway = gateway_factory([p.url], [d.url], log_level="warning")
    result = run_locust(gateway.url, users=30, spawn_rate=30, duration="15s",
                        csv_prefix=tmp_path / "locust",
                        extra=["--turns", "3", "--think", "0.2", "0.6"], timeout=120)
    assert result.ok, result.problems
    # At least one turn per user per 1.5 s: a stalled gateway would not reach it.
    assert result.turns >= 30 * 15 / 1.5
    assert result.ttft_p50 is not None and result.ttft_p99 is not None
    prefill = p.stats()
    # Later turns reused D's blocks (the users fail a turn that is not a hit), never wrongly.
    assert prefill["hits"] > 0 and prefill["wrong_reuse"] == 0


def test_the_sdk_load_generator_holds_conversations_through_the_openai_sdk(fresh_engines,
                                                                           gateway_factory,
                                                                           tmp_path):
    """bench.sdk_load (the history runs' OpenAI SDK clients, no conversation ids): every turn
    answered, and each later turn a conversation the gateway recognised (P read D's blocks)."""
    p, d = fresh_engines
    # A gateway of its own (its settings key): no other test's conversations in its store.
    gateway = gateway_factory([p.url], [d.url], log_level="error")
    out = tmp_path / "sdk.json"
    subprocess.run([sys.executable, "-m", "bench.sdk_load", "--url", gateway.url, "--salt", "t",
                    "--concurrency", "2", "--conversations", "3", "--turns", "3",
                    "--duration", "60", "--history-bytes", "1024", "--out", str(out)],
                   check=True, timeout=90, cwd=ROOT)
    result = json.loads(out.read_text())
    assert result["errors"] == [] and len(result["turns"]) == 9
    prefill = p.stats()
    assert prefill["hits"] == 6 and prefill["wrong_reuse"] == 0
