"""Overload client: N conversations in flight against one URL for a fixed time; a refused turn
(429) is timed and sent again after its Retry-After (as the OpenAI SDK does), or after a fixed
short back-off (`--backoff`: a client that ignores the header). JSON out."""

from gevent import monkey

monkey.patch_all()  # before http.client and socket: every conversation is a greenlet

import argparse  # noqa: E402
import http.client  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402
from urllib.parse import urlsplit  # noqa: E402

import gevent  # noqa: E402

from devtools import sse  # noqa: E402
from devtools.workload import benchmark_conversation  # noqa: E402

PATH = "/v1/chat/completions"
TIMEOUT = 60.0


def conversation(
    url: str, index: int, salt: str, deadline: float, backoff: float, out: dict
) -> None:
    """Turns one after another on fresh connections (a refusal closes nothing for the next)."""
    conv = benchmark_conversation(salt, index, ids=True)
    parts = urlsplit(url)
    rng = random.Random(index)
    while time.monotonic() < deadline:
        conv.ask()
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=TIMEOUT)
        sent = time.monotonic()
        try:
            conn.request(
                "POST",
                PATH,
                json.dumps(conv.body()).encode(),
                {"Content-Type": "application/json", **conv.headers()},
            )
            response = conn.getresponse()
            if response.status == 429:
                response.read()
                out["refused"].append(
                    {
                        "seconds": time.monotonic() - sent,
                        "retry_after": response.getheader("Retry-After"),
                    }
                )
                wait = backoff or float(response.getheader("Retry-After") or 1)
                gevent.sleep(wait * (0.5 + rng.random()))
                continue
            if response.status != 200:
                raise sse.StreamError(f"status {response.status}: {response.read()[:200]!r}")
            parser, events, first = sse.Parser(), [], None
            while data := response.read1(65536):
                for event in parser.feed(data):
                    events.append(event)
                    if first is None and sse.content(event):
                        first = time.monotonic()
            sse.check(events, from_engine=False)
            if first is None:
                raise sse.StreamError("no content")
            conv.add_reply(sse.reply(events), response.getheader("X-Gateway-Cache"))
            out["turns"].append(
                {
                    "ttft": first - sent,
                    "seconds": time.monotonic() - sent,
                    "hit": response.getheader("X-Gateway-Cache") == "hit",
                }
            )
        except (sse.StreamError, OSError, http.client.HTTPException, ValueError) as exc:
            out["errors"].append(f"{conv.cid}: {type(exc).__name__}: {exc}"[:300])
            return  # the history no longer matches what the engines saw
        finally:
            conn.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", required=True)
    parser.add_argument("--concurrency", type=int, required=True)
    parser.add_argument("--duration", type=float, required=True, help="no turn starts after")
    parser.add_argument(
        "--backoff",
        type=float,
        default=0.0,
        help="mean seconds a refused client waits before it sends again; "
        "0: its Retry-After (jittered 0.5-1.5x)",
    )
    parser.add_argument("--salt", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    out: dict = {"turns": [], "refused": [], "errors": []}
    deadline = time.monotonic() + args.duration
    greenlets = [
        gevent.spawn(conversation, args.url, i, args.salt, deadline, args.backoff, out)
        for i in range(args.concurrency)
    ]
    # Every turn is bounded by TIMEOUT: a client still running after that is a stuck one.
    gevent.joinall(greenlets, timeout=args.duration + TIMEOUT + 10)
    out["stuck"] = sum(not g.dead for g in greenlets)
    gevent.killall(greenlets, block=False)
    with open(args.out, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
