"""The emulated engine: prefill with real KV pulls, deterministic decoding, leases and kv_transfer_params."""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import Callable

import gevent
import requests

from .config import EngineConfig
from .errors import KVLoadError
from .faults import Fault, FaultState
from .kvport import PullError, flat_block_ids, make_session, pull, release
from .kvstore import LeaseStore, PrefixCache
from .protocol import CompletionRequest
from .stats import Stats
from .tokens import EOS, Generation, Template, generate_chat, generate_completion, token_ids

log = logging.getLogger(__name__)

REMOTE_FIELDS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")
# P declines D's blocks this close to their expiry (vLLM PR #47021 compares with a safety margin).
EXPIRY_MARGIN_S = 1.0


@dataclass
class Turn:
    """One request after prefill: its prompt, where the prompt's KV came from, and the reply to emit."""

    kind: str
    internal_id: str
    tokens: list[str]
    params_in: dict | None
    fault: Fault
    arrival: float
    gen: Generation = None  # type: ignore[assignment]
    salt: str | None = None  # cache_salt: KV computed under another salt is never this request's
    local: int = 0  # prompt tokens found in the local prefix cache
    pulled: int = 0  # prompt tokens read from a remote engine and used
    computed: int = 0  # prompt tokens computed here
    prefill_s: float = 0.0
    _prompt_ids: list | None = None

    @property
    def completion_tokens(self) -> int:
        return self.gen.completion_tokens

    @property
    def finish_reason(self) -> str:
        return self.gen.finish_reason

    @property
    def prompt_ids(self) -> list[int]:
        if self._prompt_ids is None:
            self._prompt_ids = token_ids(self.tokens)
        return self._prompt_ids

    @property
    def sequence(self) -> tuple[str, ...]:
        """Prompt and generated tokens, EOS included when the model sampled it."""
        return (*self.tokens, *self.gen.tokens, *((EOS,) if self.gen.stopped else ()))


def _readable(params: dict, p_node: bool) -> bool:
    """Whether params name blocks to read: vLLM needs remote_block_ids and the four remote fields."""
    if not params.get("remote_block_ids") or any(params.get(k) is None for k in REMOTE_FIELDS):
        return False
    try:
        flat_block_ids(params["remote_block_ids"])
        int(params["remote_port"])
    except (TypeError, ValueError):
        return False
    # P needs remote_num_tokens to know how much of D's sequence its prompt can use.
    return not p_node or (isinstance(params.get("remote_num_tokens"), int)
                          and not isinstance(params["remote_num_tokens"], bool))


class Engine:
    """One engine's state: config, leases, prefix cache, counters and faults; clock and sleep injected."""

    def __init__(self, config: EngineConfig, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = gevent.sleep,
                 session: requests.Session | None = None) -> None:
        self.config = config
        self.engine_id = str(uuid.uuid4())
        self.clock = clock
        self.sleep = sleep
        self.template = Template(frozenset(config.template_quirks))
        self.leases = LeaseStore(config.block_size, config.kv_ttl, clock=clock)
        self.prefix = PrefixCache(config.block_size, config.prefix_cache_blocks)
        self.stats = Stats()
        self.faults = FaultState(config.fault)
        self.session = session or make_session()
        # Prefill is compute-bound: an engine's prompt tokens are computed one request after
        # another (a throughput model: batching several prompts takes as long in total). On D
        # they are computed in the same GPU steps as it decodes, so until then no stream of
        # this engine emits a token (vLLM's chunked prefill interleaves; a full stall is the
        # upper bound of what a local prefill costs the others).
        self.busy_until = 0.0

    def start(self, req: CompletionRequest, internal_id: str, fault: Fault, arrival: float) -> Turn:
        """Prefill the prompt (pulling what it can) and decide the reply; raises KVLoadError."""
        turn = Turn(req.kind, internal_id, req.tokens, req.kv_transfer_params, fault, arrival,
                    salt=req.cache_salt)
        self._prefill(turn)
        count, finish = self._reply_length(req)
        cfg = self.config
        if req.kind == "chat":
            turn.gen = generate_chat(req.tokens, count, finish == "stop",
                                     reasoning_share=cfg.reasoning_share if req.thinking else 0.0,
                                     tool_names=req.tool_names, tool_call_share=cfg.tool_call_share)
        else:
            turn.gen = generate_completion(req.tokens, count, finish == "stop")
        return turn

    def _reply_length(self, req: CompletionRequest) -> tuple[int, str]:
        """Words to emit and the finish reason: max_tokens is obeyed exactly (so benchmarks control
        output length); without it the reply is --output-tokens words and then EOS."""
        room = self.config.max_model_len - len(req.tokens)
        if req.max_tokens is not None:
            return req.max_tokens, "length"
        natural = max(self.config.output_tokens, req.min_tokens)
        if req.ignore_eos or natural >= room:
            return room, "length"  # vLLM's default max_tokens is what is left of the context
        return natural, "stop"

    def _prefill(self, turn: Turn) -> None:
        started = self.clock()
        params, tokens, cfg = turn.params_in or {}, turn.tokens, self.config
        n, bs = len(tokens), cfg.block_size
        # Like vLLM's prefix cache: whole blocks only, and the last prompt token is always computed.
        local = self.prefix.match(tokens, n - 1, turn.salt)
        p_node = bool(params.get("do_remote_decode"))
        want = 0  # prompt tokens to read from the remote engine
        if (p_node or params.get("do_remote_prefill")) and not _readable(params, p_node):
            if any(params.get(k) is not None for k in ("remote_block_ids", *REMOTE_FIELDS)):
                log.warning("Got invalid KVTransferParams for %s: %s", turn.internal_id, params)
        elif p_node or params.get("do_remote_prefill"):
            # D needs the whole prompt; P can use D's sequence up to its own prompt (minus the last token).
            want = min(params["remote_num_tokens"], n - 1) if p_node else n
            if want <= local or (p_node and self._declines(params, want - local)):
                release(self.session, params)  # vLLM still notifies the owner so it frees them
                want = 0
        emulated_ms = 0.0
        ready = local
        if want > local:
            first_block = local // bs
            try:
                got, got_salt = pull(self.session, params, first_block, want)
            except PullError as exc:
                self._pull_failed(turn, exc)
            else:
                blocks = -(-want // bs) - first_block
                self.stats.pulled_blocks += blocks
                self.stats.pulled_tokens += len(got)
                emulated_ms += blocks * cfg.pull_ms_per_block
                if got == tokens[local:want] and got_salt == turn.salt:
                    ready = want
                    turn.pulled = want - local
                    if p_node:
                        self.stats.hits += 1
                        self.stats.reused_prompt_tokens += turn.pulled
                else:
                    # A real engine would attend over someone else's KV and emit garbage (or,
                    # across cache salts, leak one tenant's cache to another).
                    self.stats.wrong_reuse += 1
                    log.warning("wrong reuse in %s: pulled tokens are not a prefix of the prompt%s; "
                                "recomputing", turn.internal_id,
                                "" if got_salt == turn.salt else " (another cache_salt)")
        turn.local, turn.computed = local, n - ready
        compute_s = turn.computed * cfg.prefill_ms_per_token / 1000.0
        now = self.clock()
        self.busy_until = max(now, self.busy_until) + compute_s
        if cfg.role == "decode":
            self.stats.decode_stall_seconds += compute_s
        self.sleep(emulated_ms / 1000.0 + self.busy_until - now)
        self._count_path(params, p_node)
        self.prefix.insert(tokens, turn.salt)
        turn.prefill_s = self.clock() - started
        self.stats.local_prefix_tokens += local
        self.stats.computed_prompt_tokens += turn.computed
        self.stats.prefill_seconds += turn.prefill_s

    def _count_path(self, params: dict, p_node: bool) -> None:
        if self.config.role != "decode" or p_node:
            return
        if not params:
            self.stats.plain_requests += 1
        elif params.get("do_remote_prefill"):
            self.stats.remote_prefill_requests += 1
        else:
            self.stats.decode_only_requests += 1

    def token_wait(self, itl: float) -> float:
        """Seconds until a stream's next token: the inter-token latency, or longer while this
        engine is busy prefilling another request."""
        return max(itl, self.busy_until - self.clock())

    def _declines(self, params: dict, count: int) -> bool:
        expiry = params.get("remote_blocks_expiry_time")
        # Same host, so D's time.monotonic and ours are the same clock (vLLM converts with an offset).
        if isinstance(expiry, (int, float)) and self.clock() + EXPIRY_MARGIN_S >= expiry:
            log.info("Declining expired remote read of %s, recomputing locally", params["remote_request_id"])
            self.stats.declined_pulls += 1
            return True
        if 0 < count < self.config.recompute_threshold:
            self.stats.declined_pulls += 1
            return True
        return False

    def _pull_failed(self, turn: Turn, exc: PullError) -> None:
        if exc.stale:
            self.stats.stale_pulls += 1
        else:
            self.stats.failed_pulls += 1
        log.warning("KV pull for %s failed: %s", turn.internal_id, exc)
        if self.config.kv_load_failure_policy == "fail":
            self.stats.kv_load_errors += 1
            raise KVLoadError(f"KV transfer failed for request {turn.internal_id}: {exc}") from exc

    def finish(self, turn: Turn) -> dict | None:
        """The request finished (stop or length): keep its blocks for one pull and describe them."""
        kv_tokens = turn.sequence[:-1]  # the last sampled token has no KV yet: prompt + generated - 1
        self.prefix.insert(kv_tokens, turn.salt)
        self.stats.generated_tokens += turn.completion_tokens
        if turn.params_in is None or turn.fault.mode == "no_params":
            return None  # vLLM returns params only to requests that came with kv_transfer_params
        lease = self.leases.put(turn.internal_id, kv_tokens, turn.salt)
        p_node = bool(turn.params_in.get("do_remote_decode"))
        return {
            "do_remote_prefill": p_node, "do_remote_decode": not p_node,
            "remote_block_ids": [list(lease.block_ids)], "remote_engine_id": self.engine_id,
            "remote_request_id": turn.internal_id, "remote_host": self.config.advertise_host,
            "remote_port": self.config.kv_port, "tp_size": 1, "dcp_size": 1, "pp_size": 1,
            "remote_num_tokens": len(kv_tokens),
            "remote_blocks_expiry_time": None if p_node else lease.expires_at,
            "transfer_mode": "pull"}

    def record(self, turn: Turn, outcome: str) -> None:
        """Keep one line per request for benchmarks (GET /stats/requests)."""
        self.stats.recent.append({
            "request_id": turn.internal_id, "kind": turn.kind, "outcome": outcome,
            "arrival": turn.arrival, "prefill_ms": round(turn.prefill_s * 1000, 3),
            "total_ms": round((self.clock() - turn.arrival) * 1000, 3),
            "prompt_tokens": len(turn.tokens), "local_prefix_tokens": turn.local,
            "pulled_tokens": turn.pulled, "computed_prompt_tokens": turn.computed,
            "completion_tokens": turn.completion_tokens, "finish_reason": turn.finish_reason})

    def snapshot(self) -> dict:
        leases, blocks, self.stats.leases_expired_unread = self.leases.held()
        return {"role": self.config.role, "engine_id": self.engine_id, **self.stats.snapshot(),
                "kv_leases": leases, "kv_lease_blocks": blocks,
                "prefix_cache_blocks": len(self.prefix),
                "fault": self.faults.current.mode}
