"""What the wheel installs: the gateway's packages alone, and nothing in them imports what stays
in the checkout (the emulator, the dev tooling, the benchmarks, the tests); the license it names;
its version, in one place."""

from __future__ import annotations

import configparser
import hashlib
import importlib.metadata
import pathlib
import re
import subprocess
import sys

import pytest

import gateway
from gateway.config import Settings

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _setup_cfg() -> configparser.ConfigParser:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    return config


def _metadata() -> configparser.SectionProxy:
    return _setup_cfg()["metadata"]


def test_the_installed_gateway_holds_no_emulator_and_needs_no_tooling():
    """The emulator (whose /faults anyone can call) and the dev tooling stay in the checkout:
    the wheel's packages are the ones setup.cfg's find: names, and nothing in them imports
    what is left out."""
    import ast

    import setuptools

    include = _setup_cfg()["options.packages.find"]["include"].replace(",", " ").split()
    packages = setuptools.find_packages(str(ROOT), include=include)
    assert packages and all(p == "gateway" or p.startswith("gateway.") for p in packages)
    imported = set()
    for package in packages:
        for path in (ROOT / package.replace(".", "/")).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    imported.add(node.module.split(".")[0])
                elif isinstance(node, ast.Import):
                    imported.update(alias.name.split(".")[0] for alias in node.names)
    assert not imported & {"emulator", "devtools", "bench", "tests", "openai"}


def test_the_license_file_is_the_one_setup_cfg_names():
    """Apache-2.0, the standard text whole (the sha256 of apache.org's LICENSE-2.0.txt), shipped
    with the package (license_files)."""
    assert _metadata()["license"] == "Apache-2.0" and _metadata()["license_files"] == "LICENSE"
    assert (
        hashlib.sha256((ROOT / "LICENSE").read_bytes()).hexdigest()
        == "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"
    )


def test_the_version_is_setup_cfgs_in_the_metadata_and_the_package(capsys):
    """One place to bump (setup.cfg), read back at run time from the installed metadata (make
    install again after changing it), and `pd-gateway --version` says it."""
    wanted = _metadata()["version"]
    assert importlib.metadata.version("pd-gateway") == wanted
    assert gateway.__version__ == wanted
    with pytest.raises(SystemExit) as exited:
        Settings.from_args(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out == f"pd-gateway {wanted}\n"


@pytest.mark.processes
def test_the_installed_command_says_its_version():
    command = pathlib.Path(sys.executable).with_name("pd-gateway")
    assert command.exists(), f"{command}: no pd-gateway command beside this Python (make install)"
    said = subprocess.run([str(command), "--version"], capture_output=True, text=True, timeout=60)
    assert (said.returncode, said.stdout) == (0, f"pd-gateway {_metadata()['version']}\n")


@pytest.mark.processes
def test_make_run_installs_the_gateway_and_its_demo_not_the_test_tools():
    """`make run` (a fresh clone's first command) installs the demo extra (the OpenAI SDK the
    demo's client is), not the test tools, which `make test` and `make install` add."""

    def installs(target: str) -> list[str]:
        planned = subprocess.run(
            ["make", "-n", "-B", target],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        return re.findall(r"pip install .*-e '(\.\[[a-z-]+\])'", planned)

    assert installs("run") == [".[demo]"]
    assert installs("install") == [".[test]"]
    extras = _setup_cfg()["options.extras_require"]
    assert "pd-gateway[demo]" in extras["test-embedding"].split()  # the tests' SDK: the demo's
