"""What the wheel installs: the gateway's packages alone, and nothing in them imports what stays
in the checkout (the emulator, the dev tooling, the benchmarks, the tests)."""
from __future__ import annotations


def test_the_installed_gateway_holds_no_emulator_and_needs_no_tooling():
    """The emulator (whose /faults anyone can call) and the dev tooling stay in the checkout:
    the wheel's packages are the ones setup.cfg's find: names, and nothing in them imports
    what is left out."""
    import ast
    import configparser
    import pathlib

    import setuptools

    root = pathlib.Path(__file__).resolve().parents[1]
    config = configparser.ConfigParser()
    config.read(root / "setup.cfg")
    include = config["options.packages.find"]["include"].replace(",", " ").split()
    packages = setuptools.find_packages(str(root), include=include)
    assert packages and all(p == "gateway" or p.startswith("gateway.") for p in packages)
    imported = set()
    for package in packages:
        for path in (root / package.replace(".", "/")).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    imported.add(node.module.split(".")[0])
                elif isinstance(node, ast.Import):
                    imported.update(alias.name.split(".")[0] for alias in node.names)
    assert not imported & {"emulator", "devtools", "bench", "tests", "openai"}
