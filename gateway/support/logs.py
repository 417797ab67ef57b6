"""Log lines that trace a turn: the current request's id on every line (a contextvar and a
filter), text or JSON lines, and the W3C `traceparent` sent to P and D.

The JSON formatter is a few lines over `json.dumps`; a library (python-json-logger) would add a
dependency for what one `format` method does.
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import secrets

REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar(
    "pd_gateway_request_id", default="-"
)
TEXT_FORMAT = "%(asctime)s %(process)d %(levelname)s %(name)s [%(request_id)s]: %(message)s"
# W3C Trace Context: version 00, a 32-hex trace id and a 16-hex parent id, neither all zeros.
_TRACEPARENT = re.compile(r"00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")


class RequestIdFilter(logging.Filter):
    """Adds `request_id` (the request this thread or greenlet is serving, or "-") to records."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get()
        return True


# Every character that is not printable as an escape: control characters and Unicode's line
# and paragraph separators (a message that quotes a client, as an engine's "The model `x` does
# not exist" echoes the request's model, keeps to its line), and format characters such as the
# right-to-left override (U+202E: a line that reads otherwise than it is written).
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\t"}


def _escaped(text: str, json_escapes: bool = False) -> str:
    """`text` with each character that is not printable escaped (`\\xNN`, `\\uNNNN`; in JSON,
    `\\uNNNN` only, a pair of them beyond the BMP)."""
    out = []
    for c in text:
        if c.isprintable() or (c == "\t" and not json_escapes):
            out.append(c)
            continue
        code = ord(c)
        if not json_escapes and c in _NAMED:
            out.append(_NAMED[c])
        elif json_escapes and code > 0xFFFF:
            high, low = divmod(code - 0x10000, 0x400)
            out.append(f"\\u{0xD800 + high:04x}\\u{0xDC00 + low:04x}")
        elif code < 256 and not json_escapes:
            out.append(f"\\x{code:02x}")
        else:
            out.append(f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}")
    return "".join(out)


class TextFormatter(logging.Formatter):
    """One record, one line: no input can forge a log line. A traceback still follows on lines
    of its own (the formatter appends it after the message)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        return line if line.isprintable() else _escaped(line)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "pid": record.process,
            "request_id": getattr(record, "request_id", "-"),
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        text = json.dumps(line, ensure_ascii=False)
        # json escapes control characters; what else is not printable, as \\u escapes.
        return text if text.isprintable() else _escaped(text, json_escapes=True)


def configure(level: str, fmt: str = "text") -> None:
    """Root logging for a process running the gateway: every handler gets the request id."""
    logging.basicConfig(level=level.upper())
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RequestIdFilter) for f in handler.filters):
            handler.addFilter(RequestIdFilter())
            handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter(TEXT_FORMAT))


def traceparent(given: str | None) -> str:
    """The client's `traceparent` if it is a valid one, else a new trace (sampled)."""
    if given and _TRACEPARENT.fullmatch(given.strip().lower()):
        return given.strip().lower()
    return f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"
