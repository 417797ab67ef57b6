"""The `pd-gateway` console script: parse settings, then hand the process to gunicorn."""
from __future__ import annotations

import os
import sys

from gateway.config import Settings


def main(argv: list[str] | None = None) -> None:
    settings = Settings.from_args(argv)
    # gunicorn's master and every worker read the same settings from the environment.
    os.environ.update(settings.to_env())
    command = [sys.executable, "-m", "gunicorn", "-c", "python:gateway.standalone_conf"]
    # exec, so signals (SIGTERM for a graceful stop, SIGHUP) reach gunicorn's master directly.
    os.execv(sys.executable, command)


if __name__ == "__main__":
    main()
