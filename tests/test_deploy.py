"""The payload tarball is named by its content, and a host that has it gets nothing uploaded."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest

from flows import deploy
from flows.settings import REPO
from flows.ssh import Remote

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
