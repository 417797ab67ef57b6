"""Engine settings: every emulator flag with its default, validator and help, stated once."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field, fields
from typing import Callable

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


@dataclass
class EngineConfig:
    """Settings of one emulated engine; None means "the role's default" where noted."""

    role: str = "decode"
    host: str = "127.0.0.1"
    port: int = 8200
    kv_port: int | None = None
    model: str = "emulated-model"
    advertise_host: str = "localhost"
    prefill_ms_per_token: float = 0.1
    pull_ms_per_block: float = 0.05
    itl_ms: float = 10.0
    output_tokens: int = 32
    block_size: int = 16
    kv_ttl: float | None = None
    recompute_threshold: int = 0
    stream_params: str = "final"
    kv_load_failure_policy: str = "fail"
    prefix_cache_blocks: int | None = None
    max_model_len: int = 32768
    template_quirks: tuple = ()
    reasoning_share: float = 0.0
    tool_call_share: float = 0.0
    reasoning_field: str = "reasoning"
    stream_token_ids: str = "complete"
    fault: Fault = field(default_factory=Fault)
    access_log: bool = False
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        _check(self.role in ROLES, "role", f"must be one of {ROLES}, got {self.role!r}")
        if self.kv_port is None:
            self.kv_port = self.port + 1000
        if self.kv_ttl is None:
            self.kv_ttl = DEFAULT_KV_TTL[self.role]
        if self.prefix_cache_blocks is None:
            self.prefix_cache_blocks = DEFAULT_PREFIX_CACHE_BLOCKS[self.role]
        for name in ("port", "kv_port"):
            _check(0 < getattr(self, name) < 65536, name, f"must be a TCP port, got {getattr(self, name)}")
        _check(self.port != self.kv_port, "kv_port", "must differ from --port")
        for name in ("prefill_ms_per_token", "pull_ms_per_block", "itl_ms", "recompute_threshold",
                     "prefix_cache_blocks"):
            _check(getattr(self, name) >= 0, name, f"must be >= 0, got {getattr(self, name)}")
        for name in ("output_tokens", "block_size", "max_model_len"):
            _check(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        _check(self.kv_ttl > 0, "kv_ttl", f"must be > 0, got {self.kv_ttl}")
        _check(self.stream_params in STREAM_PARAMS, "stream_params", f"must be one of {STREAM_PARAMS}")
        _check(self.kv_load_failure_policy in FAILURE_POLICIES, "kv_load_failure_policy",
               f"must be one of {FAILURE_POLICIES}")
        unknown = sorted(set(self.template_quirks) - set(QUIRKS))
        _check(not unknown, "template_quirks", f"has unknown quirk(s) {unknown}; known: {sorted(QUIRKS)}")
        for name in ("reasoning_share", "tool_call_share"):
            _check(0 <= getattr(self, name) <= 1, name, f"must be within 0..1, got {getattr(self, name)}")
        _check(self.reasoning_field in REASONING_FIELDS, "reasoning_field", f"must be one of {REASONING_FIELDS}")
        _check(self.stream_token_ids in STREAM_TOKEN_IDS, "stream_token_ids", f"must be one of {STREAM_TOKEN_IDS}")
        _check(isinstance(logging.getLevelName(self.log_level.upper()), int), "log_level",
               f"must be a logging level name, got {self.log_level!r}")


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"--{name.replace('_', '-')} {message}")


def _quirks_arg(spec: str) -> tuple:
    return tuple(q for q in spec.replace(",", " ").split() if q != "none")


def _fault_arg(spec: str) -> Fault:
    try:
        return parse_fault_spec(spec)
    except ValueError as exc:  # argparse prints ArgumentTypeError text as is
        raise argparse.ArgumentTypeError(str(exc)) from exc


@dataclass(frozen=True)
class Flag:
    name: str  # EngineConfig attribute; the CLI flag is --name-with-dashes
    type: Callable
    help: str
    choices: tuple | None = None
    required: bool = False


FLAGS: tuple[Flag, ...] = (
    Flag("role", str, "which side of the P/D pair this engine plays", ROLES, required=True),
    Flag("port", int, "HTTP port: OpenAI API, /health, /v1/models, /stats, /faults", required=True),
    Flag("kv_port", int, "KV port serving block pulls, reported as remote_port (default: --port + 1000)"),
    Flag("host", str, "address both listeners bind to"),
    Flag("model", str, "served model name; a request naming another model gets 404"),
    Flag("advertise_host", str, "remote_host put into kv_transfer_params (vLLM's side channel says localhost)"),
    Flag("prefill_ms_per_token", float, "emulated compute per prompt token that is neither cached nor pulled"),
    Flag("pull_ms_per_block", float, "emulated transfer time per pulled block"),
    Flag("itl_ms", float, "inter-token latency"),
    Flag("output_tokens", int, "reply length in words when a request sets no max_tokens; then EOS "
         "(finish_reason stop). max_tokens is always obeyed exactly (finish_reason length)"),
    Flag("block_size", int, "tokens per KV block; all engines of a deployment must agree"),
    Flag("kv_ttl", float, "seconds finished blocks wait for one pull (default: prefill 30, decode 480)"),
    Flag("recompute_threshold", int, "P recomputes instead of pulling fewer tokens than this (vLLM: 64)"),
    Flag("stream_params", str, "where a stream carries kv_transfer_params", STREAM_PARAMS),
    Flag("kv_load_failure_policy", str, "on a failed/stale pull: error (vLLM default) or recompute",
         FAILURE_POLICIES),
    Flag("prefix_cache_blocks", int, "local prefix cache capacity in blocks (default: prefill 0, decode 200000)"),
    Flag("max_model_len", int, "context length; longer prompt+max_tokens gets 400"),
    Flag("template_quirks", _quirks_arg, "chat template behaviours that break the prefix property, comma "
         f"separated: {', '.join(QUIRKS)} (docs/emulator.md says which real template does each)"),
    Flag("reasoning_share", float, "share of chat replies (by prompt hash) that reason first: <think> ... </think>, "
         "streamed as reasoning deltas"),
    Flag("tool_call_share", float, "share of chat replies to requests with tools that are one tool call "
         "(finish_reason tool_calls)"),
    Flag("reasoning_field", str, "the response field of reasoning text: reasoning (vLLM now), "
         "reasoning_content (before PR #27752), both (the deprecation window)", REASONING_FIELDS),
    Flag("stream_token_ids", str, "with return_token_ids, tokens a parser swallows still send an empty delta "
         "with their ids (complete, vLLM after PR #29074) or no chunk at all (lossy, before it)", STREAM_TOKEN_IDS),
    Flag("fault", _fault_arg, "start with a fault, MODE[,key=value...], e.g. slow,delay_s=2"),
    Flag("access_log", bool, "log every HTTP request to stderr"),
    Flag("log_level", str, "logging level name"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pd-gateway-emulator",
        description="Emulated vLLM engine (prefill or decode role) with a real KV pull port.")
    defaults = {f.name: f.default for f in fields(EngineConfig)}
    for flag in FLAGS:
        option = "--" + flag.name.replace("_", "-")
        if flag.type is bool:
            parser.add_argument(option, dest=flag.name, action="store_true", help=flag.help)
            continue
        default = defaults.get(flag.name)
        shown = "" if flag.required or default is None or flag.name == "fault" else f" (default: {default})"
        parser.add_argument(option, dest=flag.name, type=flag.type, choices=flag.choices,
                            required=flag.required, default=None, help=flag.help + shown)
    return parser


def config_from_args(argv: list[str] | None = None) -> EngineConfig:
    """Parse argv into a validated EngineConfig; bad values exit with a message naming the flag."""
    parser = build_parser()
    args = parser.parse_args(argv)
    given = {k: v for k, v in vars(args).items() if v is not None and v is not False}
    try:
        return EngineConfig(**given)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits
