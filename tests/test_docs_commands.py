"""docs/emulator.md's own commands, run as written: two emulated engines and a gateway in front
of them serve a conversation in which P reads D's blocks (no flag left out)."""

from __future__ import annotations

import contextlib
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import requests
from openai import OpenAI

from emulator.process import wait_until
from tests.helpers.servers import MODEL

pytestmark = pytest.mark.processes

DOC = Path(__file__).resolve().parent.parent / "docs" / "emulator.md"
# How each of the doc's commands runs from a checkout, in this venv.
PROGRAMS = {
    ("python", "-m", "emulator.cli"): [sys.executable, "-m", "emulator.cli"],
    ("pd-gateway",): [sys.executable, "-m", "gateway.cli"],
}


def doc_commands() -> list[list[str]]:
    """The commands of the doc's first shell block."""
    text = DOC.read_text()
    block = text[text.index("```sh\n") + 6 :]
    return [shlex.split(line) for line in block[: block.index("```")].splitlines() if line]


def _url(args: list[str], default_host: str) -> str:
    host = args[args.index("--host") + 1] if "--host" in args else default_host
    return f"http://{host}:{args[args.index('--port') + 1]}"


def test_the_docs_engine_and_gateway_commands_serve_turns_where_p_reads_ds_blocks():
    commands = doc_commands()
    assert [c[:3] for c in commands] == [["python", "-m", "emulator.cli"]] * 2 + [
        ["pd-gateway", "--host", "127.0.0.1"]
    ]
    with contextlib.ExitStack() as stack:
        urls = []
        for args in commands:
            command = next(
                run + args[len(prefix) :]
                for prefix, run in PROGRAMS.items()
                if tuple(args[: len(prefix)]) == prefix
            )
            log = stack.enter_context(tempfile.NamedTemporaryFile(prefix="doc-command-"))
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
            stack.callback(process.wait, 10)
            stack.callback(process.terminate)
            url = _url(args, "127.0.0.1")
            wait_until(
                lambda url=url: requests.get(url + "/health", timeout=2).status_code == 200,
                30,
                " ".join(args),
                process,
                log.name,
            )
            urls.append(url)
        p_url, _, gateway_url = urls
        client = OpenAI(base_url=gateway_url + "/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "tell me about the weather in the mountains"}]
        for _ in range(3):
            reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=100)
            messages += [
                {"role": "assistant", "content": reply.choices[0].message.content},
                {"role": "user", "content": "and then?"},
            ]
        stats = requests.get(p_url + "/stats", timeout=5).json()
        assert stats["hits"] >= 1 and stats["reused_prompt_tokens"] >= 64
        assert stats["wrong_reuse"] == 0
