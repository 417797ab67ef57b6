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

REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("pd_gateway_request_id",
                                                                default="-")
TEXT_FORMAT = "%(asctime)s %(process)d %(levelname)s %(name)s [%(request_id)s]: %(message)s"
# W3C Trace Context: version 00, a 32-hex trace id and a 16-hex parent id, neither all zeros.
_TRACEPARENT = re.compile(r"00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")


class RequestIdFilter(logging.Filter):
    """Adds `request_id` (the request this thread or greenlet is serving, or "-") to records."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get()
        return True


# Control characters (and Unicode's line breaks) as escapes: a message that quotes a client
# (an engine's "The model `x` does not exist" echoes the request's model) keeps to its line.
_CONTROL = {c: f"\\x{c:02x}" if c < 256 else f"\\u{c:04x}"
            for c in [*range(32), 127, 0x85, 0x2028, 0x2029]}
_CONTROL.update({ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\t"})


class TextFormatter(logging.Formatter):
    """One record, one line: no input can forge a log line. A traceback still follows on lines
    of its own (the formatter appends it after the message)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        return line if line.isprintable() else line.translate(_CONTROL)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {"time": self.formatTime(record), "level": record.levelname,
                "logger": record.name, "pid": record.process,
                "request_id": getattr(record, "request_id", "-"), "message": record.getMessage()}
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def configure(level: str, fmt: str = "text") -> None:
    """Root logging for a process running the gateway: every handler gets the request id."""
    logging.basicConfig(level=level.upper())
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RequestIdFilter) for f in handler.filters):
            handler.addFilter(RequestIdFilter())
            handler.setFormatter(JsonFormatter() if fmt == "json"
                                 else TextFormatter(TEXT_FORMAT))


def traceparent(given: str | None) -> str:
    """The client's `traceparent` if it is a valid one, else a new trace (sampled)."""
    if given and _TRACEPARENT.fullmatch(given.strip().lower()):
        return given.strip().lower()
    return f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"
