"""The two-stage flow for one request: take the entry, prefill on P, decode on D, relay, put."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from contextlib import ExitStack
from dataclasses import dataclass, replace
from typing import NamedTuple, TypeVar

from gateway.engines.cost import Need
from gateway.engines.instances import Instance, Pool
from gateway.engines.upstream import Upstream
from gateway.engines.watch import unwatched
from gateway.flow.attempts import Answered, Work, attempt
from gateway.flow.decoded import Decoded
from gateway.flow.fast_path import CHARS_PER_TOKEN, TOKENS_PER_MESSAGE, FastPath
from gateway.flow.release import Releaser
from gateway.flow.reply import Reply, StreamRelay
from gateway.parse import ClientRequest
from gateway.reuse.conversation import Identity
from gateway.reuse.exactness import Exactness, Reuse, plain_reply
from gateway.reuse.kv_params import clean_params, decode_body, is_count, prefill_body
from gateway.reuse.store import ConversationStore, Entry
from gateway.support import jsonio, metrics
from gateway.support.errors import GatewayError, ServiceUnavailable
from gateway.support.jsonio import Written

log = logging.getLogger(__name__)
# One line per turn (`--access-log`): which path and why, the instances, TTFT and the outcome.
access = logging.getLogger("gateway.access")
# A template probe after a first turn (`Disagg._learn_template`) has no client waiting, so no
# request deadline: a /tokenize slower than this is in trouble.
PROBE_READ_TIMEOUT = 10.0

T = TypeVar("T")


def count_prefill(
    reply: dict, sent: dict | None, model: str, partial: bool = False
) -> tuple[int | None, str]:
    """Counts what P reports of its prompt (`prefill_counts`) and, for a turn that sent it D's
    params (`sent`), whether it read what D held. Returns P's prompt tokens, if it said, and
    the turn's KV outcome: read, recomputed, own_cache, unreported, or none (no params sent)."""
    prompt, cached, result = prefill_counts(
        reply, None if sent is None else sent.get("remote_num_tokens")
    )
    if prompt is not None:
        metrics.PREFILL_TOKENS.labels("prompt").inc(prompt)
    if cached is not None:
        metrics.PREFILL_TOKENS.labels("cached").inc(cached)
    kv = "none" if sent is None else result
    if cached is not None and kv != "unreported":
        metrics.CACHED_TOKENS.labels(kv, model).inc(cached)
    if sent is None:
        return prompt, kv
    if partial and result != "unreported":
        reach = min(sent["remote_num_tokens"], prompt)
        metrics.PARTIAL_TOKENS.labels("offered").inc(reach)
        metrics.PARTIAL_TOKENS.labels("cached").inc(min(cached, reach))
    metrics.KV_READS.labels(result, model).inc()
    return prompt, kv


def prefill_counts(reply: dict, held: object) -> tuple[int | None, int | None, str]:
    """What P reports of its prompt: its tokens and those it did not compute (P's params carry
    `remote_prefill_cached_tokens` when vLLM logs stats, its default; or usage's
    `prompt_tokens_details.cached_tokens` with --enable-prompt-tokens-details), None where it
    did not say; and, given the `held` tokens of D's params it was sent, whether it read them:
    read, recomputed, own_cache or unreported.

    P reads D's tokens up to min(remote_num_tokens, prompt) or none of them (under
    kv_recompute_threshold, or its own cache had them: vLLM 0.33 nixl/pull_scheduler.py
    ~L85-103), and reports its own hit plus what it read (v1/core/sched/scheduler.py ~L2476).
    """
    usage = reply.get("usage")
    usage = usage if isinstance(usage, dict) else {}
    prompt = usage.get("prompt_tokens")
    params = reply.get("kv_transfer_params")
    cached = params.get("remote_prefill_cached_tokens") if isinstance(params, dict) else None
    if not is_count(cached):
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
    prompt = prompt if is_count(prompt) else None
    cached = cached if is_count(cached) else None
    if prompt is None or cached is None or not is_count(held):
        return prompt, cached, "unreported"
    reach = min(held, prompt)
    return (
        prompt,
        cached,
        ("read" if cached == reach else "recomputed" if cached < reach else "own_cache"),
    )


def prefill_need(request: ClientRequest, entry: Entry | None) -> Need:
    """What a turn asks of P, for its choice (gateway.engines.cost): its prompt's tokens
    (`_prompt_tokens`); what D holds of them (the entry's remote_num_tokens); and what the
    conversation's own P computed for earlier turns: with an entry, taken as all D holds;
    without one (its last turn went decode-only, or the entry is gone, or holds no count), the
    chat history before the last message."""
    tokens = _prompt_tokens(request)
    on = entry.decode_url if entry is not None else None
    held = entry.params.get("remote_num_tokens") if entry is not None else None
    if is_count(held) and held > 0:  # (a bool is no count: True would hold 1)
        return Need(tokens, held, held, on)
    messages = request.body.get("messages") if request.is_chat else None
    if isinstance(messages, list) and len(messages) > 1 and isinstance(messages[-1], dict):
        content = messages[-1].get("content")
        last = _utf8_tokens(content) + TOKENS_PER_MESSAGE if isinstance(content, str) else tokens
        return Need(tokens, 0, max(tokens - last, 0), on)
    return Need(tokens, held_on=on)


def _prompt_tokens(request: ClientRequest) -> int:
    """A turn's prompt tokens as P gets them, estimated: text at CHARS_PER_TOKEN UTF-8 bytes
    a token (the chat history's JSON as written for the engines; a completion's text, each of
    a list of texts), token ids one each. A list of prompts counts all of them: P gets them
    in one request and computes each as a request of its own (vLLM 0.33.0
    entrypoints/openai/completion/serving.py ~L161-221)."""
    if request.is_chat:
        messages = request.wire.get("messages")
        if isinstance(messages, Written):
            return len(messages.data) // CHARS_PER_TOKEN + 1
        return len(jsonio.dumps(messages)) // CHARS_PER_TOKEN + 1  # what orjson could not write
    prompt = request.body.get("prompt")  # the client's: `wire` holds a list's JSON
    if isinstance(prompt, str):
        return _utf8_tokens(prompt) + 1
    if not isinstance(prompt, list):
        return 1
    return sum(
        _utf8_tokens(p) + 1 if isinstance(p, str) else len(p) if isinstance(p, list) else 1
        for p in prompt
    )


def _utf8_tokens(text: str) -> int:
    """Its tokens at CHARS_PER_TOKEN UTF-8 bytes a token: bytes, not characters, since the
    history's JSON is counted in bytes (it is never decoded for this), so its last message
    must be too."""
    return (len(text) if text.isascii() else len(text.encode())) // CHARS_PER_TOKEN


class Sent:
    """Whether a turn's entry went to a P, and its release once no P will read it: refused by
    the proof, or every P the params went to refused the connection (never read them), or the
    prefill failed before they were sent. A P that got them and failed otherwise may have read
    them, and its read notifies D: no release then (a second notification is D's error log)."""

    def __init__(self, entry: Entry | None, releaser: Releaser) -> None:
        self.entry = entry
        self.releaser = releaser
        self.carried = False
        self.dropped = False

    def drop(self, reason: str) -> None:
        if self.entry is not None and not self.dropped and not self.carried:
            self.dropped = True
            self.releaser.drop(self.entry, reason)

    def retrying(self, failure: GatewayError | None) -> None:
        """Before another attempt: after a refused connection the params were never read."""
        if self.carried and replayable(failure) and failure is not None:
            self.carried = False
            self.drop("prefill_failed")

    def failed(self, exc: GatewayError) -> None:
        """Every attempt failed: release unless a P that got the params may have read them (a
        4xx is a refusal before the engine saw the request)."""
        if isinstance(exc, ServiceUnavailable) or exc.status < 500:
            self.carried = False
        self.drop("prefill_failed")


def replayable(failure: GatewayError | None) -> bool:
    """May P's params go to another D after `failure`?

    Blocks are handed over once: a D that got the request may have read them before it failed
    (then another D's pull fails, and vLLM's default kv_load_failure_policy fails the request).
    Only a D that never got it, refused or not accepting a connection, certainly left them.
    """
    return failure is None or isinstance(failure, ServiceUnavailable)


@dataclass(frozen=True, slots=True)
class TurnPath:
    """The way a turn went, as its response headers, metrics and access-log line say it."""

    name: str  # decode-only, or two-stage
    reason: str  # why (pd_gateway_turn_paths_total's reasons)
    prefill: str  # P's name, or "-"
    cache: str  # hit, partial, miss: whether P was sent D's params (X-Gateway-Cache)
    kv: str  # what came of D's blocks: metrics.KV's words

    @property
    def kv_word(self) -> str:
        """The KV outcome as the X-Gateway-KV header says it: read, recomputed, own-cache,
        none, unreported."""
        return self.kv.replace("_", "-")


@dataclass(frozen=True, slots=True)
class Plan:
    """How a turn will run, decided before any engine computes for it: why its path, the entry
    (D's blocks) P may be sent, what exactness already proved of it, and, for a decode-only
    turn, the D that holds it. P is chosen as it is called (`Pool.choose`), each retry another;
    a two-stage D prefers the one holding the entry."""

    reason: str  # why (pd_gateway_turn_paths_total's reasons)
    entry: Entry | None = None  # the previous turn's, if it is there to read
    admitted: Reuse | None = None  # what P may read of it, where deciding the path proved it
    decode: Instance | None = None  # set: decode-only on this D; None: two-stage

    @property
    def prefer_decode(self) -> str | None:
        return self.entry.decode_url if self.entry is not None else None


class Prefilled(NamedTuple):
    """What one P attempt got: the entry's reuse it was sent (None: the miss stub), its reply."""

    reuse: Reuse | None
    reply: dict


@dataclass(slots=True)
class Turn:
    """One turn through the flow: what the client asked, whose conversation it is, what the
    engines get with it, and, once D answers, what D produced."""

    request: ClientRequest
    identity: Identity
    headers: dict  # the engines' headers (request id, trace context, credential)
    request_id: str  # for the access log
    started: float  # perf_counter() at its start: TTFT and P's time count from it
    work: Work  # what the engines did for it (the caller's, for the key's limits)
    model: str = "unknown"  # its model, as the metrics label it
    decoded: Decoded | None = None
    params_to_d: bool = False  # D was sent P's params (it loads the prompt from P)
    prefilled: float | None = None  # seconds from its start until P answered (two-stage)


class Disagg:
    """Runs requests through P and D and keeps the conversation store up to date."""

    def __init__(
        self,
        store: ConversationStore,
        upstream: Upstream,
        prefill: Pool,
        decode: Pool,
        releaser: Releaser | None = None,
        attempts: int = 2,
        exactness: Exactness | None = None,
        fast_path: FastPath = FastPath(),
        access_log: bool = False,
    ) -> None:
        self.store = store
        self.upstream = upstream
        self.prefill = prefill
        self.decode = decode
        # Entries dropped unread: their D is told to free the blocks (off: rate 0).
        self.releaser = releaser or Releaser(upstream, lambda entry: prefill, rate=0)
        self.attempts = attempts
        self.exactness = exactness or Exactness("auto")
        self.fast_path = fast_path
        self.access_log = access_log

    def take_entry(self, identity: Identity) -> Entry | None:
        """The previous turn's entry, if this request's history extends the history its blocks
        were computed for (whether its tokens do is `Exactness.admit`'s question)."""
        found = self.store.take_first(identity.lookups(), identity.root)
        if found is None:
            # First turn, expired, evicted, taken by a concurrent request, or an echo that is
            # not canonical-equal to the reply (its digest leads nowhere).
            metrics.ENTRIES.labels("absent").inc()
            return None
        key, entry = found
        if identity.extends(entry.history_digest, entry.history_len):
            metrics.ENTRIES.labels("found").inc()
            if entry.plain and identity.reasoning_added(entry.history_digest, entry.history_len):
                return replace(entry, plain=False)  # only tokens can prove that reuse
            return entry
        # Edited history, a rewritten or stripped reply, or another conversation's id.
        metrics.ENTRIES.labels("mismatch").inc()
        log.debug("conversation %s: history does not extend its entry; miss", key[:12])
        if identity.explicit:
            # Someone else's history under this id: leave the entry to its conversation.
            self.store.put(key, entry, identity.root, identity.key)
        else:
            self.releaser.drop(entry, "mismatch")
        return None

    def _attempt(
        self,
        pool: Pool,
        key: str,
        prefer: str | None,
        call: Callable[[Instance, GatewayError | None], T],
        hold: bool = False,
        only: Instance | None = None,
        work: Work | None = None,
        need: Need | None = None,
        exclude: Collection[Instance] = (),
    ) -> Answered[T]:
        """`call` on instances of `pool` until one answers, --attempts at most (`attempt`)."""
        return attempt(pool, key, call, self.attempts, prefer, hold, only, work, need, exclude)

    def run(
        self,
        request: ClientRequest,
        identity: Identity,
        headers: dict,
        request_id: str,
        work: Work | None = None,
        model: str = "unknown",
    ) -> Reply:
        """One turn: planned (`plan`), then run on its path. `work` hears what the engines did
        for it as they do it; `model` labels its metrics."""
        turn = Turn(
            request, identity, headers, request_id, time.perf_counter(), work or Work(), model
        )
        for pool in (self.decode, self.prefill):
            # No D (or P) answers its probes: fail now, before P computes a prompt no D can
            # decode, and before the conversation's entry is taken (it stays for a retry).
            if not pool.servable():
                raise ServiceUnavailable(pool.unservable(), instance_fault=False)
        plan = self.plan(turn)
        if plan.decode is not None:
            # A decode-only plan is made only for a found entry (`plan`): its D holds it.
            assert plan.entry is not None
            entry = plan.entry
            try:
                return self._decode_only(turn, plan)
            except GatewayError as exc:
                if not exc.instance_fault:
                    self.releaser.drop(entry, "decode_only")
                    raise
                # Its D failed before a byte: the two-stage path, as a miss (the blocks that D
                # held are not to be trusted now).
                log.info(
                    "decode-only turn failed on %s (%s); two-stage", plan.decode.name, exc.message
                )
                self.releaser.drop(entry, "decode_failed")
                plan = Plan("decode_failed")
        return self._two_stage(turn, plan)

    def plan(self, turn: Turn) -> Plan:
        """How `turn` will run: its entry taken from the store, and its path chosen. Calls no
        engine but D's /tokenize, where the fast path must count a prompt's tokens."""
        entry = self.take_entry(turn.identity)
        if entry is None:
            return Plan("no_entry")
        if self.decode.get(entry.decode_url) is None:
            # Its D has left the pool (removed, or its address gone from DNS): a miss, so P is
            # never sent to pull blocks from an engine that may no longer be there.
            metrics.ENTRIES.labels("gone").inc()
            # Gone from the pool is not always gone (removed for a drain, say): let it free.
            self.releaser.drop(entry, "decode_gone")
            return Plan("decode_gone")
        if not self.fast_path.max_tokens:
            return Plan("fast_path_off", entry)
        headers = turn.headers
        target = self.fast_path.target(
            entry,
            turn.request,
            turn.identity,
            self.decode,
            self.exactness,
            lambda d, body: self.upstream.tokenize(d, body, headers),
        )
        return Plan(target.reason, entry, target.reuse, target.decode)

    def _decode_only(self, turn: Turn, plan: Plan) -> Reply:
        """A plain request: D computes the few new tokens, its prefix cache serving the history,
        and keeps nothing for later (next turn: a two-stage miss, both engines' own caches
        serving most of it). The entry's blocks, now unread, go once the turn is over."""
        entry = plan.entry
        assert entry is not None  # `run` took it for this path
        d_body = self._body_for_d(turn)
        return self._decode(
            turn,
            lambda d, failure: d_body,
            None,
            TurnPath("decode-only", plan.reason, "-", "hit", "own_cache"),
            only=plan.decode,
            ended=lambda: self.releaser.drop(entry, "decode_only"),
        )

    def _two_stage(self, turn: Turn, plan: Plan) -> Reply:
        """P prefills (sent the entry's params where they are proven), then D decodes, loading
        the prompt from P."""
        sent = Sent(plan.entry, self.releaser)
        try:
            answered = self._attempt(
                self.prefill,
                turn.identity.root,
                None,
                lambda instance, failure: self._prefill(turn, plan, sent, instance, failure),
                work=turn.work,
                need=prefill_need(turn.request, plan.entry),
            )
        except GatewayError as exc:
            sent.failed(exc)
            raise
        prefill, prefilled = answered.instance, answered.result
        self.prefill.prefilled(turn.identity.root, prefill)  # the next turn's own P
        if prefill.role == "decode":
            metrics.PREFILLS_ON_DECODE.labels(prefill.name).inc()
        turn.prefilled = time.perf_counter() - turn.started
        metrics.PREFILL_SECONDS.labels(turn.model).observe(turn.prefilled)
        reuse = prefilled.reuse
        cache = "miss" if reuse is None else "partial" if reuse.result == "partial" else "hit"
        # `_prefill` keeps a reuse only with its entry.
        entry = reuse.entry if reuse is not None else None
        prompt_tokens, kv = count_prefill(
            prefilled.reply, entry.params if entry else None, turn.model, cache == "partial"
        )
        turn.work.done, turn.work.prompt_tokens = True, prompt_tokens  # P computed it
        d_body = self._body_for_d(turn)
        assert turn.decoded is not None  # `_body_for_d` made it
        turn.decoded.prompt_tokens = prompt_tokens
        with_blocks = decode_body(d_body, prefilled.reply, prefill)

        def body_for(decode: Instance, failure: GatewayError | None) -> dict:
            # The D that prefilled, decoding only as the last resort (no other D left), reads
            # nothing: its own prefix cache holds the prompt, and no D reads its own blocks.
            turn.params_to_d = replayable(failure) and decode is not prefill
            return with_blocks if turn.params_to_d else d_body

        return self._decode(
            turn,
            body_for,
            plan.prefer_decode,
            TurnPath("two-stage", plan.reason, prefill.name, cache, kv),
            ended=None if plan.entry is not None else lambda: self._learn_template(turn, prefill),
            # A D that prefilled (--prefill-on-decode) is pulled from, not decoded on.
            exclude=(prefill,) if prefill.role == "decode" else (),
        )

    def _prefill(
        self, turn: Turn, plan: Plan, sent: Sent, instance: Instance, failure: GatewayError | None
    ) -> Prefilled:
        """One attempt at P: the entry's params offered if proven and this is the first try."""
        request, identity, headers = turn.request, turn.identity, turn.headers

        def tokenize(body: dict) -> list:
            return self.upstream.tokenize(instance, body, headers)

        sent.retrying(failure)
        if (
            identity.reusable
            and plan.admitted is None
            and plan.entry is not None
            and failure is None
        ):
            # Before the reuse decision (a first turn learns it once over: `_learn_template`).
            self.exactness.prepare(request, tokenize, identity.tenant)
        # A retry never replays D's params: the failed P may already have read the blocks.
        # (After a refused connection it cannot have; one more miss keeps the rule simple.)
        reuse = None
        if plan.entry is not None and failure is None:
            reuse = (
                plan.admitted
                if plan.admitted is not None
                else self.exactness.admit(plan.entry, request, identity, tokenize)
            )
        params = None
        if reuse is not None and reuse.entry is not None:
            sent.carried = True  # whole or cut, P's notification frees D's request
            params = reuse.entry.params
        else:
            reuse = None
            sent.drop("unproven" if failure is None else "prefill_failed")
        body = prefill_body(request.wire, params)
        return Prefilled(reuse, self.upstream.post_json(instance, request.path, body, headers))

    def _learn_template(self, turn: Turn, prefill: Instance) -> None:
        """Once a turn without an entry is over, learn its template (`Exactness.prepare`: a
        probe of three /tokenize calls on P, once per template and tenant) for the turns that
        will reuse. A first turn has nothing to admit and so never waits for the probe: a
        burst of new conversations (or a new tenant's first) goes to P at once. Until it is
        known, D is asked for the turn's token ids (`Exactness.wants_ids`)."""
        if not turn.identity.reusable:
            return

        def tokenize(body: dict) -> list:
            return self.upstream.tokenize(prefill, body, turn.headers, PROBE_READ_TIMEOUT)

        try:
            with unwatched():  # the client has its reply: it may leave, the probe goes on
                self.exactness.prepare(turn.request, tokenize, turn.identity.tenant)
        except GatewayError as exc:
            # The probe counts an engine's failure itself (and waits its TTL before the next);
            # it passes on only the request's own end (client gone, deadline), which no watch
            # can cut here: never a stack trace from a reply's close.
            log.debug("template probe after the turn: %s", exc.message)

    def _body_for_d(self, turn: Turn) -> dict:
        """The client's body as D gets it (before P's params); the turn's `decoded` made ready.

        D's token ids let the next turn be verified; asked for here (once the template is
        known), they never reach a client that did not ask for them itself."""
        request = turn.request
        ask_ids = (
            turn.identity.reusable
            and self.exactness.wants_ids(request, turn.identity.tenant)
            and not request.body.get("return_token_ids")
        )
        turn.decoded = Decoded(strip_ids=ask_ids)
        return {**request.wire, "return_token_ids": True} if ask_ids else request.wire

    def _decode(
        self,
        turn: Turn,
        body_for: Callable[[Instance, GatewayError | None], dict],
        prefer: str | None,
        path: TurnPath,
        only: Instance | None = None,
        ended: Callable[[], None] | None = None,
        exclude: Collection[Instance] = (),
    ) -> Reply:
        """Decode on D (retried before the first byte unless `only`), relay, remember;
        `ended` runs when the turn is over (its stream closed), never before."""
        reply_headers = {
            "X-Gateway-Cache": path.cache,
            "X-Gateway-KV": path.kv_word,
            "X-Gateway-Path": f"{path.name}; reason={path.reason}",
        }
        request, decoded, headers = turn.request, turn.decoded, turn.headers
        assert decoded is not None  # `_body_for_d` made it, before any D was called
        if not request.stream:
            decode, reply = self._attempt(
                self.decode,
                turn.identity.root,
                prefer,
                lambda d, failure: self.upstream.post_json(
                    d, request.path, body_for(d, failure), headers
                ),
                only=only,
                work=turn.work,
                exclude=exclude,
            )
            turn.work.done = True
            self._count(turn, path)
            reply = decoded.absorb_body(reply)
            self._remember(turn, decode)
            self._let_go(decoded, decode, ended)
            metrics.E2E_SECONDS.labels(turn.model).observe(time.perf_counter() - turn.started)
            self._log_turn(turn, path, decode, None, "completed")
            return Reply(headers=reply_headers, body=reply, decoded=decoded)
        decode, stream = self._attempt(
            self.decode,
            turn.identity.root,
            prefer,
            lambda d, failure: self.upstream.open_stream(
                d, request.path, body_for(d, failure), headers
            ),
            hold=True,
            only=only,
            work=turn.work,
            exclude=exclude,
        )
        turn.work.done = True
        relay = StreamRelay(
            stream,
            decoded,
            decode,
            self.decode,
            turn.started,
            turn.model,
            lambda: self._remember(turn, decode),
            lambda ttft, outcome: self._log_turn(turn, path, decode, ttft, outcome),
        )
        try:
            self._count(turn, path)
        except BaseException:
            relay.finish()  # D's count and its stream are held from here on
            raise
        chunks = relay.chunks()
        closing = ExitStack()  # run last first, each even if one before it fails
        closing.callback(self._let_go, decoded, decode, ended)
        closing.callback(relay.finish)  # never iterated at all: the stream and D's count go
        closing.callback(chunks.close)  # cut short: its GeneratorExit counts a disconnect
        return Reply(
            headers={**reply_headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            stream=chunks,
            content_type=stream.content_type,
            close=closing.close,
            decoded=decoded,
        )

    def _let_go(self, decoded: Decoded, decode: Instance, ended: Callable[[], None] | None) -> None:
        """The turn is over: run `ended`, and release what D kept that no entry holds (a turn
        cut before its end, or one whose reply the next turn cannot find). Never raises: it
        runs in the reply's close."""
        try:
            if ended is not None:
                ended()
            raw = decoded.params
            # D's own params (do_remote_decode) name blocks D keeps for a next turn.
            params = (
                clean_params(raw)
                if isinstance(raw, dict) and raw.get("do_remote_decode") and not decoded.kept
                else None
            )
            if params is not None:
                params["remote_host"] = decode.host
                self.releaser.drop(
                    Entry(params=params, decode_url=decode.url, history_digest="", history_len=0),
                    "unstored",
                )
        except Exception:
            log.exception("letting go of the turn's blocks failed")

    @staticmethod
    def _count(turn: Turn, path: TurnPath) -> None:
        metrics.REQUESTS.labels(turn.request.label, turn.model, path.cache).inc()
        metrics.TURN_PATHS.labels(path.name, path.reason, turn.model).inc()

    def _log_turn(
        self, turn: Turn, path: TurnPath, decode: Instance, ttft: float | None, outcome: str
    ) -> None:
        if self.access_log:
            decoded = turn.decoded
            assert decoded is not None  # logged once D answered
            chunks = len(decoded.text) + len(decoded.reasoning)
            access.info(
                "turn %s model=%s cache=%s kv=%s path=%s reason=%s prefill=%s decode=%s "
                "prefill_ms=%s ttft_ms=%s chunks=%d finish=%s outcome=%s",
                turn.request_id,
                turn.model,
                path.cache,
                path.kv_word,
                path.name,
                path.reason,
                path.prefill,
                decode.name,
                "-" if turn.prefilled is None else f"{turn.prefilled * 1000:.1f}",
                "-" if ttft is None else f"{ttft * 1000:.1f}",
                chunks,
                ",".join(decoded.finish_reasons) or "-",
                outcome,
            )

    def _remember(self, turn: Turn, decode: Instance) -> None:
        request, identity, decoded = turn.request, turn.identity, turn.decoded
        assert decoded is not None  # remembered once D answered
        if decoded.reasoning:
            self.exactness.saw_reasoning(request.body.get("model"))
        if not decoded.reusable:
            return
        if decoded.params is None:
            if turn.params_to_d:  # D loaded the prompt from P, finished, kept nothing
                self.decode.kept_nothing(decode, request.stream)
            return
        if turn.params_to_d:
            self.decode.kept(decode)
        params = clean_params(decoded.params)
        if params is None:
            log.warning("%s returned malformed kv_transfer_params; not stored", decode.name)
            metrics.ENTRIES.labels("rejected").inc()
            return
        reply = decoded.reply_message() if identity.messages is not None else decoded.reply_text()
        key, digest, length = identity.after(reply)
        if key is None:
            return
        held, prefixes = self.exactness.held(
            decoded.prompt_ids,
            decoded.output_ids,
            params.get("remote_num_tokens"),
            len(params["remote_block_ids"]) == 1,
        )
        params["remote_host"] = decode.host
        self.store.put(
            key,
            Entry(
                params=params,
                decode_url=decode.url,
                history_digest=digest,
                history_len=length,
                plain=plain_reply(identity, decoded, request.body),
                token_digest=held,
                prefixes=prefixes,
            ),
            identity.root,
            identity.key,
        )
        decoded.kept = True
        metrics.ENTRIES.labels("stored").inc()
