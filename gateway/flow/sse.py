"""Relaying D's SSE stream byte for byte: whole events out, `kv_transfer_params` (and token
ids the client did not ask for) taken out of the few events that carry them.

Hand-written because no maintained SSE library relays bytes unchanged: sseclient-style parsers
rebuild events from decoded lines, and `requests.iter_lines` miscounts a split CRLF.

This runs once per token of every stream, so it is written for the common case, an event that
is one `data: {...}` line ended by a blank line (what vLLM sends): found with `bytes.find`,
parsed with orjson (jsonio.loads_engine), passed on as it came unless it changed. Anything else (CR
line ends, comments, several fields) takes the general path.
"""

from __future__ import annotations

import re

from gateway.flow.decoded import PARAMS_KEY, Decoded
from gateway.support import jsonio
from gateway.support.errors import GatewayError, error_event

_BOUNDARY = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_DATA = re.compile(rb"^data: ?", re.M)
_DONE = b"[DONE]"


class EventFilter:
    """Feed D's bytes in, get the bytes to send the client out: whole events, params removed.

    Events pass through byte for byte unless they carry `kv_transfer_params`; those are
    re-serialised without it, or dropped if nothing else is left in them.
    """

    def __init__(self, decoded: Decoded) -> None:
        self.decoded = decoded
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        if self._pending:
            # Only the new bytes (and a boundary begun in the last 3 pending ones) can end an
            # event: rescanning a large pending event on every read would be quadratic.
            scan_from = max(0, len(self._pending) - 3)
            data = self._pending + chunk
        else:
            scan_from, data = 0, chunk
        if b"\r" in data:
            return self._feed_general(data, scan_from)
        end = data.find(b"\n\n", scan_from)
        if end < 0:
            self._pending = data
            return b""
        out = None
        start = 0
        while end >= 0:  # left to right, as the general path: a run of LFs is blank lines
            end += 2
            event = data if start == 0 and end == len(data) else data[start:end]
            kept = self._event(event)
            if kept is not event and out is None:
                out = [data[:start]]  # the events before this one, as they came
            if out is not None:
                out.append(kept)
            start = end
            end = data.find(b"\n\n", start)
        self._pending = data[start:]
        if out is None:
            return data if start == len(data) else data[:start]
        return b"".join(out)

    def _feed_general(self, data: bytes, scan_from: int) -> bytes:
        bounds = [m.end() for m in _BOUNDARY.finditer(data, scan_from)]
        if not bounds:
            self._pending = data
            return b""
        complete, self._pending = data[: bounds[-1]], data[bounds[-1] :]
        out = []
        rewritten = False
        start = 0
        for end in bounds:  # one scan: no boundary lies before scan_from
            event = complete[start:end]
            start = end
            kept = self._event(event)
            rewritten |= kept is not event
            out.append(kept)
        return b"".join(out) if rewritten else complete

    def _event(self, event: bytes) -> bytes:
        if event.startswith(b"data: ") and event.find(b"\n", 6) == len(event) - 2:
            payload = event[6:-2]  # one data line, LF-ended: vLLM's every event
        else:
            match = _DATA.search(event)
            if match is None:
                return event  # a comment or keep-alive: pass it on
            payload = event[match.end() :]
        if payload[:1] != b"{":
            payload = payload.strip()
            if payload == _DONE:
                self.decoded.done = True
                return event
            if payload[:1] != b"{":
                return event
        try:
            # Exact only where the event may be written again: one that carries params or ids.
            chunk = jsonio.loads_engine(
                payload, exact=b"kv_transfer_params" in payload or b"token_ids" in payload
            )
        except ValueError:
            return event
        if type(chunk) is not dict:
            return event
        if "error" in chunk:
            # The engine's message may name hosts or engine ids; the client gets the gist.
            self.decoded.error = True
            error = chunk["error"] if isinstance(chunk["error"], dict) else {}
            return error_event(
                GatewayError(
                    "the decode engine failed during generation",
                    status=error.get("code") if isinstance(error.get("code"), int) else 500,
                ),
                done=False,
            )
        carried_params = PARAMS_KEY in chunk
        if not self.decoded.absorb_chunk(chunk):
            return event
        if carried_params and not chunk.get("choices") and chunk.get("usage") is None:
            return b""  # a params-only event: nothing left for the client
        return b"data: " + jsonio.dumps(chunk) + b"\n\n"
