"""The multi-turn chat workload: one Conversation model for the tests and the benchmarks.

A conversation asks, sends its body, and adds the reply; `turn()` does one turn over a new
connection (the tests' client, driven by `drive` and `run`); the benchmark's client
(bench.loadgen) sends `body()` and `headers()` with its own. locustfile.py has a small model of
its own: it imports nothing outside locust and the standard library.
"""

from __future__ import annotations

import os
import random
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import requests

from devtools import sse
from emulator.tokens import VOCAB, render_chat

MODEL = "emulated-model"  # the emulator's default served name
# Benchmark sizes in words (= emulator tokens), after vLLM's generate_multi_turn.json scaled
# down: a long first message, then 120-160 words a turn; the engines reply with max_tokens words.
# The first message is 300 + index words, so prompt lengths tell concurrent requests apart when
# client turns are matched to engine records (bench.metrics).
FIRST_WORDS = 300
TURN_WORDS = (120, 160)
# The benchmark's max_tokens: the emulator obeys it exactly (finish "length"). bench.profile
# --reply-words sets BENCH_REPLY_WORDS for its load generator (per-event against per-turn cost).
REPLY_WORDS = int(os.environ.get("BENCH_REPLY_WORDS", "32"))


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(VOCAB) for _ in range(count))


@dataclass
class Conversation:
    """One client conversation: its history, the next request, and what each turn got back.

    Each user message is a head unique to the conversation, then `first_words` (the first
    message) or `turn_words` words drawn from a generator seeded by `seed` (default: the id),
    so a benchmark sends the same text in every run.
    """

    url: str = ""  # where turn() sends; other clients send body() themselves
    cid: str = field(default_factory=lambda: uuid.uuid4().hex)
    seed: str = ""
    first_words: int = 3
    turn_words: tuple[int, int] = (2, 2)
    stream: bool = True
    explicit: bool = True  # conversation_id in the body
    session_header: bool = False  # the id as an X-Session-ID header
    max_tokens: int = 6
    model: str = MODEL
    stream_options: dict | None = None
    retries: int = 0  # turn() sends again only when no response came at all
    messages: list[dict] = field(default_factory=list)
    caches: list = field(default_factory=list)  # X-Gateway-Cache of each turn
    paths: list = field(default_factory=list)  # X-Gateway-Path of each turn
    kvs: list = field(default_factory=list)  # X-Gateway-KV of each turn
    errors: list = field(default_factory=list)
    _rng: random.Random = field(init=False, repr=False)
    _covered: int = field(default=0, init=False)  # prompt tokens the previous turn left in KV

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed or self.cid)

    def ask(self) -> None:
        """Add the next user message, unless one is still waiting for its reply."""
        if self.messages and self.messages[-1]["role"] == "user":
            return
        count = self.first_words if not self.messages else self._rng.randint(*self.turn_words)
        head = f"conversation {self.cid} turn {len(self.messages) // 2 + 1}:"
        self.messages.append({"role": "user", "content": f"{head} {words(self._rng, count)}"})

    def body(self) -> dict:
        body = {
            "model": self.model,
            "messages": self.messages,
            "max_tokens": self.max_tokens,
            "stream": self.stream,
        }
        if self.stream_options is not None:
            body["stream_options"] = self.stream_options
        if self.explicit:
            body["conversation_id"] = self.cid
        return body

    def headers(self) -> dict:
        return {"X-Session-ID": self.cid} if self.session_header else {}

    def prompt_tokens(self) -> int:
        return len(render_chat(self.messages))

    def ideal_computed(self, prompt_tokens: int) -> int:
        """Prompt tokens a perfect reuse computes: all of turn 1, then what the client added."""
        return prompt_tokens - min(self._covered, prompt_tokens - 1)

    def add_reply(
        self, reply: str, cache: str | None = None, prompt_tokens: int | None = None
    ) -> None:
        """A finished turn: the reply joins the history and its X-Gateway-Cache the caches;
        `prompt_tokens` (this turn's) feeds ideal_computed for the next turn."""
        if prompt_tokens is not None:
            # What the client adds next turn is new; prompt and reply are not (the engines' last
            # sampled token has no KV yet, so real reuse computes one token more than this ideal).
            self._covered = prompt_tokens + len(reply.split())
        self.messages.append({"role": "assistant", "content": reply})
        self.caches.append(cache)

    def turn(self) -> bool:
        """One turn on a new connection, as many clients do; False (and the error recorded in
        `errors`) if it failed."""
        self.ask()
        try:
            response = _post(self.url, self.body(), self.headers(), self.stream, self.retries)
            if response.status_code != 200:
                raise sse.StreamError(f"HTTP {response.status_code}: {response.text[:200]}")
            if self.stream:
                events = sse.events(response)
                sse.check(events)
                text = sse.reply(events)
            else:
                text = response.json()["choices"][0]["message"]["content"]
        except Exception as exc:  # recorded; the tests assert there are none
            self.errors.append(f"{self.cid} turn {len(self.caches)}: {exc!r}")
            return False
        self.add_reply(text, response.headers.get("X-Gateway-Cache"))
        self.paths.append(response.headers.get("X-Gateway-Path"))
        self.kvs.append(response.headers.get("X-Gateway-KV"))
        return True


def _post(url: str, body: dict, headers: dict, stream: bool, retries: int) -> requests.Response:
    """POST on a new connection; like the OpenAI SDK, retry only when no response came at all."""
    for attempt in range(retries + 1):
        try:
            return requests.post(
                url + "/v1/chat/completions",
                json=body,
                stream=stream,
                timeout=60,
                headers={"Connection": "close", **headers},
            )
        except requests.ConnectionError:
            if attempt == retries:
                raise
    raise AssertionError("unreachable: the last attempt returned or raised")


def benchmark_conversation(
    salt: str, index: int, ids: bool, history_bytes: int = 0
) -> Conversation:
    """The benchmark's conversation number `index`, its text the same in every run.

    `salt` keeps the text unique across systems sharing the engines: they are shared by every
    system in a run and D keeps a prefix cache, so two systems sending the same text would let
    the second ride on the first's cache. `ids`: send conversation_id and X-Session-ID.
    `history_bytes`: start from about this much earlier history (growth runs).
    """
    conv = Conversation(
        cid=f"conv-{salt}-{index}",
        seed=f"{salt}/{index}",
        first_words=FIRST_WORDS + index % 400,
        turn_words=TURN_WORDS,
        explicit=ids,
        session_header=ids,
        max_tokens=REPLY_WORDS,
        stream_options={"include_usage": False},
    )
    rng = random.Random(f"history/{salt}/{index}")
    while sum(len(m["content"]) for m in conv.messages) < history_bytes:
        role = "user" if len(conv.messages) % 2 == 0 else "assistant"
        conv.messages.append({"role": role, "content": words(rng, 150)})
    if conv.messages and conv.messages[-1]["role"] == "user":
        conv.messages.append({"role": "assistant", "content": words(rng, 32)})
    return conv


def drive(
    conversations: list[Conversation], turns: int, concurrency: int = 16, before_turn=None
) -> None:
    """Run `turns` more turns of every conversation, `concurrency` conversations at a time;
    `before_turn(conversation)` runs before each turn. A conversation stops at its first failure."""

    def one(conversation: Conversation) -> None:
        for _ in range(turns):
            if before_turn:
                before_turn(conversation)
            if not conversation.turn():
                return

    with ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(one, c) for c in conversations]:
            f.result()


def run(
    url: str, conversations: int = 200, turns: int = 5, concurrency: int = 16, **options
) -> list[Conversation]:
    """`conversations` new conversations of `turns` turns each; `options` are Conversation's."""
    convs = [Conversation(url, **options) for _ in range(conversations)]
    drive(convs, turns, concurrency)
    return convs


def later_hits(conversations: list[Conversation]) -> tuple[int, int]:
    """Hits among the turns after the first, and how many such turns there were."""
    later = [c for conv in conversations for c in conv.caches[1:]]
    return later.count("hit"), len(later)


def errors(conversations: list[Conversation]) -> list[str]:
    return [e for c in conversations for e in c.errors]
