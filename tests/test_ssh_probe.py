"""Probe classification against real sshd sandbox hosts, and host-key pinning rules."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows.cli.app import app
from flows.inventory.files import update_host
from flows.inventory.keys import key_line, parse_public_key
from flows.transport import sandbox as sandbox_mod
from flows.transport import remote as ssh
from flows.transport.connect import RemoteError, Timeouts
from flows.transport.probe import probe
from flows.transport.remote import Remote

pytestmark = pytest.mark.integration

FAST = Timeouts(connect=1.5, banner=1.5, auth=1.5, command=30)


def test_ok_reads_facts(sandbox) -> None:
    r = probe(sandbox.host(), sandbox.hosts_dir, FAST)
    assert r.outcome == "ok", r.detail
    assert r.presented_fingerprint == r.pinned_fingerprints[0]
    assert r.facts["arch_found"] == "cpu" and r.facts["gpu_count"] == 0
    assert r.facts["torch"] and r.facts["python"] and r.facts["disk_free_gb"] > 0
    assert r.mismatches == []


def test_ok_reports_inventory_mismatch(sandbox) -> None:
    update_host(sandbox.hosts_dir, "sbx1", arch="sm_120", gpus=8, spec="rtx-pro-6000-server")
    r = probe(sandbox.host(), sandbox.hosts_dir, FAST)
    assert r.outcome == "ok"
    assert any("sm_120" in m and "cpu" in m for m in r.mismatches), r.mismatches
    assert any("gpus" in m and "8" in m and "0" in m for m in r.mismatches), r.mismatches


def test_unauthorized_fast(sandbox) -> None:
    sandbox.fault("sbx1", "revoke-key")
    r = probe(sandbox.host(), sandbox.hosts_dir, FAST)
    assert r.outcome == "unauthorized", r.detail
    assert r.elapsed_s < 2


def test_host_key_changed_never_accepted(sandbox) -> None:
    before = (sandbox.hosts_dir / "sbx1.yaml").read_bytes()
    sandbox.fault("sbx1", "rotate-hostkey")
    new_fp = sandbox_mod.status(sandbox.state_dir)[0]["host_key"]
    r = probe(sandbox.host(), sandbox.hosts_dir, FAST)
    assert r.outcome == "host_key_changed", r.detail
    assert r.elapsed_s < 2
    assert r.presented_fingerprint == new_fp != r.pinned_fingerprints[0]
    assert new_fp in r.detail and r.pinned_fingerprints[0] in r.detail
    with pytest.raises(RemoteError) as e:
        Remote(sandbox.host(), sandbox.hosts_dir, FAST).connect()
    assert e.value.outcome == "host_key_changed"
    # Checking through the CLI neither accepts nor re-pins it, and exits non-zero.
    res = CliRunner().invoke(app, ["hosts", "check", "--json", "--hosts", str(sandbox.hosts_dir)])
    assert res.exit_code == 1
    assert json.loads(res.stdout)[0]["outcome"] == "host_key_changed"
    assert (sandbox.hosts_dir / "sbx1.yaml").read_bytes() == before
    # Declining the prompt pins nothing; `hosts trust --yes` is the one way to re-pin.
    res = CliRunner().invoke(app, ["hosts", "trust", "sbx1", "--hosts", str(sandbox.hosts_dir)], input="n\n")
    assert res.exit_code != 0 and new_fp in res.output
    assert (sandbox.hosts_dir / "sbx1.yaml").read_bytes() == before
    res = CliRunner().invoke(app, ["hosts", "trust", "sbx1", "--yes", "--hosts", str(sandbox.hosts_dir)])
    assert res.exit_code == 0, res.output
    assert sandbox.host().fingerprints() == [new_fp]
    assert probe(sandbox.host(), sandbox.hosts_dir, FAST).outcome == "ok"


def test_host_key_unknown_then_trust(sandbox) -> None:
    update_host(sandbox.hosts_dir, "sbx1", host_keys=[])
    r = probe(sandbox.host(), sandbox.hosts_dir, FAST)
    assert r.outcome == "host_key_unknown", r.detail
    assert r.presented_fingerprint == sandbox_mod.status(sandbox.state_dir)[0]["host_key"]
    res = CliRunner().invoke(app, ["hosts", "trust", "sbx1", "--hosts", str(sandbox.hosts_dir)], input="y\n")
    assert res.exit_code == 0, res.output
    assert probe(sandbox.host(), sandbox.hosts_dir, FAST).outcome == "ok"


def test_unreachable_when_stopped(sandbox) -> None:
    sandbox.fault("sbx1", "stop")
    r = probe(sandbox.host(), sandbox.hosts_dir, FAST)
    assert r.outcome == "unreachable", r.detail
    assert r.elapsed_s < 2


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_timeout_on_blackhole(sandbox) -> None:
    # An app with logging configured (prefect) must not print paramiko's handshake tracebacks.
    root, seen = logging.getLogger(), _Collect()
    root.addHandler(seen)
    try:
        sandbox.fault("sbx1", "blackhole")
        # banner < connect: paramiko's own banner timeout fires (and logs) before start_client gives up
        t = Timeouts(connect=5, banner=1.5, auth=1.5)
        r = probe(sandbox.host(), sandbox.hosts_dir, t)
        r2 = probe(sandbox.host(), sandbox.hosts_dir, FAST)
    finally:
        root.removeHandler(seen)
    assert (r.outcome, r2.outcome) == ("timeout", "timeout"), (r.detail, r2.detail)
    assert r.elapsed_s < t.banner + 1 and r2.elapsed_s < FAST.banner + 1
    assert not [rec for rec in seen.records if "Traceback" in rec.getMessage()]


def test_heal_restores_ok(sandbox) -> None:
    sandbox.fault("sbx1", "rotate-hostkey")
    sandbox.fault("sbx1", "revoke-key")
    sandbox.fault("sbx1", "heal")
    assert probe(sandbox.host(), sandbox.hosts_dir, FAST).outcome == "ok"


@pytest.mark.parametrize("failure", ["gaierror", "EHOSTUNREACH", "ENETUNREACH"])
def test_unreachable_name_and_route_errors(sandbox, monkeypatch: pytest.MonkeyPatch, failure: str) -> None:
    # Simulated at the socket layer: only loopback may be contacted from CI.
    import errno
    import socket

    def fail(*a: object, **k: object) -> None:
        if failure == "gaierror":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        raise OSError(getattr(errno, failure), failure)

    monkeypatch.setattr(socket, "getaddrinfo" if failure == "gaierror" else "create_connection", fail)
    monkeypatch.setattr(socket.socket, "connect", fail)
    r = probe(sandbox.host(), sandbox.hosts_dir, FAST)
    assert r.outcome == "unreachable", r.detail
    assert ("not resolved" in r.detail) == (failure == "gaierror")


def test_unusable_key_file_is_an_inventory_error(sandbox) -> None:
    Path(sandbox.host().key_file).write_text("not a key\n")
    res = CliRunner().invoke(app, ["hosts", "check", "--hosts", str(sandbox.hosts_dir)])
    assert res.exit_code == 2
    assert "sbx1.yaml" in res.output and "field 'key_file': not a usable private key" in " ".join(res.output.split())


def test_timeout_when_facts_command_hangs(sandbox, tmp_path: Path) -> None:
    hang = tmp_path / "python-that-hangs"
    hang.write_text("#!/bin/sh\nsleep 30\n")
    hang.chmod(0o755)
    update_host(sandbox.hosts_dir, "sbx1", python=str(hang))
    r = probe(sandbox.host(), sandbox.hosts_dir, Timeouts(connect=2, banner=2, auth=2, command=1))
    assert r.outcome == "timeout" and "fact-finding" in r.detail, r.detail
    assert r.elapsed_s < 1 + 1.5


def test_probe_connects_once_and_closes_its_client(sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    made = []
    real = ssh.connect_client

    def counting(*a: object, **k: object):
        made.append(real(*a, **k))
        return made[-1]

    monkeypatch.setattr(ssh, "connect_client", counting)
    assert probe(sandbox.host(), sandbox.hosts_dir, FAST).outcome == "ok"
    assert len(made) == 1 and made[0].get_transport() is None


def test_connection_lost_during_the_probe_is_routed(sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    def lost(self: Remote, *a: object, **k: object) -> None:
        raise EOFError()

    monkeypatch.setattr(Remote, "run", lost)
    r = probe(sandbox.host(), sandbox.hosts_dir, FAST)
    assert r.outcome == "timeout" and "EOFError" in r.detail


def test_any_pinned_key_of_the_presented_type_counts(sandbox, tmp_path: Path) -> None:
    real = sandbox.host().host_keys[0]
    other = key_line(parse_public_key(sandbox_mod._write_key(tmp_path / "other")))
    assert other.split()[0] == real.split()[0]  # two keys of one type
    for keys in ([real, other], [other, real]):
        update_host(sandbox.hosts_dir, "sbx1", host_keys=keys)
        assert probe(sandbox.host(), sandbox.hosts_dir, FAST).outcome == "ok", keys
    update_host(sandbox.hosts_dir, "sbx1", host_keys=[other])
    assert probe(sandbox.host(), sandbox.hosts_dir, FAST).outcome == "host_key_changed"
