"""The seed proxy's own virtual environment (FastAPI, uvicorn, httpx), created on first use."""
from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
VENV = os.path.join(HERE, ".venv-seed")
PACKAGES = ("fastapi", "uvicorn", "httpx")  # what the seed's docstring asks for
# shared/ sits beside the checkout (as in CI); BENCH_SEED_SCRIPT points elsewhere.
DEFAULT_SCRIPT = os.path.join(HERE, "..", "..", "shared", "seed", "disagg_proxy_multiturn.py")


def script() -> str:
    return os.path.abspath(os.environ.get("BENCH_SEED_SCRIPT", DEFAULT_SCRIPT))


def python() -> str:
    return os.path.join(VENV, "bin", "python")


def ensure() -> str | None:
    """Create the venv unless it works already; the reason the seed can't run, or None."""
    if not os.path.exists(script()):
        return f"seed script not found at {script()} (set BENCH_SEED_SCRIPT)"
    if _versions() is None:
        subprocess.run([sys.executable, "-m", "venv", "--clear", VENV], check=True)
        done = subprocess.run([python(), "-m", "pip", "install", "--quiet", *PACKAGES],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode != 0:
            return f"pip install {' '.join(PACKAGES)} failed: {done.stderr[-500:]}"
    return None


def _versions() -> dict | None:
    if not os.path.exists(python()):
        return None
    code = ("import json, importlib.metadata as m; "
            f"print(json.dumps({{p: m.version(p) for p in {PACKAGES!r}}}))")
    done = subprocess.run([python(), "-c", code], capture_output=True, text=True)
    return json.loads(done.stdout) if done.returncode == 0 else None


def versions() -> dict:
    return _versions() or {}
