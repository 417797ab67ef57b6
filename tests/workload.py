"""A bounded multi-turn chat workload over fresh connections, for the real-server tests."""
from __future__ import annotations

import json
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import requests

from tests.conftest import MODEL


def _post(url: str, body: dict, stream: bool, retries: int):
    """POST on a new connection; like the OpenAI SDK, retry only when no response came at all."""
    for attempt in range(retries + 1):
        try:
            return requests.post(url + "/v1/chat/completions", json=body, stream=stream,
                                 timeout=60, headers={"Connection": "close"})
        except requests.ConnectionError:
            if attempt == retries:
                raise


def _reply_text(response, stream: bool) -> str:
    if not stream:
        return response.json()["choices"][0]["message"]["content"]
    text, done = [], False
    for line in response.iter_lines():
        if not line.startswith(b"data: "):
            continue
        if line == b"data: [DONE]":
            done = True
            break
        event = json.loads(line[6:])
        if "error" in event:
            raise RuntimeError(f"error event {event['error']}")
        assert "kv_transfer_params" not in event
        text += [c["delta"].get("content") or "" for c in event["choices"]]
    if not done:
        raise RuntimeError("stream ended without [DONE]")
    return "".join(text)


@dataclass
class Conversation:
    """One client conversation; every request on a new connection, as many clients do."""

    url: str
    cid: str = field(default_factory=lambda: uuid.uuid4().hex)
    stream: bool = True
    explicit: bool = True
    retries: int = 0
    max_tokens: int = 6
    caches: list = field(default_factory=list)     # X-Gateway-Cache of each turn
    errors: list = field(default_factory=list)
    messages: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.messages = [{"role": "user", "content": f"conversation {self.cid} asks about kv"}]

    def turn(self) -> bool:
        body = {"model": MODEL, "messages": self.messages, "max_tokens": self.max_tokens,
                "stream": self.stream}
        if self.explicit:
            body["conversation_id"] = self.cid
        try:
            response = _post(self.url, body, self.stream, self.retries)
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
            text = _reply_text(response, self.stream)
        except Exception as exc:   # recorded; the tests assert there are none
            self.errors.append(f"{self.cid} turn {len(self.caches)}: {exc!r}")
            return False
        self.caches.append(response.headers.get("X-Gateway-Cache"))
        self.messages += [{"role": "assistant", "content": text},
                          {"role": "user", "content": f"and then {len(self.caches)}"}]
        return True


def drive(conversations: list[Conversation], turns: int, concurrency: int = 16,
          before_turn=None) -> None:
    """Run `turns` more turns of every conversation, `concurrency` conversations at a time."""
    def one(conversation: Conversation) -> None:
        for _ in range(turns):
            if before_turn:
                before_turn(conversation)
            if not conversation.turn():
                return

    with ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(one, c) for c in conversations]:
            f.result()


def later_hits(conversations: list[Conversation]) -> tuple[int, int]:
    later = [c for conv in conversations for c in conv.caches[1:]]
    return later.count("hit"), len(later)


def errors(conversations: list[Conversation]) -> list[str]:
    return [e for c in conversations for e in c.errors]


def run(url: str, conversations: int = 200, turns: int = 5, concurrency: int = 16,
        **options) -> list[Conversation]:
    convs = [Conversation(url, **options) for _ in range(conversations)]
    drive(convs, turns, concurrency)
    return convs
