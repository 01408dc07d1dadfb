"""Imports where they are used: `kdbench --help` loads none of the heavy libraries, and only
flows.pipelines imports Prefect (behaviour, not timing: `make bench-cli` times start-up)."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import pytest

import flows
from flows import REPO

# What a command may need once it runs, never to print its help (click prints help; rich only a command's output).
HEAVY = ("paramiko", "pydantic", "ruamel", "prefect", "pyarrow", "pandas", "matplotlib", "fabric", "numpy", "torch",
         "rich")
# Typer's own sub-command parser imports pydantic (typer._adapters): beyond kdbench's reach.
HEAVY_SUB = tuple(m for m in HEAVY if m != "pydantic")

LOADED = """
import json, sys
sys.argv = ["kdbench", *json.loads(sys.argv[1])]
from flows.cli.app import app
try:
    app()
except SystemExit as e:
    code = e.code
print(json.dumps({"code": code, "modules": sorted({m.split(".")[0] for m in sys.modules})}))
"""


def loaded(argv: list[str]) -> tuple[int, set[str]]:
    """The exit code of `kdbench ARGV` and the top-level packages it had imported by its end."""
    r = subprocess.run([sys.executable, "-c", LOADED, json.dumps(argv)], capture_output=True, text=True,
                       cwd=REPO, timeout=120)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return out["code"], set(out["modules"])


def test_help_imports_none_of_the_heavy_libraries() -> None:
    code, modules = loaded(["--help"])
    assert code == 0
    assert not modules & set(HEAVY), sorted(modules & set(HEAVY))


@pytest.mark.parametrize("argv", [["hosts", "--help"], ["hosts", "check", "--help"], ["sandbox", "up", "--help"],
                                  ["store", "migrate", "--help"], ["notes", "--help"], ["project", "--help"],
                                  ["import", "--help"], ["serve", "--help"], ["server", "--help"]])
def test_a_commands_help_imports_none_of_what_the_command_runs_on(argv: list[str]) -> None:
    code, modules = loaded(argv)
    assert code == 0
    assert not modules & set(HEAVY_SUB), sorted(modules & set(HEAVY_SUB))


FIRST_IMPORTING = """
import importlib, json, sys
heavy = sys.argv[2]
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
    if heavy in sys.modules:
        print(name)
        break
"""


def first_importing(names: list[str], heavy: str) -> str:
    """The first of `names` that brings in `heavy` when imported one after another ("" for none)."""
    r = subprocess.run([sys.executable, "-c", FIRST_IMPORTING, json.dumps(names), heavy], capture_output=True,
                       text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip()


def test_only_the_pipelines_import_prefect() -> None:
    """Every flows module outside flows.pipelines, imported one after another: none brings in Prefect."""
    names = [m.name for m in pkgutil.walk_packages(flows.__path__, "flows.")
             if not m.name.startswith("flows.pipelines")]
    assert "flows.analysis.backtest" in names and "flows.notes" in names
    first = first_importing(names, "prefect")
    assert first == "", f"{first} imports prefect"


def test_no_controller_module_imports_torch() -> None:
    """The controller reads the payload's typed rows (engine.rows) and never needs torch, which the
    payload's timing harness imports."""
    names = [m.name for m in pkgutil.walk_packages(flows.__path__, "flows.")]
    assert "flows.transport.pull" in names and "flows.notes.publish" in names
    first = first_importing(names, "torch")
    assert first == "", f"{first} imports torch"
