"""The checkout outside the package keeps its shape: bench/ has no import circle and an index of
every script it runs, and what tests share with the benchmarks lives in devtools/, not bench/."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, at the top or inside a function, as dotted names; `from X
    import y` also yields `X.y` (y may be a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def _bench_modules() -> dict[str, Path]:
    return {f"bench.{p.stem}": p for p in sorted(BENCH.glob("*.py")) if p.name != "__init__.py"}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One path per import circle found by a depth-first walk (a module that leads back to one
    still on the walk)."""
    circles, done = [], set()

    def walk(module: str, path: list[str]) -> None:
        for target in sorted(graph[module]):
            if target in path:
                circles.append(path[path.index(target) :] + [target])
            elif target not in done:
                walk(target, path + [target])
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            walk(module, [module])
    return circles


def test_no_import_circle_within_bench():
    modules = _bench_modules()
    graph = {name: _imports(path) & set(modules) for name, path in modules.items()}
    assert _circles(graph) == []


def test_the_circle_finder_finds_one():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert _circles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_neither_tests_nor_devtools_import_bench():
    # What tests share with the benchmarks lives in devtools/; only a test of a benchmark itself
    # (tests/test_bench_NAME.py, of bench/NAME.py) imports bench.
    importers = [
        *(
            path
            for path in ROOT.joinpath("tests").rglob("*.py")
            if not path.name.startswith("test_bench_")
        ),
        *ROOT.joinpath("devtools").glob("*.py"),
    ]
    found = [
        (str(path.relative_to(ROOT)), name)
        for path in importers
        for name in sorted(_imports(path))
        if name == "bench" or name.startswith("bench.")
    ]
    assert found == []


def _runnable(path: Path) -> bool:
    """A script: it runs under `if __name__ == "__main__"` or has a main()."""
    body = ast.parse(path.read_text()).body
    return any(
        isinstance(node, ast.If)
        and "__main__" in ast.unparse(node.test)
        or isinstance(node, ast.FunctionDef)
        and node.name == "main"
        for node in body
    )


def test_bench_readme_indexes_every_script_with_how_to_run_it():
    readme = BENCH.joinpath("README.md").read_text()
    section = readme[readme.index("## Scripts\n") :]
    section = section[: section.index("\n## ")]
    rows = re.findall(r"^\| `([a-z_]+)\.py` \| ([^|]+) \| ([^|]+) \|$", section, re.M)
    scripts = {path.stem for name, path in _bench_modules().items() if _runnable(path)}
    assert len(scripts) >= 20
    listed = [stem for stem, _, _ in rows]
    assert sorted(listed) == sorted(scripts), (
        f"not in bench/README.md: {scripts - set(listed)}; "
        f"listed, not a script: {set(listed) - scripts}"
    )
    assert all(what.strip() and how.strip() for _, what, how in rows)
