"""The probe: connect with the pinned keys, classify the outcome, and on `ok` read what the host really has.

One small program, run with the host's own python, reports its python, torch and triton versions, free
disk and `nvidia-smi`'s GPUs; the answer is validated (wrong types become None) and compared with the
inventory, so a mismatch is reported before anything is deployed.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import paramiko
from pydantic import BaseModel

from engine.table_checks import loads_untrusted
from flows.inventory.files import load_specs
from flows.inventory.hosts import Host
from flows.inventory.keys import fingerprint
from flows.transport.connect import ProbeOutcome, RemoteError, Timeouts
from flows.transport.remote import Remote


class ProbeResult(BaseModel):
    host: str
    outcome: ProbeOutcome
    detail: str
    elapsed_s: float
    pinned_fingerprints: list[str]
    presented_fingerprint: str | None = None
    facts: dict[str, Any] = {}
    mismatches: list[str] = []
    wrong_gpu: str | None = None  # the mismatch when the host's GPUs are not its spec's model


# One small program, run with the host's own python, reports what the host really has.
_FACTS = r"""
import json, os, shutil, subprocess, sys
from importlib import metadata
f = {"python": sys.version.split()[0]}
for m in ("torch", "triton"):
    try:
        f[m] = metadata.version(m)
    except Exception:
        f[m] = None
d = sys.argv[1]
while d and not os.path.isdir(d):
    d = os.path.dirname(d.rstrip("/")) or "."
f["work_dir_exists"] = os.path.isdir(sys.argv[1])
f["disk_free_gb"] = round(shutil.disk_usage(d or ".").free / 1e9, 1)
f["nvidia_smi"] = None
if shutil.which("nvidia-smi"):
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,compute_cap",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        f["nvidia_smi"] = r.stdout[:20000] if r.returncode == 0 else None
    except Exception:
        pass
print("KDBENCH_FACTS " + json.dumps(f))
"""

_CAP_TO_ARCH = {"9.0": "sm_90", "10.0": "sm_100", "10.3": "sm_103", "12.0": "sm_120"}


def _parse_facts(stdout: str) -> dict[str, Any]:
    """Facts from the host's output, validated: wrong types become None, never an exception."""
    raw: dict[str, Any] = {}
    for line in stdout.splitlines():
        if line.startswith("KDBENCH_FACTS "):
            raw = loads_untrusted(line.removeprefix("KDBENCH_FACTS "))
    if not isinstance(raw, dict):
        raw = {}

    def s(v: Any) -> str | None:
        return v[:200] if isinstance(v, str) else None

    facts: dict[str, Any] = {
        "python": s(raw.get("python")), "torch": s(raw.get("torch")), "triton": s(raw.get("triton")),
        "disk_free_gb": raw.get("disk_free_gb") if isinstance(raw.get("disk_free_gb"), (int, float)) else None,
        "work_dir_exists": raw.get("work_dir_exists") is True,
        "gpu_names": [], "gpu_count": 0, "driver": None, "arch_found": "cpu",
    }
    smi = raw["nvidia_smi"][:20000] if isinstance(raw.get("nvidia_smi"), str) else ""
    caps: set[str] = set()
    for row in smi.splitlines():
        cols = [c.strip() for c in row.split(",")]
        if len(cols) != 3 or not cols[0]:
            continue
        facts["gpu_names"].append(cols[0][:100])
        facts["driver"] = cols[1][:50]
        caps.add(cols[2][:10])
    facts["gpu_count"] = len(facts["gpu_names"])
    if caps:
        archs = sorted({_CAP_TO_ARCH.get(c, f"compute_cap {c}") for c in caps})
        facts["arch_found"] = archs[0] if len(archs) == 1 else ",".join(archs)
    return facts


def _wrong_gpu(host: Host, facts: dict[str, Any], gpu_model: str | None) -> str | None:
    """The mismatch when a GPU the host reports is not the model its spec sheet names, else None."""
    if gpu_model and host.gpus and facts["gpu_names"]:
        others = sorted({n for n in facts["gpu_names"] if gpu_model.lower() not in n.lower()})
        if others:
            return f"gpu: spec says {gpu_model}, host has {', '.join(others)}"
    return None


def _mismatches(host: Host, facts: dict[str, Any], wrong_gpu: str | None) -> list[str]:
    out = []
    if facts["arch_found"] != host.arch:
        out.append(f"arch: inventory says {host.arch}, host has {facts['arch_found']}")
    if facts["gpu_count"] != host.gpus:
        out.append(f"gpus: inventory says {host.gpus}, host has {facts['gpu_count']}")
    if wrong_gpu:
        out.append(wrong_gpu)
    if facts["python"] is None:
        out.append(f"python: {host.python!r} did not run on the host")
    elif facts["torch"] is None:
        out.append("torch: not installed for the host's python")
    if facts["python"] is not None and not facts["work_dir_exists"]:
        out.append("work_dir: does not exist yet")
    return out


def probe(host: Host, hosts_dir: Path, timeouts: Timeouts = Timeouts()) -> ProbeResult:
    """Connect with the pinned keys, classify the outcome, and on `ok` read the host's facts."""
    start = time.monotonic()
    pinned = host.fingerprints()

    def result(outcome: ProbeOutcome, detail: str, presented: str | None = None, **kw: Any) -> ProbeResult:
        return ProbeResult(
            host=host.name, outcome=outcome, detail=detail, elapsed_s=round(time.monotonic() - start, 3),
            pinned_fingerprints=pinned, presented_fingerprint=presented, **kw,
        )

    remote = Remote(host, hosts_dir, timeouts)
    try:
        remote.connect()
        presented = fingerprint(remote.presented_key())
        try:
            res = remote.run([host.python, "-c", _FACTS, host.work_dir], timeout_s=timeouts.command)
        except (RemoteError, paramiko.SSHException, OSError, EOFError) as e:
            return result(ProbeOutcome.TIMEOUT, f"no answer to the fact-finding command: {type(e).__name__}", presented)
        if res.timed_out:
            return result(ProbeOutcome.TIMEOUT, f"fact-finding command took over {timeouts.command:g} s", presented)
    except RemoteError as e:
        return result(e.outcome or ProbeOutcome.UNREACHABLE, str(e), e.presented_fingerprint)
    finally:
        remote.close()
    facts = _parse_facts(res.stdout)
    spec = load_specs(Path(hosts_dir)).get(host.spec)
    model = spec.gpu if spec and host.arch != "cpu" else None
    wrong_gpu = _wrong_gpu(host, facts, model)
    mismatches = _mismatches(host, facts, wrong_gpu)
    detail = "connected" + (f"; {len(mismatches)} mismatch(es) with the inventory" if mismatches else "")
    return result(ProbeOutcome.OK, detail, presented, facts=facts, mismatches=mismatches, wrong_gpu=wrong_gpu)
