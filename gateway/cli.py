"""The `pd-gateway` console script: parse settings, then hand the process to gunicorn (or, as
`pd-gateway check ...`, check the engines: gateway.check)."""
from __future__ import annotations

import os
import sys

from gateway.config import Settings


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["check"]:
        from gateway.check import main as check     # the gateway's own start needs none of it
        sys.exit(check(argv[1:]))
    settings = Settings.from_args(argv)
    # gunicorn's master and every worker read the same settings from the environment.
    os.environ.update(settings.to_env())
    command = [sys.executable, "-m", "gunicorn", "-c", "python:gateway.standalone_conf"]
    # exec, so signals (SIGTERM for a graceful stop, SIGHUP) reach gunicorn's master directly.
    os.execv(sys.executable, command)


if __name__ == "__main__":
    main()
