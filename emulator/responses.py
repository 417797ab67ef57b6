"""The OpenAI Responses API as vLLM 0.33 serves it for a model that is not gpt-oss: `input` items
rendered as chat messages, the reply as output items or their event stream, and the in-memory
store behind `store`, `previous_response_id`, GET and cancel, which is one engine's and off by
default (VLLM_ENABLE_RESPONSES_API_STORE).

Paths below are under vllm/entrypoints/openai/responses/ of vLLM 0.33.0.
"""

from __future__ import annotations

import time
import uuid

from .errors import BadRequest, NotFound, NotImplementedByEmulator
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
from .tokens import END_THINK, THINK, Template


def random_uuid() -> str:
    return uuid.uuid4().hex  # vllm.utils.random_uuid


class ResponseNotFound(NotFound):
    """_make_not_found_error (serving.py:1206-1212)."""

    type = "invalid_request_error"

    def __init__(self, response_id: str) -> None:
        super().__init__(f"Response with id '{response_id}' not found.", "response_id")


class InvalidRequest(BadRequest):
    type = "invalid_request_error"


class ResponseStore:
    """OpenAIServingResponses' response_store and msg_store (serving.py:162-191): every stored
    response and the chat messages it was rendered from, in memory, never removed."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.responses: dict[str, dict] = {}
        self.messages: dict[str, list[dict]] = {}

    def get(self, response_id: str) -> dict:
        if response_id not in self.responses:
            raise ResponseNotFound(response_id)
        return self.responses[response_id]

    def cancel(self, response_id: str) -> dict:
        """cancel_responses (serving.py:1177-1204): only a background response that has not
        finished can be cancelled, and the emulator runs none in the background."""
        response = self.get(response_id)
        if response["status"] not in ("queued", "in_progress"):
            raise InvalidRequest("Cannot cancel a synchronous response.", "response_id")
        response["status"] = "cancelled"
        return response


# --- the request --------------------------------------------------------------------------------


def _text(content: object) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and isinstance(content[0], dict):
        return content[0].get("text")
    return None


def _item_message(item: object, prev: dict | None) -> dict | None:
    """_construct_message_from_response_item (utils.py:326-457): a new chat message, or None when
    the item was merged into the previous assistant message."""
    if not isinstance(item, dict):
        raise ValidationError("input", "Input should be a valid dictionary")
    kind = item.get("type")
    assistant = prev if prev is not None and prev.get("role") == "assistant" else None
    if kind == "function_call":
        if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
            raise ValidationError("input", "function_call needs call_id, name and arguments")
        call = {
            "id": item["call_id"],
            "function": {"name": item["name"], "arguments": item["arguments"]},
            "type": "function",
        }
        if assistant is not None:
            assistant.setdefault("tool_calls", []).append(call)
            return None
        return {"role": "assistant", "tool_calls": [call]}
    if kind == "reasoning":
        if item.get("encrypted_content"):
            raise InvalidRequest("Encrypted content is not supported.", "input")
        parts = item.get("content") or item.get("summary") or []
        reasoning = parts[0].get("text", "") if parts and isinstance(parts[0], dict) else ""
        if assistant is not None and assistant.get("reasoning") is None:
            assistant["reasoning"] = reasoning
            return None
        return {"role": "assistant", "reasoning": reasoning}
    if kind in ("function_call_output", "custom_tool_call_output"):
        return {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
    if item.get("role") == "assistant":
        text = _text(item.get("content"))
        if text is not None:
            if assistant is not None and assistant.get("content") is None:
                assistant["content"] = text
                return None
            return {"role": "assistant", "content": text}
    if "role" in item:
        return item  # a user, system or developer message goes to the template as it is
    raise InvalidRequest(f"Unsupported input item type: {kind}", "input")


def input_messages(
    instructions: str | None,
    request_input: str | list,
    prev_messages: list[dict] | None,
    prev_output: list[dict] | None,
) -> list[dict]:
    """construct_input_messages (utils.py:263-305): instructions, the previous request's messages
    less their system ones, the previous reply's message items (reasoning and function calls are
    skipped), then this input."""
    messages: list[dict] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    messages += [dict(m) for m in prev_messages or () if m.get("role") != "system"]
    for item in prev_output or ():
        if item.get("type") == "message":
            messages += [
                {"role": "assistant", "content": part.get("text")} for part in item["content"]
            ]
    if isinstance(request_input, str):
        messages.append({"role": "user", "content": request_input})
        return messages
    new: list[dict] = []
    for item in request_input:
        message = _item_message(item, new[-1] if new else None)
        if message is not None:
            new.append(message)
    return messages + new


def _continues_final(request_input: str | list) -> bool:
    """should_continue_final_message (utils.py:216-260)."""
    if (
        isinstance(request_input, str)
        or not request_input
        or not isinstance(request_input[-1], dict)
    ):
        return False
    last = request_input[-1]
    return last.get("type", "message") in ("message", "reasoning") and last.get("status") in (
        "in_progress",
        "incomplete",
    )


def _tool_choice(body: dict) -> object:
    """check_tool_usage (protocol.py:830-867)."""
    choice = body.get("tool_choice", "auto")
    named = isinstance(choice, dict) and choice.get("type") in ("function", "custom")
    if body.get("tools"):
        if named and choice.get("name") not in {t.get("name") for t in body["tools"]}:
            raise ValidationError(
                "tool_choice", "Tool choice 'function' not found in 'tools' parameter."
            )
        return choice
    if choice in ("auto", "none"):
        return "none"
    if choice == "required":
        raise ValidationError(
            "tool_choice", "Tool choice 'required' must be specified with 'tools' parameter."
        )
    if named:
        raise ValidationError(
            "tool_choice", "Tool choice 'function' not found in 'tools' parameter."
        )
    return choice


class Parsed:
    """A Responses request as the emulator runs it: the chat body vLLM renders, and what the
    response object echoes."""

    def __init__(self, body: dict) -> None:
        """ResponsesRequest's validation (protocol.py:246-867); unknown fields are accepted."""
        if body.get("input") is None:
            raise ValidationError("input", "Field required")
        if not isinstance(body["input"], (str, list)):
            raise ValidationError("input", "Input should be a valid string or a valid list")
        for name, kind in (
            ("instructions", str),
            ("previous_response_id", str),
            ("max_output_tokens", int),
            ("store", bool),
            ("stream", bool),
            ("background", bool),
            ("tools", list),
            ("kv_transfer_params", dict),
            ("request_id", str),
            ("include_reasoning", bool),
        ):
            optional(body, name, kind)
        if body.get("prompt") is not None:  # protocol.py:691-700
            raise ValidationError("prompt", "prompt template is not supported")
        if body.get("background") and body.get("store", True) is False:  # protocol.py:677-689
            raise ValidationError("background", "background can only be used when `store` is true")
        self.body = body
        self.tool_choice = _tool_choice(body)
        self.response_id = body.get("request_id") or f"resp_{random_uuid()}"  # protocol.py:357-364
        self.store = False
        self.messages: list[dict] = []

    def resolve(self, store: ResponseStore) -> None:
        """_create_responses after the model check (serving.py:339-383): the store's rules, and
        the history previous_response_id names."""
        body = self.body
        if body.get("background"):
            # serving.py:265-277 without the store; with it vLLM runs the request as a task,
            # which the emulator does not.
            if not store.enabled:
                raise InvalidRequest(
                    "This vLLM engine does not support `store=True` and therefore does not support "
                    "the background mode. To enable these features, set the environment variable "
                    "`VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server.",
                    "background",
                )
            raise NotImplementedByEmulator("background mode is not emulated")
        # store=True without VLLM_ENABLE_RESPONSES_API_STORE is dropped silently
        # (serving.py:355-362).
        self.store = bool(body.get("store", True)) and store.enabled
        prev_id = body.get("previous_response_id")
        prev = store.get(prev_id) if prev_id is not None else None  # serving.py:364-372
        self.messages = input_messages(
            body.get("instructions"),
            body["input"],
            store.messages.get(prev_id) if prev and prev_id is not None else None,
            prev["output"] if prev else None,
        )

    def chat_body(self, max_tokens: int | None) -> dict:
        """The chat request vLLM's renderer builds (online_renderer.py:329-392;
        protocol.py:482-523): tools flattened to chat tools (utils.py:489-514), reasoning.effort as
        reasoning_effort."""
        body = self.body
        chat: dict = {
            "model": body.get("model"),
            "messages": self.messages,
            "stream": bool(body.get("stream")),
            "max_tokens": max_tokens,
            "kv_transfer_params": body.get("kv_transfer_params"),
            "cache_salt": body.get("cache_salt"),
            "include_reasoning": body.get("include_reasoning", True),
        }
        tools = [
            {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
            for t in body.get("tools") or ()
            if isinstance(t, dict) and t.get("type") == "function"
        ]
        if tools:
            chat.update(tools=tools, tool_choice=self.tool_choice)
        kwargs = dict(body.get("chat_template_kwargs") or {})
        effort = (body.get("reasoning") or {}).get("effort")
        if effort is not None:
            chat["reasoning_effort"] = effort
            kwargs.setdefault("enable_thinking", effort != "none")
        if kwargs:
            chat["chat_template_kwargs"] = kwargs
        if _continues_final(body["input"]):
            chat.update(add_generation_prompt=False, continue_final_message=True)
        return chat


# --- the reply ----------------------------------------------------------------------------------


def _event(payload: dict) -> bytes:
    """_convert_stream_to_sse_events (api_router.py:34-45)."""
    return b"event: " + payload["type"].encode() + b"\ndata: " + dumps(payload) + b"\n\n"


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"  # utils.py:103-107


def _message(item_id: str, text: str, status: str, logprobs: object = None) -> dict:
    content = (
        [{"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}]
        if text
        else []
    )
    return {
        "id": item_id,
        "content": content,
        "role": "assistant",
        "status": status,
        "type": "message",
    }


def _reasoning(item_id: str, text: str | None, status: str | None) -> dict:
    content = None if text is None else [{"text": text, "type": "reasoning_text"}]
    return {
        "id": item_id,
        "summary": [],
        "type": "reasoning",
        "content": content,
        "encrypted_content": None,
        "status": status,
    }


def _call(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {
        "arguments": arguments,
        "call_id": call_id,
        "name": name,
        "type": "function_call",
        "id": item_id,
        "namespace": None,
        "status": status,
    }


def reasoning_tokens(tokens: list[str]) -> int:
    """count_reasoning_tokens (reasoning/basic_parsers.py:178-196): tokens between the markers."""
    inside = count = 0
    for token in tokens:
        if token == THINK:
            inside += 1
        elif token == END_THINK:
            inside = max(0, inside - 1)
        elif inside:
            count += 1
    return count


class ResponsesFramer:
    """The bytes of one Responses reply: responses_full_generator's response (serving.py:770-950)
    or the stream of SimpleStreamingEventProcessor (streaming_events.py:1237-1380; serving.py:
    1214-1291, 1343-1457). kv_transfer_params ride on the response object: the body, the stored
    response, and the response.completed / response.incomplete event that ends a stream; the
    response.created and response.in_progress events, built before the engine finishes, carry
    null."""

    chat = True  # the role chunk's place: response.created, response.in_progress
    reports_cached = True  # usage.input_tokens_details.cached_tokens always (context.py:204, 220)
    # A failure mid-stream is a GenerationError whose `{"error": ...}` JSON vLLM then validates as
    # a stream event (serving.py:1418-1423); that raises, and the stream breaks off unterminated.
    cuts_after_error = True

    def __init__(
        self,
        parsed: Parsed,
        req: CompletionRequest,
        store: ResponseStore,
        model: str,
        max_model_len: int,
    ) -> None:
        self.parsed, self.store, self.model = parsed, store, model
        self.created = int(time.time())
        # sampling_params.max_tokens: the request's, capped by what the context leaves
        # (serving.py:429-442; serve/utils/api_utils.py:234-270).
        self.max_output_tokens = (
            req.max_tokens if req.max_tokens is not None else max_model_len - len(req.tokens)
        )
        self.sequence = 0
        self.started = False
        self.items: list[dict] = []  # output items closed so far
        self.state: str | None = None  # "content", "reasoning", "tool_call" or None
        self.item_id = ""
        self.text = ""
        self.call: dict = {}
        self.finish_reason: str | None = None
        if parsed.store:
            store.messages[parsed.response_id] = parsed.messages  # serving.py:540-542

    def response(
        self, status: str, output: list[dict], usage: dict | None, params: dict | None
    ) -> dict:
        """ResponsesResponse.from_request (protocol.py:966-1031), dumped with its nulls."""
        body = self.parsed.body
        return {
            "id": self.parsed.response_id,
            "created_at": self.created,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": body.get("instructions"),
            "metadata": body.get("metadata"),
            "model": self.model,
            "object": "response",
            "output": output,
            "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
            "temperature": body.get("temperature") if body.get("temperature") is not None else 1.0,
            "tool_choice": self.parsed.tool_choice,
            "tools": body.get("tools") or [],
            "top_p": body.get("top_p") if body.get("top_p") is not None else 1.0,
            "background": False,
            "max_output_tokens": self.max_output_tokens,
            "max_tool_calls": body.get("max_tool_calls"),
            "previous_response_id": body.get("previous_response_id"),
            "prompt": None,
            "prompt_cache_options": body.get("prompt_cache_options"),
            "prompt_cache_key": body.get("prompt_cache_key"),
            "prompt_cache_retention": body.get("prompt_cache_retention"),
            "reasoning": body.get("reasoning"),
            "safety_identifier": body.get("safety_identifier"),
            "service_tier": body.get("service_tier", "auto"),
            "status": status,
            "text": body.get("text"),
            "top_logprobs": None,
            "truncation": body.get("truncation") or "disabled",
            "usage": usage,
            "user": body.get("user"),
            "presence_penalty": body.get("presence_penalty") or 0.0,
            "frequency_penalty": body.get("frequency_penalty") or 0.0,
            "kv_transfer_params": params,
            "ec_transfer_params": None,
            "input_messages": None,
            "output_messages": None,
        }

    def _usage(self, gen, prompt_tokens: int, cached: int | None) -> dict:
        """serving.py:883-920; cache writes (cache_write_tokens) are not emulated: 0."""
        return {
            "input_tokens": prompt_tokens,
            "input_tokens_details": {
                "cached_tokens": cached or 0,
                "cache_write_tokens": 0,
                "input_tokens_per_turn": [],
                "cached_tokens_per_turn": [],
            },
            "output_tokens": gen.completion_tokens,
            "output_tokens_details": {
                "reasoning_tokens": reasoning_tokens(gen.tokens),
                "tool_output_tokens": 0,
                "output_tokens_per_turn": [],
                "tool_output_tokens_per_turn": [],
            },
            "total_tokens": prompt_tokens + gen.completion_tokens,
        }

    def _finished(self, response: dict) -> dict:
        if self.parsed.store:  # serving.py:944-949
            self.store.responses[response["id"]] = response
        return response

    # --- stream -----------------------------------------------------------------------------

    def _emit(self, payload: dict) -> bytes:
        payload["sequence_number"] = self.sequence
        self.sequence += 1
        return _event(payload)

    def role(self, prompt_token_ids: list[int] | None = None) -> bytes:
        self.started = True
        initial = self.response("in_progress", [], None, None)
        return self._emit(
            {"response": initial, "sequence_number": 0, "type": "response.created"}
        ) + self._emit({"response": initial, "sequence_number": 0, "type": "response.in_progress"})

    @staticmethod
    def fast(delta: dict) -> None:
        return None

    def _open(self, state: str, call: dict | None = None) -> bytes:
        """emit_simple_*_open (streaming_events.py:835-869, 957-984, 1047-1092)."""
        self.state, self.text = state, ""
        index = len(self.items)
        if state == "content":
            self.item_id = f"msg_{random_uuid()}"
            return self._emit(
                {
                    "item": {
                        "id": self.item_id,
                        "content": [],
                        "role": "assistant",
                        "status": "in_progress",
                        "type": "message",
                    },
                    "output_index": index,
                    "sequence_number": 0,
                    "type": "response.output_item.added",
                }
            ) + self._emit(
                {
                    "content_index": 0,
                    "item_id": self.item_id,
                    "output_index": index,
                    "part": {"annotations": [], "text": "", "type": "output_text", "logprobs": []},
                    "sequence_number": 0,
                    "type": "response.content_part.added",
                }
            )
        if state == "reasoning":
            self.item_id = f"rs_{random_uuid()}"
            return self._emit(
                {
                    "item": _reasoning(self.item_id, None, "in_progress"),
                    "output_index": index,
                    "sequence_number": 0,
                    "type": "response.output_item.added",
                }
            ) + self._emit(
                {
                    "content_index": 0,
                    "item_id": self.item_id,
                    "output_index": index,
                    "part": {"text": "", "type": "reasoning_text"},
                    "sequence_number": 0,
                    "type": "response.content_part.added",
                }
            )
        assert call is not None, "a tool_call state opens with its call"
        self.item_id = f"fc_{random_uuid()}"
        self.call = {"call_id": call["id"], "name": call["function"]["name"]}
        return self._emit(
            {
                "item": _call(
                    self.item_id, self.call["call_id"], self.call["name"], "", "in_progress"
                ),
                "output_index": index,
                "sequence_number": 0,
                "type": "response.output_item.added",
            }
        )

    def _close(self, status: str = "completed") -> bytes:
        """emit_simple_*_done (streaming_events.py:911-954, 1004-1044, 1137-1194)."""
        index, item_id, text = len(self.items), self.item_id, self.text
        if self.state is None:
            return b""
        if self.state == "content":
            part: dict = {"annotations": [], "text": text, "type": "output_text", "logprobs": None}
            item = {**_message(item_id, text, status), "content": [part] if text else []}
            out = self._emit(
                {
                    "content_index": 0,
                    "item_id": item_id,
                    "logprobs": [],
                    "output_index": index,
                    "sequence_number": 0,
                    "text": text,
                    "type": "response.output_text.done",
                }
            ) + self._emit(
                {
                    "content_index": 0,
                    "item_id": item_id,
                    "output_index": index,
                    "part": part,
                    "sequence_number": 0,
                    "type": "response.content_part.done",
                }
            )
        elif self.state == "reasoning":
            item = _reasoning(item_id, text, status)
            out = self._emit(
                {
                    "content_index": 0,
                    "item_id": item_id,
                    "output_index": index,
                    "sequence_number": 0,
                    "text": text,
                    "type": "response.reasoning_text.done",
                }
            ) + self._emit(
                {
                    "content_index": 0,
                    "item_id": item_id,
                    "output_index": index,
                    "part": {"text": text, "type": "reasoning_text"},
                    "sequence_number": 0,
                    "type": "response.content_part.done",
                }
            )
        else:
            item = _call(item_id, self.call["call_id"], self.call["name"], text, status)
            out = self._emit(
                {
                    "arguments": text,
                    "item_id": item_id,
                    "name": self.call["name"],
                    "output_index": index,
                    "sequence_number": 0,
                    "type": "response.function_call_arguments.done",
                }
            )
        self.items.append(item)
        self.state = None
        return out + self._emit(
            {
                "item": item,
                "output_index": index,
                "sequence_number": 0,
                "type": "response.output_item.done",
            }
        )

    def chunk(
        self,
        delta: dict,
        token_ids: list[int] | None = None,
        finish_reason: str | None = None,
        extra: dict | None = None,
    ) -> bytes:
        """One chat delta through the state machine: tool call, then reasoning, then content
        (resolve_target_state, streaming_events.py:1279-1297); an empty delta emits nothing."""
        if finish_reason is not None:
            self.finish_reason = finish_reason
        calls = delta.get("tool_calls")
        if calls and calls[0].get("function") is not None:
            out = (
                self._close() + self._open("tool_call", calls[0])
                if self.state != "tool_call"
                else b""
            )
            arguments = "".join(
                c["function"].get("arguments") or "" for c in calls if c.get("function")
            )
            if not arguments:
                return out
            self.text += arguments
            return out + self._emit(
                {
                    "delta": arguments,
                    "item_id": self.item_id,
                    "output_index": len(self.items),
                    "sequence_number": 0,
                    "type": "response.function_call_arguments.delta",
                }
            )
        if delta.get("reasoning") is not None:
            out = self._close() + self._open("reasoning") if self.state != "reasoning" else b""
            self.text += delta["reasoning"]
            return out + self._emit(
                {
                    "content_index": 0,
                    "delta": delta["reasoning"],
                    "item_id": self.item_id,
                    "output_index": len(self.items),
                    "sequence_number": 0,
                    "type": "response.reasoning_text.delta",
                }
            )
        if delta.get("content"):
            out = self._close() + self._open("content") if self.state != "content" else b""
            self.text += delta["content"]
            return out + self._emit(
                {
                    "content_index": 0,
                    "delta": delta["content"],
                    "item_id": self.item_id,
                    "logprobs": [],
                    "output_index": len(self.items),
                    "sequence_number": 0,
                    "type": "response.output_text.delta",
                }
            )
        return b""

    def tail(
        self,
        gen,
        include_usage: bool,
        prompt_tokens: int,
        cached: int | None,
        params: dict | None,
        placement: str,
    ) -> bytes:
        """The open item closed, then the whole response: response.completed, or
        response.incomplete after a length finish (serving.py:1425-1457)."""
        out = self._close(_status(self.finish_reason))
        status = _status(self.finish_reason)
        usage = self._usage(gen, prompt_tokens, cached)
        response = self._finished(self.response(status, list(self.items), usage, params))
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return out + self._emit({"response": response, "sequence_number": 0, "type": kind})

    def fail(self, envelope: dict) -> bytes:
        return b"" if self.started else self.role()

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
        """build_response_output_items (utils.py:110-191): reasoning, message, function calls;
        the last item's status follows the finish reason."""
        last = _status(gen.finish_reason)
        output: list[dict] = []
        if gen.reasoning:
            output.append(_reasoning(f"rs_{random_uuid()}", gen.reasoning, None))
        if gen.content:
            output.append(
                _message(
                    f"msg_{random_uuid()}", gen.content, "completed" if gen.tool_calls else last
                )
            )
        for i, call in enumerate(gen.tool_calls or ()):
            output.append(
                _call(
                    f"fc_{random_uuid()}",
                    call["id"],
                    call["function"]["name"],
                    call["function"]["arguments"],
                    last if i == len(gen.tool_calls) - 1 else "completed",
                )
            )
        usage = self._usage(gen, prompt_tokens, cached)
        return dumps(self._finished(self.response(last, output, usage, params)))


def responses_call(
    raw: bytes, store: ResponseStore, model: str, max_model_len: int, template: Template
) -> Call:
    """POST /v1/responses (api_router.py:48-77): the response id is the body's request_id or
    resp_<uuid>, never X-Request-Id; the engine's request id adds "_0" (serving.py:666-667)."""
    parsed = Parsed(json_body(raw))
    check_model(parsed.body, model)  # serving.py:335-338
    parsed.resolve(store)
    n = len(render_body("chat", parsed.chat_body(None), template))
    if n >= max_model_len:  # serving.py:232-253
        raise InvalidRequest(
            f"The engine prompt length {n} exceeds the max_model_len {max_model_len}. "
            "Please reduce prompt.",
            "input",
        )
    limit = parsed.body.get("max_output_tokens")
    max_tokens = None if limit is None else min(limit, max_model_len - n)
    req = request_from_body("chat", parsed.chat_body(max_tokens), model, max_model_len, template)
    return Call(
        req, f"{parsed.response_id}_0", ResponsesFramer(parsed, req, store, model, max_model_len)
    )
