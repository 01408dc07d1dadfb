"""Sandbox hosts: up/check/fault/down through the CLI, and nothing left running afterwards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows.cli.app import app
from flows.inventory.files import load_inventory
from flows.transport import sandbox as sandbox_mod
from flows.transport.remote import Remote
from flows.transport.sandbox import SandboxError, _alive, _descendants

pytestmark = pytest.mark.integration


def _check(hosts_dir: Path) -> tuple[int, dict[str, str]]:
    res = CliRunner().invoke(app, ["hosts", "check", "--json", "--connect-timeout", "1.5",
                                   "--hosts", str(hosts_dir)])
    return res.exit_code, {r["host"]: r["outcome"] for r in json.loads(res.stdout)}


def test_cli_up_check_faults_down(tmp_path: Path) -> None:
    state = tmp_path / "sbx"
    runner = CliRunner()
    try:
        res = runner.invoke(app, ["sandbox", "up", "--count", "2", "--state", str(state)])
        assert res.exit_code == 0, res.output
        hosts_dir = state / "hosts"
        assert str(hosts_dir) in res.output
        assert _check(hosts_dir) == (0, {"sbx1": "ok", "sbx2": "ok"})
        for kind, outcome in [("rotate-hostkey", "host_key_changed"), ("heal", "ok"),
                              ("revoke-key", "unauthorized"), ("heal", "ok"), ("stop", "unreachable"),
                              ("blackhole", "timeout"), ("heal", "ok")]:
            res = runner.invoke(app, ["sandbox", "fault", "sbx1", kind, "--state", str(state)])
            assert res.exit_code == 0, res.output
            code, outcomes = _check(hosts_dir)
            assert outcomes == {"sbx1": outcome, "sbx2": "ok"}, kind
            assert code == (0 if outcome == "ok" else 1)
        res = runner.invoke(app, ["sandbox", "status", "--state", str(state)])
        assert res.exit_code == 0 and "sbx2" in res.output
        pids = [r["pid"] for r in sandbox_mod.status(state)]
        assert all(pids)
    finally:
        res = runner.invoke(app, ["sandbox", "down", "--state", str(state)])
    assert res.exit_code == 0
    assert not any(_alive(p) for p in pids)
    assert all(r["pid"] is None for r in sandbox_mod.status(state))


def test_down_ends_open_sessions_and_blackholes(sandbox_factory) -> None:
    sb = sandbox_factory(count=2)
    sb.fault("sbx2", "blackhole")
    listener, blackhole = sb.pids()
    with Remote(sb.host("sbx1"), sb.hosts_dir) as r:
        assert r.run(["true"], timeout_s=5).rc == 0
        children = _descendants(listener)
        assert children  # the open connection's sshd processes
        sandbox_mod.down(sb.state_dir)
    assert not any(_alive(p) for p in [listener, blackhole, *children])


def test_named_hosts_and_state_guard(sandbox_factory) -> None:
    sb = sandbox_factory(names=["pro6000", "b300"])
    inv = load_inventory(sb.hosts_dir)
    assert set(inv.hosts) == {"pro6000", "b300"} and "cpu-sandbox" in inv.specs
    h = inv.hosts["pro6000"]
    assert (h.arch, h.spec, h.gpus, h.interconnect, len(h.host_keys)) == ("cpu", "cpu-sandbox", 0, "none", 1)
    with pytest.raises(SandboxError, match="already up"):
        sandbox_mod.up(names=["x"], state_dir=sb.state_dir)
    with pytest.raises(SandboxError, match="no sandbox host named 'nope'"):
        sb.fault("nope", "stop")
    res = CliRunner().invoke(app, ["sandbox", "fault", "b300", "explode", "--state", str(sb.state_dir)])
    assert res.exit_code == 2 and "unknown fault" in res.output
