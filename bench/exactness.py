"""Exact reuse under real chat templates: every template mode of the emulator, against a gateway.

For each mode, emulated P and D engines run that template behaviour; OpenAI SDK clients hold
multi-turn conversations through a gateway under gunicorn, some echoing the reasoning they got
back (as `message.model_dump()` does), some not. The table gives, per mode and client kind, the
later turns that hit and P's `wrong_reuse` (a pull whose tokens are not a prefix of P's prompt:
on a real engine, garbage). The harness, which tests/test_exactness_e2e.py shares, is
devtools/exactness.py; this prints its table:

    python -m bench.exactness [--set verify_reuse=always] [--conversations N] [--turns N]
"""

from __future__ import annotations

import argparse

from devtools.exactness import CLIENTS, MODES, measure


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a gateway setting, e.g. --set verify_reuse=always",
    )
    parser.add_argument("--modes", nargs="*", default=[m.name for m in MODES])
    args = parser.parse_args(argv)
    settings = dict(item.split("=", 1) for item in args.set)
    print(
        f"gateway settings: {settings or 'defaults'}; {args.conversations} conversations x "
        f"{args.turns} turns per client kind"
    )
    print(f"| mode | {' | '.join(c.name for c in CLIENTS)} | P wrong_reuse | /tokenize calls |")
    print("|---|" + "---|" * (len(CLIENTS) + 2))
    for mode in MODES:
        if mode.name not in args.modes:
            continue
        result = measure(mode, settings, args.conversations, args.turns)
        cells = []
        for client in CLIENTS:
            row = result["rows"].get(client.name)
            cells.append(
                "-"
                if row is None
                else f"{row['hits']}/{row['later']}"
                + (f" ({len(row['errors'])} errors)" if row["errors"] else "")
            )
        print(
            f"| {mode.name} | {' | '.join(cells)} | "
            f"{result['wrong_reuse']} | {result['tokenize']} |",
            flush=True,
        )
        for row in result["rows"].values():
            for error in row["errors"][:2]:
                print("   error:", error[:300])


if __name__ == "__main__":
    main()
