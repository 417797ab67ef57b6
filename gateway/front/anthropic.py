"""Anthropic's Messages API (`POST /v1/messages`) at the gateway's edge: the request converted
to the chat completion vLLM's own /v1/messages builds from it, the chat reply (a body or its
event stream) converted back into a message or Anthropic's events, errors in Anthropic's
envelope.

vLLM 0.33.0 serves /v1/messages the same way (`AnthropicServingMessages` is an
`OpenAIServingChat`), but its Anthropic stream carries no `kv_transfer_params`; so the gateway
speaks chat to P and D, and the flow (identity, store, exactness) sees a chat completion.
Line numbers below are of vllm/entrypoints/anthropic/ in vLLM 0.33.0 (docs/anthropic.md).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Generator, Iterator, Mapping
from dataclasses import replace
from typing import Any, TypeGuard, cast

from werkzeug.datastructures import Headers

from gateway.flow.reply import Reply
from gateway.parse import read_json
from gateway.support import jsonio
from gateway.support.errors import BadRequest, GatewayError

MESSAGES = "/v1/messages"
COUNT_TOKENS = "/v1/messages/count_tokens"  # passed through (gateway.flow.passthrough)

# protocol.py L68-78
BLOCK_TYPES = (
    "text",
    "image",
    "tool_use",
    "tool_result",
    "tool_reference",
    "thinking",
    "redacted_thinking",
    "tool_addition",
    "tool_removal",
)
BILLING_HEADER = "x-anthropic-billing-header"  # serving.py L398-401, L422-430
MAX_STOP_STRINGS = 4  # VLLM_MAX_STOP_STRINGS' default
# serving.py L640-655: the request fields that go on to the chat request as they are.
PASSED = (
    "temperature",
    "top_p",
    "top_k",
    "watermarking",
    "cache_salt",
    "ec_transfer_params",
    "vllm_xargs",
    "chat_template_kwargs",
    "conversation_id",
)  # the gateway's own (gateway.parse), taken off before P and D
# Anthropic's error.type by HTTP status (protocol.py L34-53).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_type(status: int) -> str:
    """translate_error_type (protocol.py L46-53)."""
    return ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def envelope(exc: GatewayError) -> dict:
    """An error as Anthropic's SDKs read it (api_router.py L40-49)."""
    return {"type": "error", "error": {"type": error_type(exc.status), "message": exc.message}}


# --- the request ------------------------------------------------------------------------------


def _bad(where: str, message: str) -> BadRequest:
    return BadRequest(f"{where}: {message}" if where else message, param=where or None)


def _int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _blocks(value: Any, where: str, system_role: bool) -> str | list[dict]:
    """A content's blocks as AnthropicContentBlock validates them (protocol.py L65-117)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _bad(where, "must be a string or a list of content blocks")
    for i, block in enumerate(value):
        at = f"{where}.{i}"
        if not isinstance(block, dict) or block.get("type") not in BLOCK_TYPES:
            raise _bad(f"{at}.type", f"must be one of {', '.join(BLOCK_TYPES)}")
        for name, kind, what in (
            ("text", str, "a string"),
            ("id", str, "a string"),
            ("tool_use_id", str, "a string"),
            ("name", str, "a string"),
            ("thinking", str, "a string"),
            ("source", dict, "an object"),
            ("input", dict, "an object"),
        ):
            if block.get(name) is not None and not isinstance(block[name], kind):
                raise _bad(f"{at}.{name}", f"must be {what}")
        content = block.get("content")
        if (
            content is not None
            and not isinstance(content, str)
            and not (isinstance(content, list) and all(isinstance(c, dict) for c in content))
        ):
            raise _bad(f"{at}.content", "must be a string or a list of objects")
        for j, item in enumerate(content if isinstance(content, list) else ()):
            for name, kind, what in (("text", str, "a string"), ("source", dict, "an object")):
                if item.get(name) is not None and not isinstance(item[name], kind):
                    raise _bad(f"{at}.content.{j}.{name}", f"must be {what}")
        if block["type"] in ("tool_addition", "tool_removal"):
            if not system_role:  # protocol.py L110-117
                raise _bad(
                    at, f'{block["type"]} blocks are only allowed in messages with role "system"'
                )
            tool = block.get("tool")
            if not isinstance(tool, dict) or tool.get("type") not in (
                "tool_reference",
                "tool_definition",
            ):
                raise _bad(f"{at}.tool", f"tool is required for {block['type']} blocks")
            if block["type"] == "tool_removal" and tool["type"] != "tool_reference":
                raise _bad(f"{at}.tool", "tool_removal only accepts a tool_reference")
            if tool["type"] == "tool_reference" and not isinstance(tool.get("name"), str):
                raise _bad(f"{at}.tool.name", "must be a string")
            if tool["type"] == "tool_definition":
                _tool(tool.get("definition"), f"{at}.tool.definition")
    return value


def _tool(tool: Any, where: str) -> None:
    """AnthropicTool (protocol.py L133-149)."""
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
        raise _bad(f"{where}.name", "is required, a string")
    if not isinstance(tool.get("input_schema"), dict):
        raise _bad(f"{where}.input_schema", "must be an object")
    if tool.get("description") is not None and not isinstance(tool["description"], str):
        raise _bad(f"{where}.description", "must be a string")


def _check(body: Any) -> None:
    """AnthropicMessagesRequest's validation (protocol.py L240-362), as far as the conversion
    relies on it; unknown fields are ignored, as there."""
    if not isinstance(body, dict):
        raise _bad("", "Request body must be a JSON object")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise _bad("model", "Model is required")  # L326-331
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise _bad("messages", "is required, a list of messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in (
            "user",
            "assistant",
            "system",
        ):
            raise _bad(f"messages.{i}.role", "must be 'user', 'assistant' or 'system'")
        _blocks(message.get("content"), f"messages.{i}.content", message["role"] == "system")
    if body.get("system") is not None:
        _blocks(body["system"], "system", False)  # L340-344
    max_tokens = body.get("max_tokens")
    if not _int(max_tokens):
        raise _bad("max_tokens", "is required, an integer")
    if max_tokens <= 0:
        raise _bad("max_tokens", "max_tokens must be positive")  # L333-338
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise _bad("stream", "must be a boolean")
    stops = body.get("stop_sequences")
    if stops is not None and not (
        isinstance(stops, list)
        and len(stops) <= MAX_STOP_STRINGS
        and all(isinstance(s, str) for s in stops)
    ):
        raise _bad("stop_sequences", f"must be a list of at most {MAX_STOP_STRINGS} strings")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _bad("tools", "must be a list")
        for i, tool in enumerate(tools):
            _tool(tool, f"tools.{i}")
    choice = body.get("tool_choice")
    if choice is not None:
        if not isinstance(choice, dict) or choice.get("type") not in (
            "auto",
            "any",
            "tool",
            "none",
        ):
            raise _bad("tool_choice.type", "must be 'auto', 'any', 'tool' or 'none'")
        if choice["type"] == "tool" and not choice.get("name"):  # L179-183
            raise _bad("tool_choice", "tool_choice.name is required when type is 'tool'")
    thinking = body.get("thinking")
    if thinking is not None:
        if not isinstance(thinking, dict) or thinking.get("type") not in (
            "enabled",
            "disabled",
            "adaptive",
        ):
            raise _bad("thinking.type", "must be 'enabled', 'disabled' or 'adaptive'")
        if thinking["type"] == "enabled":
            budget = thinking.get("budget_tokens")
            if not _int(budget) or budget < 1024:  # L207-215
                raise _bad("thinking.budget_tokens", "must be an integer of at least 1024")
            if budget >= max_tokens:  # L351-362
                raise _bad(
                    "thinking.budget_tokens", "thinking.budget_tokens must be less than max_tokens"
                )
    for name in (
        "output_config",
        "metadata",
        "chat_template_kwargs",
        "vllm_xargs",
        "ec_transfer_params",
    ):
        if body.get(name) is not None and not isinstance(body[name], dict):
            raise _bad(name, "must be an object")
    salt = body.get("cache_salt")
    if salt is not None and not (isinstance(salt, str) and 1 <= len(salt) <= 1024):
        raise _bad("cache_salt", "must be a string of 1 to 1024 characters")  # L282-294


def _system_text(content: str | list[dict]) -> str | None:
    """_extract_system_text (serving.py L418-432): an inline system message's text."""
    if isinstance(content, str):
        return None if content.startswith(BILLING_HEADER) else content
    parts = [
        b["text"]
        for b in content
        if b["type"] == "text" and b.get("text") and not b["text"].startswith(BILLING_HEADER)
    ]
    return "".join(parts) if parts else None


def _image_url(source: dict) -> str:
    """_convert_image_source_to_url (serving.py L330-349)."""
    if source.get("type") == "url":
        return source.get("url", "")
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _user_tool_result(block: dict, out: list[dict]) -> None:
    """_convert_user_tool_result (serving.py L566-624): a tool message, then a user message of
    its images, then one of its tool references."""
    content, text, images, references = block.get("content"), "", [], []
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for item in content:
            kind = item.get("type")
            if kind == "text":
                texts.append(item.get("text") or "")
            elif kind == "image":
                if url := _image_url(item.get("source", {})):
                    images.append(url)
            elif kind == "tool_reference":
                if name := item.get("tool_name") or item.get("name"):
                    references.append({"type": "tool_reference", "name": name})
        text = "\n".join(texts)
    call_id = block.get("tool_use_id") or ""
    out.append({"role": "tool", "tool_call_id": call_id, "content": text or ""})
    if images:
        out.append(
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": u}} for u in images],
            }
        )
    if references:
        out.append({"role": "tool", "tool_call_id": call_id, "content": references})


def _message(message: dict, out: list[dict]) -> None:
    """One message as chat messages (serving.py L434-534); inline system messages stay where
    they are (`merge_inline_system` off: docs/anthropic.md)."""
    role, content = message["role"], message["content"]
    if role == "system":
        if text := _system_text(content):
            out.append({"role": "system", "content": text})
        return
    chat: dict = {"role": role}
    if isinstance(content, str):
        chat["content"] = content
    else:
        parts: list[dict] = []
        calls: list[dict] = []
        reasoning: list[str] = []
        for block in content:
            kind = block["type"]
            if kind == "text" and block.get("text"):
                parts.append({"type": "text", "text": block["text"]})
            elif kind == "image" and block.get("source"):
                parts.append(
                    {"type": "image_url", "image_url": {"url": _image_url(block["source"])}}
                )
            elif kind == "thinking" and block.get("thinking") is not None:
                reasoning.append(block["thinking"])
            elif kind == "tool_use":  # L536-547
                calls.append(
                    {
                        "id": block.get("id") or f"call_{int(time.time())}",
                        "type": "function",
                        "function": {
                            "name": block.get("name") or "",
                            "arguments": json.dumps(block.get("input") or {}),
                        },
                    }
                )
            elif kind == "tool_result" and role == "user":
                _user_tool_result(block, out)
            elif kind == "tool_result":  # L558-564
                result = str(block["content"]) if block.get("content") else ""
                parts.append({"type": "text", "text": f"Tool result: {result}"})
        if reasoning:
            chat["reasoning"] = "".join(reasoning)
        if calls:
            chat["tool_calls"] = calls
        if parts:
            chat["content"] = (
                parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" else parts
            )
    if not (role == "user" and "content" not in chat):
        out.append(chat)


def _resolved_tools(body: dict) -> list[dict] | None:
    """_resolve_tools (serving.py L745-788): the tools in effect once the system messages'
    tool_addition and tool_removal blocks are applied."""
    changes = [
        block
        for message in body["messages"]
        if not isinstance(message["content"], str)
        for block in message["content"]
        if block["type"] in ("tool_addition", "tool_removal")
    ]
    if not changes:
        return body.get("tools")
    tools = {tool["name"]: tool for tool in body.get("tools") or []}
    removed: set[str] = set()
    for block in changes:
        change = block["tool"]
        if change["type"] == "tool_definition":
            name = change["definition"]["name"]
            tools[name] = change["definition"]
        else:
            name = change["name"]
            if name not in tools:
                raise _bad(
                    "messages",
                    f"{block['type']} references tool {name!r}, which is not declared in tools",
                )
            if block["type"] == "tool_addition":
                tools[name] = {**tools[name], "defer_loading": None}
        if block["type"] == "tool_removal":
            removed.add(name)
        else:
            removed.discard(name)
    return [tool for name, tool in tools.items() if name not in removed]


def _chat_tool(tool: dict) -> dict:
    """A tool as ChatCompletionToolsParam (serving.py L801-816); the schema's `type` defaults
    to "object", set last as the validator does (protocol.py L142-149)."""
    schema = tool["input_schema"]
    if "type" not in schema:
        schema = {**schema, "type": "object"}
    function = {
        "name": tool["name"],
        "description": tool.get("description"),
        "parameters": schema,
        "strict": tool.get("strict"),
        "defer_loading": tool.get("defer_loading"),
    }
    return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


def to_chat(body: Any, disabled_thinking_effort: str = "none") -> dict:
    """The chat request vLLM builds of a Messages request (`to_chat_completion_request`,
    serving.py L351-378); raises BadRequest for a body vLLM's validation refuses. Fields
    vLLM leaves None are left out: the engine reads an absent field as None."""
    _check(body)
    messages: list[dict] = []
    system = body.get("system")  # L380-416
    if system:
        if isinstance(system, str):
            messages.append({"role": "system", "content": system})
        elif text := "".join(
            b["text"]
            for b in system
            if b["type"] == "text" and b.get("text") and not b["text"].startswith(BILLING_HEADER)
        ):
            messages.append({"role": "system", "content": text})
    for message in body["messages"]:
        _message(message, messages)
    chat: dict = {
        "model": body["model"],
        "messages": messages,  # L626-655
        "max_tokens": body["max_tokens"],
        "max_completion_tokens": body["max_tokens"],
    }
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    chat.update((name, body[name]) for name in PASSED if body.get(name) is not None)
    if body.get("stream"):  # L701-714
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    output = body.get("output_config") or {}  # L682-699
    form = output.get("format")
    if isinstance(form, dict) and form.get("schema"):
        chat["response_format"] = {
            "type": form.get("type", "json_schema"),
            "json_schema": {"name": form.get("type", "json_schema"), "schema": form["schema"]},
        }
    if output.get("effort") is not None:
        chat["reasoning_effort"] = output["effort"]
    thinking = body.get("thinking")  # L657-680
    if thinking is not None:
        if thinking["type"] == "disabled":
            chat["reasoning_effort"] = disabled_thinking_effort
        elif thinking["type"] == "enabled":
            chat["thinking_token_budget"] = thinking["budget_tokens"]
    choice = body.get("tool_choice")  # L716-743
    if choice is not None:
        chat["parallel_tool_calls"] = not choice.get("disable_parallel_tool_use")
        chat["tool_choice"] = (
            {"type": "function", "function": {"name": choice["name"]}}
            if choice["type"] == "tool"
            else {"auto": "auto", "any": "required", "none": "none"}[choice["type"]]
        )
    tools = _resolved_tools(body)  # L790-820
    if tools is not None:
        chat["tools"] = [_chat_tool(tool) for tool in tools]
        chat.setdefault("tool_choice", "auto")
    return chat


# --- the reply --------------------------------------------------------------------------------


def usage(chat_usage: Any) -> dict:
    """_build_anthropic_usage (serving.py L75-111): input_tokens less the cache's, whose
    fields show only when the engine reported them."""
    if not isinstance(chat_usage, dict):
        return {"input_tokens": 0, "output_tokens": 0}
    out: dict = {"input_tokens": 0, "output_tokens": chat_usage.get("completion_tokens") or 0}
    prompt = chat_usage.get("prompt_tokens") or 0
    details = chat_usage.get("prompt_tokens_details")
    if isinstance(details, dict):
        for field, name in (
            ("created_cache_tokens", "cache_creation_input_tokens"),
            ("cached_tokens", "cache_read_input_tokens"),
        ):
            if _int(details.get(field)):
                prompt -= details[field]
                out[name] = details[field]
    out["input_tokens"] = max(0, prompt)
    return out


def stop_reason(
    finish_reason: Any, stop: Any, tool_used: bool, tool_complete: bool
) -> tuple[str | None, str | None]:
    """_to_anthropic_stop_reason (serving.py L114-143)."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason not in ("stop", "tool_calls"):
        return None, None
    if tool_complete:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    if finish_reason == "tool_calls" or tool_used:
        return "tool_use", None
    return "end_turn", None


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def message(chat: dict) -> dict:
    """messages_full_converter (serving.py L861-916), serialised without nulls
    (api_router.py L82-85)."""
    choices = chat.get("choices") or [{}]
    choice = choices[0] if isinstance(choices[0], dict) else {}
    reply = choice.get("message") or {}
    calls = reply.get("tool_calls") or []
    reason, sequence = stop_reason(
        choice.get("finish_reason"), choice.get("stop_reason"), bool(calls), bool(calls)
    )
    content: list[dict] = []
    reasoning = reply.get("reasoning") or reply.get("reasoning_content")
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": uuid.uuid4().hex})
    if reply.get("content"):
        content.append({"type": "text", "text": reply["content"]})
    for call in calls:
        function = call.get("function") or {}
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except ValueError as exc:  # vLLM's own converter fails here: a 500 there
            raise GatewayError("the model's tool call arguments are not JSON", status=502) from exc
        content.append(
            {
                "type": "tool_use",
                "id": call.get("id"),
                "name": function.get("name"),
                "input": arguments,
            }
        )
    out = {
        "id": chat.get("id") or f"msg_{int(time.time() * 1000)}",
        "type": "message",
        "role": "assistant",
        "content": content or [{"type": "text", "text": ""}],
        "model": chat.get("model"),
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(chat.get("usage")),
    }
    return {k: v for k, v in out.items() if v is not None}


def _event(payload: dict) -> bytes:
    """wrap_data_with_event (serving.py L154-155)."""
    return b"event: " + payload["type"].encode() + b"\ndata: " + jsonio.dumps(payload) + b"\n\n"


class MessageStream:
    """message_stream_converter (serving.py L918-1247): the chat stream's events (whole events,
    as the relay sends them, `kv_transfer_params` already out) in, Anthropic's events out."""

    def __init__(self) -> None:
        self._pending = b""
        self.started = False
        self.ended = False
        self.index = 0  # content_block_index
        self.block: str | None = None  # the open block's type
        self.signature: str | None = None  # a thinking block's, sent as it stops
        self.tool_use_id: str | None = None
        self.held: list[str] = []  # text after a tool call: pending_content
        self.finish_reason: str | None = None
        self.stop: Any = None
        self.tool_used = False
        self.last_tool_args: list[str] = []
        self.tool_ids: dict[int, str] = {}

    def feed(self, data: bytes) -> bytes:
        self._pending += data
        out = []
        while not self.ended:
            end = self._pending.find(b"\n\n")
            if end < 0:
                break
            event, self._pending = self._pending[:end], self._pending[end + 2 :]
            out.append(self._event(event))
        return b"".join(out)

    def _event(self, event: bytes) -> bytes:
        payload = b"".join(
            line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")
        )
        if not payload:
            return b""
        if payload.strip() == b"[DONE]":
            self.ended = True
            return b"".join(self._stop_and_flush()) + _event({"type": "message_stop"})
        try:
            chunk = jsonio.loads_engine(payload, exact=False)
        except ValueError:
            return b""
        if not isinstance(chunk, dict):
            return b""
        if "error" in chunk:
            error = chunk["error"] if isinstance(chunk["error"], dict) else {}
            code = error.get("code") if _int(error.get("code")) else 500
            return self.fail(
                GatewayError(str(error.get("message") or "stream failed"), status=code)
            )
        return b"".join(self._chunk(chunk))

    def fail(self, exc: GatewayError) -> bytes:
        """The open block stopped, then Anthropic's `error` event (serving.py L1228-1247)."""
        self.ended = True
        return b"".join(self._stop_block()) + _event(
            {"type": "error", "error": {"type": error_type(exc.status), "message": exc.message}}
        )

    def _start(self, block: dict) -> bytes:
        event = _event({"type": "content_block_start", "content_block": block, "index": self.index})
        self.block = block["type"]
        self.signature = uuid.uuid4().hex if block["type"] == "thinking" else None
        self.tool_use_id = block.get("id") if block["type"] == "tool_use" else None
        return event

    def _stop_block(self) -> list[bytes]:
        """stop_active_block (L971-999)."""
        if self.block is None:
            return []
        events = []
        if self.signature is not None:
            events.append(
                _event(
                    {
                        "type": "content_block_delta",
                        "index": self.index,
                        "delta": {"type": "signature_delta", "signature": self.signature},
                    }
                )
            )
        events.append(_event({"type": "content_block_stop", "index": self.index}))
        self.block = self.signature = self.tool_use_id = None
        self.held = []
        self.index += 1
        return events

    def _stop_and_flush(self) -> list[bytes]:
        """stop_and_flush (L1012-1028): text held behind a tool call becomes a text block."""
        held, self.held = self.held, []
        events = self._stop_block()
        if held:
            events.append(self._start({"type": "text", "text": ""}))
            events.append(self._delta({"type": "text_delta", "text": "".join(held)}))
            events.extend(self._stop_block())
        return events

    def _delta(self, delta: dict) -> bytes:
        return _event({"type": "content_block_delta", "index": self.index, "delta": delta})

    def _chunk(self, chunk: dict) -> Iterator[bytes]:
        """One chat chunk (L1030-1221)."""
        if not self.started:
            self.started = True
            yield _event(
                {
                    "type": "message_start",
                    "message": {
                        "id": chunk.get("id"),
                        "type": "message",
                        "role": "assistant",
                        "content": [],
                        "model": chunk.get("model"),
                        "stop_reason": None,
                        "stop_sequence": None,
                        "usage": usage(chunk.get("usage")),
                    },
                }
            )
            return
        choices = chunk.get("choices")
        if not choices:  # the usage chunk: the message's end
            yield from self._stop_and_flush()
            reason, sequence = stop_reason(
                self.finish_reason or "stop",
                self.stop,
                self.tool_used,
                self.tool_used and _is_json("".join(self.last_tool_args)),
            )
            yield _event(
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": usage(chunk.get("usage")),
                }
            )
            return
        choice = choices[0] if isinstance(choices[0], dict) else {}
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
            self.stop = choice.get("stop_reason")
        delta = choice.get("delta") or {}
        reasoning = delta.get("reasoning")
        if reasoning is None:
            reasoning = delta.get("reasoning_content")  # vLLM before PR #27752
        if reasoning:
            if self.block != "thinking":
                yield from self._stop_and_flush()
                yield self._start({"type": "thinking", "thinking": ""})
            yield self._delta({"type": "thinking_delta", "thinking": reasoning})
        text = delta.get("content")
        if text:
            if self.block == "tool_use":
                self.held.append(text)
            else:
                if self.block != "text":
                    yield from self._stop_and_flush()
                    yield self._start({"type": "text", "text": ""})
                yield self._delta({"type": "text_delta", "text": text})
        for call in delta.get("tool_calls") or ():
            function = call.get("function") or {}
            arguments = function.get("arguments")
            if call.get("id") is not None:
                self.tool_ids[call.get("index")] = call["id"]
                if self.tool_use_id != call["id"] and function.get("name") is not None:
                    yield from self._stop_and_flush()
                    self.tool_used, self.last_tool_args = True, []
                    yield self._start(
                        {
                            "type": "tool_use",
                            "id": call["id"],
                            "name": function["name"],
                            "input": {},
                        }
                    )
                current = call["id"]
            else:
                current = self.tool_ids.get(call.get("index"))
            if arguments and current is not None and self.tool_use_id == current:
                self.last_tool_args.append(arguments)
                yield self._delta({"type": "input_json_delta", "partial_json": arguments})


def converted_stream(chunks: Iterator[bytes]) -> Generator[bytes, None, None]:
    """The chat stream's bytes as Anthropic's events; a failure the relay reports (its error
    event) becomes Anthropic's `error` event, and nothing follows it."""
    stream = MessageStream()
    for data in chunks:
        out = stream.feed(data)
        if out:
            yield out
        if stream.ended:
            return
    if not stream.ended:
        yield stream.fail(GatewayError("the stream ended before it was complete", status=502))


def converted(reply: Reply) -> Reply:
    """A chat reply of the flow as the Messages API's: a message, or Anthropic's events. (A
    reply relayed from the worker that owns the conversation is one already: it ran this.)"""
    if isinstance(reply.body, dict):
        return replace(reply, body=message(reply.body))
    if reply.stream is None:
        return reply
    inner, close = reply.stream, reply.close
    outer = converted_stream(inner)

    def close_both() -> None:
        try:
            outer.close()
        finally:
            close()

    return replace(
        reply, stream=outer, close=close_both, content_type="text/event-stream; charset=utf-8"
    )


class Edge:
    """What `Gateway.complete` needs of a route that is not a chat completion: its request as
    the chat request to run, and the chat reply as the route's."""

    endpoint = MESSAGES

    def __init__(self, disabled_thinking_effort: str = "none") -> None:
        self.disabled_thinking_effort = disabled_thinking_effort

    def chat(self, raw: bytes) -> bytes:
        return jsonio.dumps(to_chat(read_json(raw), self.disabled_thinking_effort))

    reply: Callable[[Reply], Reply] = staticmethod(converted)


EDGE = Edge()


def with_bearer(headers: Mapping[str, str]) -> Mapping[str, str]:
    """`headers`, their `x-api-key` (how Anthropic's clients send a key) as the bearer key the
    gateway reads, unless they carry an Authorization of their own."""
    key = headers.get("x-api-key")
    if not key or headers.get("Authorization"):
        return headers
    out = Headers(headers.items())
    out["Authorization"] = f"Bearer {key}"
    # why: Headers is no Mapping (it iterates pairs) but has what its readers call (get, items).
    return cast(Mapping[str, str], out)
