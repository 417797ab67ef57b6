"""Conversation identity: explicit ids, chained history digests, tenant scope, prefix checks.

A digest match proves the client sent back the history an entry's KV was computed for; whether
the new prompt's *tokens* extend D's tokens is the template's business (see
`gateway.reuse.exactness` and docs/exactness.md).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import orjson

from gateway.parse import is_plain

# Request fields known NOT to change the prompt an engine renders: sampling and output options
# (vLLM's ChatCompletionRequest and CompletionRequest). Every other field is part of the digest
# scope, so two requests differing in it never share KV blocks: a field vLLM adds tomorrow
# (like cache_salt, reasoning_effort or mm_processor_kwargs before it) is safe by default.
# (Kept as a paragraph: formatted one name a line, it would be ~60 lines.)
# fmt: off
PROMPT_NEUTRAL = frozenset((
    "stream", "stream_options", "max_tokens", "max_completion_tokens", "min_tokens",
    "min_completion_tokens", "n", "best_of", "temperature", "top_p", "top_k", "min_p", "seed",
    "stop", "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "length_penalty", "use_beam_search",
    "logit_bias", "logprobs", "top_logprobs", "prompt_logprobs", "logprob_token_ids",
    "allowed_token_ids", "bad_words", "skip_special_tokens", "spaces_between_special_tokens",
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern", "structural_tag",
    "parallel_tool_calls", "include_reasoning", "thinking_token_budget", "echo", "user",
    "priority", "request_id", "return_token_ids", "return_tokens_as_token_ids",
    "return_token_offsets", "return_prompt_text", "return_mm_kwargs", "repetition_detection",
    "stream_interval", "watermarking", "metadata", "store", "service_tier", "prediction",
    "kv_transfer_params"))
# fmt: on
# The prompt itself, digested message by message (chat) or as text (completions).
_PROMPT = ("messages", "prompt")
# Left truncation (vLLM's default truncation side) drops the prompt's start: no prefix at all.
NO_REUSE = ("truncate_prompt_tokens", "prompt_embeds")
ID_HEADERS = ("X-Conversation-Id", "X-Session-ID")


# How far back a request's history is searched for the previous turn's entry, in messages:
# the turn's own new messages (a user message, or a tool loop's results) are rarely more.
LOOKUP_DEPTH = 64


def _h(*parts: bytes) -> bytes:
    # SHA-256 (cut to 16 bytes): CPUs hash it in hardware, faster than BLAKE2b, and every turn
    # hashes its whole history (docs/BENCHMARKS.md, "The figures behind smaller choices").
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(4, "little"))
        h.update(part)
    return h.digest()[:16]


def canonical_json(value: Any) -> bytes:
    """JSON bytes independent of key order and layout: what digests are taken over."""
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except TypeError:  # an integer beyond 64 bits (gateway.support.jsonio)
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def canonical_content(content: Any) -> Any:
    """Text as the engine sees it: None, "" and text-only parts joined by newlines are strings."""
    if content is None:
        return ""
    if isinstance(content, list):
        if all(isinstance(p, Mapping) and p.get("type") == "text" for p in content):
            return "\n".join(str(p.get("text", "")) for p in content)
        return [dict(p) if isinstance(p, Mapping) else p for p in content]
    return content


def canonical_message(message: Mapping[str, Any]) -> bytes:
    """The bytes of one chat message that decide its rendered tokens, independent of JSON layout."""
    if is_plain(message):
        # Most of every history, digested on every turn: the general form below, built direct.
        return orjson.dumps([message["role"], message["content"], None, [], None, None])
    tool_calls = [
        {
            "id": c.get("id"),
            "type": c.get("type", "function"),
            "function": {
                "name": (c.get("function") or {}).get("name"),
                "arguments": (c.get("function") or {}).get("arguments"),
            },
        }
        for c in message.get("tool_calls") or ()
        if isinstance(c, Mapping)
    ]
    return canonical_json(
        [
            message.get("role"),
            canonical_content(message.get("content")),
            message.get("name"),
            tool_calls,
            message.get("tool_call_id"),
            message.get("reasoning_content") or message.get("reasoning") or None,
        ]
    )


def tenant_of(authorization: str | None) -> bytes:
    """A tenant is a hash of the credential, so ids and digests never cross credentials."""
    return _h(b"tenant", (authorization or "").encode())


def tenant_salt(authorization: str | None, client_salt: str | None) -> str:
    """The cache_salt that keeps a tenant's prompts out of every other tenant's prefix cache
    hits (vLLM mixes cache_salt into its first block's hash). Derived from the credential, so
    no client can name another tenant's salt; the client's own salt, if any, stays inside."""
    return _h(b"cache-salt", tenant_of(authorization), (client_salt or "").encode()).hex()


@dataclass(frozen=True)
class Identity:
    """Who a request belongs to and which stored entries it may use.

    `root` is stable for the whole conversation (worker and instance affinity). Chat histories
    get one chained digest per message prefix; a completions prompt is checked by the digest of
    its first `history_len` characters.
    """

    root: str
    explicit: bool
    scope: bytes
    messages: tuple[bytes, ...] | None  # chained digests of each message prefix (chat)
    prompt: str | None  # the prompt (completions)
    reusable: bool = True  # False: the request's prompt is not what it says
    # For each assistant message that carries reasoning: the digest of the prefix ending with it,
    # its reasoning left out. An entry whose reply reasoned is stored under that digest, so a
    # client that does not echo reasoning finds it as well as one that does. The digest then
    # proves nothing of the reasoning, and needs not: such an entry is never plain, and an entry
    # found only through this digest (reasoning the reply did not have) is treated as not plain
    # either (`reasoning_added`): its reuse is always token-verified (gateway.reuse.exactness).
    unreasoned: Mapping[int, bytes] = field(default_factory=dict)
    tenant: bytes = b""  # a hash of the credential (tenant_of)
    # The client key the turn runs for (gateway.front.auth.ApiKeys.tenant; "" without client
    # keys): keys share each D's pinned budget and the store's size (gateway.reuse.store).
    key: str = ""

    def lookups(self) -> list[str]:
        """Store keys to try, longest history first."""
        if not self.reusable:
            return []
        if self.explicit:
            return [self.root]
        if self.messages is None:
            return []
        # Entries live under histories that end with an assistant reply; any of the most recent
        # LOOKUP_DEPTH prefixes may be one. Bounded: a store (Redis) is asked for every key in
        # one call, and a body of a million messages must not make that a million keys.
        first = max(0, len(self.messages) - LOOKUP_DEPTH - 1)
        keys = []
        for i in range(len(self.messages) - 2, first - 1, -1):
            keys.append(self.messages[i].hex())
            if i in self.unreasoned:
                keys.append(self.unreasoned[i].hex())
        return keys

    def extends(self, history_digest: str, history_len: int) -> bool:
        """Does this request's history strictly extend the history an entry's blocks hold?"""
        if self.messages is not None:
            if not 0 < history_len < len(self.messages):
                return False
            unreasoned = self.unreasoned.get(history_len - 1)
            return self.messages[history_len - 1].hex() == history_digest or (
                unreasoned is not None and unreasoned.hex() == history_digest
            )
        return (
            self.prompt is not None
            and 0 < history_len < len(self.prompt)
            and _h(self.scope, self.prompt[:history_len].encode()).hex() == history_digest
        )

    def reasoning_added(self, history_digest: str, history_len: int) -> bool:
        """Did this request's history reach the entry only with a reply's reasoning left out?
        Then the digest cannot vouch for the tokens of what the client sent."""
        return (
            self.messages is not None
            and 0 < history_len <= len(self.messages)
            and self.messages[history_len - 1].hex() != history_digest
        )

    def at_boundary(self, history_len: int) -> bool:
        """Completions: does the prompt continue the entry's text at a token boundary?

        The text is compared by characters, but D holds tokens: a continuation glued to the last
        word ("walk" + "ed") re-tokenizes it. A word character followed by whitespace is a
        boundary in the pre-tokenizers of BPE models (GPT-2/Llama 3/Qwen regexes split before a
        space-led word) and of SentencePiece (whitespace starts a new piece); anything else may
        merge. Chat replies end at the template's end-of-turn token, always a boundary.
        """
        if self.prompt is None:
            return True
        return word_boundary(self.prompt, history_len)

    def after(self, reply: Mapping[str, Any] | str) -> tuple[str | None, str, int]:
        """(store key, history digest, history length) for the entry this turn leaves behind."""
        if not self.reusable:
            return None, "", 0
        if self.messages is not None:
            assert not isinstance(reply, str)  # a chat turn's reply is a message
            digest = _h(self.messages[-1], canonical_message(_unreasoned(reply))).hex()
            length = len(self.messages) + 1
            return (self.root if self.explicit else digest), digest, length
        text = (self.prompt or "") + str(reply)
        digest = _h(self.scope, text.encode()).hex()
        return (self.root if self.explicit else None), digest, len(text)


REASONING_FIELDS = ("reasoning_content", "reasoning")


def _unreasoned(message: Mapping[str, Any]) -> Mapping[str, Any]:
    """The message without its reasoning (the same object if it has none)."""
    if not any(message.get(name) for name in REASONING_FIELDS):
        return message
    return {k: v for k, v in message.items() if k not in REASONING_FIELDS}


def _unreasoned_chain(
    messages: Sequence[Mapping[str, Any]], chain: Sequence[bytes], scope: bytes
) -> dict[int, bytes]:
    """Identity.unreasoned: only assistant messages with reasoning cost a digest."""
    out = {}
    for i, message in enumerate(messages):
        if len(message) == 2 and "content" in message:
            continue  # most messages: role and content, nothing to leave out
        if message.get("role") == "assistant" and any(message.get(n) for n in REASONING_FIELDS):
            previous = chain[i - 1] if i else scope
            out[i] = next(_chain(previous, [_unreasoned(message)]))
    return out


def word_boundary(text: str, at: int) -> bool:
    """Does `text` split into words at `at` (a word character, then whitespace)?"""
    return 0 < at < len(text) and not text[at - 1].isspace() and text[at].isspace()


class Conversation:
    """A validated request's conversation, digested as far as each caller needs: `root()` for
    the worker that owns it (the messages up to the first user message), `identity()` for the
    worker that serves it (every message). A worker that owns the conversation asks both, and
    the scope is digested once."""

    def __init__(
        self,
        body: Mapping[str, Any],
        headers: Mapping[str, str],
        conversation_id: str | None,
        key: str = "",
    ) -> None:
        self.body = body
        self.key = key
        self.tenant = tenant_of(headers.get("Authorization"))
        self.scope = _h(
            b"scope",
            self.tenant,
            canonical_json(
                {k: v for k, v in body.items() if k not in PROMPT_NEUTRAL and k not in _PROMPT}
            ),
        )
        self.explicit_id = conversation_id or next(
            (headers[h] for h in ID_HEADERS if headers.get(h)), None
        )
        self._root: str | None = None

    def root(self) -> str:
        """`identity().root`, digesting only the messages up to the first user message."""
        if self._root is None:
            body = self.body
            chain = _chain(self.scope, body["messages"]) if "messages" in body else None
            self._root = _root(body, self.tenant, self.scope, self.explicit_id, chain)
        return self._root

    def identity(self) -> Identity:
        """The identity of the request (chat if it has `messages`, else completions)."""
        body, scope = self.body, self.scope
        messages = tuple(_chain(scope, body["messages"])) if "messages" in body else None
        prompt = (
            body.get("prompt") if messages is None and isinstance(body.get("prompt"), str) else None
        )
        unreasoned = _unreasoned_chain(body["messages"], messages, scope) if messages else {}
        if self._root is None:
            self._root = _root(body, self.tenant, scope, self.explicit_id, messages)
        return Identity(
            root=self._root,
            explicit=bool(self.explicit_id),
            scope=scope,
            messages=messages,
            prompt=prompt,
            reusable=all(body.get(name) is None for name in NO_REUSE),
            unreasoned=unreasoned,
            tenant=self.tenant,
            key=self.key,
        )


def identify(
    body: Mapping[str, Any], headers: Mapping[str, str], conversation_id: str | None
) -> Identity:
    """Build the identity of a validated request (chat if it has `messages`, else completions)."""
    return Conversation(body, headers, conversation_id).identity()


def root_key(
    body: Mapping[str, Any], headers: Mapping[str, str], conversation_id: str | None
) -> str:
    """Just `identify(...).root`: all a worker needs to know when it forwards the request to
    the conversation's owner."""
    return Conversation(body, headers, conversation_id).root()


def _chain(scope: bytes, messages: Iterable[Mapping[str, Any]]) -> Iterator[bytes]:
    """The chained digest of each message prefix, lazily: _h(previous, canonical_message)."""
    chain = scope
    for message in messages:
        chain = _h(chain, canonical_message(message))
        yield chain


def _root(
    body: Mapping[str, Any],
    tenant: bytes,
    scope: bytes,
    explicit_id: str | None,
    chain: Iterable[bytes] | None,
) -> str:
    if explicit_id:
        return _h(b"id", tenant, explicit_id.encode()).hex()
    if chain is not None:
        # Up to the first user message: every turn of the conversation shares it.
        messages = body["messages"]
        first_user = next(
            (i for i, m in enumerate(messages) if m.get("role") == "user"), len(messages) - 1
        )
        return next(islice(chain, first_user, None)).hex()
    return _h(scope, str(body.get("prompt", ""))[:256].encode()).hex()
