"""The OpenAI surface as vLLM serves it: request validation, and response bodies and SSE chunks as
bytes.

A little over 300 lines: every byte a client sees mirrors one vLLM serving module
(serving_chat/serving_completion), and keeping them together keeps the mirror checkable.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Protocol, TypeVar, overload

from .errors import BadRequest, NotFound
from .tokens import BARE_JSON, SPACED_JSON, TEXT_PARTS, Template, render_completion

T = TypeVar("T")


class AnyFramer(Protocol):
    """What app.py's stream and body ask of a route's framer: `Framer` (chat and completions),
    anthropic.MessagesFramer, responses.ResponsesFramer. A protocol, so that this module names
    none of the others (they import it)."""

    chat: bool
    reports_cached: bool
    cuts_after_error: bool

    def fast(self, delta: dict) -> bytes | None: ...

    def chunk(
        self,
        delta: dict,
        token_ids: list[int] | None = None,
        finish_reason: str | None = None,
        extra: dict | None = None,
    ) -> bytes: ...

    def role(self, prompt_token_ids: list[int] | None = None) -> bytes: ...

    def tail(
        self,
        gen,
        include_usage: bool,
        prompt_tokens: int,
        cached: int | None,
        params: dict | None,
        placement: str,
    ) -> bytes: ...

    def fail(self, envelope: dict) -> bytes: ...

    def body(
        self,
        gen,
        prompt_tokens: int,
        params: dict | None,
        prompt_token_ids: list[int] | None = None,
        output_token_ids: list[int] | None = None,
        cached: int | None = None,
    ) -> bytes: ...


DONE = b"data: [DONE]\n\n"


def dumps(value: object) -> bytes:
    """Compact one-line JSON, as vLLM's model_dump_json / JSONResponse produce."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


class ValidationError(BadRequest):
    """A field-level problem, shaped like vLLM's request validation errors."""

    type = "Bad Request"

    def __init__(self, param: str, problem: str) -> None:
        where = f"body.{param}" if param else "body"  # "": a model validator's error
        super().__init__(f"1 validation error: {where}: {problem}", where)


@dataclass
class CompletionRequest:
    """What the engine needs from a chat or completions body; unknown fields were accepted and
    dropped."""

    kind: str  # "chat" or "completion"
    tokens: list[str]
    stream: bool
    max_tokens: int | None
    min_tokens: int
    ignore_eos: bool
    include_usage: bool
    kv_transfer_params: dict | None
    return_token_ids: bool = False
    tool_names: list[str] = field(
        default_factory=list
    )  # tools the model may call (tool_choice not "none")
    thinking: bool = True  # chat_template_kwargs.enable_thinking is not false
    include_reasoning: bool = True
    cache_salt: str | None = None


@overload
def optional(body: dict, name: str, kind: type[T]) -> T | None: ...
@overload
def optional(body: dict, name: str, kind: type[T], default: T) -> T: ...
def optional(body: dict, name: str, kind: type[T], default: T | None = None) -> T | None:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValidationError(name, f"must be {kind.__name__}, got {type(value).__name__}")
    return value


def _count(body: dict, name: str, minimum: int) -> int | None:
    value = optional(body, name, int)
    if value is not None and value < minimum:
        raise ValidationError(name, f"must be >= {minimum}, got {value}")
    return value


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
                    raise ValidationError(
                        f"{where}.content.{j}", "must be an object with a string type"
                    )
                if part["type"] in TEXT_PARTS and not isinstance(part.get("text"), str):
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
        prompt = prompt[
            0
        ]  # vLLM also takes a batch; one prompt is the only batch the emulator serves
    if prompt is None:
        raise ValidationError("prompt", "Field required")
    if not isinstance(prompt, str):
        raise ValidationError("prompt", "must be a string (token ids and batches are not emulated)")
    if not prompt.split():
        raise BadRequest("The prompt cannot be empty.", "prompt")
    return prompt


def json_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"Invalid JSON body: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.", "body")
    return body


def check_model(body: dict, model: str) -> None:
    name = optional(body, "model", str)
    if name is not None and name != model:
        raise NotFound(f"The model `{name}` does not exist.", "model")


def render_body(kind: str, body: dict, template: Template) -> list[str]:
    """The prompt tokens a chat or completions body renders to (as /tokenize reports them)."""
    if kind != "chat":
        return render_completion(_check_prompt(body))
    add_generation_prompt = optional(body, "add_generation_prompt", bool, True)
    continue_final_message = optional(body, "continue_final_message", bool, False)
    if add_generation_prompt and continue_final_message and "add_generation_prompt" in body:
        raise BadRequest(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        )
    kwargs = optional(body, "chat_template_kwargs", dict, {})
    effort = optional(body, "reasoning_effort", str)
    return template.render(
        _check_messages(body),
        body.get("tools"),
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        kwargs=kwargs,
        reasoning_effort=effort,
    )


def _truncate(body: dict, tokens: list[str], max_model_len: int) -> list[str]:
    """vLLM's truncate_prompt_tokens keeps the last k tokens (left truncation; -1: the context)."""
    k = optional(body, "truncate_prompt_tokens", int)
    if k is None:
        return tokens
    if k == -1:
        k = max_model_len
    if k < 1:
        raise ValidationError("truncate_prompt_tokens", f"must be >= 1 or -1, got {k}")
    return tokens[-k:]


def _tool_names(body: dict) -> list[str]:
    if body.get("tool_choice") == "none" or not isinstance(body.get("tools"), list):
        return []
    return [
        t["function"]["name"]
        for t in body["tools"]
        if isinstance(t, dict)
        and isinstance(t.get("function"), dict)
        and isinstance(t["function"].get("name"), str)
    ]


def parse_request(
    kind: str, raw: bytes, model: str, max_model_len: int, template: Template = Template()
) -> CompletionRequest:
    """Validate a /v1/chat/completions (kind "chat") or /v1/completions body; raise the 400/404 vLLM
    would."""
    return request_from_body(kind, json_body(raw), model, max_model_len, template)


def request_from_body(
    kind: str, body: dict, model: str, max_model_len: int, template: Template = Template()
) -> CompletionRequest:
    """parse_request on a decoded body; the Anthropic and Responses routes, which vLLM turns into
    chat requests, come in here with the chat body they convert to."""
    check_model(body, model)
    tokens = _truncate(body, render_body(kind, body, template), max_model_len)
    max_tokens = _count(body, "max_tokens", 1)
    if kind == "chat":
        max_tokens = _count(body, "max_completion_tokens", 1) or max_tokens
    if _count(body, "n", 1) not in (None, 1):
        raise BadRequest("n > 1 is not supported by the emulator.", "n")
    stream_options = optional(body, "stream_options", dict, {})
    include_usage = stream_options.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise ValidationError("stream_options.include_usage", "must be bool")
    if len(tokens) + (max_tokens or 1) > max_model_len:
        raise BadRequest(
            f"This model's maximum context length is {max_model_len} tokens. "
            f"However, you requested {len(tokens) + (max_tokens or 1)} tokens "
            f"({len(tokens)} in the messages, {max_tokens or 1} in the completion). "
            f"Please reduce the length of the messages or completion."
        )
    kwargs = optional(body, "chat_template_kwargs", dict, {})
    return CompletionRequest(
        kind=kind,
        tokens=tokens,
        stream=bool(optional(body, "stream", bool, False)),
        max_tokens=max_tokens,
        min_tokens=_count(body, "min_tokens", 0) or 0,
        ignore_eos=bool(optional(body, "ignore_eos", bool, False)),
        include_usage=bool(include_usage),
        kv_transfer_params=optional(body, "kv_transfer_params", dict),
        return_token_ids=bool(optional(body, "return_token_ids", bool, False)),
        tool_names=_tool_names(body) if kind == "chat" else [],
        thinking=kwargs.get("enable_thinking") is not False,
        include_reasoning=bool(optional(body, "include_reasoning", bool, True)),
        cache_salt=optional(body, "cache_salt", str),
    )


@dataclass
class Call:
    """A generating request as a route hands it to the engine: the request, the engine's request
    id (before vLLM's random suffix) and the framer that writes the reply."""

    req: CompletionRequest
    request_id: str
    framer: AnyFramer


def chat_call(
    kind: str,
    raw: bytes,
    xid: str,
    model: str,
    max_model_len: int,
    template: Template,
    reasoning_field: str,
) -> Call:
    """/v1/chat/completions and /v1/completions: ids from X-Request-Id
    (serve/engine/serving.py:133-142)."""
    req = parse_request(kind, raw, model, max_model_len, template)
    response_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{xid}"
    return Call(
        req, response_id, Framer(kind, response_id, model, int(time.time()), reasoning_field)
    )


def parse_tokenize(raw: bytes, model: str, max_model_len: int, template: Template) -> list[str]:
    """POST /tokenize: a chat form (messages, ...) or a completion form (prompt); vLLM's fields."""
    body = json_body(raw)
    check_model(body, model)
    return render_body("chat" if "messages" in body else "completion", body, template)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }


# A content delta of a vocabulary word, bare or spaced, pre-serialised: the streaming hot path.
CONTENT_JSON: dict[str, bytes] = {
    **{w: v for w, v in BARE_JSON.items()},
    **{" " + w: v for w, v in SPACED_JSON.items()},
}


class Framer:
    """The bytes of one response; plain content chunks are pre-serialised (two concatenations).

    app.py's stream and body call the same methods on the Anthropic and Responses framers
    (anthropic.py, responses.py), which turn the chat chunks into their own events as vLLM's
    converters do."""

    reports_cached = False  # cached_tokens only with --enable-prompt-tokens-details

    def __init__(
        self,
        kind: str,
        response_id: str,
        model: str,
        created: int,
        reasoning_field: str = "reasoning",
    ) -> None:
        self.chat = kind == "chat"
        self.reasoning_field = reasoning_field
        self.head = {
            "id": response_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": created,
            "model": model,
        }
        open_head = dumps(self.head)[:-1]  # '{"id":...,"model":"..."' awaiting more keys
        if self.chat:
            self._pre = b"data: " + open_head + b',"choices":[{"index":0,"delta":{"content":'
            self._post = b'},"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n'
        else:
            self._pre = b"data: " + open_head + b',"choices":[{"index":0,"text":'
            self._post = b',"logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'

    def fast(self, delta: dict) -> bytes | None:
        """The pre-serialised chunk of a plain vocabulary-word delta, or None."""
        piece = delta.get("content" if self.chat else "text")
        if piece is None or len(delta) != 1:
            return None
        encoded = CONTENT_JSON.get(piece)
        return None if encoded is None else self._pre + encoded + self._post

    def _reasoning(self, delta: dict) -> dict:
        """vLLM names reasoning `reasoning` (now) or `reasoning_content` (before PR #27752), or
        sends both during the deprecation window."""
        if "reasoning" not in delta or self.reasoning_field == "reasoning":
            return delta
        text = delta["reasoning"]
        out = {k: v for k, v in delta.items() if k != "reasoning"}
        out["reasoning_content"] = text
        if self.reasoning_field == "both":
            out["reasoning"] = text
        return out

    def chunk(
        self,
        delta: dict,
        token_ids: list[int] | None = None,
        finish_reason: str | None = None,
        extra: dict | None = None,
    ) -> bytes:
        """One streamed chunk: a chat delta ({} for a token a parser swallowed) or a completions
        text."""
        if self.chat:
            choice = {
                "index": 0,
                "delta": self._reasoning(delta),
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        else:
            choice = {
                "index": 0,
                "text": delta.get("text", ""),
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        if finish_reason is not None or not self.chat:
            choice["stop_reason"] = None
        if self.chat or token_ids is not None:
            choice["token_ids"] = token_ids
        if extra and "choice" in extra:
            choice.update(extra["choice"])
        out: dict = {"choices": [choice]}
        if extra and "params" in extra:
            out["kv_transfer_params"] = extra["params"]
        return self._event(out)

    def _event(self, extra: dict) -> bytes:
        return b"data: " + dumps({**self.head, **extra}) + b"\n\n"

    def role(self, prompt_token_ids: list[int] | None = None) -> bytes:
        return self._event(
            {
                "choices": [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
                "prompt_token_ids": prompt_token_ids,
            }
        )

    def usage(self, prompt_tokens: int, completion_tokens: int, cached: int | None = None) -> bytes:
        """The trailing usage chunk (serialised without nulls); `cached` with
        --enable-prompt-tokens-details."""
        details = {} if cached is None else {"prompt_tokens_details": {"cached_tokens": cached}}
        return self._event(
            {"choices": [], "usage": {**usage(prompt_tokens, completion_tokens), **details}}
        )

    @staticmethod
    def params_only(params: dict) -> bytes:
        # Shaped like the fake D chunk in vLLM's test_disagg_proxy_multiturn.py.
        return b"data: " + dumps({"kv_transfer_params": params}) + b"\n\n"

    def tail(
        self,
        gen,
        include_usage: bool,
        prompt_tokens: int,
        cached: int | None,
        params: dict | None,
        placement: str,
    ) -> bytes:
        """What follows the finish chunk: [usage chunk], [params chunk under `separate`], [DONE]."""
        out = self.usage(prompt_tokens, gen.completion_tokens, cached) if include_usage else b""
        if params is not None and placement == "separate":
            out += self.params_only(params)
        return out + DONE

    @staticmethod
    def error(envelope: dict) -> bytes:
        return b"data: " + dumps(envelope) + b"\n\n"

    # A failure after the headers: the error event, then [DONE] (serving.py's stream generator).
    cuts_after_error = False

    def fail(self, envelope: dict) -> bytes:
        return self.error(envelope) + DONE

    def body(
        self,
        gen,
        prompt_tokens: int,
        params: dict | None,
        prompt_token_ids: list[int] | None = None,
        output_token_ids: list[int] | None = None,
        cached: int | None = None,
    ) -> bytes:
        """The non-streaming response: one line, null fields included, top-level
        kv_transfer_params."""
        if self.chat:
            message = {
                "role": "assistant",
                "content": gen.content,
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                **self._reasoning({"reasoning": gen.reasoning}),
            }
            if gen.tool_calls:
                message["tool_calls"] = gen.tool_calls
            choice = {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": gen.finish_reason,
                "stop_reason": None,
                "token_ids": output_token_ids,
            }
            obj = "chat.completion"
            top_prompt_ids = prompt_token_ids
        else:
            choice = {
                "index": 0,
                "text": gen.content,
                "logprobs": None,
                "finish_reason": gen.finish_reason,
                "stop_reason": None,
                "prompt_logprobs": None,
                "prompt_token_ids": prompt_token_ids,
                "token_ids": output_token_ids,
            }
            obj = "text_completion"
            top_prompt_ids = None
        body = {
            **self.head,
            "object": obj,
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": None,
            "usage": {
                **usage(prompt_tokens, gen.completion_tokens),
                "prompt_tokens_details": None if cached is None else {"cached_tokens": cached},
            },
            "prompt_logprobs": None,
            "prompt_token_ids": top_prompt_ids,
            "kv_transfer_params": params,
        }
        return dumps(body)
