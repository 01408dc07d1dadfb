"""What this host is: device, arch, versions. The provenance every result file carries."""

from __future__ import annotations

import platform
import subprocess
import sys
from datetime import datetime, timezone

import torch


class UsageError(Exception):
    """Bad arguments, arch or device: the CLIs print the message and exit 2."""


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def arch_of(major: int, minor: int) -> str:
    return f"sm_{major}{minor}"


def triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def driver_version() -> str | None:
    """The NVIDIA driver version from nvidia-smi, None when there is none to ask."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if out.returncode == 0 and lines else None


def facts() -> dict:
    """Device found + versions; never touches CUDA APIs when no GPU is visible."""
    gpu = torch.cuda.is_available() and torch.cuda.device_count() > 0
    f = {
        "device": "cuda" if gpu else "cpu",
        "gpu_name": None, "gpu_count": 0, "arch_found": "cpu", "driver": None,
        "cuda": torch.version.cuda, "torch": torch.__version__, "triton": triton_version(),
        "python": platform.python_version(),
    }
    if gpu:
        f["gpu_name"] = torch.cuda.get_device_name(0)
        f["gpu_count"] = torch.cuda.device_count()
        f["arch_found"] = arch_of(*torch.cuda.get_device_capability(0))
        f["driver"] = driver_version()
    else:
        f["gpu_name"] = f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)"
    return f


def pick_device(requested: str, found: dict) -> torch.device:
    """auto -> cuda when present; an explicit cuda on a GPU-less host is a usage error."""
    if requested not in ("auto", "cuda", "cpu"):
        raise UsageError(f"--device must be auto, cuda or cpu, got {requested!r}")
    if requested == "cuda" and found["device"] != "cuda":
        raise UsageError("--device cuda asked but no CUDA GPU is visible on this host")
    if requested == "cpu" or found["device"] == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", 0)


def check_arch(asked: str, found: dict) -> None:
    """The arch the inventory promised must be the arch this host has."""
    if asked == found["arch_found"]:
        return
    if asked.startswith("sm_") and found["device"] == "cpu":
        raise UsageError(f"--arch {asked} asked but no CUDA GPU is visible on this host (found: cpu)")
    raise UsageError(f"--arch {asked} does not match the device found: {found['arch_found']}"
                     + (f" ({found['gpu_name']})" if found["device"] == "cuda" else ""))


def fail(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(2)
