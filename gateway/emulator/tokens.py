"""Prompt tokens and generated words: the chat template, whitespace tokenisation, the vocabulary."""

from __future__ import annotations

import hashlib
import json
import random

EOS = "<|end|>"  # ends every rendered message, and is the token a reply stops with
GENERATION_PROMPT = "<|assistant|>"

# Plain lowercase words so a reply is easy to read in logs and never contains a template marker.
VOCAB: tuple[str, ...] = tuple(
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
    "oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu amber basil "
    "cedar dune ember fern grove harbor island jasper kelp lagoon meadow nectar orchid pebble "
    "quartz river saffron thistle umber valley willow yarrow zephyr acorn brook clover dawn "
    "elm frost glade heath iris juniper".split())

# Pre-serialised JSON strings for the streaming hot path: a token costs a dict lookup.
BARE_JSON: dict[str, bytes] = {w: json.dumps(w).encode() for w in VOCAB}
SPACED_JSON: dict[str, bytes] = {w: json.dumps(" " + w).encode() for w in VOCAB}


def content_words(content: object) -> list[str]:
    """Words of a message's content: a string, or a list of parts (text parts give their words)."""
    if content is None:
        return []
    if isinstance(content, str):
        return content.split()
    words: list[str] = []
    for part in content:  # validated upstream: a list of objects with a string "type"
        if part.get("type") == "text":
            words.extend(part.get("text", "").split())
        else:
            words.append(f"<|{part['type']}|>")
    return words


def _json_words(value: object) -> list[str]:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).split()


def render_chat(messages: list[dict], tools: object = None) -> list[str]:
    """Tokens of ``[<|tools|> json <|end|>] (<|role|> [name=N] words [<|tool_call|> json]... <|end|>)* <|assistant|>``.

    An assistant message renders exactly like the generation prompt followed by its words and EOS,
    so render(messages) + reply words is a prefix of render(messages + [reply] + more).
    """
    tokens: list[str] = []
    if tools:
        tokens += ["<|tools|>", *_json_words(tools), EOS]
    for message in messages:
        tokens.append(f"<|{message['role']}|>")
        if message.get("name"):
            tokens.append(f"name={message['name']}")
        tokens += content_words(message.get("content"))
        for call in message.get("tool_calls") or ():
            tokens += ["<|tool_call|>", *_json_words(call)]
        if message.get("tool_call_id"):
            tokens.append(f"tool_call_id={message['tool_call_id']}")
        tokens.append(EOS)
    tokens.append(GENERATION_PROMPT)
    return tokens


def render_completion(prompt: str) -> list[str]:
    """Tokens of a completions prompt: its whitespace-separated words, nothing added."""
    return prompt.split()


def generate(tokens: list[str], count: int) -> list[str]:
    """The `count` words an engine replies to `tokens` with; deterministic across processes."""
    digest = hashlib.blake2b("\n".join(tokens).encode(), digest_size=8).digest()
    rng = random.Random(int.from_bytes(digest, "big"))
    return [VOCAB[rng.randrange(len(VOCAB))] for _ in range(count)]


def reply_text(kind: str, words: list[str]) -> str:
    """The reply as the client sees it: chat "w1 w2", completions " w1 w2" (appended to the prompt)."""
    text = " ".join(words)
    return text if kind == "chat" else (" " + text if words else "")
