"""Load: multi-turn streaming chat users on the gateway, time to first token as its own metric."""
# Each user holds one conversation at a time: a task is one turn (a streamed chat completion
# whose reply is echoed into the next request); after --turns turns it starts a new one. Half
# the conversations carry an X-Session-ID, half rely on history digests. Run it bounded and
# headless: `make load` (bench/load.py), or
# locust -f locustfile.py --headless -u 300 -r 50 -t 60s --host http://127.0.0.1:8000
from __future__ import annotations

import random
import time

from locust import FastHttpUser, events, task
from locust.contrib.fasthttp import FAILURE_EXCEPTIONS

from devtools import sse
from devtools.workload import MODEL, Conversation

TTFT = ("TTFT", "time to first token")   # the custom metric's row in locust's stats
CHAT = "/v1/chat/completions"


@events.init_command_line_parser.add_listener
def _options(parser) -> None:
    parser.add_argument("--turns", type=int, default=5, help="turns per conversation")
    parser.add_argument("--max-tokens", type=int, default=16, help="max_tokens of every turn")
    parser.add_argument("--model", default=MODEL, help="model name sent")
    parser.add_argument("--think", type=float, nargs=2, default=(0.5, 1.5), metavar=("MIN", "MAX"),
                        help="seconds a user waits between turns (reading the reply)")


class ChatUser(FastHttpUser):
    """One person chatting: streams each reply, then asks a follow-up that quotes it."""

    def on_start(self) -> None:
        self.new_conversation()

    def wait_time(self) -> float:
        return random.uniform(*self.environment.parsed_options.think)

    def new_conversation(self) -> None:
        options = self.environment.parsed_options
        # Its id in every message: automatic digests must not collide across conversations.
        self.conversation = Conversation(
            first_words=40, turn_words=(10, 10), explicit=False,
            session_header=random.random() < 0.5, max_tokens=options.max_tokens,
            model=options.model, stream_options={"include_usage": True})

    @task
    def next_turn(self) -> None:
        conv = self.conversation
        conv.ask()
        start = time.perf_counter()
        with self.client.post(CHAT, json=conv.body(), headers=conv.headers(), stream=True,
                              catch_response=True, name="chat turn") as response:
            try:
                if response.status_code != 200:
                    raise sse.StreamError(f"HTTP {response.status_code}: {response.text[:200]}")
                reply, first = self.read_stream(response, start)
                # Every turn after the first extends a history the gateway has stored.
                if conv.caches and response.headers.get("X-Gateway-Cache") != "hit":
                    raise sse.StreamError(f"turn {len(conv.caches) + 1} was a cache miss")
            except sse.StreamError as exc:
                response.failure(str(exc))
                self.new_conversation()
                return
        self.environment.events.request.fire(
            request_type=TTFT[0], name=TTFT[1], response_time=(first - start) * 1000,
            response_length=0, exception=None, context={})
        conv.add_reply(reply, response.headers.get("X-Gateway-Cache"))
        if len(conv.caches) >= self.environment.parsed_options.turns:
            self.new_conversation()

    @staticmethod
    def read_stream(response, start: float) -> tuple[str, float]:
        """The reply text and when its first token arrived; raises StreamError on a bad stream."""
        # One SSE event per read, as its bytes arrive: CompatResponse.readline splits on CRLF
        # only, and read(n) waits for n bytes, which would delay the first token.
        raw = response._response
        parser, received, first, finish = sse.Parser(), [], None, None
        try:
            while block := raw.readline(b"\n\n"):      # to the end, so the connection is reusable
                for event in parser.feed(block):
                    received.append(event)
                    if sse.content(event):
                        first = first or time.perf_counter()
                    if isinstance(event, dict):
                        for choice in event.get("choices") or ():
                            finish = choice.get("finish_reason") or finish
        except (ValueError, *FAILURE_EXCEPTIONS) as exc:
            raise sse.StreamError(f"stream broke: {exc!r}") from exc
        sse.check(received)
        if first is None or finish not in ("stop", "length"):
            raise sse.StreamError(
                f"stream ended early: finish={finish} text={sse.reply(received)!r}")
        return sse.reply(received), first
