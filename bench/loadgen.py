"""Load generator: conversations of T streamed turns, C in flight, one gevent process, JSON out."""
from gevent import monkey

# Before http.client and socket are imported: every conversation is a greenlet on one hub.
monkey.patch_all()

import argparse  # noqa: E402
import http.client  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import time  # noqa: E402
from typing import Iterator  # noqa: E402
from urllib.parse import urlsplit  # noqa: E402

import gevent  # noqa: E402

from bench.workload import Conversation, filler_history  # noqa: E402

PATH = "/v1/chat/completions"
REQUEST_TIMEOUT = 120.0  # as vLLM's benchmark: --request-timeout-sec 120


class TurnFailed(Exception):
    """The turn got no complete stream: a status, an error event, or a cut connection."""


class Sse:
    """Split a byte stream into SSE events and keep what the figures need, timestamped per read."""

    def __init__(self) -> None:
        self.buffer = b""
        self.events = 0
        self.content: list[str] = []
        self.first = self.last = 0.0
        self.max_gap = 0.0
        self.done = False

    def feed(self, data: bytes, now: float) -> None:
        self.buffer += data
        *events, self.buffer = self.buffer.split(b"\n\n")
        for event in events:
            if event.startswith(b"data: "):
                self.events += 1
                self._data(event[6:], now)

    def _data(self, payload: bytes, now: float) -> None:
        if payload == b"[DONE]":
            self.done = True
            return
        chunk = json.loads(payload)
        if "error" in chunk:
            raise TurnFailed(f"error event: {str(chunk['error'])[:200]}")
        text = ((chunk.get("choices") or [{}])[0].get("delta") or {}).get("content")
        if not text:
            return
        if self.content:
            self.max_gap = max(self.max_gap, now - self.last)
        else:
            self.first = now
        self.last = now
        self.content.append(text)


def run_turn(conn: http.client.HTTPConnection, conv: Conversation, explicit_id: bool) -> dict:
    """Send the conversation's next turn, stream the reply, and extend the history with it."""
    conv.next_user_message()
    prompt = conv.prompt_tokens()
    headers = {"Content-Type": "application/json"}
    if explicit_id:
        headers["X-Session-ID"] = conv.id
    body = json.dumps(conv.body(explicit_id)).encode()
    sent = time.monotonic()
    conn.request("POST", PATH, body, headers)
    response = conn.getresponse()
    if response.status != 200:
        raise TurnFailed(f"status {response.status}: {response.read()[:200]!r}")
    sse = Sse()
    while data := response.read1(65536):
        sse.feed(data, time.monotonic())
    if not sse.done or not sse.content:
        raise TurnFailed("stream ended without [DONE]" if not sse.done else "no content")
    reply = "".join(sse.content)
    ideal = conv.ideal_computed(prompt)
    conv.add_reply(prompt, reply)
    return {"sent": sent, "first": sse.first, "last": sse.last, "content_events": len(sse.content),
            "events": sse.events, "max_gap": sse.max_gap, "prompt_tokens": prompt,
            "ideal_computed": ideal, "hit": response.getheader("X-Gateway-Cache") == "hit"}


def conversation(url: str, conv: Conversation, turns: int, explicit_id: bool, deadline: float,
                 results: list, errors: list) -> None:
    """Run one conversation's turns in order on one keep-alive connection, until the deadline."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=REQUEST_TIMEOUT)
    try:
        for _ in range(turns):
            if time.monotonic() >= deadline:
                return
            try:
                results.append(run_turn(conn, conv, explicit_id))
            except (TurnFailed, OSError, http.client.HTTPException, ValueError) as exc:
                # The history no longer matches what the engines saw: this conversation ends.
                errors.append(f"{conv.id}: {type(exc).__name__}: {exc}"[:300])
                return
    finally:
        conn.close()


def client(url: str, convs: Iterator[Conversation], turns: int, explicit_id: bool,
           deadline: float, results: list, errors: list) -> None:
    """Run conversations one after another; the iterator is shared, so each is run once."""
    for conv in convs:
        if time.monotonic() >= deadline:
            return
        conversation(url, conv, turns, explicit_id, deadline, results, errors)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", required=True)
    parser.add_argument("--concurrency", type=int, required=True, help="conversations in flight")
    parser.add_argument("--conversations", type=int, required=True, help="in all")
    parser.add_argument("--turns", type=int, required=True)
    parser.add_argument("--duration", type=float, required=True, help="no turn starts after this")
    parser.add_argument("--salt", required=True)
    parser.add_argument("--ids", action="store_true", help="send conversation_id and X-Session-ID")
    parser.add_argument("--history-bytes", type=int, default=0,
                        help="start each conversation from this much earlier history (growth runs)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    results: list[dict] = []
    errors: list[str] = []
    convs = iter([filler_history(args.salt, i, args.history_bytes) if args.history_bytes
                  else Conversation(args.salt, i) for i in range(args.conversations)])
    started = time.monotonic()
    deadline = started + args.duration
    gevent.joinall([gevent.spawn(client, args.url, convs, args.turns, args.ids, deadline,
                                 results, errors) for _ in range(args.concurrency)])
    usage = resource.getrusage(resource.RUSAGE_SELF)
    with open(args.out, "w") as out:
        json.dump({"started": started, "ended": time.monotonic(), "turns": results,
                   "errors": errors, "cpu_s": usage.ru_utime + usage.ru_stime}, out)


if __name__ == "__main__":
    main()
