"""Parse and validate client request bodies; anything a client can get wrong becomes a 400."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from .errors import BadRequest

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@dataclass(frozen=True)
class ClientRequest:
    """A validated request: the body to forward (gateway-only fields removed) and its mode."""

    path: str
    body: dict
    stream: bool
    conversation_id: str | None

    @property
    def is_chat(self) -> bool:
        return self.path == CHAT


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite(text: str) -> float:
    # 1e999 parses to inf, which would go to the engines as the non-JSON constant Infinity.
    number = float(text)
    if math.isinf(number):
        raise ValueError(f"{text} is out of range")
    return number


# A JSON escape of half a UTF-16 pair decodes to a lone surrogate, which no engine can
# tokenize and UTF-8 cannot encode; only bodies holding such an escape are checked in full.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _has_lone_surrogate(body: Any) -> bool:
    try:
        json.dumps(body, ensure_ascii=False).encode()
        return False
    except UnicodeEncodeError:
        return True


# No OpenAI request nests deeper (a tool's JSON Schema is the deepest, a dozen levels or so);
# deeper bodies would reach the recursion limit in some later JSON or digest walk (a 500).
MAX_DEPTH = 64


def _too_deep(text: str, body: Any) -> bool:
    if text.count("[") + text.count("{") <= MAX_DEPTH:    # cheap: most bodies stop here
        return False
    todo = [(body, 1)]
    while todo:
        value, depth = todo.pop()
        if depth > MAX_DEPTH:
            return True
        children = value.values() if isinstance(value, dict) else value
        todo += [(c, depth + 1) for c in children if isinstance(c, (dict, list))]
    return False


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise BadRequest(message, param=param)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional(body: dict, name: str, test, what: str) -> None:
    if body.get(name) is not None:
        _check(test(body[name]), name, f"'{name}' must be {what}")


def _check_messages(messages: Any) -> None:
    _check(isinstance(messages, list) and messages, "messages",
           "'messages' must be a non-empty list of message objects")
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        _check(isinstance(m, dict), where, f"'{where}' must be an object")
        _check(isinstance(m.get("role"), str), f"{where}.role", f"'{where}.role' must be a string")
        content = m.get("content")
        _check(content is None or isinstance(content, str) or (
            isinstance(content, list) and all(isinstance(p, dict) for p in content)),
            f"{where}.content", f"'{where}.content' must be a string or a list of parts")
        _optional(m, "name", lambda v: isinstance(v, str), "a string")
        _optional(m, "tool_calls", lambda v: isinstance(v, list) and all(map(_is_tool_call, v)),
                  "a list of tool calls, each with a 'function' object of strings")
        _optional(m, "tool_call_id", lambda v: isinstance(v, str), "a string")


def _is_tool_call(call: Any) -> bool:
    if not isinstance(call, dict):
        return False
    function = call.get("function") or {}
    return isinstance(function, dict) and all(
        isinstance(function.get(k) or "", str) for k in ("name", "arguments"))


def _is_prompt(prompt: Any) -> bool:
    if isinstance(prompt, str):
        return True
    if not isinstance(prompt, list) or not prompt:
        return False
    return (all(isinstance(p, str) for p in prompt) or all(_is_int(p) for p in prompt)
            or all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt))


def parse(path: str, raw: bytes) -> ClientRequest:
    """Validate `raw` for `path`; raises BadRequest naming the offending field."""
    try:
        # UTF-8 only (RFC 8259): json.loads would also guess UTF-16/32 from bytes.
        text = raw.decode("utf-8")
        body = json.loads(text, parse_constant=_reject_constant, parse_float=_finite)
    except (ValueError, RecursionError) as exc:
        # UnicodeDecodeError and JSONDecodeError are both ValueErrors.
        raise BadRequest(f"Request body is not valid JSON: {exc}"[:300]) from exc
    if isinstance(body, (dict, list)) and _too_deep(text, body):
        raise BadRequest(f"Request body nests JSON deeper than {MAX_DEPTH} levels")
    if _SURROGATE_ESCAPE.search(text) and _has_lone_surrogate(body):
        raise BadRequest("Request body holds an unpaired UTF-16 surrogate escape")
    _check(isinstance(body, dict), "body", "Request body must be a JSON object")
    if path == CHAT:
        _check("messages" in body, "messages", "'messages' is required")
        _check_messages(body["messages"])
    else:
        _check("prompt" in body, "prompt", "'prompt' is required")
        _check(_is_prompt(body["prompt"]), "prompt",
               "'prompt' must be a string, a list of strings or a list of token ids")
    _optional(body, "model", lambda v: isinstance(v, str), "a string")
    _optional(body, "stream", lambda v: isinstance(v, bool), "a boolean")
    _optional(body, "stream_options", lambda v: isinstance(v, dict), "an object")
    for name in ("max_tokens", "max_completion_tokens", "min_tokens", "n"):
        _optional(body, name, _is_int, "an integer")
    _optional(body, "conversation_id", lambda v: isinstance(v, str) and 0 < len(v) <= 1024,
              "a string of 1 to 1024 characters")
    conversation_id = body.pop("conversation_id", None)
    # Only the gateway decides which KV blocks an engine reads.
    body.pop("kv_transfer_params", None)
    return ClientRequest(path=path, body=body, stream=bool(body.get("stream")),
                         conversation_id=conversation_id)
