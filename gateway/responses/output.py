"""A chat completion's reply as a Responses reply: a whole body as the Response object, a stream
of chat chunks as the Responses events in OpenAI's order, a failure mid-stream as a final
`response.failed`.

The items and their order follow vLLM 0.33.0's (vllm/entrypoints/openai/responses/utils.py
build_response_output_items L110-191: reasoning, message, function calls; the last item
`incomplete` after a length finish, L103-107), the stream its SimpleStreamingEventProcessor's
(streaming_events.py L835-1380, serving.py L1343-1457).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator

from gateway.support import jsonio
from gateway.support.errors import GatewayError


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def message_item(item_id: str, text: str, status: str) -> dict:
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def reasoning_item(item_id: str, text: str) -> dict:
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": None,
    }


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def usage_of(usage: dict | None) -> dict | None:
    """Chat usage as Responses usage (serving.py L883-920)."""
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens") or 0, usage.get("completion_tokens") or 0
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": usage.get("total_tokens") or prompt + completion,
    }


class Shape:
    """The response object of one request, as its fields are echoed (ResponsesResponse
    .from_request, protocol.py L966-1031)."""

    def __init__(
        self, body: dict, response_id: str, model: str | None, tool_choice: object
    ) -> None:
        self.body, self.id, self.model = body, response_id, model
        self.tool_choice = tool_choice
        self.created_at = int(time.time())

    def response(
        self, status: str, output: list[dict], usage: dict | None = None, error: dict | None = None
    ) -> dict:
        body = self.body
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": error,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "instructions": body.get("instructions"),
            "model": self.model or body.get("model"),
            "output": output,
            "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
            "previous_response_id": body.get("previous_response_id"),
            "max_output_tokens": body.get("max_output_tokens"),
            "reasoning": body.get("reasoning"),
            "store": body.get("store", True) is not False,
            "temperature": body.get("temperature", 1.0),
            "top_p": body.get("top_p", 1.0),
            "text": body.get("text") or {"format": {"type": "text"}},
            "tool_choice": self.tool_choice,
            "tools": body.get("tools") or [],
            "truncation": body.get("truncation") or "disabled",
            "usage": usage,
            "user": body.get("user"),
            "metadata": body.get("metadata") or {},
            "background": False,
            "service_tier": body.get("service_tier", "auto"),
        }


def response_of(shape: Shape, completion: dict) -> dict:
    """A whole chat completion as the Response object."""
    choice = (completion.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    finish = choice.get("finish_reason")
    last = _status(finish)
    output: list[dict] = []
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    if reasoning:
        output.append(reasoning_item(new_id("rs"), reasoning))
    calls = message.get("tool_calls") or []
    if message.get("content"):
        output.append(
            message_item(new_id("msg"), message["content"], "completed" if calls else last)
        )
    for i, call in enumerate(calls):
        function = call.get("function") or {}
        output.append(
            call_item(
                new_id("fc"),
                call.get("id") or new_id("call"),
                function.get("name") or "",
                function.get("arguments") or "",
                last if i == len(calls) - 1 else "completed",
            )
        )
    shape.model = completion.get("model") or shape.model
    return shape.response(last, output, usage_of(completion.get("usage")))


def data_events(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """The `data:` payloads of an SSE byte stream, however its bytes were cut."""
    buffer = b""
    for chunk in chunks:
        buffer += chunk
        while True:
            end = buffer.find(b"\n\n")
            if end < 0:
                break
            event, buffer = buffer[:end], buffer[end + 2 :]
            data = [
                line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")
            ]
            if data:
                yield b"\n".join(data)


class EventStream:
    """Chat chunks in, Responses events out: created and in_progress first, then each output
    item opened, its deltas, closed; last response.completed (or response.incomplete after a
    length finish), or response.failed when the chat stream ended in an error event.

    `finished(response)` is called with the whole response before its terminal event goes
    out: the response is kept before the client can name it in its next request."""

    def __init__(self, shape: Shape, finished: Callable[[dict], None]) -> None:
        self.shape, self.finished = shape, finished
        self.sequence = 0
        self.items: list[dict] = []
        self.open: dict | None = None  # the item being streamed
        self.call_index: int | None = None  # the chat tool call index it streams
        self.finish_reason: str | None = None
        self.usage: dict | None = None

    def _event(self, kind: str, **fields: object) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + jsonio.dumps(payload) + b"\n\n"

    def start(self) -> bytes:
        initial = self.shape.response("in_progress", [])
        return self._event("response.created", response=initial) + self._event(
            "response.in_progress", response=initial
        )

    def _open(self, item: dict) -> bytes:
        out = self._close()
        self.open = item
        index = len(self.items)
        added = {**item, "status": "in_progress"}
        if item["type"] == "message":
            added["content"] = []
        elif item["type"] == "reasoning":
            added["content"] = []
        out += self._event("response.output_item.added", output_index=index, item=added)
        if item["type"] == "message":
            out += self._event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
            )
        elif item["type"] == "reasoning":
            out += self._event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part={"type": "reasoning_text", "text": ""},
            )
        return out

    def _close(self, status: str = "completed") -> bytes:
        item, index = self.open, len(self.items)
        if item is None:
            return b""
        self.open = None
        out = b""
        if item["type"] == "message":
            part = item["content"][0]
            item["status"] = status
            out += self._event(
                "response.output_text.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                text=part["text"],
                logprobs=[],
            )
            out += self._event(
                "response.content_part.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=part,
            )
        elif item["type"] == "reasoning":
            part = item["content"][0]
            out += self._event(
                "response.reasoning_text.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                text=part["text"],
            )
            out += self._event(
                "response.content_part.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=part,
            )
        else:
            item["status"] = status
            out += self._event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                name=item["name"],
                arguments=item["arguments"],
            )
        self.items.append(item)
        return out + self._event("response.output_item.done", output_index=index, item=item)

    def chunk(self, chunk: dict) -> bytes:
        """One chat chunk's events (none for a role or an empty delta)."""
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        self.shape.model = chunk.get("model") or self.shape.model
        out = b""
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
            out += self._delta(choice.get("delta") or {})
        return out

    def _delta(self, delta: dict) -> bytes:
        out = b""
        reasoning = delta.get("reasoning") or delta.get("reasoning_content")
        if reasoning:
            if self.open is None or self.open["type"] != "reasoning":
                out += self._open(reasoning_item(new_id("rs"), ""))
            assert self.open is not None  # open, or `_open` opened it
            self.open["content"][0]["text"] += reasoning
            out += self._event(
                "response.reasoning_text.delta",
                item_id=self.open["id"],
                output_index=len(self.items),
                content_index=0,
                delta=reasoning,
            )
        if delta.get("content"):
            text = delta["content"]
            if self.open is None or self.open["type"] != "message":
                out += self._open(message_item(new_id("msg"), "", "in_progress"))
            assert self.open is not None  # open, or `_open` opened it
            self.open["content"][0]["text"] += text
            out += self._event(
                "response.output_text.delta",
                item_id=self.open["id"],
                output_index=len(self.items),
                content_index=0,
                delta=text,
                logprobs=[],
            )
        for call in delta.get("tool_calls") or ():
            function = call.get("function") or {}
            index = call.get("index", 0)
            if (
                self.open is None
                or self.open["type"] != "function_call"
                or self.call_index != index
            ):
                out += self._open(
                    call_item(
                        new_id("fc"),
                        call.get("id") or new_id("call"),
                        function.get("name") or "",
                        "",
                        "in_progress",
                    )
                )
                self.call_index = index
            assert self.open is not None  # open, or `_open` opened it
            arguments = function.get("arguments") or ""
            if arguments:
                self.open["arguments"] += arguments
                out += self._event(
                    "response.function_call_arguments.delta",
                    item_id=self.open["id"],
                    output_index=len(self.items),
                    delta=arguments,
                )
        return out

    def done(self) -> bytes:
        """The open item closed and the terminal event, the whole response in it."""
        status = _status(self.finish_reason)
        out = self._close(status)
        response = self.shape.response(status, self.items, usage_of(self.usage))
        self.finished(response)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return out + self._event(kind, response=response)

    def failed(self, error: dict) -> bytes:
        """A failure after the first byte: OpenAI's `error` event, then `response.failed`."""
        code = str(error.get("code") or error.get("type") or "server_error")
        message = error.get("message") or "The response failed"
        return self._event(
            "error", code=code, message=message, param=error.get("param")
        ) + self._event(
            "response.failed",
            response=self.shape.response(
                "failed",
                self.items,
                usage_of(self.usage),
                error={"code": "server_error", "message": message},
            ),
        )

    def convert(self, chunks: Iterator[bytes]) -> Iterator[bytes]:
        """The whole conversion of a chat stream's bytes."""
        yield self.start()
        for data in data_events(chunks):
            if data == b"[DONE]":
                yield self.done()
                return
            try:
                chunk = jsonio.loads_engine(data)
            except ValueError:
                continue
            if not isinstance(chunk, dict):
                continue
            if isinstance(chunk.get("error"), dict):
                yield self.failed(chunk["error"])
                return
            out = self.chunk(chunk)
            if out:
                yield out
        # Ended with neither [DONE] nor an error event (a forwarded stream cut short).
        yield self.failed(
            GatewayError("the stream ended before it was complete", status=502).envelope()["error"]
        )
