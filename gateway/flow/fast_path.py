"""The decode-only fast path's decision: may a follow-up turn skip P and go to the D that
already holds its history? It may when that D is ready and the new prompt tokens are few.

A short follow-up ("and in Python?") costs D a few tokens of prefill from its own prefix cache;
the two-stage path costs a P round trip and two KV transfers. The threshold (`--fast-path-tokens`)
is where the two cross; docs/fast-path.md says how to choose it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from gateway.engines.instances import Instance, Pool
from gateway.parse import ClientRequest
from gateway.reuse.conversation import Identity, canonical_content
from gateway.reuse.exactness import Exactness, Reuse
from gateway.reuse.kv_params import is_count
from gateway.reuse.store import Entry

# About 4 characters of English per BPE token (GPT-2 through Llama 3 and Qwen tokenizers); a
# chat template adds a role header and an end-of-turn marker per message. An estimate decides
# only the path, never what is reused: exactness decides that, and counts the tokens where it
# verifies them.
CHARS_PER_TOKEN = 4
TOKENS_PER_MESSAGE = 8


class Target(NamedTuple):
    """The fast path's answer for one turn."""

    decode: Instance | None  # the D for a decode-only turn; None: two-stage
    reason: str  # why (pd_gateway_turn_paths_total's reasons)
    reuse: Reuse | None  # the entry's reuse, where deciding the path proved it


@dataclass(frozen=True)
class FastPath:
    max_tokens: int = 0  # new prompt tokens below which a turn skips P; 0: off

    def target(
        self,
        entry: Entry,
        request: ClientRequest,
        identity: Identity,
        decode: Pool,
        exactness: Exactness,
        tokenize: Callable[[Instance, dict], list],
    ) -> Target:
        """Decode-only on the D that holds `entry`, or two-stage, and why."""
        instance, state = decode.readiness(entry.decode_url)
        if instance is None:
            return Target(None, f"decode_{state}", None)
        if self.estimate(request, entry) >= self.max_tokens:
            return Target(None, "long", None)

        def on_d(body: dict) -> list:
            return tokenize(instance, body)

        # The same proof as the two-stage path: a decode-only turn never reuses what P would
        # not have been allowed to read.
        exactness.prepare(request, on_d, identity.tenant)
        reuse = exactness.admit(entry, request, identity, on_d)
        if reuse.result == "error":
            # D's /tokenize failed: P may still prove it.
            return Target(None, "tokenize_failed", None)
        if reuse.entry is None:
            return Target(None, "unproven", reuse)
        if reuse.result == "partial":
            # P reads what the prompt shares, computes the rest.
            return Target(None, "partial", reuse)
        held = entry.params.get("remote_num_tokens")
        if (
            reuse.prompt_tokens is not None
            and is_count(held)
            and reuse.prompt_tokens - held >= self.max_tokens
        ):
            return Target(None, "long", reuse)  # exact where the tokens were counted
        return Target(instance, "short", reuse)

    @staticmethod
    def estimate(request: ClientRequest, entry: Entry) -> int:
        """New prompt tokens since `entry`'s history (messages or characters)."""
        body = request.body
        if request.is_chat:
            chars = 0
            for message in body["messages"][entry.history_len :]:
                content = canonical_content(message.get("content"))
                chars += len(content) if isinstance(content, str) else len(json.dumps(content))
                if message.get("tool_calls"):
                    chars += len(json.dumps(message["tool_calls"]))
            new = len(body["messages"]) - entry.history_len
            return new * TOKENS_PER_MESSAGE + chars // CHARS_PER_TOKEN
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            return 1 << 30  # token-id or batched prompts: never estimated short
        return (len(prompt) - entry.history_len) // CHARS_PER_TOKEN + 1
