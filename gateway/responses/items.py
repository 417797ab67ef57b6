"""A Responses request (`POST /v1/responses`) as the chat completion request vLLM renders from it:
`instructions`, the previous response's history and `input` items as chat messages, the options
as chat options; anything a client can get wrong a 400 naming the field.

Rendering follows vLLM 0.33.0's own route, vllm/entrypoints/openai/responses/utils.py
(construct_input_messages L263-305, _construct_message_from_response_item L326-457), so P and D
render the prompt vLLM's /v1/responses would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.parse import MAX_DEPTH
from gateway.support import jsonio
from gateway.support.errors import BadRequest

RESPONSES = "/v1/responses"

# Copied to the chat request as they are: chat options of the same name and meaning (vLLM's
# ResponsesRequest.to_sampling_params, protocol.py L482-523, and its vLLM-only fields), and the
# gateway's own conversation_id.
_AS_IS = (
    "model",
    "temperature",
    "top_p",
    "parallel_tool_calls",
    "user",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
    "cache_salt",
    "priority",
    "include_reasoning",
    "chat_template_kwargs",
    "conversation_id",
)
# Echoed on the response object and otherwise without effect on the engines.
_ECHOED = (
    "metadata",
    "service_tier",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "include",
    "truncation",
    "top_logprobs",
    "max_tool_calls",
    "text",
    "reasoning",
    "tool_choice",
    "tools",
    "store",
    "stream",
    "stream_options",
    "instructions",
    "input",
    "previous_response_id",
    "max_output_tokens",
    "background",
)
KNOWN = frozenset(_AS_IS + _ECHOED)


@dataclass
class ResponsesRequest:
    """A validated request: its body, what the response echoes, and whether it is kept."""

    body: dict
    store: bool
    stream: bool
    previous_response_id: str | None


def _check(ok: object, param: str, message: str) -> None:
    if not ok:
        raise BadRequest(message, param=param)


def _optional(body: dict, name: str, kind: type | tuple, what: str) -> None:
    value = body.get(name)
    if value is not None:
        _check(
            isinstance(value, kind) and not (kind is int and isinstance(value, bool)),
            name,
            f"'{name}' must be {what}",
        )


def parse_request(raw: bytes) -> ResponsesRequest:
    """Validate a Responses body; raises BadRequest naming the field (OpenAI's 400s)."""
    try:
        body = jsonio.loads(raw, MAX_DEPTH)
    except jsonio.TooDeep as exc:
        raise BadRequest(f"Request body {exc}") from exc
    except (ValueError, RecursionError) as exc:
        raise BadRequest(f"Request body is not valid JSON: {exc}"[:300]) from exc
    _check(isinstance(body, dict), "body", "Request body must be a JSON object")
    unknown = sorted(set(body) - KNOWN)
    _check(
        not unknown,
        unknown[0] if unknown else "",
        f"Unrecognized request argument supplied: {', '.join(unknown)}",
    )
    _check(body.get("input") is not None, "input", "'input' is required")
    _check(
        isinstance(body["input"], str)
        or (
            isinstance(body["input"], list)
            and body["input"]
            and all(isinstance(i, dict) for i in body["input"])
        ),
        "input",
        "'input' must be a string or a non-empty list of items",
    )
    for name, kind, what in (
        ("model", str, "a string"),
        ("instructions", str, "a string"),
        ("previous_response_id", str, "a string"),
        ("store", bool, "a boolean"),
        ("stream", bool, "a boolean"),
        ("background", bool, "a boolean"),
        ("max_output_tokens", int, "an integer"),
        ("tools", list, "a list of tools"),
        ("metadata", dict, "an object"),
        ("reasoning", dict, "an object"),
        ("text", dict, "an object"),
        ("conversation_id", str, "a string"),
    ):
        _optional(body, name, kind, what)
    # vLLM runs `background` only with its store on (serving.py L265-277), as a task of its
    # own; the gateway's turns run while their client waits.
    _check(
        not body.get("background"), "background", "background mode is not supported by this gateway"
    )
    _check(
        body.get("truncation") in (None, "disabled"),
        "truncation",
        "only truncation 'disabled' is supported",
    )
    for i, tool in enumerate(body.get("tools") or ()):
        _check(
            isinstance(tool, dict)
            and tool.get("type") == "function"
            and isinstance(tool.get("name"), str),
            f"tools.{i}",
            "only function tools (type 'function' with a name) are supported",
        )
    fmt = (body.get("text") or {}).get("format")
    _check(
        fmt is None
        or (isinstance(fmt, dict) and fmt.get("type") in ("text", "json_object", "json_schema")),
        "text.format",
        "'text.format' must be of type text, json_object or json_schema",
    )
    previous = body.get("previous_response_id")
    return ResponsesRequest(
        body=body,
        store=body.get("store", True) is not False,
        stream=bool(body.get("stream")),
        previous_response_id=previous,
    )


# --- input items as chat messages (utils.py L308-457) --------------------------------------------


def _part(part: Any) -> Any:
    """input_text and output_text parts are text to vLLM's chat parser
    (vllm/renderers/chat_utils/chat_message.py L105-106, L343): plain text parts here, so the
    history digests the same whichever way a client spells it."""
    if isinstance(part, dict) and part.get("type") in ("input_text", "output_text"):
        return {"type": "text", "text": part.get("text")}
    return part


def _text_of(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and isinstance(content[0], dict):
        return content[0].get("text")
    return None


def _message(item: dict, prev: dict | None, where: str) -> dict | None:
    """One item as a new chat message, or None when it joined the assistant message before it
    (_construct_message_from_response_item, utils.py L326-457)."""
    kind = item.get("type")
    assistant = prev if prev is not None and prev.get("role") == "assistant" else None
    if kind == "function_call":
        _check(
            all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")),
            where,
            f"'{where}': a function_call needs call_id, name and arguments strings",
        )
        call = {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        if assistant is not None:
            assistant.setdefault("tool_calls", []).append(call)
            return None
        return {"role": "assistant", "tool_calls": [call]}
    if kind == "reasoning":
        _check(not item.get("encrypted_content"), where, "Encrypted content is not supported.")
        parts = item.get("content") or item.get("summary") or []
        reasoning = (
            parts[0].get("text") or ""
            if isinstance(parts, list) and parts and isinstance(parts[0], dict)
            else ""
        )
        if assistant is not None and assistant.get("reasoning") is None:
            assistant["reasoning"] = reasoning
            return None
        return {"role": "assistant", "reasoning": reasoning}
    if kind in ("function_call_output", "custom_tool_call_output"):
        _check(
            isinstance(item.get("call_id"), str),
            where,
            f"'{where}': a {kind} needs a call_id string",
        )
        output = item.get("output")
        return {
            "role": "tool",
            "tool_call_id": item["call_id"],
            "content": [_part(p) for p in output] if isinstance(output, list) else output,
        }
    role = item.get("role")
    if kind not in (None, "message") or not isinstance(role, str):
        raise BadRequest(f"Unsupported input item type: {kind}", param=where)
    content: Any = item.get("content")  # a string or a list of parts, once checked
    _check(
        isinstance(content, str)
        or (isinstance(content, list) and all(isinstance(p, dict) for p in content)),
        f"{where}.content",
        f"'{where}.content' must be a string or a list of parts",
    )
    if role == "assistant":
        text = _text_of(content)
        if text is not None:
            if assistant is not None and assistant.get("content") is None:
                assistant["content"] = text
                return None
            return {"role": "assistant", "content": text}
    # vLLM hands the item to the template as it is (utils.py L451-452): its role and content
    # are what render (an item's id, type and status are not).
    message = {
        "role": role,
        "content": content if isinstance(content, str) else [_part(p) for p in content],
    }
    if isinstance(item.get("name"), str):
        message["name"] = item["name"]
    return message


def item_messages(items: list[dict], where: str = "input") -> list[dict]:
    """Items as chat messages (construct_chat_messages_with_tool_call, utils.py L308-323)."""
    messages: list[dict] = []
    for i, item in enumerate(items):
        message = _message(item, messages[-1] if messages else None, f"{where}.{i}")
        if message is not None:
            messages.append(message)
    return messages


def input_messages(request: ResponsesRequest, previous: dict | None) -> list[dict]:
    """The chat messages of this turn (construct_input_messages, utils.py L263-305): the
    instructions as a system message; the previous request's messages less their system ones
    (instructions do not carry over, L281-284); the previous reply; then this input.

    vLLM adds only the previous reply's message items (L285-296, its reasoning and function
    calls left out); here the whole reply is rendered as a client that sends its items back
    gets it (L326-457: reasoning and function calls joined to the assistant message), as
    OpenAI's previous_response_id means: otherwise a function_call_output answers a call the
    prompt never made, and a template that renders the last turn's reasoning sees a prompt
    that D's blocks (which hold both) do not begin, so they could never be read.
    """
    body = request.body
    messages: list[dict] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": body["instructions"]})
    if previous is not None:
        messages += [m for m in previous["messages"] if m.get("role") != "system"]
        messages += item_messages(previous["response"]["output"], "previous_response_id")
    if isinstance(body["input"], str):
        messages.append({"role": "user", "content": body["input"]})
    else:
        messages += item_messages(body["input"])
    return messages


def _continues_final(request_input: Any) -> bool:
    """should_continue_final_message (utils.py L216-260): a partial assistant message last."""
    if isinstance(request_input, str) or not request_input:
        return False
    last = request_input[-1]
    return last.get("type", "message") in ("message", "reasoning") and last.get("status") in (
        "in_progress",
        "incomplete",
    )


def tool_choice(body: dict) -> Any:
    """The request's tool_choice as vLLM checks it (protocol.py L830-867): 'none' without
    tools; 'required' or a named tool without them is a 400."""
    choice = body.get("tool_choice", "auto")
    named = isinstance(choice, dict) and choice.get("type") == "function"
    if body.get("tools"):
        if named:
            _check(
                choice.get("name") in {t.get("name") for t in body["tools"]},
                "tool_choice",
                "Tool choice 'function' not found in 'tools' parameter.",
            )
        else:
            _check(
                choice in ("auto", "none", "required"),
                "tool_choice",
                "'tool_choice' must be auto, none, required or a function",
            )
        return choice
    _check(
        choice in ("auto", "none"),
        "tool_choice",
        "Tool choice 'required' must be specified with 'tools' parameter."
        if choice == "required"
        else "Tool choice 'function' not found in 'tools' parameter.",
    )
    return "none"


def chat_body(request: ResponsesRequest, messages: list[dict]) -> dict:
    """The chat completion request P and D get: vLLM's renderer's inputs (online_renderer.py
    L329-392): the messages, the function tools flattened to chat tools (utils.py L489-514),
    reasoning.effort as reasoning_effort; max_output_tokens as max_tokens."""
    body = request.body
    chat: dict = {name: body[name] for name in _AS_IS if body.get(name) is not None}
    chat["messages"] = messages
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    choice = tool_choice(body)
    tools = [
        {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
        for t in body.get("tools") or ()
    ]
    if tools:
        chat["tools"] = tools
        chat["tool_choice"] = (
            choice
            if not isinstance(choice, dict)
            else {"type": "function", "function": {"name": choice["name"]}}
        )
    effort = (body.get("reasoning") or {}).get("effort")
    if effort is not None:
        chat["reasoning_effort"] = effort
    fmt = (body.get("text") or {}).get("format") or {}
    if fmt.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif fmt.get("type") == "json_schema":
        chat["response_format"] = {
            "type": "json_schema",
            "json_schema": {
                k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt
            },
        }
    if _continues_final(body["input"]):
        chat.update(add_generation_prompt=False, continue_final_message=True)
    if request.stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}  # for response.completed's usage
    return chat
