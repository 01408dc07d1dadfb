"""The payload tarball is named by its content, and a host that has it gets nothing uploaded."""

from __future__ import annotations

import logging
import os
import pwd
import shlex
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from flows import REPO
from flows.inventory.files import update_host
from flows.transport import deploy
from flows.transport.remote import Remote

log = logging.getLogger("test_deploy")


def _copy_sources(dst: Path) -> Path:
    for d in deploy.PAYLOAD_DIRS:
        shutil.copytree(REPO / d, dst / d, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for f in deploy.PAYLOAD_FILES:
        shutil.copy(REPO / f, dst / f)
    return dst


def test_payload_hash_depends_on_content_only(tmp_path: Path) -> None:
    src = _copy_sources(tmp_path / "src")
    a = deploy.build_payload(tmp_path / "a", root=src)
    os.utime(src / "engine" / "schema.py", (1, 1))  # a new mtime is not a new payload
    (src / "engine" / "__pycache__").mkdir(exist_ok=True)
    (src / "engine" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"junk")
    b = deploy.build_payload(tmp_path / "b", root=src)
    assert a.sha256 == b.sha256 and a.path.name == f"{a.sha256}.tar.gz"
    assert a.path.read_bytes() == b.path.read_bytes()
    (src / "kernels" / "__init__.py").write_text((src / "kernels" / "__init__.py").read_text() + "\n# changed\n")
    assert deploy.build_payload(tmp_path / "c", root=src).sha256 != a.sha256


@pytest.mark.integration
def test_redeploying_an_unchanged_payload_uploads_nothing(sandbox_factory, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    sbx = sandbox_factory(names=["dep1"])
    host = sbx.host("dep1")
    payload = deploy.build_payload(tmp_path / "p", root=_copy_sources(tmp_path / "src"))
    puts: list[str] = []
    real_put = Remote.put
    monkeypatch.setattr(Remote, "put", lambda self, local, remote: puts.append(remote) or real_put(self, local, remote))
    with Remote(host, sbx.hosts_dir) as r:
        first = deploy.deploy(r, host, payload, log)
        assert first.uploaded and len(puts) == 1 and first.installed == []
        # the host's own torch is reused through the venv, and the payload's engine is what runs
        res = r.run([first.python, "-c", "import torch, engine.schema as s; print(s.__file__)"],
                    timeout_s=120, cwd=first.payload_dir)
        assert res.rc == 0, res.stderr
        assert res.stdout.strip().startswith(first.payload_dir)
        second = deploy.deploy(r, host, payload, log)
    assert not second.uploaded and len(puts) == 1
    assert second.payload_dir == first.payload_dir == f"{host.work_dir}/payloads/{payload.sha256}"
    assert sorted(p.name for p in Path(host.work_dir, "payloads").iterdir()) == [payload.sha256]


def python_envs(root: Path) -> tuple[Path, Path]:
    """Two envs side by side, as conda keeps them: one without torch (a fresh venv) and one with it
    (a wrapper around this interpreter, which has torch and triton)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "envs" / "bare")], check=True, timeout=120)
    with_torch = root / "envs" / "torch" / "bin" / "python"
    with_torch.parent.mkdir(parents=True)
    with_torch.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    with_torch.chmod(0o755)
    return root / "envs" / "bare" / "bin" / "python", with_torch


@pytest.mark.integration
def test_a_python_without_torch_stops_deploy_before_any_upload(sandbox_factory, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    sbx = sandbox_factory(names=["nopy"])
    bare, with_torch = python_envs(tmp_path)
    host = update_host(sbx.hosts_dir, "nopy", python=str(bare))
    payload = deploy.build_payload(tmp_path / "p", root=_copy_sources(tmp_path / "src"))
    runs: list[list[str]] = []
    real_run, real_put = Remote.run, Remote.put
    monkeypatch.setattr(Remote, "put", lambda *a: pytest.fail("uploaded"))
    monkeypatch.setattr(Remote, "run", lambda self, argv, **kw: runs.append(list(argv)) or real_run(self, argv, **kw))
    with Remote(host, sbx.hosts_dir) as r:
        with pytest.raises(deploy.HostPythonError) as e:
            deploy.deploy(r, host, payload, log)
    msg = str(e.value)
    assert "nopy.yaml: field 'python':" in msg and f"{str(bare)!r} is Python 3." in msg
    assert "no torch and no triton" in msg and "never installs torch or triton" in msg
    assert f"{with_torch} (torch {version('torch')}, triton {version('triton')})" in msg
    assert not any("pip" in argv or "venv" in argv for argv in runs)       # nothing installed, no venv made
    assert not Path(host.work_dir, "payloads").exists() and not Path(host.work_dir, "venv").exists()
    # pointed at an interpreter that has them, the same host deploys
    host = update_host(sbx.hosts_dir, "nopy", python=str(with_torch))
    monkeypatch.setattr(Remote, "put", real_put)
    with Remote(host, sbx.hosts_dir) as r:
        assert deploy.python_problem(r, host) is None
        assert deploy.deploy(r, host, payload, log).installed == []


@pytest.mark.integration
def test_a_python_that_does_not_run_is_named_with_the_alternatives(sandbox_factory, tmp_path: Path) -> None:
    sbx = sandbox_factory(names=["nopy2"])
    _, with_torch = python_envs(tmp_path)
    host = update_host(sbx.hosts_dir, "nopy2", python=str(tmp_path / "envs" / "gone" / "bin" / "python"))
    with Remote(host, sbx.hosts_dir) as r:
        msg = deploy.python_problem(r, host)
    assert msg and "field 'python'" in msg and "did not run on the host (exit 127)" in msg and str(with_torch) in msg


@pytest.mark.integration
def test_a_relative_work_dir_is_resolved_on_the_host(sandbox_factory, tmp_path: Path) -> None:
    """The shipped hosts say `work_dir: kdbench` (under the login's home); the benchmarks run inside the
    payload folder, so the venv's python must be an absolute path there."""
    sbx = sandbox_factory(names=["rel"])
    home = pwd.getpwnam(sbx.host("rel").user).pw_dir
    host = update_host(sbx.hosts_dir, "rel", work_dir=os.path.relpath(tmp_path / "work", home))
    assert not host.work_dir.startswith("/")
    payload = deploy.build_payload(tmp_path / "p", root=_copy_sources(tmp_path / "src"))
    with Remote(host, sbx.hosts_dir) as r:
        dep = deploy.deploy(r, host, payload, log)
        res = r.run([dep.python, "-c", "import engine.schema as s; print(s.__file__)"], timeout_s=120,
                    cwd=dep.payload_dir)
    assert dep.work_dir == str((tmp_path / "work").resolve()) and dep.python.startswith(dep.work_dir)
    assert res.rc == 0 and res.stdout.strip().startswith(dep.payload_dir), res.stderr


@pytest.mark.parametrize("answer", ["[" * 100_000 + "]" * 100_000, '{"a": 1}', "[1, 2]", "not json"])
def test_a_malformed_site_packages_answer_is_a_deploy_error(tmp_path: Path, answer: str) -> None:
    """The host's site-packages list is its word: too deep, not a list or not strings is refused, never a crash."""
    class Res:
        def __init__(self, rc: int, stdout: str = "") -> None:
            self.rc, self.stdout, self.stderr, self.timed_out = rc, stdout, "", False

    class FakeRemote:
        def run(self, argv, timeout_s, **kw):
            if argv[:1] == ["test"]:
                return Res(1)  # no venv yet
            return Res(0, answer if argv[1:2] == ["-c"] and argv[2] == deploy._SITE else "")

    host = type("H", (), {"python": "/usr/bin/python3", "name": "box"})()
    with pytest.raises(deploy.DeployError, match="malformed site-packages"):
        deploy.ensure_venv(FakeRemote(), host, logging.getLogger("t"), str(tmp_path))
