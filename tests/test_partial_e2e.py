"""Partial reuse end to end: OpenAI SDK clients through a gateway under gunicorn, emulated
engines whose templates leave the next prompt sharing only a prefix of what D holds. P's prefix
cache is off here (not vLLM's default: it stands for a P whose cache turned over, or another P
than the last turn's), so every token P does not compute was read from D. P's `wrong_reuse`
counts a read whose blocks do not hold P's tokens at the positions they are read into."""

from __future__ import annotations

import pytest

from devtools.partial import CASES, HYBRID, measure

pytestmark = pytest.mark.processes  # engines and gateways, every test

BY_NAME = {c.name: c for c in CASES}


@pytest.mark.parametrize("name", list(BY_NAME))
def test_p_reads_what_it_shares_with_d_and_nothing_wrong(name):
    result = measure(BY_NAME[name], cold=True, conversations=3, turns=4, first_host=90)
    print(
        f"\n{name}: read {result['read']} of {result['shareable']}, partial "
        f"{result['partial']}, wrong {result['wrong_reuse']}"
    )
    assert result["errors"] == [] and result["p_errors"] == 0
    assert result["wrong_reuse"] == 0
    assert result["shareable"] > 0 and result["read"] >= 0.9 * result["shareable"]
    assert result["partial"] > 0


def test_a_hybrid_model_gets_no_partial_read():
    """Two KV groups, one a sliding window: no cut of D's lists is position-exact."""
    result = measure(HYBRID, cold=True, conversations=3, turns=4, first_host=92)
    assert result["errors"] == [] and result["p_errors"] == 0
    assert result["partial"] == 0 and result["wrong_reuse"] == 0 and result["shareable"] > 0


def test_off_reads_nothing_of_a_shared_prefix():
    result = measure(
        BY_NAME["system-last"],
        cold=True,
        conversations=2,
        turns=3,
        settings={"partial_reuse_tokens": 0},
        first_host=94,
    )
    assert result["partial"] == 0 and result["read"] == 0 and result["wrong_reuse"] == 0


def test_engines_with_32_token_blocks_get_partial_reads_with_no_flag():
    """The block size partial reuse cuts at is what the engines report
    (vllm:cache_config_info): 32-token blocks need no --kv-block-size."""
    case = BY_NAME["reasoning-dropped, echoed"]
    wide = type(case)(case.name, {**case.engine, "block_size": 32}, case.request)
    result = measure(wide, cold=True, conversations=2, turns=3, first_host=96)
    assert result["errors"] == [] and result["p_errors"] == 0 and result["wrong_reuse"] == 0
    assert result["partial"] > 0 and result["read"] > 0


def test_a_block_size_given_against_the_engines_gets_no_partial_read():
    """--kv-block-size still overrides the engines' report: 16 against engines with 32-token
    blocks, D's lists do not fit it, so no entry is cut (and a warning says why)."""
    case = BY_NAME["reasoning-dropped, echoed"]
    wide = type(case)(case.name, {**case.engine, "block_size": 32}, case.request)
    result = measure(
        wide, cold=True, conversations=2, turns=3, settings={"kv_block_size": 16}, first_host=96
    )
    assert result["errors"] == [] and result["partial"] == 0 and result["wrong_reuse"] == 0
