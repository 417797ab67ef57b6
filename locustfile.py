"""Load: multi-turn streaming chat users on a gateway, each turn timed to its [DONE]."""

# Self-contained (locust and the standard library only), so it runs from anywhere against any
# gateway, a production one included:
#   locust -f locustfile.py --headless -u 300 -r 50 -t 60s --host https://gateway.example \
#       --api-key KEY --model MODEL [--workload long]
# `make load` (bench/load.py) runs it against emulated engines.
#
# Each user holds one conversation at a time: a task is one turn (a streamed chat completion
# whose reply is echoed into the next request); after --turns turns it starts a new one. Half
# the conversations carry an X-Session-ID, half rely on history digests. A turn fails on an HTTP
# error, a broken stream, or a later turn the gateway did not recognise (X-Gateway-Cache not
# "hit"). Rows in locust's stats: "chat turn", the whole turn (request sent to [DONE]); TTFT,
# to the first token; TPOT, per output token after the first (as vLLM's benchmarks time them).
#
# --workload: "short" replies (16 tokens) are under vLLM's kv_recompute_threshold (64), so P
# recomputes them from its own prefix cache and never reads D's blocks; "long" replies (128
# tokens, min_tokens too so a model's early end does not shorten them) leave D holding more than
# that beyond P's cache, so every later turn's P reads D's blocks
# (pd_gateway_kv_reads_total{result="read"}; unless --fast-path-tokens, off by default, sends
# the turn to D alone).
from __future__ import annotations

import json
import os
import random
import time
import uuid
from dataclasses import dataclass

from locust import FastHttpUser, events, task
from locust.contrib.fasthttp import FAILURE_EXCEPTIONS

CHAT = "/v1/chat/completions"
TURN = "chat turn"  # the turns' row in locust's stats: POST, TURN
TTFT = ("TTFT", "time to first token")  # custom metrics' rows
TPOT = ("TPOT", "time per output token")
REPLY_TOKENS = {"short": 16, "long": 128}  # max_tokens of each --workload
WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
    "november oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee "
    "zulu"
).split()


@events.init_command_line_parser.add_listener
def _options(parser) -> None:
    parser.add_argument(
        "--api-key",
        env_var="LOCUST_API_KEY",
        default="",
        is_secret=True,
        help="client key sent as Authorization: Bearer (the gateway's "
        "--api-keys); default $LOCUST_API_KEY, else $OPENAI_API_KEY",
    )
    parser.add_argument("--model", default="emulated-model", help="model name sent")
    parser.add_argument(
        "--workload",
        choices=sorted(REPLY_TOKENS),
        default="short",
        help="short: 16-token replies, which P recomputes; long: 128-token "
        "replies, which P reads from D on the next turn",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="max_tokens of every turn (default: the workload's)",
    )
    parser.add_argument("--turns", type=int, default=5, help="turns per conversation")
    parser.add_argument(
        "--think",
        type=float,
        nargs=2,
        default=(0.5, 1.5),
        metavar=("MIN", "MAX"),
        help="seconds a user waits between turns (reading the reply)",
    )


class StreamError(Exception):
    """A turn a client cannot use: its status, an error event, no [DONE] (the message says)."""


class Conversation:
    """One conversation's history: a unique 40-word first message, then 10-word follow-ups."""

    def __init__(self, model: str, max_tokens: int, long: bool, session_header: bool) -> None:
        self.cid = uuid.uuid4().hex
        self.model, self.max_tokens, self.long = model, max_tokens, long
        self.session_header = session_header
        self.messages: list[dict] = []
        self.turns = 0

    def ask(self) -> None:
        """Add the next user message, unless one is still waiting for its reply."""
        if self.messages and self.messages[-1]["role"] == "user":
            return
        # Its id in every message: automatic digests must not collide across conversations.
        words = " ".join(random.choices(WORDS, k=10 if self.messages else 40))
        self.messages.append(
            {"role": "user", "content": f"conversation {self.cid} turn {self.turns + 1}: {words}"}
        )

    def body(self) -> dict:
        body = {
            "model": self.model,
            "messages": self.messages,
            "max_tokens": self.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.long:
            body["min_tokens"] = self.max_tokens  # vLLM's; the gateway passes it to D
        return body

    def headers(self) -> dict:
        return {"X-Session-ID": self.cid} if self.session_header else {}

    def add_reply(self, reply: str) -> None:
        self.messages.append({"role": "assistant", "content": reply})
        self.turns += 1


class ChatUser(FastHttpUser):
    """One person chatting: streams each reply, then asks a follow-up that quotes it."""

    def on_start(self) -> None:
        options = self.environment.parsed_options
        key = options.api_key or os.environ.get("OPENAI_API_KEY", "")
        self.auth = {"Authorization": f"Bearer {key}"} if key else {}
        self.new_conversation()

    def wait_time(self) -> float:
        return random.uniform(*self.environment.parsed_options.think)

    def new_conversation(self) -> None:
        options = self.environment.parsed_options
        self.conversation = Conversation(
            options.model,
            options.max_tokens or REPLY_TOKENS[options.workload],
            options.workload == "long",
            session_header=random.random() < 0.5,
        )

    @task
    def next_turn(self) -> None:
        conv = self.conversation
        conv.ask()
        start = time.perf_counter()
        with self.client.post(
            CHAT,
            json=conv.body(),
            headers={**self.auth, **conv.headers()},
            stream=True,
            catch_response=True,
            name=TURN,
        ) as response:
            try:
                if response.status_code != 200:
                    raise StreamError(f"HTTP {response.status_code}: {response.text[:200]}")
                turn = read_stream(response)
                # Every turn after the first extends a history the gateway has stored.
                if conv.turns and response.headers.get("X-Gateway-Cache") != "hit":
                    raise StreamError(f"turn {conv.turns + 1} was a cache miss")
            except StreamError as exc:
                response.failure(str(exc))
                self.new_conversation()
                return
            finally:
                # locust stopped the clock at the headers: the turn ends at [DONE].
                response.request_meta["response_time"] = (time.perf_counter() - start) * 1000
        self.report(TTFT, turn.first - start)
        if turn.tokens > 1:
            self.report(TPOT, (turn.last - turn.first) / (turn.tokens - 1))
        conv.add_reply(turn.text)
        if conv.turns >= self.environment.parsed_options.turns:
            self.new_conversation()

    def report(self, row: tuple[str, str], seconds: float) -> None:
        self.environment.events.request.fire(
            request_type=row[0],
            name=row[1],
            response_time=seconds * 1000,
            response_length=0,
            exception=None,
            context={},
        )


@dataclass
class Turn:
    """A streamed reply as it arrived: its text, first and last token (perf_counter), finish."""

    text: str = ""
    events: int = 0  # events that carried text
    usage_tokens: int = 0  # completion_tokens of the usage chunk (include_usage)
    first: float | None = None
    last: float | None = None
    finish: str | None = None

    @property
    def tokens(self) -> int:
        """Output tokens: as the usage chunk counts them, else one an event."""
        return self.usage_tokens or self.events


def read_stream(response) -> Turn:
    """Read an OpenAI chat stream to its [DONE]; StreamError if a client could not use it."""
    # One SSE event per read, as its bytes arrive: CompatResponse.readline splits on CRLF only,
    # and read(n) waits for n bytes, which would delay the first token. Read to the end, so the
    # connection is reusable.
    raw, turn, buffer, done = response._response, Turn(), b"", False
    try:
        while block := raw.readline(b"\n\n"):
            buffer = (buffer + block).replace(b"\r\n", b"\n")
            *complete, buffer = buffer.split(b"\n\n")
            for event in complete:
                data = b"\n".join(
                    line[5:].removeprefix(b" ")
                    for line in event.split(b"\n")
                    if line.startswith(b"data:")
                )
                if not data or done:
                    continue  # a comment, a keep-alive, or past [DONE]
                if data == b"[DONE]":
                    done = True
                    continue
                read_event(json.loads(data), turn)
    except (ValueError, *FAILURE_EXCEPTIONS) as exc:
        raise StreamError(f"stream broke: {exc!r}") from exc
    if not done:
        raise StreamError("stream ended without [DONE]")
    if turn.first is None or turn.finish not in ("stop", "length"):
        raise StreamError(f"stream ended early: finish={turn.finish} text={turn.text!r}")
    return turn


def read_event(event: dict, turn: Turn) -> None:
    """One chunk of the stream into `turn`; StreamError for an error event."""
    if not isinstance(event, dict):
        raise StreamError(f"not a chunk: {json.dumps(event)[:200]}")
    if "error" in event:
        raise StreamError(f"error event {str(event['error'])[:200]}")
    if "kv_transfer_params" in event:
        raise StreamError(f"engine detail in {json.dumps(event)[:200]}")
    now = time.perf_counter()
    for choice in event.get("choices") or ():
        content = (choice.get("delta") or {}).get("content")
        if content:
            turn.text += content
            turn.events += 1
            turn.first, turn.last = turn.first or now, now
        turn.finish = choice.get("finish_reason") or turn.finish
    turn.usage_tokens = (event.get("usage") or {}).get("completion_tokens") or turn.usage_tokens
