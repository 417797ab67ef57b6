"""The peers' own virtual environments (the seed proxy, vllm-router), created on first use."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
# shared/ sits beside the checkout (as in CI); BENCH_SEED_SCRIPT points elsewhere.
DEFAULT_SEED_SCRIPT = os.path.join(HERE, "..", "..", "shared", "seed", "disagg_proxy_multiturn.py")


@dataclass(frozen=True)
class Venv:
    """A venv under bench/ holding `requirements` (pip specs: "name" or "name==version")."""

    directory: str
    requirements: tuple[str, ...]

    @property
    def path(self) -> str:
        return os.path.join(HERE, self.directory)

    def bin(self, name: str) -> str:
        return os.path.join(self.path, "bin", name)

    def python(self) -> str:
        return self.bin("python")

    def ensure(self) -> str | None:
        """(Re)create the venv unless it holds what it should; the reason it can't, or None."""
        if not self._satisfied():
            subprocess.run([sys.executable, "-m", "venv", "--clear", self.path], check=True)
            done = subprocess.run(
                [self.python(), "-m", "pip", "install", "--quiet", *self.requirements],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            if done.returncode != 0:
                return f"pip install {' '.join(self.requirements)} failed: {done.stderr[-500:]}"
        return None

    def versions(self) -> dict:
        """Installed version of each requirement, {} where the venv does not work."""
        if not os.path.exists(self.python()):
            return {}
        names = [spec.split("==")[0] for spec in self.requirements]
        code = (
            "import json, importlib.metadata as m; "
            f"print(json.dumps({{p: m.version(p) for p in {names!r}}}))"
        )
        done = subprocess.run([self.python(), "-c", code], capture_output=True, text=True)
        return json.loads(done.stdout) if done.returncode == 0 else {}

    def _satisfied(self) -> bool:
        have = self.versions()
        pins = dict(spec.split("==") for spec in self.requirements if "==" in spec)
        return bool(have) and all(have.get(name) == version for name, version in pins.items())


# The seed: what its docstring asks for, unpinned, as a user following it gets.
SEED = Venv(".venv-seed", ("fastapi", "uvicorn", "httpx"))
# vLLM's Rust router (a binary wheel), pinned so every later run reads against the same peer.
ROUTER = Venv(".venv-router", ("vllm-router==0.1.17",))


def seed_script() -> str:
    return os.path.abspath(os.environ.get("BENCH_SEED_SCRIPT", DEFAULT_SEED_SCRIPT))


def seed_problem() -> str | None:
    """Why the seed can't run here, or None (its venv created on the way)."""
    if not os.path.exists(seed_script()):
        return f"seed script not found at {seed_script()} (set BENCH_SEED_SCRIPT)"
    return SEED.ensure()
