"""Partial reuse: how much of what D holds, and the next prompt shares, P reads.

Templates that drop reasoning, move the system prompt into the last user message, put an empty
think block in the generation prompt or re-render tool calls leave the next prompt sharing only
a prefix of D's tokens. For each, OpenAI SDK clients hold conversations through a gateway under
gunicorn; the bench asks D's token ids (`return_token_ids`, as a client may) and P's /tokenize
for each next prompt, so it knows the block-aligned prefix every later turn shares with what D
holds ("shareable"), and compares it with what P read (P's `reused_prompt_tokens`).

Engines: vLLM's defaults (kv_recompute_threshold 64, prefix caching on) with bidirectional
transfer on; "cold" turns P's prefix cache off, which is what a turn sees when another P takes it
or P's cache turned over. "hybrid" adds a 64-token sliding window (two KV groups): no partial
read is position-exact there, so the gateway must make none. The harness, which
tests/test_partial_e2e.py shares, is devtools/partial.py; this prints its table:

    python -m bench.partial [--conversations 12] [--turns 5] [--output-tokens 24]
"""

from __future__ import annotations

import argparse

from devtools.partial import CASES, HYBRID, measure


def row(result: dict) -> str:
    share = result["read"] / result["shareable"] if result["shareable"] else 0.0
    return (
        f"| {result['case']} | {'cold' if result['cold'] else 'warm'} | "
        f"{result['read']:,} of {result['shareable']:,} ({share:.0%}) | {result['local']:,} | "
        f"{result['computed']:,} | {result['hits']} + {result['partials']} of "
        f"{result['later']} | {result['wrong_reuse']} | {result['p_errors']} |"
        + (f" {len(result['errors'])} client errors" if result["errors"] else "")
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--output-tokens", type=int, default=24)
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a gateway setting, e.g. --set partial_reuse_tokens=0",
    )
    args = parser.parse_args(argv)
    settings = dict(item.split("=", 1) for item in args.set)
    print(
        f"gateway settings: {settings or 'defaults'}; {args.conversations} conversations x "
        f"{args.turns} turns, {args.output_tokens}-token replies"
    )
    print(
        "| template | P's cache | P read from D, of shareable | P's own cache | P computed "
        "| later turns hit + partial | P wrong_reuse | P errors |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for case, cold in [(c, True) for c in CASES] + [(HYBRID, True)] + [(c, False) for c in CASES]:
        result = measure(case, cold, args.conversations, args.turns, args.output_tokens, settings)
        print(row(result), flush=True)
        for error in result["errors"][:2]:
            print("   error:", error[:300])


if __name__ == "__main__":
    main()
