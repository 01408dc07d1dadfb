"""Ship the payload (engine/ + kernels/ + project metadata) to a host and give it a venv.

The tarball is deterministic (sorted members, fixed mtimes/owners, gzip without a timestamp), so
its sha256 names the code exactly: a host that already unpacked that hash gets nothing uploaded,
and every result file carries the hash of the code that produced it.

Remote layout under the host's work_dir:
    payloads/<hash>/        the unpacked payload (complete once it holds `.complete`)
    venv/                   `python -m venv --system-site-packages`, plus a .pth to the host
                            python's own site-packages, so the host's torch/triton are reused
                            even when the host python is itself a venv
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import logging
import tarfile
from pathlib import Path
from typing import Callable

from pydantic import BaseModel

from flows.inventory import Host
from flows.settings import REPO
from flows.ssh import Remote

PAYLOAD_DIRS = ("engine", "kernels")
PAYLOAD_FILES = ("pyproject.toml",)
# import name -> pip requirement: what the payload imports beyond the stdlib
REQUIREMENTS = {"torch": "torch", "triton": "triton", "numpy": "numpy", "pyarrow": "pyarrow"}
MARKER = ".complete"
SHORT_S = 120.0


class DeployError(RuntimeError):
    """The host could not be given the payload or a working venv."""


class Payload(BaseModel):
    path: Path
    sha256: str


class Deployed(BaseModel):
    payload_hash: str
    uploaded: bool
    payload_dir: str
    python: str  # the venv's interpreter
    installed: list[str]  # pip requirements installed because the host lacked them


def _members(root: Path) -> list[Path]:
    files = [root / f for f in PAYLOAD_FILES if (root / f).is_file()]
    for d in PAYLOAD_DIRS:
        files += [p for p in (root / d).rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def build_payload(out_dir: Path, root: Path = REPO) -> Payload:
    """Write `<out_dir>/<sha256>.tar.gz`; the same sources always give the same bytes."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in _members(root):
            info = tarfile.TarInfo(path.relative_to(root).as_posix())
            data = path.read_bytes()
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))
    packed = io.BytesIO()
    with gzip.GzipFile(fileobj=packed, mode="wb", mtime=0, filename="") as gz:
        gz.write(raw.getvalue())
    blob = packed.getvalue()
    digest = hashlib.sha256(blob).hexdigest()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{digest}.tar.gz"
    path.write_bytes(blob)
    return Payload(path=path, sha256=digest)


def _check(res, what: str) -> str:
    if res.rc != 0 or res.timed_out:
        tail = (res.stderr or res.stdout).strip().splitlines()[-5:]
        raise DeployError(f"{what} failed (rc {res.rc}{', timed out' if res.timed_out else ''}): "
                          + " | ".join(tail))
    return res.stdout


# Unpack next to the final place, then rename: a half-unpacked payload is never marked complete.
_UNPACK = ('set -e; rm -rf "$1.tmp"; mkdir -p "$1.tmp"; tar -xzf "$2" -C "$1.tmp"; '
           'touch "$1.tmp/' + MARKER + '"; rm -rf "$1"; mv "$1.tmp" "$1"; rm -f "$2"')


def upload(remote: Remote, host: Host, payload: Payload, log: logging.Logger | logging.LoggerAdapter) -> tuple[str, bool]:
    """Unpack the payload on the host unless that hash is already there; returns (dir, uploaded)."""
    base = f"{host.work_dir.rstrip('/')}/payloads"
    pdir = f"{base}/{payload.sha256}"
    if remote.run(["test", "-f", f"{pdir}/{MARKER}"], timeout_s=SHORT_S).rc == 0:
        log.info("payload %s already on %s: nothing uploaded", payload.sha256[:12], host.name)
        return pdir, False
    _check(remote.run(["mkdir", "-p", base], timeout_s=SHORT_S), "mkdir payloads")
    tgz = f"{base}/{payload.sha256}.tar.gz"
    remote.put(payload.path, tgz)
    _check(remote.run(["sh", "-c", _UNPACK, "unpack", pdir, tgz], timeout_s=SHORT_S), "unpack payload")
    log.info("payload %s uploaded to %s", payload.sha256[:12], host.name)
    return pdir, True


# the host python's site-packages, its user site included (a venv hides both)
_SITE = ("import json, site; print(json.dumps(site.getsitepackages()"
         " + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])))")
# addsitedir (not a bare path line) so the host's own .pth files are honoured too
_PTH = ("import pathlib, sys, sysconfig; "
        "pathlib.Path(sysconfig.get_paths()['purelib'], 'kdbench-host-site.pth')"
        ".write_text(''.join(f'import site; site.addsitedir({p!r})\\n' for p in sys.argv[1:]))")
_MISSING = ("import importlib.util, sys; "
            "print(' '.join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))")


def ensure_venv(remote: Remote, host: Host, log: logging.Logger | logging.LoggerAdapter,
                on_line: Callable[[str], None] | None = None) -> tuple[str, list[str]]:
    """Create the host venv once and install only the requirements the host python lacks."""
    venv = f"{host.work_dir.rstrip('/')}/venv"
    py = f"{venv}/bin/python"
    ready = f"{venv}/.kdbench-ready"  # written last: a half-made venv is made again
    if remote.run(["test", "-f", ready], timeout_s=SHORT_S).rc != 0:
        # no pip unless something must be installed: ensurepip is most of a venv's creation time
        _check(remote.run([host.python, "-m", "venv", "--clear", "--system-site-packages", "--without-pip", venv],
                          timeout_s=600), "create venv")
        sites = json.loads(_check(remote.run([host.python, "-c", _SITE], timeout_s=SHORT_S), "read host site-packages"))
        if not all(isinstance(s, str) for s in sites):
            raise DeployError("host python reported malformed site-packages")
        _check(remote.run([py, "-c", _PTH, *sites], timeout_s=SHORT_S), "link host site-packages")
        _check(remote.run(["touch", ready], timeout_s=SHORT_S), "mark venv ready")
        log.info("venv created on %s (reusing the host python's packages)", host.name)
    missing = _check(remote.run([py, "-c", _MISSING, *REQUIREMENTS], timeout_s=SHORT_S), "check imports").split()
    unknown = [m for m in missing if m not in REQUIREMENTS]
    if unknown:
        raise DeployError(f"unexpected answer from the host import check: {unknown}")
    reqs = [REQUIREMENTS[m] for m in missing]
    if reqs:
        log.info("installing on %s: %s", host.name, " ".join(reqs))
        if remote.run([py, "-m", "pip", "--version"], timeout_s=SHORT_S).rc != 0:
            _check(remote.run([py, "-m", "ensurepip", "--default-pip"], timeout_s=600), "ensurepip")
        _check(remote.run([py, "-m", "pip", "install", "--quiet", *reqs], timeout_s=1800, on_line=on_line),
               "pip install")
    return py, reqs


def deploy(remote: Remote, host: Host, payload: Payload, log: logging.Logger | logging.LoggerAdapter,
           on_line: Callable[[str], None] | None = None) -> Deployed:
    pdir, uploaded = upload(remote, host, payload, log)
    py, installed = ensure_venv(remote, host, log, on_line)
    return Deployed(payload_hash=payload.sha256, uploaded=uploaded, payload_dir=pdir,
                    python=py, installed=installed)
