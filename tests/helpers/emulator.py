"""For the emulator's own tests (tests/emulator/): what a gateway sends P on turn 1, D's events
parsed, and a prefill and a decode process driven by hand as a gateway drives them."""

from __future__ import annotations

from dataclasses import dataclass

import requests

from devtools import sse as sse_client
from emulator.process import EmulatorProcess

# What a gateway sends P on turn 1 (vLLM's disagg_proxy_multiturn.py).
STUB = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def parse_sse(raw: bytes) -> list:
    """SSE body -> list of decoded JSON events, with "[DONE]" kept as the string."""
    assert raw.endswith(b"\n\n"), raw[-200:]
    events = sse_client.events(raw)
    assert len(events) == raw.count(b"\n\n"), raw  # every block is one data event
    return events


def stream_params(events: list) -> dict | None:
    """D's kv_transfer_params from a stream, wherever the engine placed them."""
    for event in events:
        if isinstance(event, dict) and event.get("kv_transfer_params"):
            return event["kv_transfer_params"]
    return None


@dataclass
class PD:
    """A prefill and a decode process on different loopback addresses, driven by hand like a
    gateway."""

    p: EmulatorProcess
    d: EmulatorProcess

    def prefill(
        self, messages: list, params: dict | None = None, **extra: object
    ) -> requests.Response:
        body = {
            "model": "emulated-model",
            "messages": messages,
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": params if params is not None else STUB,
            **extra,
        }
        return requests.post(self.p.url + "/v1/chat/completions", json=body, timeout=10)

    def decode(self, messages: list, p_params: dict | None, **extra: object) -> requests.Response:
        body = {
            "model": "emulated-model",
            "messages": messages,
            "stream": True,
            "kv_transfer_params": p_params,
            **extra,
        }
        # stream=True on the client side too, so a test can read (or abandon) the body
        # incrementally.
        return requests.post(
            self.d.url + "/v1/chat/completions", json=body, timeout=10, stream=True
        )

    def turn(
        self, messages: list, d_params: dict | None = None, **decode_extra: object
    ) -> tuple[str, dict]:
        """One full turn as the gateway runs it; returns D's reply text and D's params.
        `decode_extra` goes into D's body (max_tokens=100: a reply long enough that the next
        turn's P reads it rather than recompute it, past kv_recompute_threshold)."""
        if d_params is None:
            p_in = STUB
        else:  # the previous turn's D params, flags flipped, host rewritten to D's address
            p_in = {
                **d_params,
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "remote_host": self.d.host,
            }
        p_response = self.prefill(messages, p_in)
        assert p_response.status_code == 200, p_response.text
        p_params = {**p_response.json()["kv_transfer_params"], "remote_host": self.p.host}
        d_response = self.decode(messages, p_params, **decode_extra)
        assert d_response.status_code == 200, d_response.text
        events = parse_sse(d_response.content)
        reply = sse_client.reply(events)
        params = stream_params(events)
        assert params is not None, events
        return reply, params
