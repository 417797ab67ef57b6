"""Parse and validate client request bodies; anything a client can get wrong becomes a 400."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from gateway.support import jsonio
from gateway.support.errors import BadRequest

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@dataclass(frozen=True)
class ClientRequest:
    """A validated request: the body to forward (gateway-only fields removed) and its mode."""

    path: str
    body: dict
    stream: bool
    conversation_id: str | None
    endpoint: str = ""  # the route the client called, if not `path` (/v1/messages and
    # /v1/responses run as chat): for the metrics

    @property
    def is_chat(self) -> bool:
        return self.path == CHAT

    @property
    def label(self) -> str:
        """The endpoint as the metrics label it."""
        return self.endpoint or self.path

    @cached_property
    def wire(self) -> dict:
        """The body as the engines get it, its history written once (both P and D get it)."""
        prompt = "messages" if "messages" in self.body else "prompt"
        if not isinstance(self.body.get(prompt), list):
            return self.body
        return {**self.body, prompt: jsonio.fragment(self.body[prompt])}


# No OpenAI request nests deeper (a tool's JSON Schema is the deepest, a dozen levels or so);
# deeper bodies would reach the recursion limit in some later JSON or digest walk (a 500).
MAX_DEPTH = 64


def is_plain(message: Any) -> bool:
    """A message of a role and a text alone: most of every history, so validated here and
    digested (gateway.reuse.conversation.canonical_message) without the general walk."""
    return (
        type(message) is dict
        and len(message) == 2
        and type(message.get("role")) is str
        and type(message.get("content")) is str
    )


def _check(ok: object, param: str, message: str) -> None:
    if not ok:
        raise BadRequest(message, param=param)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional(body: dict, name: str, test, what: str) -> None:
    if body.get(name) is not None:
        _check(test(body[name]), name, f"'{name}' must be {what}")


def _check_messages(messages: Any) -> None:
    _check(
        isinstance(messages, list) and messages,
        "messages",
        "'messages' must be a non-empty list of message objects",
    )
    for i, m in enumerate(messages):
        if is_plain(m):
            continue  # most of every history: nothing more to check
        where = f"messages.{i}"
        _check(isinstance(m, dict), where, f"'{where}' must be an object")
        _check(isinstance(m.get("role"), str), f"{where}.role", f"'{where}.role' must be a string")
        content = m.get("content")
        _check(
            content is None
            or isinstance(content, str)
            or (isinstance(content, list) and all(isinstance(p, dict) for p in content)),
            f"{where}.content",
            f"'{where}.content' must be a string or a list of parts",
        )
        _optional(m, "name", lambda v: isinstance(v, str), "a string")
        _optional(
            m,
            "tool_calls",
            lambda v: isinstance(v, list) and all(map(_is_tool_call, v)),
            "a list of tool calls, each with a 'function' object of strings",
        )
        _optional(m, "tool_call_id", lambda v: isinstance(v, str), "a string")


def _is_tool_call(call: Any) -> bool:
    if not isinstance(call, dict):
        return False
    function = call.get("function") or {}
    return isinstance(function, dict) and all(
        isinstance(function.get(k) or "", str) for k in ("name", "arguments")
    )


def _is_prompt(prompt: Any) -> bool:
    if isinstance(prompt, str):
        return True
    if not isinstance(prompt, list) or not prompt:
        return False
    return (
        all(isinstance(p, str) for p in prompt)
        or all(_is_int(p) for p in prompt)
        or all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt)
    )


def read_json(raw: bytes) -> Any:
    """A client's body as JSON; BadRequest if it is not, or nests too deep."""
    try:
        return jsonio.loads(raw, MAX_DEPTH)
    except jsonio.TooDeep as exc:
        raise BadRequest(f"Request body {exc}") from exc
    except (ValueError, RecursionError) as exc:
        # UnicodeDecodeError, JSONDecodeError and orjson's are all ValueErrors.
        raise BadRequest(f"Request body is not valid JSON: {exc}"[:300]) from exc


def parse(path: str, raw: bytes) -> ClientRequest:
    """Validate `raw` for `path`; raises BadRequest naming the offending field."""
    body = read_json(raw)
    _check(isinstance(body, dict), "body", "Request body must be a JSON object")
    if path == CHAT:
        _check("messages" in body, "messages", "'messages' is required")
        _check_messages(body["messages"])
    else:
        _check("prompt" in body, "prompt", "'prompt' is required")
        _check(
            _is_prompt(body["prompt"]),
            "prompt",
            "'prompt' must be a string, a list of strings or a list of token ids",
        )
    _optional(body, "model", lambda v: isinstance(v, str), "a string")
    _optional(body, "stream", lambda v: isinstance(v, bool), "a boolean")
    _optional(body, "stream_options", lambda v: isinstance(v, dict), "an object")
    for name in ("max_tokens", "max_completion_tokens", "min_tokens", "n"):
        _optional(body, name, _is_int, "an integer")
    _optional(
        body,
        "conversation_id",
        lambda v: isinstance(v, str) and 0 < len(v) <= 1024,
        "a string of 1 to 1024 characters",
    )
    conversation_id = body.pop("conversation_id", None)
    # Only the gateway decides which KV blocks an engine reads.
    body.pop("kv_transfer_params", None)
    return ClientRequest(
        path=path, body=body, stream=bool(body.get("stream")), conversation_id=conversation_id
    )
