"""The decode-only fast path's measure: how many new prompt tokens a follow-up turn adds to the
history its D already holds, estimated from text before any engine is asked.

A short follow-up ("and in Python?") costs D a few tokens of prefill from its own prefix cache;
the two-stage path costs a P round trip and two KV transfers. The threshold (`--fast-path-tokens`)
is where the two cross; docs/fast-path.md says how to choose it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from .conversation import canonical_content
from .parse import ClientRequest
from .store import Entry

# About 4 characters of English per BPE token (GPT-2 through Llama 3 and Qwen tokenizers); a
# chat template adds a role header and an end-of-turn marker per message. An estimate decides
# only the path, never what is reused: exactness decides that, and counts the tokens where it
# verifies them.
CHARS_PER_TOKEN = 4
TOKENS_PER_MESSAGE = 8


@dataclass(frozen=True)
class FastPath:
    max_tokens: int = 0            # new prompt tokens below which a turn skips P; 0: off

    @staticmethod
    def estimate(request: ClientRequest, entry: Entry) -> int:
        """New prompt tokens since `entry`'s history (messages or characters)."""
        body = request.body
        if request.is_chat:
            chars = 0
            for message in body["messages"][entry.history_len:]:
                content = canonical_content(message.get("content"))
                chars += len(content) if isinstance(content, str) else len(json.dumps(content))
                if message.get("tool_calls"):
                    chars += len(json.dumps(message["tool_calls"]))
            new = len(body["messages"]) - entry.history_len
            return new * TOKENS_PER_MESSAGE + chars // CHARS_PER_TOKEN
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            return 1 << 30                 # token-id or batched prompts: never estimated short
        return (len(prompt) - entry.history_len) // CHARS_PER_TOKEN + 1
