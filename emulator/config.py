"""Engine settings: every emulator flag with its default, validator and help, stated once."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from typing import Any

from gateway.options import (
    SettingsError,
    add_arguments,
    boolean,
    bounded,
    check,
    given,
    option,
    positive,
)
from gateway.options import port as _port

from .faults import Fault, parse_fault_spec
from .tokens import QUIRKS

ROLES = ("prefill", "decode")
STREAM_PARAMS = ("final", "separate", "absent")
REASONING_FIELDS = ("reasoning", "reasoning_content", "both")
STREAM_TOKEN_IDS = ("complete", "lossy")
FAILURE_POLICIES = ("fail", "recompute")


def _quirks(value: Any) -> tuple:
    items = value.replace(",", " ").split() if isinstance(value, str) else list(value)
    quirks = tuple(q for q in items if q != "none")
    unknown = sorted(set(quirks) - set(QUIRKS))
    if unknown:
        raise ValueError(f"unknown quirk(s) {unknown}; known: {sorted(QUIRKS)}")
    return quirks


def _fault(value: Any) -> Fault:
    return value if isinstance(value, Fault) else parse_fault_spec(str(value))


def _log_level(value: Any) -> str:
    if not isinstance(logging.getLevelName(str(value).upper()), int):
        raise ValueError(f"{value!r} is not a logging level name")
    return str(value)


@dataclass
class EngineConfig:
    """Settings of one emulated engine; None means "the role's default" where noted."""

    role: str = option(
        "decode", str, "which side of the P/D pair this engine plays", choices=ROLES, required=True
    )
    port: int = option(
        8200, _port, "HTTP port: OpenAI API, /health, /v1/models, /stats, /faults", required=True
    )
    kv_port: int | None = option(
        None, _port, "KV port serving block pulls, reported as remote_port", show="--port + 1000"
    )
    host: str = option("127.0.0.1", str, "address both listeners bind to")
    model: str = option(
        "emulated-model", str, "served model name; a request naming another model gets 404"
    )
    advertise_host: str = option(
        "localhost",
        str,
        "remote_host put into kv_transfer_params (vLLM's side channel says localhost)",
    )
    prefill_ms_per_token: float = option(
        0.1,
        bounded(float, 0),
        "emulated compute per token "
        "in a step: a prompt token neither cached nor "
        "pulled, or a decode's one token",
    )
    pull_ms_per_block: float = option(
        0.05, bounded(float, 0), "emulated transfer time per pulled block"
    )
    itl_ms: float = option(
        10.0,
        bounded(float, 0),
        "inter-token latency: the shortest step "
        "(reading the weights once); a step takes the longer of this and "
        "its tokens' compute",
    )
    # vLLM 0.33's defaults for `vllm serve` on an 80 GB GPU other than an A100, the emulator's
    # stated one (engine/arg_utils.py ~L2983-2997; without chunked prefill the budget is raised
    # to max_model_len, ~L3190-3199); chunked prefill is on for generative models (~L3040-3048)
    # and the long-prefill cap off (config/scheduler.py ~L79).
    max_num_batched_tokens: int | None = option(
        None,
        bounded(int, 1),
        "token budget of one engine step, shared by decodes (one token each) and prompt chunks",
        show="8192; max(8192, --max-model-len) without chunked prefill",
    )
    max_num_seqs: int = option(
        1024,
        bounded(int, 1),
        "requests running at once; more wait (vllm:num_requests_waiting_by_reason capacity)",
    )
    enable_chunked_prefill: bool = option(
        True,
        boolean,
        "split a prompt over steps to fit the "
        "token budget; off, a prompt waits until it fits whole",
    )
    long_prefill_token_threshold: int = option(
        0,
        bounded(int, 0),
        "the most prompt tokens one request computes in a step when others wait; 0: no cap",
    )
    output_tokens: int = option(
        32,
        bounded(int, 1),
        "reply length in words when a request sets "
        "no max_tokens; then EOS (finish_reason stop). max_tokens is "
        "always obeyed exactly (finish_reason length)",
    )
    block_size: int = option(
        16, bounded(int, 1), "tokens per KV block; all engines of a deployment must agree"
    )
    # vLLM's kv_connector_extra_config, with its defaults (nixl/base_scheduler.py ~L82-86,
    # ~L168-185): which one a finished request's blocks get depends on the request, not the role.
    kv_lease_duration: float = option(
        30.0,
        positive(float),
        "seconds a P-side request's blocks (do_remote_decode) wait for D's read",
    )
    decoder_kv_blocks_ttl: float = option(
        480.0,
        positive(float),
        "seconds a D-side request's blocks wait for the next turn's P to read them",
    )
    bidirectional_kv_xfer: bool = option(
        False,
        boolean,
        "vLLM's bidirectional_kv_xfer (off by "
        "default, PR #32553): a D request that loaded from P "
        "keeps its blocks for the next turn's P and returns its "
        "params; off, D keeps nothing and P never reads D",
    )
    recompute_threshold: int = option(
        64,
        bounded(int, 0),
        "kv_recompute_threshold: P recomputes "
        "instead of pulling fewer than this many tokens from D; "
        "0 always pulls",
    )
    kv_capacity_blocks: int = option(
        20_000,
        bounded(int, 1),
        "KV cache size in blocks, shared by "
        "running requests, blocks kept for a read and the prefix "
        "cache (vLLM sizes it from GPU memory; 20,000 blocks of 16 "
        "is an 8B model's cache on one 80 GB GPU)",
    )
    sliding_window: int = option(
        0,
        bounded(int, 0),
        "a hybrid model's sliding window in tokens "
        "(Gemma 2/3 and gpt-oss alternate full and sliding-window "
        "layers): > 0 gives two KV-cache groups, and the window's "
        "exports hold only D's last cdiv(window, block size) + 1 blocks "
        "(nixl/base_scheduler.py ~L141-154); 0: one full-attention group",
    )
    enable_prefix_caching: bool = option(
        True,
        boolean,
        "vLLM's --enable-prefix-caching (on by "
        "default): finished blocks stay findable until evicted",
    )
    enable_prompt_tokens_details: bool = option(
        False,
        boolean,
        "usage.prompt_tokens_details.cached_tokens in replies, as vLLM's flag",
        action="store_true",
    )
    stream_params: str = option(
        "final", str, "where a stream carries kv_transfer_params", choices=STREAM_PARAMS
    )
    kv_load_failure_policy: str = option(
        "fail",
        str,
        "on a failed/stale pull: error (vLLM default) or recompute",
        choices=FAILURE_POLICIES,
    )
    max_model_len: int = option(
        32768, bounded(int, 1), "context length; longer prompt+max_tokens gets 400"
    )
    template_quirks: tuple = option(
        (),
        _quirks,
        "chat template behaviours that break the prefix "
        f"property, comma separated: {', '.join(QUIRKS)} "
        "(docs/emulator.md says which real template does each)",
        show="none",
    )
    reasoning_share: float = option(
        0.0,
        bounded(float, 0, 1),
        "share of chat replies (by "
        "prompt hash) that reason first: <think> ... </think>, "
        "streamed as reasoning deltas",
    )
    tool_call_share: float = option(
        0.0,
        bounded(float, 0, 1),
        "share of chat replies to "
        "requests with tools that are one tool call (finish_reason "
        "tool_calls)",
    )
    reasoning_field: str = option(
        "reasoning",
        str,
        "the response field of reasoning text: "
        "reasoning (vLLM now), reasoning_content (before PR #27752), "
        "both (the deprecation window)",
        choices=REASONING_FIELDS,
    )
    stream_token_ids: str = option(
        "complete",
        str,
        "with return_token_ids, tokens a parser "
        "swallows still send an empty delta with their ids (complete, "
        "vLLM after PR #29074) or no chunk at all (lossy, before it)",
        choices=STREAM_TOKEN_IDS,
    )
    responses_api_store: bool = option(
        False,
        boolean,
        "vLLM's VLLM_ENABLE_RESPONSES_API_STORE (off "
        "by default): on, /v1/responses keeps every response with "
        "store=true in memory for previous_response_id, GET and "
        "cancel; off, store=true is ignored and every id is unknown",
    )
    fault: Fault = option(
        Fault(), _fault, "start with a fault, MODE[,key=value...], e.g. slow,delay_s=2", show="none"
    )
    access_log: bool = option(
        False, boolean, "log every HTTP request to stderr", action="store_true"
    )
    log_level: str = option("INFO", _log_level, "logging level name")

    def __post_init__(self) -> None:
        check(self)  # every field converted and validated; errors name the flag
        if self.kv_port is None:
            self.kv_port = self.port + 1000
        check(self, ("kv_port",))  # --port 65000 leaves no room for the default KV port
        if self.kv_port == self.port:
            raise SettingsError("--kv-port must differ from --port")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = (
                8192 if self.enable_chunked_prefill else max(8192, self.max_model_len)
            )
        # config/scheduler.py ~L316-336: vLLM refuses these two.
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise SettingsError(
                f"--max-num-batched-tokens {self.max_num_batched_tokens} is "
                f"below --max-model-len {self.max_model_len}, and without "
                "chunked prefill a longer prompt could never run"
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise SettingsError(
                f"--max-num-batched-tokens {self.max_num_batched_tokens} must "
                f"be at least --max-num-seqs {self.max_num_seqs}"
            )
        # vLLM refuses to start when one request of max_model_len tokens cannot fit its cache.
        if self.kv_capacity_blocks * self.block_size < self.max_model_len:
            raise SettingsError(
                f"--kv-capacity-blocks: {self.kv_capacity_blocks} blocks of "
                f"{self.block_size} hold less than --max-model-len "
                f"{self.max_model_len} tokens"
            )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m emulator.cli",
        description="Emulated vLLM engine (prefill or decode role) with a real KV pull port.",
    )
    add_arguments(parser, EngineConfig)
    return parser


def config_from_args(argv: list[str] | None = None) -> EngineConfig:
    """Parse argv into a validated EngineConfig; bad values exit with a message naming the flag."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return EngineConfig(**given(args, EngineConfig))
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits
