"""Engine settings: every emulator flag with its default, validator and help, stated once."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from typing import Any

from ..options import (SettingsError, add_arguments, boolean, bounded, check, given, option,
                       positive)
from ..options import port as _port
from .faults import Fault, parse_fault_spec
from .tokens import QUIRKS

ROLES = ("prefill", "decode")
STREAM_PARAMS = ("final", "separate", "absent")
REASONING_FIELDS = ("reasoning", "reasoning_content", "both")
STREAM_TOKEN_IDS = ("complete", "lossy")
FAILURE_POLICIES = ("fail", "recompute")
# vLLM: kv_lease_duration (P, 30 s) and decoder_kv_blocks_ttl (D, 480 s).
DEFAULT_KV_TTL = {"prefill": 30.0, "decode": 480.0}
# P runs without a local prefix cache so its counters show only what the gateway made it reuse.
DEFAULT_PREFIX_CACHE_BLOCKS = {"prefill": 0, "decode": 200_000}


def _per_role(defaults: dict[str, float]) -> str:
    return ", ".join(f"{role} {value:g}" for role, value in defaults.items())


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

    role: str = option("decode", str, "which side of the P/D pair this engine plays",
                       choices=ROLES, required=True)
    port: int = option(8200, _port, "HTTP port: OpenAI API, /health, /v1/models, /stats, "
                       "/faults", required=True)
    kv_port: int | None = option(None, _port, "KV port serving block pulls, reported as "
                                 "remote_port", show="--port + 1000")
    host: str = option("127.0.0.1", str, "address both listeners bind to")
    model: str = option("emulated-model", str,
                        "served model name; a request naming another model gets 404")
    advertise_host: str = option("localhost", str, "remote_host put into kv_transfer_params "
                                 "(vLLM's side channel says localhost)")
    prefill_ms_per_token: float = option(0.1, bounded(float, 0), "emulated compute per prompt "
                                         "token that is neither cached nor pulled")
    pull_ms_per_block: float = option(0.05, bounded(float, 0),
                                      "emulated transfer time per pulled block")
    itl_ms: float = option(10.0, bounded(float, 0), "inter-token latency")
    output_tokens: int = option(32, bounded(int, 1), "reply length in words when a request sets "
                                "no max_tokens; then EOS (finish_reason stop). max_tokens is "
                                "always obeyed exactly (finish_reason length)")
    block_size: int = option(16, bounded(int, 1),
                             "tokens per KV block; all engines of a deployment must agree")
    kv_ttl: float | None = option(None, positive(float), "seconds finished blocks wait for one "
                                  "pull", show=_per_role(DEFAULT_KV_TTL))
    recompute_threshold: int = option(0, bounded(int, 0), "P recomputes instead of pulling "
                                      "fewer tokens than this (vLLM: 64)")
    stream_params: str = option("final", str, "where a stream carries kv_transfer_params",
                                choices=STREAM_PARAMS)
    kv_load_failure_policy: str = option("fail", str, "on a failed/stale pull: error (vLLM "
                                         "default) or recompute", choices=FAILURE_POLICIES)
    prefix_cache_blocks: int | None = option(None, bounded(int, 0),
                                             "local prefix cache capacity in blocks",
                                             show=_per_role(DEFAULT_PREFIX_CACHE_BLOCKS))
    max_model_len: int = option(32768, bounded(int, 1),
                                "context length; longer prompt+max_tokens gets 400")
    template_quirks: tuple = option((), _quirks, "chat template behaviours that break the prefix "
                                    f"property, comma separated: {', '.join(QUIRKS)} "
                                    "(docs/emulator.md says which real template does each)",
                                    show="none")
    reasoning_share: float = option(0.0, bounded(float, 0, 1), "share of chat replies (by "
                                    "prompt hash) that reason first: <think> ... </think>, "
                                    "streamed as reasoning deltas")
    tool_call_share: float = option(0.0, bounded(float, 0, 1), "share of chat replies to "
                                    "requests with tools that are one tool call (finish_reason "
                                    "tool_calls)")
    reasoning_field: str = option("reasoning", str, "the response field of reasoning text: "
                                  "reasoning (vLLM now), reasoning_content (before PR #27752), "
                                  "both (the deprecation window)", choices=REASONING_FIELDS)
    stream_token_ids: str = option("complete", str, "with return_token_ids, tokens a parser "
                                   "swallows still send an empty delta with their ids (complete, "
                                   "vLLM after PR #29074) or no chunk at all (lossy, before it)",
                                   choices=STREAM_TOKEN_IDS)
    fault: Fault = option(Fault(), _fault, "start with a fault, MODE[,key=value...], e.g. "
                          "slow,delay_s=2", show="none")
    access_log: bool = option(False, boolean, "log every HTTP request to stderr",
                              action="store_true")
    log_level: str = option("INFO", _log_level, "logging level name")

    def __post_init__(self) -> None:
        check(self)  # every field converted and validated; errors name the flag
        derived = {"kv_port": self.port + 1000, "kv_ttl": DEFAULT_KV_TTL[self.role],
                   "prefix_cache_blocks": DEFAULT_PREFIX_CACHE_BLOCKS[self.role]}
        for name, value in derived.items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        check(self, ("kv_port",))  # --port 65000 leaves no room for the default KV port
        if self.kv_port == self.port:
            raise SettingsError("--kv-port must differ from --port")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pd-gateway-emulator",
        description="Emulated vLLM engine (prefill or decode role) with a real KV pull port.")
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
