"""Reading an OpenAI-style SSE stream as a client does: its events, their text, if it is usable.

An event is the JSON of a `data:` field, or the string "[DONE]", which ends the stream: nothing
after it is kept. A source is a whole body (bytes), a `requests` response (read as it
arrives), or any iterable of byte chunks. Not the gateway's own relay (`gateway/flow/sse.py`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from itertools import pairwise

DONE = "[DONE]"
Event = dict | str


class StreamError(Exception):
    """A response a client cannot use: its status, an error event, no [DONE] (the message says)."""


class Parser:
    """Incremental: `feed` the bytes as they arrive, get back the events they complete."""

    def __init__(self) -> None:
        self._buffer = b""
        self.done = False  # "[DONE]" has been seen; later bytes are ignored

    def feed(self, data: bytes) -> list[Event]:
        if self.done:
            return []
        self._buffer = (self._buffer + data).replace(b"\r\n", b"\n")
        *blocks, self._buffer = self._buffer.split(b"\n\n")
        events: list[Event] = []
        for block in blocks:
            fields = [line[5:] for line in block.split(b"\n") if line.startswith(b"data:")]
            if not fields:
                continue  # a comment or a keep-alive
            data = b"\n".join(f[1:] if f.startswith(b" ") else f for f in fields)
            if data == DONE.encode():
                self.done = True
                events.append(DONE)
                break
            events.append(json.loads(data))
        return events


def _chunks(source) -> Iterator[bytes]:
    if isinstance(source, bytes):
        return iter([source])
    if hasattr(source, "iter_content"):  # a requests response
        # 512: what iter_lines reads; a chunked body yields each chunk as it comes.
        return iter(source.iter_content(512))
    return iter(source)


def iter_events(source) -> Iterator[Event]:
    """Each event as soon as its bytes have arrived; the last is "[DONE]" if the stream has it."""
    parser = Parser()
    for chunk in _chunks(source):
        yield from parser.feed(chunk)
        if parser.done:
            return


def timed_events(source) -> list[tuple[float, Event]]:
    """Every event with its arrival (time.monotonic()); the source is read to its end, so a
    stream that stays open after "[DONE]" shows in the caller's timing."""
    chunks = _chunks(source)
    timed = [(time.monotonic(), event) for event in iter_events(chunks)]
    for _ in chunks:
        pass
    return timed


@dataclass
class TimedTurn:
    """One streamed turn as a client saw it (seconds from sending the request)."""

    headers: Mapping[str, str]
    ttft: float  # to the first event (the role chunk of a chat stream)
    gaps: list[float]  # between consecutive events before "[DONE]"
    text: str


def timed_turn(session, url: str, body: dict, timeout: float = 300) -> TimedTurn:
    """POST a streamed completion request and time its events; raises on an HTTP error."""
    started = time.monotonic()
    with session.post(url, json=body, stream=True, timeout=timeout) as response:
        response.raise_for_status()
        timed = timed_events(response)
    arrivals = [t for t, event in timed if event != DONE]
    return TimedTurn(
        response.headers,
        timed[0][0] - started,
        [b - a for a, b in pairwise(arrivals)],
        reply(event for _, event in timed),
    )


def events(source) -> list[Event]:
    """Every event, the source read to its end."""
    return [event for _, event in timed_events(source)]


def content(event: Event) -> str:
    """The reply text one event carries: chat deltas' content, or completions' text."""
    if not isinstance(event, dict):
        return ""
    return "".join(
        (choice.get("delta") or {}).get("content") or choice.get("text") or ""
        for choice in event.get("choices") or ()
    )


def reply(events: Iterable[Event]) -> str:
    """The reply text of a stream."""
    return "".join(content(event) for event in events)


def check(events: list[Event], from_engine: bool = False) -> None:
    """StreamError unless a client can use the stream: "[DONE]" at the end, no error event, and
    (unless it comes from an engine or a relay of one) none of the engines' kv_transfer_params."""
    for event in events:
        if isinstance(event, dict) and "error" in event:
            raise StreamError(f"error event {str(event['error'])[:200]}")
        if not from_engine and isinstance(event, dict) and "kv_transfer_params" in event:
            raise StreamError(f"engine detail in {json.dumps(event)[:200]}")
    if not events or events[-1] != DONE:
        raise StreamError("stream ended without [DONE]")
