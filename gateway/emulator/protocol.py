"""The OpenAI surface as vLLM serves it: request validation, and response bodies and SSE chunks as bytes."""

from __future__ import annotations

import json
from dataclasses import dataclass

from .errors import BadRequest, NotFound
from .tokens import BARE_JSON, SPACED_JSON, render_chat, render_completion

DONE = b"data: [DONE]\n\n"


def dumps(value: object) -> bytes:
    """Compact one-line JSON, as vLLM's model_dump_json / JSONResponse produce."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


class ValidationError(BadRequest):
    """A field-level problem, shaped like vLLM's request validation errors."""

    type = "Bad Request"

    def __init__(self, param: str, problem: str) -> None:
        super().__init__(f"1 validation error: body.{param}: {problem}", f"body.{param}")


@dataclass
class CompletionRequest:
    """What the engine needs from a chat or completions body; unknown fields were accepted and dropped."""

    kind: str  # "chat" or "completion"
    tokens: list[str]
    stream: bool
    max_tokens: int | None
    min_tokens: int
    ignore_eos: bool
    include_usage: bool
    kv_transfer_params: dict | None


def _optional(body: dict, name: str, kind: type, default: object = None) -> object:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValidationError(name, f"must be {kind.__name__}, got {type(value).__name__}")
    return value


def _count(body: dict, name: str, minimum: int) -> int | None:
    value = _optional(body, name, int)
    if value is not None and value < minimum:
        raise ValidationError(name, f"must be >= {minimum}, got {value}")
    return value  # type: ignore[return-value]


def _check_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if messages is None:
        raise ValidationError("messages", "Field required")
    if not isinstance(messages, list) or not messages:
        raise ValidationError("messages", "must be a non-empty list of messages")
    for i, message in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(message, dict):
            raise ValidationError(where, "must be an object")
        if not isinstance(message.get("role"), str) or not message["role"]:
            raise ValidationError(f"{where}.role", "must be a non-empty string")
        content = message.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise ValidationError(f"{where}.content.{j}", "must be an object with a string type")
                if part["type"] == "text" and not isinstance(part.get("text"), str):
                    raise ValidationError(f"{where}.content.{j}.text", "must be a string")
        elif content is not None and not isinstance(content, str):
            raise ValidationError(f"{where}.content", "must be a string or a list of content parts")
        if message.get("name") is not None and not isinstance(message["name"], str):
            raise ValidationError(f"{where}.name", "must be a string")
        if message.get("tool_calls") is not None and not isinstance(message["tool_calls"], list):
            raise ValidationError(f"{where}.tool_calls", "must be a list")
    return messages


def _check_prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]  # vLLM also takes a batch; one prompt is the only batch the emulator serves
    if prompt is None:
        raise ValidationError("prompt", "Field required")
    if not isinstance(prompt, str):
        raise ValidationError("prompt", "must be a string (token ids and batches are not emulated)")
    if not prompt.split():
        raise BadRequest("The prompt cannot be empty.", "prompt")
    return prompt


def parse_request(kind: str, raw: bytes, model: str, max_model_len: int) -> CompletionRequest:
    """Validate a /v1/chat/completions (kind "chat") or /v1/completions body; raise the 400/404 vLLM would."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"Invalid JSON body: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.", "body")
    name = _optional(body, "model", str)
    if name is not None and name != model:
        raise NotFound(f"The model `{name}` does not exist.", "model")
    if kind == "chat":
        tokens = render_chat(_check_messages(body), body.get("tools"))
    else:
        tokens = render_completion(_check_prompt(body))
    max_tokens = _count(body, "max_tokens", 1)
    if kind == "chat":
        max_tokens = _count(body, "max_completion_tokens", 1) or max_tokens
    if _count(body, "n", 1) not in (None, 1):
        raise BadRequest("n > 1 is not supported by the emulator.", "n")
    stream_options = _optional(body, "stream_options", dict, {})
    include_usage = stream_options.get("include_usage")  # type: ignore[union-attr]
    if include_usage is not None and not isinstance(include_usage, bool):
        raise ValidationError("stream_options.include_usage", "must be bool")
    if len(tokens) + (max_tokens or 1) > max_model_len:
        raise BadRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{len(tokens) + (max_tokens or 1)} tokens ({len(tokens)} in the messages, "
            f"{max_tokens or 1} in the completion). Please reduce the length of the messages or completion.")
    return CompletionRequest(
        kind=kind, tokens=tokens,
        stream=bool(_optional(body, "stream", bool, False)),
        max_tokens=max_tokens,
        min_tokens=_count(body, "min_tokens", 0) or 0,
        ignore_eos=bool(_optional(body, "ignore_eos", bool, False)),
        include_usage=bool(include_usage),
        kv_transfer_params=_optional(body, "kv_transfer_params", dict),  # type: ignore[arg-type]
    )


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens}


class Framer:
    """The bytes of one response; per-token chunks are pre-serialised so a token is two concatenations."""

    def __init__(self, kind: str, response_id: str, model: str, created: int) -> None:
        self.chat = kind == "chat"
        self.head = {"id": response_id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                     "created": created, "model": model}
        open_head = dumps(self.head)[:-1]  # '{"id":...,"model":"..."' awaiting more keys
        if self.chat:
            self._pre = b"data: " + open_head + b',"choices":[{"index":0,"delta":{"content":'
            self._post = b'},"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n'
        else:
            self._pre = b"data: " + open_head + b',"choices":[{"index":0,"text":'
            self._post = b',"logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'
        # Chat replies start bare ("w1 w2"); completions continue the prompt (" w1 w2").
        self._first = BARE_JSON if self.chat else SPACED_JSON

    def piece(self, index: int, word: str) -> str:
        return word if self.chat and index == 0 else " " + word

    def token(self, index: int, word: str) -> bytes:
        return self._pre + (self._first if index == 0 else SPACED_JSON)[word] + self._post

    def _event(self, extra: dict) -> bytes:
        return b"data: " + dumps({**self.head, **extra}) + b"\n\n"

    def role(self) -> bytes:
        return self._event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}],
                            "prompt_token_ids": None})

    def finish(self, text: str, finish_reason: str, params: dict | None = None) -> bytes:
        """The last token's chunk, carrying finish_reason (and D's params when placed "final")."""
        if self.chat:
            choice = {"index": 0, "delta": {"content": text}, "logprobs": None,
                      "finish_reason": finish_reason, "stop_reason": None, "token_ids": None}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                      "stop_reason": None}
        extra: dict = {"choices": [choice]}
        if params is not None:
            extra["kv_transfer_params"] = params
        return self._event(extra)

    def usage(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        return self._event({"choices": [], "usage": usage(prompt_tokens, completion_tokens)})

    @staticmethod
    def params_only(params: dict) -> bytes:
        # Shaped like the fake D chunk in vLLM's test_disagg_proxy_multiturn.py.
        return b"data: " + dumps({"kv_transfer_params": params}) + b"\n\n"

    @staticmethod
    def error(envelope: dict) -> bytes:
        return b"data: " + dumps(envelope) + b"\n\n"

    def body(self, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int,
             params: dict | None) -> bytes:
        """The non-streaming response: one line, null fields included, top-level kv_transfer_params."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None,
                                              "annotations": None, "audio": None, "function_call": None,
                                              "reasoning_content": None},
                      "logprobs": None, "finish_reason": finish_reason, "stop_reason": None,
                      "token_ids": None}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                      "stop_reason": None, "prompt_logprobs": None, "token_ids": None}
            obj = "text_completion"
        body = {**self.head, "object": obj, "choices": [choice], "service_tier": None,
                "system_fingerprint": None,
                "usage": {**usage(prompt_tokens, completion_tokens), "prompt_tokens_details": None},
                "prompt_logprobs": None, "prompt_token_ids": None, "kv_transfer_params": params}
        return dumps(body)
