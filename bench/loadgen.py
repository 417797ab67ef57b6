"""Load generator: conversations of T streamed turns, C in flight, one gevent process, JSON out."""

from gevent import monkey

# Before http.client and socket are imported: every conversation is a greenlet on one hub.
monkey.patch_all()

import http.client  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from urllib.parse import urlsplit  # noqa: E402

import gevent  # noqa: E402

from bench import clients  # noqa: E402
from devtools import sse  # noqa: E402
from devtools.workload import Conversation, benchmark_conversation  # noqa: E402

PATH = "/v1/chat/completions"
REQUEST_TIMEOUT = 120.0  # as vLLM's benchmark: --request-timeout-sec 120


class Timing:
    """When the reply's text arrived, per read: the first and last content, the gaps between
    content events (inter-token latency as vLLM's benchmark client takes it: one gap per
    content event after the first, vllm/benchmarks/lib/endpoint_request_func.py:463-486 in
    vLLM 0.33.0; events that came in one read are 0 apart)."""

    def __init__(self) -> None:
        self.first = self.last = 0.0
        self.max_gap = 0.0
        self.gaps: list[float] = []
        self.content_events = 0

    def add(self, event: sse.Event, now: float) -> None:
        if not sse.content(event):
            return
        if self.content_events:
            self.max_gap = max(self.max_gap, now - self.last)
            self.gaps.append(round(now - self.last, 6))
        else:
            self.first = now
        self.last = now
        self.content_events += 1


def run_turn(conn: http.client.HTTPConnection, conv: Conversation) -> dict:
    """Send the conversation's next turn, stream the reply, and extend the history with it."""
    conv.ask()
    prompt = conv.prompt_tokens()
    headers = {"Content-Type": "application/json", **conv.headers()}
    body = json.dumps(conv.body()).encode()
    sent = time.monotonic()
    conn.request("POST", PATH, body, headers)
    response = conn.getresponse()
    if response.status != 200:
        raise sse.StreamError(f"status {response.status}: {response.read()[:200]!r}")
    parser, timing, events = sse.Parser(), Timing(), []
    while data := response.read1(65536):
        now = time.monotonic()
        for event in parser.feed(data):
            events.append(event)
            timing.add(event, now)
    # The systems measured include relays of D (nginx): its kv_transfer_params are no failure.
    sse.check(events, from_engine=True)
    if not timing.content_events:
        raise sse.StreamError("no content")
    reply = sse.reply(events)
    ideal = conv.ideal_computed(prompt)
    cache = response.getheader("X-Gateway-Cache")
    conv.add_reply(reply, cache, prompt)
    return {
        "sent": sent,
        "first": timing.first,
        "last": timing.last,
        "content_events": timing.content_events,
        "events": len(events),
        "max_gap": timing.max_gap,
        "gaps": timing.gaps,
        "prompt_tokens": prompt,
        "ideal_computed": ideal,
        "hit": cache == "hit",
    }


def conversation(
    url: str,
    conv: Conversation,
    turns: int,
    deadline: float,
    results: list,
    errors: list,
    think: float = 0.0,
) -> None:
    """Run one conversation's turns in order on one keep-alive connection, until the deadline,
    `think` seconds between a reply and the next question."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=REQUEST_TIMEOUT)
    try:
        for turn in range(turns):
            if turn and think:
                gevent.sleep(think)
            if time.monotonic() >= deadline:
                return
            try:
                results.append(run_turn(conn, conv))
            except (sse.StreamError, OSError, http.client.HTTPException, ValueError) as exc:
                # The history no longer matches what the engines saw: this conversation ends.
                errors.append(f"{conv.cid}: {type(exc).__name__}: {exc}"[:300])
                return
    finally:
        conn.close()


def client(
    url: str,
    convs: Iterator[Conversation],
    turns: int,
    deadline: float,
    results: list,
    errors: list,
    think: float = 0.0,
) -> None:
    """Run conversations one after another; the iterator is shared, so each is run once."""
    for conv in convs:
        if time.monotonic() >= deadline:
            return
        conversation(url, conv, turns, deadline, results, errors, think)


def main(argv: list[str] | None = None) -> None:
    parser = clients.arguments(__doc__)
    parser.add_argument(
        "--think",
        type=float,
        default=0.0,
        help="seconds a conversation waits between a reply and its next turn",
    )
    args = parser.parse_args(argv)
    results: list[dict] = []
    errors: list[str] = []
    convs = iter(
        [
            benchmark_conversation(args.salt, i, args.ids, args.history_bytes)
            for i in range(args.conversations)
        ]
    )
    started = time.monotonic()
    deadline = started + args.duration
    gevent.joinall(
        [
            gevent.spawn(client, args.url, convs, args.turns, deadline, results, errors, args.think)
            for _ in range(args.concurrency)
        ]
    )
    clients.write_results(args.out, started, results, errors)


if __name__ == "__main__":
    main()
