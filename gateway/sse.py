"""Bytes-level SSE event splitting and rewriting of D's stream, and what a finished turn produced.

Hand-written because no maintained SSE library relays bytes unchanged: sseclient-style parsers
rebuild events from decoded lines, and `requests.iter_lines` miscounts a split CRLF.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from .errors import GatewayError, error_event

_BOUNDARY = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_DATA = re.compile(rb"^data: ?", re.M)
PARAMS_KEY = "kv_transfer_params"
# The engine finished normally (vLLM's FINISHED_STOPPED or _LENGTH_CAPPED, for which D keeps its
# blocks); "tool_calls" is a stop the serving layer renamed because the parser found a call.
REUSABLE_FINISH = frozenset({"stop", "length", "tool_calls"})
# Where vLLM puts token ids with return_token_ids: chat on the first chunk / body top level,
# completions on the choice; generated ids on each choice.
PROMPT_IDS, OUTPUT_IDS = "prompt_token_ids", "token_ids"


@dataclass
class Turn:
    """What D produced for one turn: its KV params, how it finished, the reply to echo."""

    params: Any = None
    finish_reasons: list = field(default_factory=list)
    text: list = field(default_factory=list)          # content (chat) or text (completions)
    reasoning: list = field(default_factory=list)
    tool_calls: dict = field(default_factory=dict)    # index -> call, arguments concatenated
    choices: set = field(default_factory=set)
    done: bool = False                                # [DONE] seen (stream) or body complete
    error: bool = False
    stored: bool = False                              # the entry for the next turn was put
    prompt_ids: list | None = None                    # D's token ids, when it returned them
    output_ids: list | None = None
    strip_ids: bool = False                           # the gateway asked for them, not the client

    @property
    def reusable(self) -> bool:
        """Only a single-choice turn that completed with stop/length leaves usable blocks."""
        return (self.done and not self.error and self.choices <= {0}
                and bool(self.finish_reasons)
                and all(r in REUSABLE_FINISH for r in self.finish_reasons))

    def reply_message(self) -> dict:
        """The assistant message as a client will echo it in the next request."""
        message: dict = {"role": "assistant", "content": "".join(self.text)}
        if self.tool_calls:
            message["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        return message

    def reply_text(self) -> str:
        return "".join(self.text)

    def take_ids(self, holder: dict) -> bool:
        """Collect token ids from a chunk, body or choice; null them if the client did not ask.
        True if `holder` changed."""
        changed = False
        for key in (PROMPT_IDS, OUTPUT_IDS):
            ids = holder.get(key)
            if not isinstance(ids, list):
                continue
            if key == PROMPT_IDS:
                self.prompt_ids = ids
            else:
                self.output_ids = ids if self.output_ids is None else self.output_ids + ids
            if self.strip_ids:
                holder[key] = None
                changed = True
        return changed

    def add_choice(self, choice: dict, delta_key: str) -> None:
        """Fold one choice of a chunk (delta_key "delta") or of a whole body ("message")."""
        self.choices.add(choice.get("index", 0))
        if choice.get("finish_reason"):
            self.finish_reasons.append(choice["finish_reason"])
        if "text" in choice:
            self.text.append(choice["text"] or "")
        part = choice.get(delta_key) or {}
        if part.get("content"):
            self.text.append(part["content"] if isinstance(part["content"], str)
                             else json.dumps(part["content"]))
        reasoning = part.get("reasoning_content") or part.get("reasoning")
        if reasoning:
            self.reasoning.append(reasoning)
        for call in part.get("tool_calls") or ():
            self._add_tool_call(call)

    def _add_tool_call(self, call: dict) -> None:
        index = call.get("index", len(self.tool_calls))
        known = self.tool_calls.setdefault(
            index, {"id": None, "type": "function", "function": {"name": None, "arguments": ""}})
        known["id"] = call.get("id") or known["id"]
        known["type"] = call.get("type") or known["type"]
        function = call.get("function") or {}
        known["function"]["name"] = function.get("name") or known["function"]["name"]
        known["function"]["arguments"] += function.get("arguments") or ""

    def absorb_body(self, body: dict) -> dict:
        """Record a non-streamed reply and return it without the params."""
        self.params = body.pop(PARAMS_KEY, None)
        self.take_ids(body)
        for choice in body.get("choices") or ():
            if isinstance(choice, dict):
                self.add_choice(choice, "message")
                self.take_ids(choice)
        self.done = True
        return body


class EventRelay:
    """Feed D's bytes in, get the bytes to send the client out: whole events, params removed.

    Events pass through byte for byte unless they carry `kv_transfer_params`; those are
    re-serialised without it, or dropped if nothing else is left in them.
    """

    def __init__(self, turn: Turn) -> None:
        self.turn = turn
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        if self._pending:
            # Only the new bytes (and a boundary begun in the last 3 pending ones) can end an
            # event: rescanning a large pending event on every read would be quadratic.
            scan_from = max(0, len(self._pending) - 3)
            data = self._pending + chunk
        else:
            scan_from, data = 0, chunk
        last = None
        for last in _BOUNDARY.finditer(data, scan_from):
            pass
        if last is None:
            self._pending = data
            return b""
        complete, self._pending = data[:last.end()], data[last.end():]
        out = []
        rewritten = False
        start = 0
        for boundary in _BOUNDARY.finditer(complete):
            event = complete[start:boundary.end()]
            start = boundary.end()
            kept = self._event(event)
            rewritten |= kept is not event
            out.append(kept)
        return b"".join(out) if rewritten else complete

    def _event(self, event: bytes) -> bytes:
        match = _DATA.search(event)
        if match is None:
            return event                     # a comment or keep-alive: pass it on
        payload = event[match.end():].strip()
        if payload == b"[DONE]":
            self.turn.done = True
            return event
        try:
            chunk = json.loads(payload)
        except ValueError:
            return event
        if not isinstance(chunk, dict):
            return event
        if "error" in chunk:
            # The engine's message may name hosts or engine ids; the client gets the gist.
            self.turn.error = True
            error = chunk["error"] if isinstance(chunk["error"], dict) else {}
            return error_event(GatewayError(
                "the decode engine failed during generation",
                status=error.get("code") if isinstance(error.get("code"), int) else 500),
                done=False)
        changed = self.turn.take_ids(chunk)
        for choice in chunk.get("choices") or ():
            if isinstance(choice, dict):
                self.turn.add_choice(choice, "delta")
                changed |= self.turn.take_ids(choice)
        if PARAMS_KEY not in chunk:
            return _encode(chunk) if changed else event
        self.turn.params = chunk.pop(PARAMS_KEY)
        if not chunk.get("choices") and chunk.get("usage") is None and "error" not in chunk:
            return b""                       # a params-only event: nothing left for the client
        return _encode(chunk)


def _encode(chunk: dict) -> bytes:
    return b"data: " + json.dumps(chunk, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"
