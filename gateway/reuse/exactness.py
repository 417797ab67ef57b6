"""May this turn's P read the blocks D kept after the previous turn? Proof before reuse.

P reads D's blocks by position, so reuse is right only if the new prompt's *tokens* extend the
tokens D holds (vLLM issue #43094). A history digest proves the client sent back what it got;
that the tokens follow depends on the chat template. Three proofs, cheapest first:

- **Plain turn** (no reasoning, no tool calls, no surrounding whitespace): the digest is enough
  where the template keeps the prefix property, which `TemplateProbe` checks once per template
  with three small /tokenize calls (a template that rewrites earlier text fails it).
- **Token verification**: D returns its token ids (`return_token_ids`, vLLM 0.10.2+); the entry
  keeps a digest of the tokens D holds, and the next turn's prompt is tokenized on P
  (`/tokenize`, the same fields the engine renders) and compared. Reasoning and tool-call turns
  need it: templates drop or re-render them.
- **Partial reuse**: where the tokens differ, the largest block-aligned prefix the new prompt
  still shares with D's tokens (`gateway.reuse.partial`), if it is at least `partial_tokens`: P
  reads only those (D's params cut to them).
- Otherwise: no reuse (a miss, never a wrong read).

`verify_reuse`: `auto` (verify only what the digest cannot prove), `always` (verify every reuse),
`off` (no /tokenize, no token ids: plain turns on the digest alone, the rest miss).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any, NamedTuple

from cachetools import TTLCache

from gateway.parse import ClientRequest
from gateway.reuse import partial
from gateway.reuse.conversation import Identity, canonical_json, word_boundary
from gateway.reuse.kv_params import is_count
from gateway.reuse.store import Entry
from gateway.support import metrics
from gateway.support.errors import ClientGone, GatewayError, clip

log = logging.getLogger(__name__)

MODES = ("auto", "always", "off")
# The chat fields vLLM's /tokenize renders like a chat request does (TokenizeChatRequest).
TOKENIZE_CHAT_FIELDS = (
    "model",
    "messages",
    "tools",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "mm_processor_kwargs",
    "media_io_kwargs",
)
TOKENIZE_COMPLETION_FIELDS = ("model", "prompt", "add_special_tokens")
# Fields that change a chat prompt but that /tokenize does not take: a request carrying one
# cannot be reproduced, so its reuse cannot be verified (vLLM passes them to the template).
NOT_TOKENIZABLE = ("documents", "reasoning_effort")
# The fields that select a template's behaviour: one probe per distinct combination.
TEMPLATE_FIELDS = (
    "model",
    "tools",
    "tool_choice",
    "chat_template",
    "chat_template_kwargs",
    "mm_processor_kwargs",
    "add_special_tokens",
    *NOT_TOKENIZABLE,
)
PROBE_HISTORY = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is a prefix?"},
]
PROBE_REPLY = {"role": "assistant", "content": "The start of a sequence."}
PROBE_NEXT = {"role": "user", "content": "And a suffix?"}

Tokenize = Callable[[dict], list]


class Reuse(NamedTuple):
    """What P is sent for a found entry, and why: the entry, its first K tokens (`partial`) or
    nothing (a miss); the prompt's token count where it was tokenized; a REUSE_CHECKS label."""

    entry: Entry | None
    prompt_tokens: int | None
    result: str


def plain_reply(identity: Identity, decoded, body: dict) -> bool:
    """Is this turn's reply one whose re-rendering the digest can vouch for?

    Reasoning and tool calls are re-rendered by templates from what the client sends back (or
    dropped); leading or trailing whitespace is trimmed by many (Llama 3's `| trim`, Qwen3's
    strip); a completions reply must start at a token boundary of its prompt.
    """
    if decoded.reasoning or decoded.tool_calls:
        return False
    text = decoded.reply_text()
    if identity.messages is not None:
        return (
            text == text.strip()
            and not body.get("continue_final_message")
            and body.get("add_generation_prompt") is not False
        )
    prompt = identity.prompt or ""
    return word_boundary(prompt + text, len(prompt))


def _propagate(exc: GatewayError) -> bool:
    """A failure of the request itself (client gone, deadline), not of /tokenize."""
    return isinstance(exc, ClientGone) or (exc.status == 504 and not exc.instance_fault)


class TemplateProbe:
    """Does a template keep the prefix property for plain turns? Probed once per template and
    tenant: a probe's answer is known at once for a template already probed, so shared between
    tenants the time of a turn would tell one tenant whether another sent the same `tools`.

    render(history) + reply must be a prefix of render(history + reply + next), and the
    generation prompt a prefix of the rendered reply. Three /tokenize calls per template
    (model, tools, chat_template, kwargs...) per worker, kept for `ttl` seconds; a failed
    probe is retried after `retry` seconds and counts as unsafe until then.
    """

    def __init__(self, ttl: float = 3600.0, retry: float = 30.0, maxsize: int = 1024) -> None:
        self._known: TTLCache = TTLCache(maxsize, ttl)
        self._failed: TTLCache = TTLCache(maxsize, retry)
        self._lock = threading.Lock()
        self._probing: dict[str, threading.Lock] = {}  # one probe per template at a time

    @staticmethod
    def key(body: dict, tenant: bytes = b"") -> str:
        fields = canonical_json({k: body.get(k) for k in TEMPLATE_FIELDS if k in body})
        return hashlib.blake2b(fields, digest_size=16, key=tenant[:64]).hexdigest()

    def known(self, body: dict, tenant: bytes = b"") -> bool | None:
        key = self.key(body, tenant)
        with self._lock:
            if key in self._failed:
                return False
            return self._known.get(key)

    def safe(self, body: dict, tokenize: Tokenize, tenant: bytes = b"") -> bool:
        cached = self.known(body, tenant)
        if cached is not None:
            return cached
        key = self.key(body, tenant)
        with self._lock:
            probing = self._probing.setdefault(key, threading.Lock())
        with probing:  # the first request of a new template probes; the others wait for it
            cached = self.known(body, tenant)
            if cached is not None:
                return cached
            try:
                return self._probe(body, tokenize, key)
            finally:
                with self._lock:
                    self._probing.pop(key, None)

    def _probe(self, body: dict, tokenize: Tokenize, key: str) -> bool:
        if any(body.get(name) is not None for name in NOT_TOKENIZABLE):
            return self._remember(key, False, "unsafe")
        fields = {k: body[k] for k in TOKENIZE_CHAT_FIELDS if k in body and k != "messages"}
        fields.pop("add_generation_prompt", None)
        fields.pop("continue_final_message", None)
        try:
            generation = tokenize({**fields, "messages": PROBE_HISTORY})
            reply = tokenize(
                {
                    **fields,
                    "messages": PROBE_HISTORY + [PROBE_REPLY],
                    "add_generation_prompt": False,
                    "continue_final_message": True,
                }
            )
            following = tokenize({**fields, "messages": PROBE_HISTORY + [PROBE_REPLY, PROBE_NEXT]})
        except GatewayError as exc:
            if _propagate(exc):
                raise
            log.warning(
                "template probe failed (%s); reuse needs token verification for %ss",
                exc.message,
                int(self._failed.ttl),
            )
            metrics.TEMPLATE_PROBES.labels("error").inc()
            with self._lock:
                self._failed[key] = True
            return False
        keeps = (
            len(reply) > len(generation)
            and reply[: len(generation)] == generation
            and following[: len(reply)] == reply
        )
        if not keeps:
            log.warning(
                "the chat template of model %s does not keep the prefix property "
                "(earlier text re-rendered): every reuse is token-verified",
                clip(repr(body.get("model"))),
            )
        return self._remember(key, keeps, "safe" if keeps else "unsafe")

    def _remember(self, key: str, safe: bool, result: str) -> bool:
        metrics.TEMPLATE_PROBES.labels(result).inc()
        with self._lock:
            self._known[key] = safe
        return safe


class Exactness:
    """Decides, per turn, whether an entry's blocks may be read and what D must report."""

    def __init__(
        self, mode: str, partial_tokens: int = 0, block_size: int | Callable[[], int | None] = 16
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"verify_reuse must be one of {MODES}, got {mode!r}")
        self.mode = mode
        # Partial reuse from this many shared tokens up (0: off), in blocks of the engines'
        # size: a number, or what the engines report now (None: unknown, no partial reuse).
        self.partial_tokens = partial_tokens
        self._block_size = block_size if callable(block_size) else (lambda: block_size)
        self._size_warned = False
        self.templates = TemplateProbe()
        self._reasoning_models: set = set()

    def saw_reasoning(self, model: Any) -> None:
        """A reply of this model reasoned: ask for its token ids from now on (auto)."""
        if len(self._reasoning_models) < 1024:
            self._reasoning_models.add(model)

    def prepare(self, request: ClientRequest, tokenize: Tokenize, tenant: bytes = b"") -> None:
        """Learn the request's template behaviour before its first reuse decision (auto, chat),
        each tenant its own probe."""
        if self.mode == "auto" and request.is_chat:
            self.templates.safe(request.body, tokenize, tenant)

    def wants_ids(self, request: ClientRequest, tenant: bytes = b"") -> bool:
        """Should D return token ids, so that the next turn can be verified?"""
        if self.mode == "off":
            return False
        if self.mode == "always":
            return True
        if not request.is_chat:
            return False
        body = request.body
        return (
            bool(body.get("tools"))
            or body.get("model") in self._reasoning_models
            or self.templates.known(body, tenant) is not True
        )

    def held(
        self, prompt_ids: list | None, output_ids: list | None, held: Any, single_group: bool
    ) -> tuple[str | None, bytes | None]:
        """The token digest of what D holds after a turn, and its partial-reuse checkpoints
        (only for one KV group, the only kind partial reuse may cut)."""
        size = (self._block_size() or 0) if self.partial_tokens and single_group else 0
        return partial.held_digests(prompt_ids, output_ids, held, size)

    def admit(
        self, entry: Entry, request: ClientRequest, identity: Identity, tokenize: Tokenize
    ) -> Reuse:
        """What P may read of `entry`'s blocks for this request. Counts why not."""
        proven = entry.plain and identity.at_boundary(entry.history_len)
        if self.mode == "off" or (
            self.mode == "auto"
            and proven
            and (not request.is_chat or self.templates.known(request.body, identity.tenant))
        ):
            if proven:
                metrics.REUSE_CHECKS.labels("digest").inc()
                return Reuse(entry, None, "digest")
            return self._refuse("unproven")
        if entry.token_digest is None:
            return self._refuse("unverifiable")
        body = self.tokenize_body(request)
        if body is None:
            return self._refuse("unverifiable")
        try:
            tokens = tokenize(body)
        except GatewayError as exc:
            if _propagate(exc):
                raise
            log.warning("token verification failed: %s; miss", exc.message)
            return self._refuse("error")
        held = entry.params.get("remote_num_tokens")
        if not is_count(held):
            return self._refuse("mismatch")
        data = partial.ids_bytes(tokens)
        # P reads min(held, prompt - 1) tokens: the prompt must be longer than what D holds.
        if (
            data is not None
            and len(tokens) > held
            and hashlib.blake2b(data[: held * 8], digest_size=16).hexdigest() == entry.token_digest
        ):
            metrics.REUSE_CHECKS.labels("verified").inc()
            return Reuse(entry, len(tokens), "verified")
        cut = self._partial(entry, held, data)
        if cut is not None:
            metrics.REUSE_CHECKS.labels("partial").inc()
            return Reuse(cut, len(tokens), "partial")
        return self._refuse("mismatch")

    def _partial(self, entry: Entry, held: int, data: bytes | None) -> Entry | None:
        """The entry cut to the longest block-aligned prefix of D's tokens the prompt shares
        (`data`: its ids as int64), if that is `partial_tokens` or more and the cut is exact."""
        size = self._block_size()
        if not (self.partial_tokens and entry.prefixes and data and size):
            return None
        shared = partial.shared_tokens(entry.prefixes, held, data, size)
        if shared < self.partial_tokens:
            return None
        params = partial.cut(entry.params, shared, size)
        if params is None:
            self._warn_block_size(entry, size)
            return None
        return replace(entry, params=params)

    def _warn_block_size(self, entry: Entry, size: int) -> None:
        groups = entry.params.get("remote_block_ids") or [[]]
        held = entry.params.get("remote_num_tokens")
        if (
            not self._size_warned
            and len(groups) == 1
            and is_count(held)
            and len(groups[0]) != -(-held // size)
        ):
            self._size_warned = True
            log.warning(
                "D's block list (%d ids for %d tokens) does not match a block size of "
                "%d (--kv-block-size): no partial reuse",
                len(groups[0]),
                held,
                size,
            )

    @staticmethod
    def tokenize_body(request: ClientRequest) -> dict | None:
        """The /tokenize body that renders exactly this request's prompt, or None."""
        body = request.body
        if not request.is_chat:
            return (
                {k: body[k] for k in TOKENIZE_COMPLETION_FIELDS if k in body}
                if isinstance(body.get("prompt"), str)
                else None
            )
        if any(body.get(name) is not None for name in NOT_TOKENIZABLE):
            return None
        wire = request.wire  # the history as already written for P and D
        out = {k: wire[k] for k in TOKENIZE_CHAT_FIELDS if k in wire}
        if out.get("continue_final_message"):
            out["add_generation_prompt"] = False  # vLLM rejects both set
        return out

    @staticmethod
    def _refuse(reason: str) -> Reuse:
        metrics.REUSE_CHECKS.labels(reason).inc()
        return Reuse(None, None, reason)
