"""The `pd-gateway` console script: parse settings, then hand the process to gunicorn (or, as
`pd-gateway check ...`, check the engines: gateway.check)."""

from __future__ import annotations

import os
import sys

from gateway.config import Settings


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["check"]:
        from gateway.check import main as check  # the gateway's own start needs none of it

        sys.exit(check(argv[1:]))
    settings = Settings.from_args(argv)
    # gunicorn's master and every worker read the same settings from the environment; an
    # engine key from $OPENAI_API_KEY (the seed's convention) stays there, where the workers
    # read it and say where it came from (gateway.service), never what it is.
    env = settings.to_env()
    if (
        settings.upstream_api_key
        and "GATEWAY_UPSTREAM_API_KEY" not in os.environ
        and settings.upstream_api_key == os.environ.get("OPENAI_API_KEY")
    ):
        env.pop("GATEWAY_UPSTREAM_API_KEY")
    os.environ.update(env)
    command = [sys.executable, "-m", "gunicorn", "-c", "python:gateway.standalone_conf"]
    # exec, so signals (SIGTERM for a graceful stop, SIGHUP) reach gunicorn's master directly.
    os.execv(sys.executable, command)


if __name__ == "__main__":
    main()
