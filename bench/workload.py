"""The multi-turn chat workload: deterministic conversations, request bodies and the ideal prefill."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from gateway.emulator.tokens import VOCAB, render_chat

MODEL = "emulated-model"  # the emulator's default served name
# Sizes in words (= emulator tokens), after vLLM's generate_multi_turn.json scaled down: a long
# first message, then 120-160 words a turn; the engines reply with --output-tokens words.
# The first message is 300 + index words, so prompt lengths tell concurrent requests apart when
# client turns are matched to engine records (bench.metrics).
FIRST_WORDS = 300
TURN_WORDS = (120, 160)
REPLY_WORDS = 32  # max_tokens: the emulator obeys it exactly (finish_reason "length")


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(VOCAB) for _ in range(count))


@dataclass
class Conversation:
    """One client conversation; `salt` keeps its text unique across systems sharing the engines.

    The engines are shared by every system in a run and D keeps a prefix cache, so two systems
    sending the same text would let the second ride on the first's cache.
    """

    salt: str
    index: int
    first_words: int | None = None  # default FIRST_WORDS + index
    messages: list[dict] = field(default_factory=list)
    _rng: random.Random = field(init=False, repr=False)
    _covered: int = field(default=0, init=False)  # prompt tokens the previous turn left in KV

    def __post_init__(self) -> None:
        self._rng = random.Random(f"{self.salt}/{self.index}")
        if self.first_words is None:
            self.first_words = FIRST_WORDS + self.index % 400

    @property
    def id(self) -> str:
        return f"conv-{self.salt}-{self.index}"

    def next_user_message(self) -> None:
        count = self.first_words if not self.messages else self._rng.randint(*TURN_WORDS)
        head = f"conversation {self.id} turn {len(self.messages) // 2 + 1}:"
        self.messages.append({"role": "user", "content": f"{head} {words(self._rng, count)}"})

    def body(self, explicit_id: bool) -> dict:
        """The payload of vLLM's multi-turn benchmark, plus `conversation_id` when ids are sent."""
        body = {"model": MODEL, "messages": self.messages, "stream": True,
                "stream_options": {"include_usage": False}, "max_tokens": REPLY_WORDS}
        if explicit_id:
            body["conversation_id"] = self.id
        return body

    def prompt_tokens(self) -> int:
        return len(render_chat(self.messages))

    def ideal_computed(self, prompt_tokens: int) -> int:
        """Prompt tokens a perfect reuse computes: all of turn 1, then only what the client added."""
        return prompt_tokens - min(self._covered, prompt_tokens - 1)

    def add_reply(self, prompt_tokens: int, reply: str) -> None:
        # What the client adds next turn is new; prompt and reply are not (the engines' last
        # sampled token has no KV yet, so real reuse computes one token more than this ideal).
        self._covered = prompt_tokens + len(reply.split())
        self.messages.append({"role": "assistant", "content": reply})


def filler_history(salt: str, index: int, size_bytes: int) -> Conversation:
    """A conversation whose messages already hold about `size_bytes` of text (growth runs)."""
    conv = Conversation(salt, index)
    rng = random.Random(f"history/{salt}/{index}")
    while sum(len(m["content"]) for m in conv.messages) < size_bytes:
        role = "user" if len(conv.messages) % 2 == 0 else "assistant"
        conv.messages.append({"role": role, "content": words(rng, 150)})
    if conv.messages and conv.messages[-1]["role"] == "user":
        conv.messages.append({"role": "assistant", "content": words(rng, 32)})
    return conv
