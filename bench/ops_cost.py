"""What two production features cost a turn, in process: checking a client API key (with 1 and
100 keys accepted: every key is compared) and writing one access-log line (text and JSON, to a
file, with the request-id filter), each timed over many repetitions.

    .venv/bin/python -m bench.ops_cost [--repeat 20000]

Read them against the CPU of a whole turn: docs/BENCHMARKS.md, "Where a turn's CPU goes".
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time

from gateway.front.auth import ApiKeys
from gateway.support.logs import TEXT_FORMAT, JsonFormatter, RequestIdFilter


def per_call_us(call, repeat: int) -> float:
    call()
    started = time.process_time()
    for _ in range(repeat):
        call()
    return (time.process_time() - started) / repeat * 1e6


def key_check_us(keys: int, repeat: int) -> float:
    accepted = [f"sk-{i:040d}" for i in range(keys)]
    api_keys = ApiKeys(accepted)
    header = f"Bearer {accepted[-1]}"
    return per_call_us(lambda: api_keys.check(header), repeat)


def access_line_us(fmt: str, repeat: int) -> float:
    """One line of the shape `Disagg._log_turn` writes, through a file handler."""
    logger = logging.getLogger(f"bench.access.{fmt}")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    with tempfile.TemporaryDirectory() as folder:
        handler = logging.FileHandler(os.path.join(folder, "access.log"))
        handler.addFilter(RequestIdFilter())
        handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
        logger.addHandler(handler)
        try:
            return per_call_us(
                lambda: logger.info(
                    "turn %s cache=%s path=%s reason=%s prefill=%s decode=%s ttft_ms=%s chunks=%d "
                    "finish=%s outcome=%s",
                    "4f9c2a",
                    "hit",
                    "disagg",
                    "stored",
                    "127.0.0.2:8100",
                    "127.0.0.3:8200",
                    "23.4",
                    32,
                    "length",
                    "completed",
                ),
                repeat,
            )
        finally:
            logger.removeHandler(handler)
            handler.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=20000)
    args = parser.parse_args(argv)
    print("| what | worker CPU us |\n|---|---|")
    for keys in (1, 100):
        print(
            f"| API key check, {keys} key{'s' if keys > 1 else ''} | "
            f"{key_check_us(keys, args.repeat):.1f} |"
        )
    for fmt in ("text", "json"):
        print(f"| access-log line, {fmt} | {access_line_us(fmt, args.repeat):.1f} |")


if __name__ == "__main__":
    main()
