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

# What a command may need once it runs, never to print its help.
HEAVY = ("paramiko", "pydantic", "ruamel", "prefect", "pyarrow", "pandas", "matplotlib", "fabric", "numpy", "torch")
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


FIRST_PREFECT = """
import importlib, json, sys
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
    if "prefect" in sys.modules:
        print(name)
        break
"""


def test_only_the_pipelines_import_prefect() -> None:
    """Every flows module outside flows.pipelines, imported one after another: none brings in Prefect."""
    names = [m.name for m in pkgutil.walk_packages(flows.__path__, "flows.")
             if not m.name.startswith("flows.pipelines")]
    assert "flows.analysis.backtest" in names and "flows.notes" in names
    r = subprocess.run([sys.executable, "-c", FIRST_PREFECT, json.dumps(names)], capture_output=True, text=True,
                       cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "", f"{r.stdout.strip()} imports prefect"
