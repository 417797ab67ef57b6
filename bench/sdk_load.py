"""Load generator with the OpenAI SDK: the benchmark's conversations, C in flight, JSON out.

The same conversations and arguments as bench.loadgen, sent as an application sends them: the
`openai` package's client (one, shared by C threads, its own connection pool), streamed chat
completions, each reply read to "[DONE]". Its streams close their response at "[DONE]", before
the HTTP client has read the end of the chunked body, so no connection is used twice: every
turn is a new connection, to any server. It measures no timing (use bench.loadgen for TTFT
and ITL): the history runs take only turns, errors and the proxy's CPU from it.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai

from bench import clients
from devtools.workload import Conversation, benchmark_conversation

REQUEST_TIMEOUT = 120.0  # as bench.loadgen


def run_turn(sdk: openai.OpenAI, conv: Conversation) -> dict:
    conv.ask()
    extra = (
        {"extra_body": {"conversation_id": conv.cid}, "extra_headers": conv.headers()}
        if conv.explicit
        else {}
    )
    if conv.stream_options is not None:
        extra["stream_options"] = conv.stream_options
    sent = time.monotonic()
    stream = sdk.chat.completions.create(
        model=conv.model, messages=conv.messages, max_tokens=conv.max_tokens, stream=True, **extra
    )
    reply = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    if not reply:
        raise ValueError("no content")
    conv.add_reply(reply)
    return {"sent": sent, "last": time.monotonic()}


def main(argv: list[str] | None = None) -> None:
    args = clients.arguments(__doc__.split("\n\n")[0]).parse_args(argv)
    sdk = openai.OpenAI(
        base_url=args.url + "/v1", api_key="EMPTY", max_retries=0, timeout=REQUEST_TIMEOUT
    )
    results: list[dict] = []
    errors: list[str] = []
    lock = threading.Lock()
    started = time.monotonic()
    deadline = started + args.duration

    def conversation(index: int) -> None:
        conv = benchmark_conversation(args.salt, index, args.ids, args.history_bytes)
        for _ in range(args.turns):
            if time.monotonic() >= deadline:
                return
            try:
                result = run_turn(sdk, conv)
            except Exception as exc:  # noqa: BLE001  (older openai releases let the HTTP
                # client's errors through while a stream is read): the conversation ends
                with lock:
                    errors.append(f"{conv.cid}: {type(exc).__name__}: {exc}"[:300])
                return
            with lock:
                results.append(result)

    with ThreadPoolExecutor(args.concurrency) as pool:
        for future in [pool.submit(conversation, i) for i in range(args.conversations)]:
            future.result()
    clients.write_results(args.out, started, results, errors)


if __name__ == "__main__":
    main()
