"""The Anthropic Messages API as vLLM 0.33 serves it: a request converted to a chat request, the
chat reply converted back into a message or Anthropic's event stream.

vLLM does the same (`AnthropicServingMessages` is an `OpenAIServingChat`), so prefix caching,
P/D pulls and token accounting are the chat path's. Paths below are under
vllm/entrypoints/anthropic/ of vLLM 0.33.0.
"""

from __future__ import annotations

import json
import time
import uuid

from .errors import EngineError, Unavailable
from .protocol import (
    Call,
    CompletionRequest,
    ValidationError,
    check_model,
    dumps,
    json_body,
    optional,
    render_body,
    request_from_body,
)
from .tokens import Template

# vLLM's default VLLM_MAX_STOP_STRINGS (vllm/envs.py:1157), protocol.py:249-251.
MAX_STOP_STRINGS = 4
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
)  # protocol.py:68-78
BILLING_HEADER = "x-anthropic-billing-header"  # serving.py:398-401

# Anthropic's error.type by HTTP status (protocol.py:34-53).
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
    return ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


class MessagesError(EngineError):
    """An error the Messages handler returns, in Anthropic's envelope (api_router.py:40-49,
    73-80). A request that fails the route's own validation is not one of these: FastAPI's
    handler answers it with vLLM's OpenAI envelope, as on every route
    (serve/exception_handling/handlers/validation.py:149-195)."""

    def __init__(self, exc: EngineError) -> None:
        super().__init__(exc.message, exc.param)
        self.code = exc.code
        self.type = error_type(exc.code)

    def envelope(self) -> dict:
        return {"type": "error", "error": {"type": self.type, "message": self.message}}


# --- the request --------------------------------------------------------------------------------


def _blocks(value: object, where: str) -> list[dict]:
    if not isinstance(value, list):
        raise ValidationError(where, "Input should be a valid string or a valid list")
    for i, block in enumerate(value):
        if not isinstance(block, dict) or block.get("type") not in BLOCK_TYPES:
            raise ValidationError(f"{where}.{i}.type", f"Input should be one of {BLOCK_TYPES}")
        if block["type"] in ("tool_addition", "tool_removal"):
            # Allowed only in role "system" messages (protocol.py:110-117); vLLM then rewrites
            # the tool list (serving.py:745-788), which the emulator does not.
            raise ValidationError(f"{where}.{i}", f"{block['type']} blocks are not emulated")
    return value


def _content(value: object, where: str) -> str | list[dict]:
    return value if isinstance(value, str) else _blocks(value, where)


def _check(body: dict, count_tokens: bool) -> None:
    """AnthropicMessagesRequest's / AnthropicCountTokensRequest's validation (protocol.py:240-362,
    562-593); unknown fields are ignored (a plain pydantic BaseModel)."""
    if not optional(body, "model", str):
        raise ValidationError("model", "Model is required")  # protocol.py:326-331
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise ValidationError(
            "messages", "Field required" if messages is None else "Input should be a valid list"
        )
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in (
            "user",
            "assistant",
            "system",
        ):
            raise ValidationError(
                f"messages.{i}.role", "Input should be 'user', 'assistant' or 'system'"
            )
        _content(message.get("content"), f"messages.{i}.content")
    if body.get("system") is not None:
        _content(body["system"], "system")
    for i, tool in enumerate(optional(body, "tools", list, [])):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise ValidationError(f"tools.{i}.name", "Field required")
        if not isinstance(tool.get("input_schema"), dict):
            raise ValidationError(f"tools.{i}.input_schema", "Input should be a valid dictionary")
    choice = optional(body, "tool_choice", dict)
    if choice is not None:
        if choice.get("type") not in ("auto", "any", "tool", "none"):
            raise ValidationError(
                "tool_choice.type", "Input should be 'auto', 'any', 'tool' or 'none'"
            )
        if choice["type"] == "tool" and not choice.get("name"):
            raise ValidationError("tool_choice", "tool_choice.name is required when type is 'tool'")
    thinking = optional(body, "thinking", dict)
    if thinking is not None:
        if thinking.get("type") not in ("enabled", "disabled", "adaptive"):
            raise ValidationError(
                "thinking.type", "Input tag does not match 'enabled', 'disabled', 'adaptive'"
            )
        budget = thinking.get("budget_tokens")
        if thinking["type"] == "enabled" and not (isinstance(budget, int) and budget >= 1024):
            raise ValidationError(
                "thinking.enabled.budget_tokens", "Input should be greater than or equal to 1024"
            )
    if count_tokens:
        return
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        raise ValidationError("max_tokens", "Field required")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
        raise ValidationError("max_tokens", "Input should be a valid integer")
    if max_tokens <= 0:
        raise ValidationError(
            "max_tokens", "Value error, max_tokens must be positive"
        )  # protocol.py:333-338
    stops = optional(body, "stop_sequences", list)
    if stops is not None and (
        len(stops) > MAX_STOP_STRINGS or not all(isinstance(s, str) for s in stops)
    ):
        raise ValidationError(
            "stop_sequences", f"List should have at most {MAX_STOP_STRINGS} strings"
        )
    optional(body, "stream", bool)
    params = optional(body, "kv_transfer_params", dict)
    salt = optional(body, "cache_salt", str)
    if salt is not None and not 1 <= len(salt) <= 1024:
        raise ValidationError("cache_salt", "String should have 1 to 1024 characters")
    # protocol.py:351-362: "P/D prefill legs are sent with max_tokens=1 and never decode; the
    # decode leg carries the client's max_tokens and is still checked."
    if params and params.get("do_remote_decode"):
        return
    if (
        thinking is not None
        and thinking["type"] == "enabled"
        and thinking["budget_tokens"] >= max_tokens
    ):
        raise ValidationError(
            "", "Value error, thinking.budget_tokens must be less than max_tokens"
        )


def _system_text(content: str | list[dict]) -> str | None:
    """Text of a system prompt, without Claude Code's per-request billing header
    (serving.py:380-432)."""
    if isinstance(content, str):
        return None if content.startswith(BILLING_HEADER) else content
    parts = [
        b["text"]
        for b in content
        if b["type"] == "text" and b.get("text") and not b["text"].startswith(BILLING_HEADER)
    ]
    return "".join(parts) or None


def _image_url(source: dict) -> str:
    """serving.py:330-349."""
    if source.get("type") == "url":
        return source.get("url", "")
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _tool_result(block: dict, out: list[dict]) -> None:
    """A user's tool_result: a tool message, and a user message with its images
    (serving.py:566-624)."""
    content, text, images, references = block.get("content"), "", [], []
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        items = [item for item in content if isinstance(item, dict)]
        text = "\n".join(item.get("text", "") for item in items if item.get("type") == "text")
        images = [
            url
            for item in items
            if item.get("type") == "image"
            if (url := _image_url(item.get("source", {})))
        ]
        references = [
            {"type": "tool_reference", "name": name}
            for item in items
            if item.get("type") == "tool_reference"
            if (name := item.get("tool_name") or item.get("name"))
        ]
    out.append(
        {"role": "tool", "tool_call_id": block.get("tool_use_id") or "", "content": text or ""}
    )
    if images:
        out.append(
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": u}} for u in images],
            }
        )
    if references:
        out.append(
            {"role": "tool", "tool_call_id": block.get("tool_use_id") or "", "content": references}
        )


def _message(message: dict, out: list[dict]) -> None:
    """One Anthropic message as chat messages (serving.py:434-534): tool results go out first as
    tool messages, and a user message left with no content is dropped."""
    role, content = message["role"], message["content"]
    if role == "system":  # kept in place: the emulator's template takes inline system turns
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
            elif kind == "tool_use":
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
                _tool_result(block, out)
            elif kind == "tool_result":
                parts.append({"type": "text", "text": f"Tool result: {block.get('content') or ''}"})
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


def _tools(body: dict) -> list[dict] | None:
    """serving.py:790-820 (ChatCompletionToolsParam; its None fields left out)."""
    if body.get("tools") is None:
        return None
    tools = []
    for tool in body["tools"]:
        function = {
            "name": tool["name"],
            "description": tool.get("description"),
            "parameters": {"type": "object", **tool["input_schema"]},
        }
        function.update(
            {k: tool[k] for k in ("strict", "defer_loading") if tool.get(k) is not None}
        )
        tools.append({"type": "function", "function": function})
    return tools


def to_chat_body(body: dict, *, count_tokens: bool = False) -> dict:
    """Validate an Anthropic body and convert it to the chat body vLLM builds from it
    (`to_chat_completion_request`, serving.py:351-378)."""
    _check(body, count_tokens)
    messages: list[dict] = []
    if body.get("system") and (system := _system_text(body["system"])):
        messages.append({"role": "system", "content": system})
    for message in body["messages"]:
        _message(message, messages)
    chat: dict = {"model": body["model"], "messages": messages}
    if body.get("chat_template_kwargs") is not None:
        chat["chat_template_kwargs"] = body["chat_template_kwargs"]
    if not count_tokens:  # serving.py:626-655, 701-714
        chat.update(
            max_tokens=body["max_tokens"],
            max_completion_tokens=body["max_tokens"],
            stop=body.get("stop_sequences"),
            kv_transfer_params=body.get("kv_transfer_params"),
            cache_salt=body.get("cache_salt"),
        )
        if body.get("stream"):
            chat.update(
                stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}
            )
    effort = (body.get("output_config") or {}).get("effort")  # serving.py:682-699
    thinking = body.get("thinking") or {}
    if thinking.get("type") == "disabled":
        # serving.py:657-680: the effort DisabledThinkingEffortResolver probes for; the emulator's
        # template renders "none" apart from every effort, so the probe settles on "none"
        # (serving.py:184-196). budget_tokens (thinking_token_budget) is not emulated.
        effort = "none"
    if effort is not None:
        chat["reasoning_effort"] = effort
    choice = body.get("tool_choice")  # serving.py:716-743
    if choice is not None:
        chat["parallel_tool_calls"] = not choice.get("disable_parallel_tool_use")
        chat["tool_choice"] = (
            {"type": "function", "function": {"name": choice["name"]}}
            if choice["type"] == "tool"
            else {"auto": "auto", "any": "required", "none": "none"}[choice["type"]]
        )
    if (tools := _tools(body)) is not None:
        chat["tools"] = tools
        chat.setdefault("tool_choice", "auto")
    return chat


# --- the reply ----------------------------------------------------------------------------------


def _usage(prompt_tokens: int, completion_tokens: int, cached: int | None) -> dict:
    """_build_anthropic_usage (serving.py:75-111): input_tokens leaves out the cache reads,
    which show only with --enable-prompt-tokens-details."""
    if cached is None:
        return {"input_tokens": prompt_tokens, "output_tokens": completion_tokens}
    return {
        "input_tokens": max(0, prompt_tokens - cached),
        "output_tokens": completion_tokens,
        "cache_read_input_tokens": cached,
    }


def stop_reason(
    finish_reason: str | None, stop: str | None, tool_used: bool, tool_complete: bool
) -> tuple[str | None, str | None]:
    """_to_anthropic_stop_reason (serving.py:114-143)."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason not in ("stop", "tool_calls"):
        return None, None
    if tool_complete:
        return "tool_use", None
    if stop is not None:
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


def _event(payload: dict) -> bytes:
    return b"event: " + payload["type"].encode() + b"\ndata: " + dumps(payload) + b"\n\n"


class MessagesFramer:
    """The bytes of one Messages reply: `messages_full_converter` for a body (serving.py:861-916),
    `message_stream_converter` for a stream (serving.py:918-1247), fed the chat chunks app.py
    produces. Neither the stream's events nor its message carry kv_transfer_params: the
    converter never reads them off the chat chunks; only a body does (serving.py:870)."""

    chat = True  # the chat role chunk opens the stream: message_start
    reports_cached = False
    cuts_after_error = False

    def __init__(self, response_id: str, model: str, req: CompletionRequest) -> None:
        self.response_id, self.model, self.prompt_tokens = response_id, model, len(req.tokens)
        self.started = False
        self.index = 0  # the next content block's index
        self.block: str | None = None  # the open block's type
        self.tool_use_id: str | None = None
        self.signature: str | None = None  # a thinking block's, sent when it closes
        self.tool_used = False
        self.last_tool_args: list[str] = []
        self.finish_reason: str | None = None

    # --- stream -----------------------------------------------------------------------------

    def role(self, prompt_token_ids: list[int] | None = None) -> bytes:
        """message_start; its usage is the role chunk's, which continuous_usage_stats gives
        the prompt's count and no cache details (chat serving.py:623-634)."""
        self.started = True
        return _event(
            {
                "type": "message_start",
                "message": {
                    "id": self.response_id,
                    "type": "message",
                    "role": "assistant",
                    "content": [],
                    "model": self.model,
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0},
                },
            }
        )

    @staticmethod
    def fast(delta: dict) -> None:
        return None

    def _start(self, block: dict) -> bytes:
        self.block, self.tool_use_id = block["type"], block.get("id")
        self.signature = uuid.uuid4().hex if block["type"] == "thinking" else None
        return _event({"type": "content_block_start", "content_block": block, "index": self.index})

    def _stop(self) -> bytes:
        """stop_active_block (serving.py:971-999): a thinking block sends its signature first."""
        if self.block is None:
            return b""
        out = b""
        if self.signature is not None:
            out = _event(
                {
                    "type": "content_block_delta",
                    "delta": {"type": "signature_delta", "signature": self.signature},
                    "index": self.index,
                }
            )
        self.block = self.tool_use_id = self.signature = None
        self.index += 1
        return out + _event({"type": "content_block_stop", "index": self.index - 1})

    def _delta(self, delta: dict) -> bytes:
        return _event({"type": "content_block_delta", "delta": delta, "index": self.index})

    def chunk(
        self,
        delta: dict,
        token_ids: list[int] | None = None,
        finish_reason: str | None = None,
        extra: dict | None = None,
    ) -> bytes:
        """One chat chunk's events (serving.py:1085-1221); a chunk's kv_transfer_params are
        dropped, as the converter never reads them."""
        out = b""
        if finish_reason is not None:
            self.finish_reason = finish_reason
        if delta.get("reasoning"):
            if self.block != "thinking":
                out += self._stop() + self._start({"type": "thinking", "thinking": ""})
            out += self._delta({"type": "thinking_delta", "thinking": delta["reasoning"]})
        if delta.get("content"):
            # Text after a tool call is held back until the block closes (pending_content); the
            # emulator never generates any.
            if self.block != "text":
                out += self._stop() + self._start({"type": "text", "text": ""})
            out += self._delta({"type": "text_delta", "text": delta["content"]})
        for call in delta.get("tool_calls") or ():
            function = call.get("function") or {}
            if (
                call.get("id") is not None
                and self.tool_use_id != call["id"]
                and function.get("name")
            ):
                out += self._stop()
                self.tool_used, self.last_tool_args = True, []
                out += self._start(
                    {"type": "tool_use", "id": call["id"], "name": function["name"], "input": {}}
                )
            if function.get("arguments") and self.tool_use_id == call.get("id"):
                self.last_tool_args.append(function["arguments"])
                out += self._delta(
                    {"type": "input_json_delta", "partial_json": function["arguments"]}
                )
        return out

    def tail(
        self,
        gen,
        include_usage: bool,
        prompt_tokens: int,
        cached: int | None,
        params: dict | None,
        placement: str,
    ) -> bytes:
        """The usage chunk becomes message_delta (the converter forces include_usage,
        serving.py:701-714, 1057-1083), then message_stop; no [DONE], no params."""
        reason, sequence = stop_reason(
            self.finish_reason or "stop",
            None,
            self.tool_used,
            self.tool_used and _is_json("".join(self.last_tool_args)),
        )
        return (
            self._stop()
            + _event(
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": _usage(prompt_tokens, gen.completion_tokens, cached),
                }
            )
            + _event({"type": "message_stop"})
        )

    def fail(self, envelope: dict) -> bytes:
        """A failure after the headers: the open block closed, then an `error` event in
        Anthropic's vocabulary (serving.py:1228-1247). vLLM sends the role chunk before it
        reads the engine's first output, so message_start comes first."""
        error = envelope["error"]
        opening = b"" if self.started else self.role()
        return (
            opening
            + self._stop()
            + _event(
                {
                    "type": "error",
                    "error": {"type": error_type(error["code"]), "message": error["message"]},
                }
            )
        )

    # --- body -------------------------------------------------------------------------------

    def body(
        self,
        gen,
        prompt_tokens: int,
        params: dict | None,
        prompt_token_ids: list[int] | None = None,
        output_token_ids: list[int] | None = None,
        cached: int | None = None,
    ) -> bytes:
        """The message, serialised without nulls (api_router.py:82-85): kv_transfer_params only
        when the chat response had them."""
        content: list[dict] = []
        if gen.reasoning:
            content.append(
                {"type": "thinking", "thinking": gen.reasoning, "signature": uuid.uuid4().hex}
            )
        if gen.content:
            content.append({"type": "text", "text": gen.content})
        for call in gen.tool_calls or ():
            content.append(
                {
                    "type": "tool_use",
                    "id": call["id"],
                    "name": call["function"]["name"],
                    "input": json.loads(call["function"]["arguments"]),
                }
            )
        calls = bool(gen.tool_calls)
        reason, sequence = stop_reason(gen.finish_reason, None, calls, calls)
        message = {
            "id": self.response_id,
            "type": "message",
            "role": "assistant",
            "content": content or [{"type": "text", "text": ""}],
            "model": self.model,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": _usage(prompt_tokens, gen.completion_tokens, cached),
            "kv_transfer_params": params,
        }
        return dumps({k: v for k, v in message.items() if v is not None})


# --- the routes ---------------------------------------------------------------------------------


def _anthropic_body(raw: bytes, count: bool) -> dict:
    try:
        return to_chat_body(json_body(raw), count_tokens=count)
    except ValidationError:
        raise
    except EngineError as exc:  # not JSON, or not an object: FastAPI's validation says so
        raise ValidationError("", exc.message) from exc


def messages_call(raw: bytes, xid: str, model: str, max_model_len: int, template: Template) -> Call:
    """POST /v1/messages (api_router.py:52-87): the chat request's id, chatcmpl-<X-Request-Id>,
    is the message's id (serving.py:865-866, 1034-1037)."""
    chat = _anthropic_body(raw, False)
    try:
        req = request_from_body("chat", chat, model, max_model_len, template)
    except EngineError as exc:
        raise MessagesError(exc) from exc
    response_id = f"chatcmpl-{xid}"
    return Call(req, response_id, MessagesFramer(response_id, model, req))


def count_tokens(raw: bytes, model: str, template: Template, down: bool) -> dict:
    """POST /v1/messages/count_tokens (api_router.py:90-120; serving.py:1249-1282): the prompt the
    same request renders, counted."""
    chat = _anthropic_body(raw, True)
    try:
        if down:
            raise Unavailable("emulated fault: down")
        check_model(chat, model)
        n = len(render_body("chat", chat, template))
    except EngineError as exc:
        raise MessagesError(exc) from exc
    return {"input_tokens": n, "context_management": {"original_input_tokens": n}}
