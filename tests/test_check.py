"""`pd-gateway check` against real emulated engines: what it reports, and its exit status."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers.servers import starts_processes

pytestmark = pytest.mark.processes

BIDIRECTIONAL_FIX = (
    '--kv-transfer-config \'{"kv_connector":"NixlConnector","kv_role":'
    '"kv_both","kv_connector_extra_config":{"bidirectional_kv_xfer":true}}\''
)


@pytest.fixture(scope="module")
@starts_processes
def engines():
    """vLLM's defaults but for bidirectional transfer, on 127.0.0.150-154 (no other module's):
    P and D of block size 16, a D without bidirectional transfer (vLLM's default), and P and D
    of block size 32."""
    from emulator.process import EmulatorProcess

    specs = {
        "p16": ("prefill", "127.0.0.150", {"bidirectional_kv_xfer": True}),
        "d16": ("decode", "127.0.0.151", {"bidirectional_kv_xfer": True}),
        "d16_off": ("decode", "127.0.0.152", {}),
        "p32": ("prefill", "127.0.0.153", {"bidirectional_kv_xfer": True, "block_size": 32}),
        "d32": ("decode", "127.0.0.154", {"bidirectional_kv_xfer": True, "block_size": 32}),
    }
    with ThreadPoolExecutor(len(specs)) as pool:  # each start waits for its /health
        futures = {
            name: pool.submit(EmulatorProcess, role, host=host, itl_ms=1, **flags)
            for name, (role, host, flags) in specs.items()
        }
    started = {name: f.result() for name, f in futures.items() if f.exception() is None}
    try:
        for future in futures.values():
            if future.exception() is not None:
                raise future.exception()
        yield started
    finally:
        for engine in started.values():
            engine.stop()


def check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", "check", "--timeout", "10", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_good_pair_passes_with_its_kv_cache_and_p_reading_ds_blocks(engines):
    done = check("--prefill", engines["p16"].url, "--decode", engines["d16"].url)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert out.count("  block size      16\n") == 2
    assert out.count("  capacity        20000 blocks\n") == 2
    assert out.count("  prefix caching  on\n") == 2
    assert "prefill[0] -> decode[0]: P reads D's blocks (" in out
    assert "the chat template keeps the prefix property" in out
    assert "FAIL" not in out and "warn " not in out
    assert out.rstrip().endswith("reuse will work (0 failures, 0 warnings)")


def test_a_decode_without_bidirectional_transfer_fails_naming_the_setting(engines):
    done = check("--prefill", engines["p16"].url, "--decode", engines["d16_off"].url)
    assert done.returncode == 1, done.stdout + done.stderr
    assert (
        "FAIL  prefill[0] -> decode[0]: D returned no kv_transfer_params after the turn"
        in done.stdout
    )
    assert f"      fix: start D with {BIDIRECTIONAL_FIX}\n" in done.stdout
    assert "P reads D's blocks" not in done.stdout
    assert done.stdout.rstrip().endswith("reuse will NOT work (1 failure, 0 warnings)")


def test_an_unreachable_decode_fails_and_the_others_are_still_checked(engines):
    from emulator.process import free_port

    nowhere = f"http://127.0.0.155:{free_port('127.0.0.155')}"
    done = check("--prefill", engines["p16"].url, "--decode", nowhere, engines["d16"].url)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"FAIL  decode[0]: not reachable: GET {nowhere}/health did not answer 200" in done.stdout
    assert "prefill[0] -> decode[1]: P reads D's blocks (" in done.stdout
    assert "reuse will NOT work (1 failure, 0 warnings)" in done.stdout


def test_engines_of_block_size_32_pass_and_the_json_report_says_so(engines):
    model = f"emulated-model;prefill={engines['p32'].url};decode={engines['d32'].url}"
    done = check("--models", model, "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["ok"] is True
    assert [(e["name"], e["block_size"], e["prefix_caching"]) for e in report["engines"]] == [
        ("emulated-model/prefill[0]", 32, True),
        ("emulated-model/decode[0]", 32, True),
    ]
    assert {
        "status": "ok",
        "subject": "emulated-model",
        "message": "P's and D's block sizes agree (32)",
        "fix": "",
    } in report["checks"]
    assert [c for c in report["checks"] if c["status"] != "ok"] == []


def test_a_prefill_block_size_not_a_multiple_of_the_decodes_fails(engines):
    done = check("--prefill", engines["p16"].url, "--decode", engines["d32"].url)
    assert done.returncode == 1, done.stdout + done.stderr
    assert (
        "FAIL  emulated-model: P's and D's block sizes differ (prefill[0] 16; decode[0] 32)"
        in done.stdout
    )
    assert "      fix: start every P and D of the model with one --block-size\n" in done.stdout


def test_a_usage_error_exits_2():
    done = check("--decode", "not-a-url")
    assert done.returncode == 2
    assert "--decode: 'not-a-url' is not an http://host:port URL" in done.stderr
