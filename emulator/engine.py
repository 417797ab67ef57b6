"""The emulated engine: prefill with real KV pulls, deterministic decoding, leases and
kv_transfer_params."""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import gevent
import requests
from gevent.event import Event

from .config import EngineConfig
from .errors import ClientGone, KVLoadError
from .faults import Fault, FaultState
from .kvport import PullError, flat_block_ids, make_session, pull, release
from .kvstore import BlockPool, Blocks, Lease, LeaseStore
from .protocol import CompletionRequest
from .scheduler import Scheduler, Seq
from .stats import Stats
from .tokens import EOS, Generation, Template, generate_chat, generate_completion, token_ids

log = logging.getLogger(__name__)

REMOTE_FIELDS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")
# P declines D's blocks this close to their expiry (nixl/pull_worker.py ~L31-33, ~L127-136).
EXPIRY_MARGIN_S = 5.0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Turn:
    """One request after prefill: its prompt, where the prompt's KV came from, and the reply to
    emit."""

    kind: str
    internal_id: str
    tokens: list[str]
    params_in: dict | None
    fault: Fault
    arrival: float
    # why the ignore: Engine sets it right after making the turn (before its prefill); no
    # turn is read without one.
    gen: Generation = None  # type: ignore[assignment]
    salt: str | None = None  # cache_salt: KV computed under another salt is never this request's
    local: int = 0  # prompt tokens found in the local prefix cache
    pulled: int = 0  # prompt tokens read from a remote engine and used (less the last, recomputed)
    loaded: int = 0  # prompt tokens loaded from a remote engine, as vLLM counts them
    computed: int = 0  # prompt tokens computed here
    prefill_s: float = 0.0
    waited_s: float = 0.0  # waiting for KV memory before the prefill could start
    blocks: Blocks | None = None  # held from admission until the end, or handed to a lease
    seq: Seq | None = None  # in the scheduler from the end of its KV load to its last token
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

    @property
    def cached_tokens(self) -> int:
        """vLLM's num_cached_tokens: local prefix hits plus tokens loaded from another engine,
        counted before a whole loaded prompt's last token is set aside to be recomputed
        (v1/metrics/stats.py ~L326-338, set at scheduling: scheduler.py ~L1250-1258)."""
        return self.local + self.loaded


def _flag(params: dict, name: str) -> bool:
    return bool(params.get(name))


def _remote_groups(params: dict) -> list[list[int]] | None:
    """The remote block ids to read from, one list per KV-cache group, or None if the params
    name no readable blocks (vLLM needs remote_block_ids and the four remote fields:
    nixl/pull_scheduler.py ~L67-80, ~L135-144). A flat list (very old vLLM) is one group."""
    ids = params.get("remote_block_ids")
    if not ids or any(params.get(k) is None for k in REMOTE_FIELDS):
        return None
    try:
        groups = (
            [list(flat_block_ids(g)) for g in ids]
            if all(isinstance(g, list) for g in ids)
            else [list(flat_block_ids(ids))]
        )
        int(params["remote_port"])
    except (TypeError, ValueError):
        return None
    return groups


class Engine:
    """One engine's state: config, KV memory, leases, counters and faults; clock and sleep
    injected."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = gevent.sleep,
        session: requests.Session | None = None,
        background: Callable[..., object] = gevent.spawn,
    ) -> None:
        self.config = config
        # A notification with nothing to read goes out beside the request, as NIXL's send_notif
        # does (nixl/pull_worker.py ~L452-476): it never holds up the prefill.
        self.background = background
        self.engine_id = str(uuid.uuid4())
        self.clock = clock
        self.sleep = sleep
        self.template = Template(frozenset(config.template_quirks))
        self.pool = BlockPool(
            config.block_size, config.kv_capacity_blocks, caching=config.enable_prefix_caching
        )
        self.leases = LeaseStore(config.block_size, clock=clock, on_free=self._lease_freed)
        self.stats = Stats()
        self.faults = FaultState(config.fault)
        self.session = session or make_session()
        # Prompts and decodes share the engine's steps, as on vLLM: a prefill on D slows its
        # streams, and a request beyond the token budget or max_num_seqs waits its turn.
        assert config.max_num_batched_tokens is not None  # EngineConfig.__post_init__ set it
        self.scheduler = Scheduler(
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            step_s=self._step_s,
            enable_chunked_prefill=config.enable_chunked_prefill,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            on_step=self._stepped,
        )
        # Requests waiting for KV memory, first come first served: vLLM's scheduler stops at
        # the first waiting request it cannot allocate (v1/core/sched/scheduler.py ~L1454-1461).
        self._waiting: deque[Event] = deque()
        self.deferred = 0  # waiting for a remote KV load (vLLM's "deferred" waiting)

    def start(
        self,
        req: CompletionRequest,
        internal_id: str,
        fault: Fault,
        arrival: float,
        gone: Callable[[], bool] = lambda: False,
    ) -> Turn:
        """Admit the request into KV memory, prefill it (pulling what it can) and decide the
        reply; raises KVLoadError, or ClientGone if the client left while it waited for memory
        (nothing held then)."""
        turn = Turn(
            req.kind,
            internal_id,
            req.tokens,
            req.kv_transfer_params,
            fault,
            arrival,
            salt=req.cache_salt,
        )
        count, finish = self._reply_length(req)
        cfg = self.config
        if req.kind == "chat":
            turn.gen = generate_chat(
                req.tokens,
                count,
                finish == "stop",
                reasoning_share=cfg.reasoning_share if req.thinking else 0.0,
                tool_names=req.tool_names,
                tool_call_share=cfg.tool_call_share,
            )
        else:
            turn.gen = generate_completion(req.tokens, count, finish == "stop")
        try:
            self._prefill(turn, gone)
        except BaseException:
            self._release(turn)
            raise
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

    # --- KV memory ---------------------------------------------------------------------------

    def _admit(self, turn: Turn, hashes: list[int], gone: Callable[[], bool]) -> int:
        """Take the blocks the whole request needs (prompt and reply; vLLM allocates the reply's
        as it goes and may preempt, the emulator reserves them at once and never preempts),
        waiting in line while the pool cannot hold them. Returns the local prefix hit in blocks."""
        n, bs = len(turn.tokens), self.config.block_size
        need = cdiv(n + turn.completion_tokens, bs)
        limit = (
            n - 1
        ) // bs  # the last prompt token is always computed (kv_cache_manager.py ~L296-302)
        waiter: Event | None = None
        started = self.clock()
        waited = False
        try:
            while True:
                self.leases.expire()
                if not self._waiting or self._waiting[0] is waiter:
                    hit = self.pool.match(hashes, limit)
                    turn.blocks = self.pool.allocate(hashes[:hit], need - hit)
                    if turn.blocks is not None:
                        break
                if waiter is None:
                    waiter = Event()
                    self._waiting.append(waiter)
                waited = True
                waiter.clear()
                waiter.wait(self._until_next_expiry())
                if gone():  # vLLM aborts a request whose client left, waiting or not
                    self.stats.aborted_streams += 1
                    raise ClientGone(f"{turn.internal_id}: the client left while it waited")
        finally:
            if waiter is not None:
                self._waiting.remove(waiter)
                self._wake()
        turn.waited_s = self.clock() - started if waited else 0.0
        self.stats.kv_wait_seconds += turn.waited_s
        return hit

    def _until_next_expiry(self) -> float:
        expiry = self.leases.next_expiry()
        return 1.0 if expiry is None else min(1.0, max(0.01, expiry - self.clock()))

    def _wake(self) -> None:
        if self._waiting:
            self._waiting[0].set()

    def _lease_freed(self, lease: Lease) -> None:
        self.pool.free(lease.blocks)
        self._wake()

    def _release(self, turn: Turn) -> None:
        """The request ended without leaving its blocks to a lease: free them."""
        if turn.seq is not None:
            self.scheduler.remove(turn.seq, self.clock())
        if turn.blocks is not None:
            self.pool.free(turn.blocks)
            turn.blocks = None
            self._wake()

    # --- steps -------------------------------------------------------------------------------

    def _step_s(self, prefill: int, decode: int) -> float:
        """A step reads the weights once (itl_ms, a decode-only step of a small batch) and
        computes its tokens (prefill_ms_per_token each, a decode's token as a prompt's): it
        takes the longer of the two, so one request alone prefills in about prompt tokens x
        prefill_ms_per_token, and a big batch decodes slower than itl_ms."""
        cfg = self.config
        return max(cfg.itl_ms, (prefill + decode) * cfg.prefill_ms_per_token) / 1000.0

    def _stepped(self, prefill: int, decode: int, duration: float) -> None:
        if prefill and decode and self.config.role == "decode":
            self.stats.decode_stall_seconds += duration - self._step_s(0, decode)

    def wait_token(self, turn: Turn, index: int) -> None:
        """Return once the turn's token `index` (0: the first) is out."""
        while (wait := self.until_token(turn, index)) > 0:
            self.sleep(wait)

    def until_token(self, turn: Turn, index: int) -> float:
        """Seconds until the step that may bring the turn's token `index` ends (0: it is out)."""
        seq = turn.seq
        assert seq is not None  # asked once the turn is scheduled
        return self.scheduler.until(lambda: seq.generated > index, self.clock())

    # --- prefill -----------------------------------------------------------------------------

    def _prefill(self, turn: Turn, gone: Callable[[], bool]) -> None:
        started = self.clock()
        params, tokens, cfg = turn.params_in or {}, turn.tokens, self.config
        n, bs = len(tokens), cfg.block_size
        hashes = self.pool.hashes(tokens, turn.salt)
        local = self._admit(turn, hashes, gone) * bs
        self.stats.prefix_cache_queries += n
        self.stats.prefix_cache_hits += local
        p_node = _flag(params, "do_remote_decode")
        groups = _remote_groups(params)
        count = 0  # prompt tokens to load from the remote engine
        if (p_node or _flag(params, "do_remote_prefill")) and groups is None:
            if any(params.get(k) is not None for k in ("remote_block_ids", *REMOTE_FIELDS)):
                log.warning("Got invalid KVTransferParams for %s: %s", turn.internal_id, params)
        elif p_node and not cfg.bidirectional_kv_xfer:
            # update_state_after_alloc queues a read of D's blocks only with bidirectional
            # transfer on (nixl/pull_scheduler.py ~L130-134): nothing is read, nothing notified.
            log.warning(
                "%s: D's params on an engine without bidirectional_kv_xfer; ignored",
                turn.internal_id,
            )
        elif p_node:
            # Turn 2+ on P (nixl/pull_scheduler.py ~L85-103): what D holds beyond P's own hit,
            # unless that is under kv_recompute_threshold. Either way P's connector queues a
            # receive, and a receive with nothing to read only notifies D, which frees the
            # request's blocks (~L145-177; nixl/pull_worker.py ~L452-476).
            count = min(params.get("remote_num_tokens") or 0, n) - local
            if 0 < count < cfg.recompute_threshold:
                self.stats.declined_pulls += 1
                count = 0
            if count <= 0:
                self.background(release, self.session, params)
        elif _flag(params, "do_remote_prefill"):
            count = n - local  # D loads the whole prompt it lacks, no threshold (~L59-65)
        ready = local
        # Every new request of an engine with a connector queries it (scheduler.py ~L1212-1214).
        self.stats.external_prefix_cache_queries += n - local
        if count > 0:
            # While it loads remote KV a request waits in WAITING_FOR_REMOTE_KVS: vLLM counts it
            # as a deferred waiting request, not a running one (v1/core/sched/scheduler.py
            # ~L2705-2712 and ~L3288-3292; v1/metrics/loggers.py ~L1150-1160).
            assert groups is not None  # count > 0: the params named blocks (the first `if`)
            self.deferred += 1
            try:
                read_blocks, ok = self._read(turn, params, groups, local, count)
                self.sleep(read_blocks * cfg.pull_ms_per_block / 1000.0)
            finally:
                self.deferred -= 1
            if ok:
                # A whole prompt loaded still computes its last token (scheduler.py ~L3515).
                ready = min(local + count, n - 1)
                turn.pulled, turn.loaded = ready - local, count
                self.stats.external_prefix_cache_hits += count
                if p_node:
                    self.stats.hits += 1
                    self.stats.reused_prompt_tokens += turn.pulled
        turn.local, turn.computed = local, n - ready
        turn.seq = Seq(max(turn.computed, 1), turn.completion_tokens)
        self.scheduler.add(turn.seq, self.clock())
        self.wait_token(turn, 0)
        self._count_path(params, p_node)
        assert turn.blocks is not None  # held since admission
        self.pool.commit(turn.blocks, hashes)
        turn.prefill_s = self.clock() - started
        self.stats.local_prefix_tokens += local
        self.stats.computed_prompt_tokens += turn.computed
        self.stats.prefill_seconds += turn.prefill_s

    @property
    def window_blocks(self) -> int:
        """Blocks a sliding-window group keeps and exports: cdiv(window, block_size) + 1
        (nixl/base_scheduler.py ~L141-154); 0 for a model without one."""
        window = self.config.sliding_window
        return cdiv(window, self.config.block_size) + 1 if window else 0

    def _read(
        self, turn: Turn, params: dict, groups: list[list[int]], local: int, count: int
    ) -> tuple[int, bool]:
        """Read the blocks for prompt tokens [local, local + count) as vLLM's worker maps them:
        in each KV-cache group, this request's new blocks take the *last* entries of the remote
        group (the suffix trim, nixl/base_worker.py ~L3786-3793), which is right only when the
        remote sequence ends where this read does, or its list was cut there. A sliding-window
        group's new blocks are only the read's last window (both sides clip to it,
        nixl/base_scheduler.py ~L270-286). Returns the blocks read and whether each holds this
        prompt's tokens at the position it is read into."""
        bs, window = self.config.block_size, self.window_blocks
        first, end = local // bs, cdiv(local + count, bs)
        if len(groups) != 1 + bool(window):
            self.stats.kv_load_errors += 1
            raise KVLoadError(
                f"KV transfer failed for request {turn.internal_id}: "
                f"AssertionError: Number of KV cache groups must match "
                f"({len(groups)} remote, {1 + bool(window)} here)"
            )
        wanted: list[tuple[list[int], int]] = []  # (remote ids to read, first position)
        for i, group in enumerate(groups):
            new = end - first if i == 0 else min(end - first, window)
            if len(group) < new:
                # base_worker.py ~L3791: `assert num_decode_blocks <= len(prefill_group)`.
                self.stats.kv_load_errors += 1
                raise KVLoadError(
                    f"KV transfer failed for request {turn.internal_id}: "
                    f"AssertionError: {new} blocks to read, the remote group "
                    f"has {len(group)}"
                )
            wanted.append((group[len(group) - new :], end - new))
        expiry = params.get("remote_blocks_expiry_time")
        # Same host, so D's time.monotonic and ours are one clock (vLLM converts with an offset).
        if isinstance(expiry, (int, float)) and self.clock() + EXPIRY_MARGIN_S >= expiry:
            log.info("Declining expired remote read of %s", params["remote_request_id"])
            self.stats.declined_pulls += 1
            self._pull_failed(turn, PullError("remote blocks expired", stale=True))
            return 0, False
        try:
            got, got_salt = pull(self.session, params, [i for ids, _ in wanted for i in ids])
        except PullError as exc:
            self._pull_failed(turn, exc)
            return 0, False
        read = sum(len(ids) for ids, _ in wanted)
        self.stats.pulled_blocks += read
        self.stats.pulled_tokens += count
        expected = [
            turn.tokens[b * bs : min((b + 1) * bs, local + count)]
            for ids, start in wanted
            for b in range(start, start + len(ids))
        ]
        if (
            len(got) == len(expected)
            and got_salt == turn.salt
            and all(block[: len(want)] == want for block, want in zip(got, expected, strict=True))
        ):
            return read, True
        # A real engine would attend over someone else's KV and emit garbage (or, across cache
        # salts, leak one tenant's cache to another).
        self.stats.wrong_reuse += 1
        log.warning(
            "wrong reuse in %s: the blocks read do not hold this prompt's tokens%s; recomputing",
            turn.internal_id,
            "" if got_salt == turn.salt else " (another cache_salt)",
        )
        return read, False

    def _count_path(self, params: dict, p_node: bool) -> None:
        if self.config.role != "decode":
            return
        if p_node:
            # A P's request (do_remote_decode) sent to this D: vLLM's scheduler treats a request
            # by its params, whatever the engine's kv_role (nixl/pull_scheduler.py
            # request_finished ~L191-293 names no role), so a router may prefill here.
            self.stats.prefill_requests += 1
        elif not params:
            self.stats.plain_requests += 1
        elif params.get("do_remote_prefill"):
            self.stats.remote_prefill_requests += 1
        else:
            self.stats.decode_only_requests += 1

    def _pull_failed(self, turn: Turn, exc: PullError) -> None:
        if exc.stale:
            self.stats.stale_pulls += 1
        else:
            self.stats.failed_pulls += 1
        log.warning("KV pull for %s failed: %s", turn.internal_id, exc)
        if self.config.kv_load_failure_policy == "fail":
            self.stats.kv_load_errors += 1
            raise KVLoadError(f"KV transfer failed for request {turn.internal_id}: {exc}") from exc

    # --- the end of a request ------------------------------------------------------------------

    def finish(self, turn: Turn) -> dict | None:
        """The request finished (stop or length): keep its blocks for one read and describe
        them, as the connector's request_finished does (nixl/pull_scheduler.py ~L191-293)."""
        kv_tokens = turn.sequence[
            :-1
        ]  # the last sampled token has no KV yet: prompt + generated - 1
        assert turn.blocks is not None  # held since admission, until here
        self.pool.commit(turn.blocks, self.pool.hashes(kv_tokens, turn.salt))
        self.stats.generated_tokens += turn.completion_tokens
        params = turn.params_in
        if not params or turn.fault.mode == "no_params":
            return None  # no params, nothing kept: the blocks are freed (and stay cached)
        p_node = _flag(params, "do_remote_decode")
        if not p_node and not self.config.bidirectional_kv_xfer:
            return None  # a D keeps nothing without bidirectional transfer (~L232-233)
        if p_node:
            ttl = self.config.kv_lease_duration
        elif _flag(params, "do_remote_prefill"):
            ttl = self.config.decoder_kv_blocks_ttl
        else:
            # D-side params that set neither flag: request_finished still delays the free and
            # exports params (the dict is not empty), but update_state_after_alloc never put the
            # request in reqs_in_batch (~L119-125), so the worker sets no expiry and ignores a
            # reader's notification (pull_worker.py ~L97-121, ~L670-681): held for good.
            ttl = None
            log.warning(
                "%s: kv_transfer_params without do_remote_prefill or do_remote_decode; "
                "its %d blocks will never be freed",
                turn.internal_id,
                len(turn.blocks),
            )
        lease = self.leases.put(
            turn.internal_id, kv_tokens, ttl, turn.salt, turn.blocks, window=self.window_blocks
        )
        turn.blocks = None
        out = {
            "do_remote_prefill": p_node,
            "do_remote_decode": not p_node,
            "remote_block_ids": lease.groups,
            "remote_engine_id": self.engine_id,
            "remote_request_id": turn.internal_id,
            "remote_host": self.config.advertise_host,
            "remote_port": self.config.kv_port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": len(kv_tokens),
            # The scheduler stamps the deadline whether or not the worker will ever keep it.
            "remote_blocks_expiry_time": None
            if p_node
            else (self.clock() + self.config.decoder_kv_blocks_ttl),
            # Bumped when an engine registers its KV cache again (after a sleep); the
            # emulator never does (nixl/pull_scheduler.py ~L291).
            "remote_registration_generation": 0,
            "transfer_mode": "pull",
        }
        if p_node:
            # P's cache hits, for D to report as its own (v1/core/sched/scheduler.py ~L2476-2487).
            out["remote_prefill_cached_tokens"] = turn.cached_tokens
        return out

    def reported_cached_tokens(self, turn: Turn) -> int:
        """What usage.prompt_tokens_details.cached_tokens says: on D after a remote prefill, P's
        hits as P reported them (v1/engine/output_processor.py ~L285-296, ~L798-799)."""
        params = turn.params_in or {}
        cached = params.get("remote_prefill_cached_tokens")
        if params.get("do_remote_prefill") and isinstance(cached, int):
            return cached
        return turn.cached_tokens

    def record(self, turn: Turn, outcome: str) -> None:
        """The request is over: free what no lease took, and keep one line for benchmarks
        (GET /stats/requests)."""
        self._release(turn)
        self.stats.recent.append(
            {
                "request_id": turn.internal_id,
                "kind": turn.kind,
                "outcome": outcome,
                "arrival": turn.arrival,
                "prefill_ms": round(turn.prefill_s * 1000, 3),
                "kv_wait_ms": round(turn.waited_s * 1000, 3),
                "total_ms": round((self.clock() - turn.arrival) * 1000, 3),
                "prompt_tokens": len(turn.tokens),
                "local_prefix_tokens": turn.local,
                "pulled_tokens": turn.pulled,
                "computed_prompt_tokens": turn.computed,
                "completion_tokens": turn.completion_tokens,
                "finish_reason": turn.finish_reason,
            }
        )

    def snapshot(self) -> dict:
        self.scheduler.advance(self.clock())
        waiting = len(self._waiting) + len(self.scheduler.waiting)
        held = self.leases.held()
        self.stats.leases_expired_unread = held.pop("leases_expired_unread")
        return {
            "role": self.config.role,
            "engine_id": self.engine_id,
            **self.stats.snapshot(),
            **held,
            "kv_blocks_used": self.pool.used,
            "kv_capacity_blocks": self.pool.capacity,
            "kv_cache_usage": round(self.pool.usage(), 6),
            "prefix_cache_blocks": self.pool.cached,
            "requests_running": len(self.scheduler.running),
            "requests_waiting": waiting + self.deferred,
            "requests_waiting_capacity": waiting,
            "requests_waiting_deferred": self.deferred,
            "fault": self.faults.current.mode,
        }
