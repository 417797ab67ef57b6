"""Prompt tokens, token ids and the chat template, with the template behaviours real models have.

A token is a whitespace-separated word. The default template keeps the prefix property a P/D
gateway leans on: render(history) + the reply's tokens is a prefix of render(history + reply +
more). Real templates break it in ways this module can switch on per engine (`QUIRKS`), so a
gateway's exactness can be tested against what real models do, not against its own assumption.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from functools import lru_cache

EOS = "<|end|>"  # ends every rendered message, and is the token a reply stops with
GENERATION_PROMPT = "<|assistant|>"
THINK, END_THINK = "<think>", "</think>"  # Qwen3 / DeepSeek-R1 reasoning markers
TOOL_CALL, END_TOOL_CALL = "<tool_call>", "</tool_call>"  # Hermes / Qwen tool-call markers

# Plain lowercase words so a reply is easy to read in logs and never contains a template marker.
VOCAB: tuple[str, ...] = tuple(
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
    "oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu amber basil "
    "cedar dune ember fern grove harbor island jasper kelp lagoon meadow nectar orchid pebble "
    "quartz river saffron thistle umber valley willow yarrow zephyr acorn brook clover dawn "
    "elm frost glade heath iris juniper".split()
)

# Pre-serialised JSON strings for the streaming hot path: a token costs a dict lookup.
BARE_JSON: dict[str, bytes] = {w: json.dumps(w).encode() for w in VOCAB}
SPACED_JSON: dict[str, bytes] = {w: json.dumps(" " + w).encode() for w in VOCAB}

# Template behaviours that break the prefix property, each as a real template does it:
QUIRKS = {
    # Qwen3, QwQ, DeepSeek-R1: an assistant turn's reasoning is rendered only after the last user
    # message (inside a tool-call loop); earlier turns lose it, while D's KV holds the <think> span.
    "drop_reasoning": "reasoning of assistant turns before the last user message is not rendered",
    # Hermes/Qwen templates render a tool call from the parsed JSON arguments (vLLM parses the
    # arguments string into a dict for the template): the layout differs from the generated text.
    "tool_json": "tool calls are re-rendered from parsed JSON in another layout than generated",
    # Qwen3 with chat_template_kwargs {"enable_thinking": false}: the generation prompt ends with an
    # empty <think></think>, which earlier assistant turns are rendered without.
    "empty_think": "enable_thinking=false puts an empty think block in the generation prompt only",
    # Mistral/Mixtral templates: the system prompt is rendered inside the last user message, so
    # every turn rewrites text the previous turn's KV holds.
    "system_last": "the system prompt is rendered in the last user message",
}


@lru_cache(maxsize=1 << 16)
def token_id(token: str) -> int:
    """A stable id per token string, the same in every process (31-bit, like a vocabulary index)."""
    return int.from_bytes(hashlib.blake2b(token.encode(), digest_size=4).digest(), "big") >> 1


def token_ids(tokens) -> list[int]:
    return [token_id(t) for t in tokens]


TEXT_PARTS = ("text", "input_text", "output_text")


def content_words(content: str | list[dict] | None) -> list[str]:
    """Words of a message's content: a string, or a list of parts (text parts give their words)."""
    if content is None:
        return []
    if isinstance(content, str):
        return content.split()
    words: list[str] = []
    for part in content:  # validated upstream: a list of objects with a string "type"
        # vLLM's chat parser takes the Responses API's text parts as text (chat_message.py:105, 343)
        if part.get("type") in TEXT_PARTS:
            words.extend(part.get("text", "").split())
        else:
            words.append(f"<|{part['type']}|>")
    return words


def _json_words(value: object) -> list[str]:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).split()


def generated_call_text(name: str, arguments: dict) -> str:
    """A tool call as the model writes it: spaced JSON (also how vLLM's parser re-serialises
    the arguments: json.dumps with default separators)."""
    return json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)


def _reasoning_of(message: dict) -> str | None:
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    return reasoning if isinstance(reasoning, str) and reasoning.strip() else None


@dataclass(frozen=True)
class Template:
    """The chat template of one engine: the default plus any of `QUIRKS`."""

    quirks: frozenset = frozenset()

    def render(
        self,
        messages: list[dict],
        tools: object = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        kwargs: dict | None = None,
        reasoning_effort: str | None = None,
    ) -> list[str]:
        """Tokens of ``[<|tools|> json <|end|>] (<|role|> [name=N] [<think> r </think>] words
        [<tool_call> json </tool_call>]... [tool_call_id=ID] <|end|>)* <|assistant|>``."""
        q, kwargs = self.quirks, kwargs or {}
        tokens: list[str] = []
        if tools:
            tokens += ["<|tools|>", *_json_words(tools), EOS]
        if reasoning_effort is not None:
            tokens += ["<|effort|>", str(reasoning_effort), EOS]  # as gpt-oss's system header
        users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
        last_user = users[-1] if users else -1
        system = [
            w
            for m in messages
            if m.get("role") == "system"
            for w in content_words(m.get("content"))
        ]
        last = len(messages) - 1
        for i, message in enumerate(messages):
            role = message["role"]
            if "system_last" in q and role == "system":
                continue
            tokens.append(f"<|{role}|>")
            if message.get("name"):
                tokens.append(f"name={message['name']}")
            reasoning = _reasoning_of(message) if role == "assistant" else None
            if reasoning and not ("drop_reasoning" in q and i < last_user):
                tokens += [THINK, *reasoning.split(), END_THINK]
            if "system_last" in q and i == last_user:
                tokens += system
            tokens += content_words(message.get("content"))
            for call in message.get("tool_calls") or ():
                tokens += self._call(call)
            if message.get("tool_call_id"):
                tokens.append(f"tool_call_id={message['tool_call_id']}")
            if not (continue_final_message and i == last):
                tokens.append(EOS)
        if add_generation_prompt and not continue_final_message:
            tokens.append(GENERATION_PROMPT)
            if "empty_think" in q and kwargs.get("enable_thinking") is False:
                tokens += [THINK, END_THINK]
        return tokens

    def _call(self, call: object) -> list[str]:
        function = (call.get("function") if isinstance(call, dict) else None) or {}
        name, arguments = function.get("name"), function.get("arguments")
        if "tool_json" in self.quirks:
            try:
                parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
            except ValueError:
                parsed = arguments
            return [TOOL_CALL, *_json_words({"name": name, "arguments": parsed}), END_TOOL_CALL]
        # The arguments string verbatim, wrapped as the model writes it.
        return [
            TOOL_CALL,
            *f'{{"name": {json.dumps(name)}, "arguments": {arguments}}}'.split(),
            END_TOOL_CALL,
        ]


DEFAULT_TEMPLATE = Template()


def render_chat(messages: list[dict], tools: object = None) -> list[str]:
    """The default template (which keeps the prefix property)."""
    return DEFAULT_TEMPLATE.render(messages, tools)


def render_completion(prompt: str) -> list[str]:
    """Tokens of a completions prompt: its whitespace-separated words, nothing added."""
    return prompt.split()


def _rng(tokens: list[str], salt: str = "") -> random.Random:
    text = "\n".join(tokens) if not salt else salt + "\n" + "\n".join(tokens)
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "big"))


def generate(tokens: list[str], count: int) -> list[str]:
    """The `count` words an engine replies to `tokens` with; deterministic across processes."""
    rng = _rng(tokens)
    return [VOCAB[rng.randrange(len(VOCAB))] for _ in range(count)]


def reply_text(kind: str, words: list[str]) -> str:
    """The reply as the client sees it: chat "w1 w2", completions " w1 w2" (appended to the
    prompt)."""
    text = " ".join(words)
    return text if kind == "chat" else (" " + text if words else "")


@dataclass
class Generation:
    """What a model generated for one request, token by token, and how vLLM's parsers show it.

    `tokens` are the generated tokens (EOS not included); `deltas[i]` is what a stream shows for
    token i: a delta dict, or None when the reasoning or tool parser swallows the token (vLLM then
    sends no chunk, so that token's id never reaches the client either).
    """

    tokens: list[str]
    deltas: list[dict | None]
    stopped: bool  # ended with EOS (else cut by max_tokens)
    reasoning: str | None = None
    content: str | None = None
    tool_calls: list | None = None

    @property
    def finish_reason(self) -> str:
        if not self.stopped:
            return "length"
        return "tool_calls" if self.tool_calls else "stop"

    @property
    def completion_tokens(self) -> int:
        # A stop is the model sampling EOS: a token, counted in usage, whose text is empty.
        return len(self.tokens) + self.stopped


def _unit(tokens: list[str], salt: str) -> float:
    return _rng(tokens, salt).random()


def generate_chat(
    prompt: list[str],
    count: int,
    stopped: bool,
    *,
    reasoning_share: float = 0.0,
    tool_names: list[str] | None = None,
    tool_call_share: float = 0.0,
) -> Generation:
    """The reply to a chat prompt: `count` content words, after a reasoning span for a
    `reasoning_share` of prompts; or, for a `tool_call_share` of prompts with tools, one tool
    call. `stopped=False` cuts the whole sequence at `count` tokens (max_tokens)."""
    words = generate(prompt, count)
    tokens: list[str] = []
    deltas: list[dict | None] = []
    reasoning = None
    if reasoning_share and _unit(prompt, "reasoning") < reasoning_share:
        thought = generate(prompt + ["<|reasoning|>"], max(2, count // 2))
        tokens += [THINK, *thought, END_THINK]
        deltas += [
            None,
            *({"reasoning": w if i == 0 else " " + w} for i, w in enumerate(thought)),
            None,
        ]
        reasoning = " ".join(thought)
    if tool_names and tool_call_share and _unit(prompt, "tool") < tool_call_share:
        arguments = {"query": words[0] if words else VOCAB[0], "limit": len(prompt) % 7 + 1}
        call_words = [
            TOOL_CALL,
            *generated_call_text(tool_names[0], arguments).split(),
            END_TOOL_CALL,
        ]
        digest = hashlib.blake2b(" ".join(prompt).encode(), digest_size=16).hexdigest()
        call = {
            "id": f"chatcmpl-tool-{digest}",
            "type": "function",
            "function": {
                "name": tool_names[0],
                "arguments": json.dumps(arguments, ensure_ascii=False),
            },
        }
        if stopped or len(tokens) + len(call_words) <= count:
            # The parser holds the call back until its JSON is complete, then sends it whole.
            tokens += call_words
            deltas += [None] * (len(call_words) - 2) + [
                {"tool_calls": [{"index": 0, **call}]},
                None,
            ]
            return Generation(tokens, deltas, True, reasoning, None, [call])
    content_start = len(tokens)
    tokens += words
    deltas += [{"content": w if i == 0 else " " + w} for i, w in enumerate(words)]
    if not stopped:
        tokens, deltas = tokens[:count], deltas[:count]
        if len(tokens) <= content_start:  # cut inside the reasoning
            if reasoning is not None:
                reasoning = " ".join(t for t in tokens[1:] if t not in (THINK, END_THINK)) or None
            return Generation(tokens, deltas, False, reasoning, "")
    content = " ".join(tokens[content_start:])
    return Generation(tokens, deltas, stopped, reasoning, content)


def generate_completion(prompt: list[str], count: int, stopped: bool) -> Generation:
    words = generate(prompt, count)
    return Generation(
        words, [{"text": " " + w} for w in words], stopped, content=reply_text("completion", words)
    )
