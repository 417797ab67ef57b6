"""Load: multi-turn streaming chat users on the gateway, time to first token as its own metric."""
# Each user holds one conversation at a time: a task is one turn (a streamed chat completion
# whose reply is echoed into the next request); after --turns turns it starts a new one. Half
# the conversations carry an X-Session-ID, half rely on history digests. Run it bounded and
# headless: `make load` (bench/load.py), or
# locust -f locustfile.py --headless -u 300 -r 50 -t 60s --host http://127.0.0.1:8000
from __future__ import annotations

import json
import random
import time
import uuid

from locust import FastHttpUser, events, task
from locust.contrib.fasthttp import FAILURE_EXCEPTIONS

TTFT = ("TTFT", "time to first token")   # the custom metric's row in locust's stats
CHAT = "/v1/chat/completions"
WORDS = ("prefill decode block cache tensor stream token engine gateway worker reply history "
         "prompt layer batch").split()


@events.init_command_line_parser.add_listener
def _options(parser) -> None:
    parser.add_argument("--turns", type=int, default=5, help="turns per conversation")
    parser.add_argument("--max-tokens", type=int, default=16, help="max_tokens of every turn")
    parser.add_argument("--model", default="emulated-model", help="model name sent")
    parser.add_argument("--think", type=float, nargs=2, default=(0.5, 1.5), metavar=("MIN", "MAX"),
                        help="seconds a user waits between turns (reading the reply)")


def _words(n: int) -> str:
    return " ".join(random.choices(WORDS, k=n))


class TurnFailed(Exception):
    """The stream finished without a usable reply; the message says how."""


class ChatUser(FastHttpUser):
    """One person chatting: streams each reply, then asks a follow-up that quotes it."""

    def on_start(self) -> None:
        self.new_conversation()

    def wait_time(self) -> float:
        return random.uniform(*self.environment.parsed_options.think)

    def new_conversation(self) -> None:
        self.turn = 0
        # A unique system prompt: automatic digests must not collide across conversations.
        self.messages = [{"role": "system", "content": f"conversation {uuid.uuid4().hex}"},
                         {"role": "user", "content": _words(40)}]
        self.headers = {"X-Session-ID": uuid.uuid4().hex} if random.random() < 0.5 else {}

    @task
    def next_turn(self) -> None:
        options = self.environment.parsed_options
        body = {"model": options.model, "messages": self.messages, "stream": True,
                "max_tokens": options.max_tokens, "stream_options": {"include_usage": True}}
        start = time.perf_counter()
        with self.client.post(CHAT, json=body, headers=self.headers, stream=True,
                              catch_response=True, name="chat turn") as response:
            try:
                if response.status_code != 200:
                    raise TurnFailed(f"HTTP {response.status_code}: {response.text[:200]}")
                reply, first = self.read_stream(response, start)
                # Every turn after the first extends a history the gateway has stored.
                if self.turn > 0 and response.headers.get("X-Gateway-Cache") != "hit":
                    raise TurnFailed(f"turn {self.turn + 1} was a cache miss")
            except TurnFailed as exc:
                response.failure(str(exc))
                self.new_conversation()
                return
        self.environment.events.request.fire(
            request_type=TTFT[0], name=TTFT[1], response_time=(first - start) * 1000,
            response_length=0, exception=None, context={})
        self.turn += 1
        if self.turn >= options.turns:
            self.new_conversation()
            return
        self.messages = [*self.messages, {"role": "assistant", "content": reply},
                         {"role": "user", "content": _words(10)}]

    @staticmethod
    def read_stream(response, start: float) -> tuple[str, float]:
        """The reply text and when its first token arrived; raises TurnFailed on a bad stream."""
        # One SSE event per read, as its bytes arrive: CompatResponse.readline splits on CRLF
        # only, and read(n) waits for n bytes, which would delay the first token.
        raw = response._response
        text, first, done, finish = [], None, False, None
        try:
            while event := raw.readline(b"\n\n"):
                if not event.startswith(b"data:"):
                    continue                     # an SSE comment or keep-alive
                payload = event[5:].strip()
                if payload == b"[DONE]":
                    done = True
                    continue
                chunk = json.loads(payload)
                if "error" in chunk or "kv_transfer_params" in chunk:
                    raise TurnFailed(f"bad event: {payload[:200]!r}")
                for choice in chunk.get("choices") or ():
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        first = first or time.perf_counter()
                        text.append(content)
                    finish = choice.get("finish_reason") or finish
        except (ValueError, *FAILURE_EXCEPTIONS) as exc:
            raise TurnFailed(f"stream broke: {exc!r}") from exc
        if not done or first is None or finish not in ("stop", "length"):
            raise TurnFailed(f"stream ended early: done={done} finish={finish} text={text!r}")
        return "".join(text), first
