"""The development tooling itself: ports, waiting, the client's SSE parser, the workload model."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from devtools import sse
from devtools.workload import Conversation, benchmark_conversation
from emulator.process import free_port, wait_until


def test_ports_handed_out_are_never_handed_out_again_before_anyone_binds_them():
    runs = [range(base, base + 3) for base in (free_port(run=3) for _ in range(50))]
    ports = [port for run in runs for port in run]
    assert len(set(ports)) == len(ports)
    assert all(20000 <= port < 32000 for port in ports)  # below the ephemeral range
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


@pytest.mark.processes
def test_wait_until_returns_the_value_and_fails_with_the_log_tail(tmp_path):
    assert wait_until(lambda: {"ready": 1}, 1, "a dict") == {"ready": 1}
    log = tmp_path / "log"
    log.write_text("the reason it died")
    process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(RuntimeError, match="exited with 3:\nthe reason it died"):
        wait_until(lambda: False, 10, "child", process, str(log))
    with pytest.raises(RuntimeError, match="did not become ready in 0.1 s"):
        wait_until(lambda: False, 0.1, "nothing")


STREAM = (
    b': keep-alive\n\ndata: {"choices": [{"delta": {"content": "a"}}]}\r\n\r\n'
    b'data: {"choices": [{"text": " b"}]}\n\ndata: [DONE]\n\ndata: {"after": 1}\n\n'
)


def test_events_from_bytes_or_chunks_end_at_done():
    expected = [{"choices": [{"delta": {"content": "a"}}]}, {"choices": [{"text": " b"}]}, "[DONE]"]
    assert sse.events(STREAM) == expected
    assert sse.events(STREAM[i : i + 1] for i in range(len(STREAM))) == expected
    assert sse.reply(expected) == "a b"
    sse.check(expected)


def test_check_says_why_a_stream_is_unusable():
    with pytest.raises(sse.StreamError, match="without"):
        sse.check([{"choices": []}])
    with pytest.raises(sse.StreamError, match="error event"):
        sse.check([{"error": {"code": 502}}, "[DONE]"])
    with pytest.raises(sse.StreamError, match="engine detail"):
        sse.check([{"kv_transfer_params": {}}, "[DONE]"])
    sse.check([{"kv_transfer_params": {}}, "[DONE]"], from_engine=True)


def test_a_conversation_asks_once_per_reply_and_a_benchmark_one_is_reproducible():
    conv = Conversation(explicit=False, session_header=True)
    conv.ask()
    conv.ask()  # still waiting: the same question
    assert [m["role"] for m in conv.messages] == ["user"]
    assert "conversation_id" not in conv.body() and conv.headers() == {"X-Session-ID": conv.cid}
    conv.add_reply("fine", "miss")
    conv.ask()
    assert [m["role"] for m in conv.messages] == ["user", "assistant", "user"]
    assert conv.caches == ["miss"]
    one, two = benchmark_conversation("s", 7, ids=True), benchmark_conversation("s", 7, ids=True)
    one.ask()
    two.ask()
    assert one.messages == two.messages and len(one.messages[0]["content"].split()) == 4 + 307
    assert one.body()["conversation_id"] == "conv-s-7"
    grown = benchmark_conversation("s", 7, ids=False, history_bytes=5000)
    assert grown.messages[-1]["role"] == "assistant"
    assert sum(len(m["content"]) for m in grown.messages) >= 5000
