"""Ship the payload (engine/ + kernels/ + project metadata) to a host and give it a venv.

The tarball is deterministic (sorted members, fixed mtimes/owners, gzip without a timestamp), so
its sha256 names the code exactly: a host that already unpacked that hash gets nothing uploaded,
and every result file carries the hash of the code that produced it.

Remote layout under the host's work_dir (resolved to an absolute path on the host first: the
benchmarks run inside the payload folder, where a relative work_dir would point elsewhere):
    payloads/<hash>/        the unpacked payload (complete once it holds `.complete`)
    venv/                   `python -m venv --system-site-packages`, plus a .pth to the host
                            python's own site-packages, so the host's torch/triton are reused
                            even when the host python is itself a venv

torch and triton must come with the host's python (the `python:` field of its host file): kdbench
never installs them, since a generic wheel of several GB may not match the host's driver. When
they are missing, `python_problem` says so before anything is uploaded, and names the
interpreters on the host that do have torch.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import logging
import re
import tarfile
from pathlib import Path
from typing import Callable

from pydantic import BaseModel

from engine.table_checks import loads_untrusted
from flows import REPO
from flows.inventory.files import display_path, host_path
from flows.inventory.hosts import Host
from flows.transport.remote import Remote

PAYLOAD_DIRS = ("engine", "kernels")
PAYLOAD_FILES = ("pyproject.toml",)
# what the payload needs from the host's own python; never installed by kdbench
HOST_PROVIDED = ("torch", "triton")
# import name -> pip requirement: what else the payload imports beyond the stdlib
REQUIREMENTS = {"numpy": "numpy", "pyarrow": "pyarrow"}
MARKER = ".complete"
SHORT_S = 120.0
SEARCH_S = 60.0          # the whole search for interpreters with torch
MAX_CANDIDATES = 40      # interpreters tried by that search
MAX_LISTED = 8           # of those with torch, named in the message


class DeployError(RuntimeError):
    """The host could not be given the payload or a working venv."""


class HostPythonError(DeployError):
    """The host's python lacks torch or triton; the message says what to set `python:` to."""


class Payload(BaseModel):
    path: Path
    sha256: str


class Deployed(BaseModel):
    work_dir: str  # absolute, on the host
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
_UNPACK = ('set -e; rm -rf -- "$1.tmp"; mkdir -p -- "$1.tmp"; tar -xzf "$2" -C "$1.tmp"; '
           'touch -- "$1.tmp/' + MARKER + '"; rm -rf -- "$1"; mv -- "$1.tmp" "$1"; rm -f -- "$2"')


def resolve_work_dir(remote: Remote, host: Host) -> str:
    """The host's work_dir as an absolute path, created when missing (relative = under the login's home)."""
    out = _check(remote.run(["sh", "-c", 'mkdir -p -- "$1" && cd -- "$1" && pwd -P', "work_dir", host.work_dir],
                            timeout_s=SHORT_S), "resolve work_dir").strip()
    if not out.startswith("/") or len(out) > 4096 or not out.isprintable():
        raise DeployError(f"the host answered no usable absolute path for work_dir ({len(out)} characters)")
    return out


def upload(remote: Remote, host: Host, payload: Payload, log: logging.Logger | logging.LoggerAdapter,
           work_dir: str) -> tuple[str, bool]:
    """Unpack the payload on the host unless that hash is already there; returns (dir, uploaded)."""
    base = f"{work_dir.rstrip('/')}/payloads"
    pdir = f"{base}/{payload.sha256}"
    if remote.run(["test", "-f", f"{pdir}/{MARKER}"], timeout_s=SHORT_S).rc == 0:
        log.info("payload %s already on %s: nothing uploaded", payload.sha256[:12], host.name)
        return pdir, False
    _check(remote.run(["mkdir", "-p", "--", base], timeout_s=SHORT_S), "mkdir payloads")
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
# the host python's version and, for each module asked, its version ("?" when importable without
# metadata) or "-" when it is not there
_VERSIONS = ("import importlib.util, sys; from importlib import metadata\n"
             "def v(m):\n"
             "    try:\n        return metadata.version(m)\n"
             "    except Exception:\n        return '?' if importlib.util.find_spec(m) else '-'\n"
             "print('KDBENCH_PY', sys.version.split()[0], *(v(m) for m in sys.argv[1:]))")
# Interpreters with torch: on PATH, in conda/mamba/pyenv installs and envs, common venv places, and
# the envs next to the configured one ($1). Bounded (MAX_CANDIDATES tried, 10 s each, one overall
# limit); paths under the login's home are printed relative to it, as `python:` takes them.
_SEARCH = r"""
n=0; seen=""
check() {
  case $1 in *-config|*.py) return 0;; esac
  [ -f "$1" ] && [ -x "$1" ] || return 0
  # by path, not by target: a venv's python links to its base interpreter but sees other packages
  case "$seen" in *"
$1
"*) return 0;; esac
  seen="$seen
$1
"
  n=$((n + 1)); [ "$n" -le "$2" ] || exit 0
  v=$(timeout -k 2 10 "$1" -c "$3" torch triton 2>/dev/null) || return 0
  p=$1; case $p in "$HOME"/*) p=${p#"$HOME"/};; esac
  printf '%s\t%s\n' "$v" "$p"
}
conf=$1; max=$2; prog=$3
IFS=:; set -f; set -- $PATH; set +f; unset IFS
dirs=""
for d in "$@"; do
  d=$(cd -- "$d" 2>/dev/null && pwd -P) || continue   # /bin and /usr/bin are often one folder
  case "$dirs" in *"
$d
"*) continue;; esac
  dirs="$dirs
$d
"
  for p in "$d"/python3 "$d"/python3.[0-9]* "$d"/python; do check "$p" "$max" "$prog"; done
done
envs=""
case $conf in */*/*/*) envs=$(dirname -- "$(dirname -- "$(dirname -- "$conf")")");; esac
for p in "$HOME"/miniconda3/bin/python "$HOME"/anaconda3/bin/python "$HOME"/miniforge3/bin/python          "$HOME"/mambaforge/bin/python /opt/conda/bin/python /opt/miniconda3/bin/python          "$HOME"/miniconda3/envs/*/bin/python "$HOME"/anaconda3/envs/*/bin/python          "$HOME"/miniforge3/envs/*/bin/python "$HOME"/mambaforge/envs/*/bin/python          "$HOME"/.conda/envs/*/bin/python /opt/conda/envs/*/bin/python          "$HOME"/.pyenv/versions/*/bin/python /opt/*/.venv/bin/python /opt/*/venv/bin/python          "$HOME"/.venv/bin/python "$HOME"/venv/bin/python "$HOME"/*/.venv/bin/python "$HOME"/*/venv/bin/python          /usr/local/bin/python3 /usr/bin/python3 ${envs:+"$envs"/*/bin/python}; do
  check "$p" "$max" "$prog"
done
"""
_VERSION = re.compile(r"[\w.+?-]{1,40}\Z")
_FOUND = re.compile(r"KDBENCH_PY (\S+) (\S+) (\S+)\t(.{1,200})\Z")


def _missing_text(torch: str, triton: str) -> str:
    lacks = [m for m, v in (("torch", torch), ("triton", triton)) if v == "-"]
    return " and ".join(f"no {m}" for m in lacks)


def interpreters_with_torch(remote: Remote, host: Host) -> list[str]:
    """Interpreters on the host that have torch, as `path (torch X, triton Y)`; bounded, host output validated."""
    res = remote.run(["sh", "-c", _SEARCH, "search", host.python, str(MAX_CANDIDATES), _VERSIONS],
                     timeout_s=SEARCH_S)
    found = []
    for line in res.stdout.splitlines():
        m = _FOUND.match(line)
        if not m or m.group(2) == "-" or not all(_VERSION.match(x) for x in m.group(1, 2, 3)):
            continue
        path = m.group(4)
        if not path.isprintable():
            continue
        triton = "no triton" if m.group(3) == "-" else f"triton {m.group(3)}"
        found.append(f"{path} (torch {m.group(2)}, {triton})")
    return found[:MAX_LISTED]


def python_problem(remote: Remote, host: Host) -> str | None:
    """None when the host's python has torch and triton; else one message naming the host file,
    its `python:` field, what that interpreter has, and the interpreters on the host with torch."""
    res = remote.run([host.python, "-c", _VERSIONS, *HOST_PROVIDED], timeout_s=SHORT_S)
    m = re.fullmatch(r"KDBENCH_PY (\S{1,40}) (\S{1,40}) (\S{1,40})", res.stdout.strip())
    if res.rc == 0 and m and "-" not in m.group(2, 3):
        return None
    if res.rc == 0 and m:
        found = f"{host.python!r} is Python {m.group(1)} with {_missing_text(m.group(2), m.group(3))}"
    else:
        found = f"{host.python!r} did not run on the host (exit {res.rc}{', timed out' if res.timed_out else ''})"
    others = interpreters_with_torch(remote, host)
    where = display_path(host_path(remote.hosts_dir, host.name))
    hint = (f"interpreters on the host with torch: {'; '.join(others)}. Set python: to one of them "
            "(a path without a leading / is relative to the login's home)" if others else
            "no interpreter with torch was found on PATH, in conda/mamba/pyenv installs and envs, "
            "/opt/*/.venv, ~/.venv, ~/venv or /usr/local/bin: install torch and triton for the host's "
            "GPU and driver, then set python: to that interpreter")
    return f"{where}: field 'python': {found}; kdbench never installs torch or triton; {hint}"


def ensure_venv(remote: Remote, host: Host, log: logging.Logger | logging.LoggerAdapter, work_dir: str,
                on_line: Callable[[str], None] | None = None) -> tuple[str, list[str]]:
    """Create the host venv once and install only the requirements the host python lacks (never
    torch or triton: those must come with the host python, see `python_problem`)."""
    venv = f"{work_dir.rstrip('/')}/venv"
    py = f"{venv}/bin/python"
    ready = f"{venv}/.kdbench-ready"  # written last: a half-made venv is made again
    if remote.run(["test", "-f", ready], timeout_s=SHORT_S).rc != 0:
        # no pip unless something must be installed: ensurepip is most of a venv's creation time
        _check(remote.run([host.python, "-m", "venv", "--clear", "--system-site-packages", "--without-pip", "--",
                           venv], timeout_s=600), "create venv")
        answer = _check(remote.run([host.python, "-c", _SITE], timeout_s=SHORT_S), "read host site-packages")
        sites = loads_untrusted(answer)
        if not isinstance(sites, list) or not all(isinstance(s, str) for s in sites):
            raise DeployError("host python reported malformed site-packages")
        _check(remote.run([py, "-c", _PTH, *sites], timeout_s=SHORT_S), "link host site-packages")
        _check(remote.run(["touch", "--", ready], timeout_s=SHORT_S), "mark venv ready")
        log.info("venv created on %s (reusing the host python's packages)", host.name)
    missing = _check(remote.run([py, "-c", _MISSING, *HOST_PROVIDED, *REQUIREMENTS], timeout_s=SHORT_S),
                     "check imports").split()
    unknown = [m for m in missing if m not in REQUIREMENTS and m not in HOST_PROVIDED]
    if unknown:
        raise DeployError(f"unexpected answer from the host import check: {unknown[:5]}")
    if set(missing) & set(HOST_PROVIDED):
        raise DeployError(f"the venv on {host.name} does not see the host python's "
                          f"{' and '.join(m for m in HOST_PROVIDED if m in missing)}")
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
    """Check the host python, upload the payload unless already there, make the venv."""
    problem = python_problem(remote, host)
    if problem:
        raise HostPythonError(problem)
    work_dir = resolve_work_dir(remote, host)
    pdir, uploaded = upload(remote, host, payload, log, work_dir)
    py, installed = ensure_venv(remote, host, log, work_dir, on_line)
    return Deployed(work_dir=work_dir, payload_hash=payload.sha256, uploaded=uploaded, payload_dir=pdir,
                    python=py, installed=installed)
