"""What D produced in one turn (its KV params, how it finished, the reply a client will echo,
its token ids), folded from streamed chunks or a whole body: the next turn's identity."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

PARAMS_KEY = "kv_transfer_params"
# The engine finished normally (vLLM's FINISHED_STOPPED or _LENGTH_CAPPED, for which D keeps its
# blocks); "tool_calls" is a stop the serving layer renamed because the parser found a call.
REUSABLE_FINISH = frozenset({"stop", "length", "tool_calls"})
# Where vLLM puts token ids with return_token_ids: chat on the first chunk / body top level,
# completions on the choice; generated ids on each choice.
PROMPT_IDS, OUTPUT_IDS = "prompt_token_ids", "token_ids"


@dataclass
class Decoded:
    """What D produced for one turn: its KV params, how it finished, the reply to echo."""

    params: Any = None
    finish_reasons: list = field(default_factory=list)
    text: list = field(default_factory=list)  # content (chat) or text (completions)
    reasoning: list = field(default_factory=list)
    tool_calls: dict = field(default_factory=dict)  # index -> call, arguments concatenated
    choices: set = field(default_factory=set)
    done: bool = False  # [DONE] seen (stream) or body complete
    error: bool = False
    stored: bool = False  # the entry for the next turn was put
    kept: bool = False  # ...and D's params with it
    prompt_ids: list | None = None  # D's token ids, when it returned them
    output_ids: list | None = None
    strip_ids: bool = False  # the gateway asked for them, not the client
    prompt_tokens: int | None = None  # as P (or D's whole body) reported them
    completion_tokens: int | None = None  # as D's whole body reported them

    @property
    def reusable(self) -> bool:
        """Only a single-choice turn that completed with stop/length leaves usable blocks."""
        return (
            self.done
            and not self.error
            and self.choices <= {0}
            and bool(self.finish_reasons)
            and all(r in REUSABLE_FINISH for r in self.finish_reasons)
        )

    def reply_message(self) -> dict:
        """The assistant message as a client will echo it in the next request."""
        message: dict = {"role": "assistant", "content": "".join(self.text)}
        if self.tool_calls:
            message["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        return message

    def reply_text(self) -> str:
        return "".join(self.text)

    def take_ids(self, holder: dict) -> bool:
        """Collect token ids from a chunk, body or choice; null them if the client did not ask.
        True if `holder` changed."""
        if PROMPT_IDS not in holder and OUTPUT_IDS not in holder:
            return False  # every chunk of a turn whose ids nobody asked for
        changed = False
        for key in (PROMPT_IDS, OUTPUT_IDS):
            ids = holder.get(key)
            if not isinstance(ids, list):
                continue
            if key == PROMPT_IDS:
                self.prompt_ids = ids
            else:
                if self.output_ids is None:
                    self.output_ids = list(ids)
                else:
                    self.output_ids.extend(ids)  # per chunk: never re-copy the reply so far
            if self.strip_ids:
                holder[key] = None
                changed = True
        return changed

    def add_choice(self, choice: dict, delta_key: str) -> None:
        """Fold one choice of a chunk (delta_key "delta") or of a whole body ("message")."""
        self.choices.add(choice.get("index", 0))
        finish = choice.get("finish_reason")
        if finish:
            self.finish_reasons.append(finish)
        if "text" in choice:
            self.text.append(choice["text"] or "")
        part = choice.get(delta_key)
        if not part:
            return
        content = part.get("content")
        if content:
            self.text.append(content if isinstance(content, str) else json.dumps(content))
        reasoning = part.get("reasoning_content") or part.get("reasoning")
        if reasoning:
            self.reasoning.append(reasoning)
        calls = part.get("tool_calls")
        if calls:
            for call in calls:
                self._add_tool_call(call)

    def _add_tool_call(self, call: dict) -> None:
        index = call.get("index", len(self.tool_calls))
        known = self.tool_calls.setdefault(
            index, {"id": None, "type": "function", "function": {"name": None, "arguments": ""}}
        )
        known["id"] = call.get("id") or known["id"]
        known["type"] = call.get("type") or known["type"]
        function = call.get("function") or {}
        known["function"]["name"] = function.get("name") or known["function"]["name"]
        known["function"]["arguments"] += function.get("arguments") or ""

    def absorb_chunk(self, chunk: dict) -> bool:
        """Record one streamed chunk, taking out its params (and the ids the client did not
        ask for). True if `chunk` changed."""
        return self._absorb(chunk, "delta")

    def absorb_body(self, body: dict) -> dict:
        """Record a non-streamed reply and return it without the params."""
        self._absorb(body, "message")
        usage = body.get("usage")
        if isinstance(usage, dict):
            self.prompt_tokens = _count(usage.get("prompt_tokens"), self.prompt_tokens)
            self.completion_tokens = _count(usage.get("completion_tokens"), None)
        self.done = True
        return body

    def tokens(self, prompt_estimate: int) -> int:
        """The turn's prompt and reply tokens as the engines reported them; a streamed reply
        without usage counts its deltas (vLLM streams a token, or a few, per delta)."""
        completion = self.completion_tokens
        if completion is None:
            completion = len(self.text) + len(self.reasoning) + len(self.tool_calls)
        prompt = self.prompt_tokens if self.prompt_tokens is not None else prompt_estimate
        return prompt + completion

    def _absorb(self, holder: dict, part_key: str) -> bool:
        changed = self.take_ids(holder)
        for choice in holder.get("choices") or ():
            if isinstance(choice, dict):
                self.add_choice(choice, part_key)
                changed |= self.take_ids(choice)
        if PARAMS_KEY in holder:
            self.params = holder.pop(PARAMS_KEY)
            changed = True
        return changed


def _count(value: object, default: int | None) -> int | None:
    return (
        value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else default
    )
