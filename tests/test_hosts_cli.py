"""`kdbench hosts` commands: list, add, retire/activate, check selection and exit codes."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows.cli.app import app
from flows.inventory.files import load_host, load_inventory, update_host


def kd(*args: str, input: str | None = None):  # noqa: A002 - mirrors CliRunner
    return CliRunner().invoke(app, list(args), input=input)


def test_list_shows_table(inv_dir: Path) -> None:
    res = kd("hosts", "list", "--hosts", str(inv_dir))
    assert res.exit_code == 0, res.output
    for word in ("pro6000", "b300", "h200", "sm_120", "sm_103", "retired", "released", "active"):
        assert word in res.output


def test_hosts_env_var(inv_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (inv_dir / "h200.yaml").unlink()
    monkeypatch.setenv("KDBENCH_HOSTS", str(inv_dir))
    res = kd("hosts", "list")
    assert res.exit_code == 0 and "h200" not in res.output and "b300" in res.output


def test_add_writes_file_without_pinned_key(inv_dir: Path) -> None:
    (inv_dir / "id_test").write_text("key\n")
    args = ["hosts", "add", "newbox", "--address", "10.0.0.5", "--port", "2200", "--user", "bench",
            "--key", "id_test", "--spec", "b200-sxm", "--gpus", "8", "--arch", "sm_100",
            "--interconnect", "nvlink", "--hosts", str(inv_dir)]
    res = kd(*args)
    assert res.exit_code == 0, res.output
    h = load_host(inv_dir, "newbox")
    assert (h.port, h.gpus, h.arch, h.spec, h.host_keys, h.status) == (2200, 8, "sm_100", "b200-sxm", [], "active")
    assert kd(*args).exit_code == 2  # already exists
    bad = kd("hosts", "add", "other", "--address", "a", "--user", "u", "--key", "id_test", "--spec", "b200-sxm",
             "--gpus", "1", "--arch", "sm_75", "--hosts", str(inv_dir))
    assert bad.exit_code == 2 and "field 'arch'" in bad.output and "Traceback" not in bad.output
    nokey = kd("hosts", "add", "other", "--address", "a", "--user", "u", "--key", "nope", "--spec", "b200-sxm",
               "--gpus", "1", "--arch", "sm_100", "--hosts", str(inv_dir))
    assert nokey.exit_code == 2 and "key_file" in nokey.output
    assert not (inv_dir / "other.yaml").exists()


def test_retire_activate_keep_comments(inv_dir: Path) -> None:
    before_other = (inv_dir / "b300.yaml").read_bytes()
    res = kd("hosts", "retire", "pro6000", "--reason", "unauthorized", "--hosts", str(inv_dir))
    assert res.exit_code == 0, res.output
    text = (inv_dir / "pro6000.yaml").read_text()
    assert "# placeholder: refused before any network activity until edited" in text
    assert "status: retired" in text and "retired_reason: unauthorized" in text
    assert load_host(inv_dir, "pro6000").retired_at is not None
    assert kd("hosts", "retire", "pro6000", "--reason", "bored", "--hosts", str(inv_dir)).exit_code == 2
    assert kd("hosts", "activate", "pro6000", "--hosts", str(inv_dir)).exit_code == 0
    assert load_inventory(inv_dir).hosts["pro6000"].status == "active"
    assert (inv_dir / "b300.yaml").read_bytes() == before_other
    assert kd("hosts", "activate", "nope", "--hosts", str(inv_dir)).exit_code == 2


@pytest.mark.integration
def test_check_selects_active_hosts_and_names(sandbox_factory) -> None:
    sb = sandbox_factory(count=2)
    kd("hosts", "retire", "sbx2", "--reason", "released", "--hosts", str(sb.hosts_dir))
    res = kd("hosts", "check", "--json", "--hosts", str(sb.hosts_dir))
    assert res.exit_code == 0
    rows = json.loads(res.stdout)
    assert [(r["host"], r["outcome"]) for r in rows] == [("sbx1", "ok")]
    assert load_host(sb.hosts_dir, "sbx1").last_seen is not None
    res = kd("hosts", "check", "sbx2", "--hosts", str(sb.hosts_dir))  # named: probed even when retired
    assert res.exit_code == 0 and "sbx2: ok" in res.output
    assert kd("hosts", "check", "ghost", "--hosts", str(sb.hosts_dir)).exit_code == 2


def hostile_python(root: Path, gpu: str) -> Path:
    """The controller's python, run with a fake nvidia-smi first on PATH that reports `gpu`."""
    bin_dir = root / "bin"
    bin_dir.mkdir(parents=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\nprintf '%s, 570.86\\033[2J, 9.0\\n' {shlex.quote(gpu)}\n")
    py = bin_dir / "python"
    py.write_text(f'#!/bin/sh\nPATH={shlex.quote(str(bin_dir))}:$PATH exec {shlex.quote(sys.executable)} "$@"\n')
    for f in (smi, py):
        f.chmod(0o755)
    return py


@pytest.mark.integration
def test_check_prints_host_reported_strings_inert(sandbox_factory, tmp_path: Path) -> None:
    sb = sandbox_factory(names=["odd"])
    py = hostile_python(tmp_path, "[bold red]H100[/bold red] at 10.9.8.7 \x1b]0;owned\x07")
    update_host(sb.hosts_dir, "odd", python=str(py), arch="sm_90", gpus=1, spec="h200-sxm")
    res = kd("hosts", "check", "odd", "--hosts", str(sb.hosts_dir))
    assert "odd: ok" in res.output, res.output
    assert "[bold red]H100[/bold red] at [redacted]" in res.output       # markup shown as text, address redacted
    assert "10.9.8.7" not in res.output and "\x1b" not in res.output and "\x07" not in res.output
    assert "mismatch gpu: spec says H200, host has [bold red]H100" in " ".join(res.output.split())
