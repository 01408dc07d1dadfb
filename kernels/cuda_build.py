"""Build CUDA C++ kernels with the host's own nvcc for the GPU's own arch, and launch them.

Why not a torch extension: that needs a host C++ toolchain and Python headers and takes a minute
to compile; a cubin needs only nvcc (seconds) and the driver, which every GPU host has. The cubin
is cached by the hash of (prelude, source, nvcc version, arch, flags), like Triton's cache, so
`engine.build` compiles once and the benches load it. Launches go through the driver API on
torch's current stream, so they are captured by CUDA graphs like any other kernel; a launch may ask
for programmatic dependent launch (sm_90 on), so that its CTAs start while the kernel before it drains
(the kernel then waits for that one's results with griddepcontrol.wait). A `Launch` is set up once
(config struct, argument buffer), so an eager call pays the driver's launch and little else; a
`Chain` makes a call's launches in one call into the host launcher (launch_chain.c, a small shared
library the same nvcc builds), or, where that did not build, one ctypes call a launch. The
driver also answers what a device allows (`device_attribute`) and what a kernel needs
(`Kernel.attribute`), which the MoE's config check reads.

A host without nvcc (or with one that fails) gets `CudaUnavailable` with the reason; the callers
then run the Triton kernel and say so (build.json, the impl column). One whose nvcc builds the cubin
but not the launcher (no host compiler) launches from Python, and build.json says so.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
NVCC_FLAGS = ("-cubin", "-O3", "-std=c++17")
HOST_FLAGS = ("-shared", "-O2", "-cudart", "none", "-Xcompiler", "-fPIC")
LAUNCHER = "launch_chain.c"
NVCC_TIMEOUT_S = 600
_QUOTED_INCLUDE = re.compile(rb'^#include "([^"/]+)"', re.MULTILINE)
DEFAULT_NVCC = Path("/usr/local/cuda/bin/nvcc")
_MAX_DYNAMIC_SMEM = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
# cuda.h's CUdevice_attribute values read by device_attribute
MAX_REGISTERS_PER_BLOCK = 12
MAX_REGISTERS_PER_MULTIPROCESSOR = 82
MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97
# cuda.h's CUfunction_attribute values read by Kernel.attribute
FUNC_MAX_THREADS_PER_BLOCK = 0
FUNC_SHARED_SIZE_BYTES = 1
FUNC_NUM_REGS = 4
_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID


class LaunchAttribute(ctypes.Structure):
    """cuda.h's CUlaunchAttribute: an id, padded to 8 bytes, then a 64-byte value union."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("value_pad", ctypes.c_char * 60)]


class LaunchConfig(ctypes.Structure):
    """cuda.h's CUlaunchConfig."""

    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(LaunchAttribute)),
                ("num_attrs", ctypes.c_uint)]


class CudaUnavailable(RuntimeError):
    """This host cannot build or load the CUDA kernels; the message says why."""


def nvcc_path() -> str:
    """nvcc from $CUDA_HOME/bin, then PATH, then /usr/local/cuda/bin (where SSH sessions often lack it on PATH)."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    for found in (home and Path(home) / "bin" / "nvcc", shutil.which("nvcc"), DEFAULT_NVCC):
        if found and Path(found).is_file():
            return str(found)
    raise CudaUnavailable("nvcc not found (looked in $CUDA_HOME/bin, PATH, /usr/local/cuda/bin); "
                          "set CUDA_HOME to the CUDA toolkit")


@cache
def nvcc_version(nvcc: str) -> str:
    """nvcc's release line, e.g. 'release 13.0, V13.0.88'."""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise CudaUnavailable(f"nvcc --version failed: {type(e).__name__}") from None
    line = next((ln for ln in out.splitlines() if "release" in ln), "")
    return line.split(",", 1)[-1].strip()[:80] or "unknown"


def arch_of(device: torch.device) -> str:
    """'sm_90' for an H200, 'sm_120' for an RTX PRO 6000, ...: the cubin's target."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def cache_dir() -> Path:
    return Path(os.environ.get("KDBENCH_CUDA_CACHE") or Path.home() / ".cache" / "kdbench" / "cuda")


def compile_cubin(source: Path, arch: str, prelude: str = "") -> Path:
    """The cached cubin of `source` for `arch`, compiled after `prelude` (source text: what the host
    decides for this build, e.g. the MoE's layout and kernel list) now if missing (atomic: tmp file,
    then rename). nvcc reads prelude + source as one file whose lines name `source` (a #line). The
    headers `source` includes by quotes lie beside it (found there, one level: they include none)
    and are part of the cache key, so editing one builds a new cubin."""
    num = arch.removeprefix("sm_")
    body = source.read_bytes()
    text = f'{prelude}#line 1 "{source.name}"\n'.encode() + body
    headers = []
    for name in _QUOTED_INCLUDE.findall(body):
        header = source.parent / name.decode()
        if not header.is_file():
            raise CudaUnavailable(f"{source.name} includes {name.decode()!r}, which is not beside it")
        headers.append(header.read_bytes())
    return _build(source, text, ".cu", f"-{arch}", ".cubin", (*NVCC_FLAGS, f"-gencode=arch=compute_{num},code=sm_{num}"),
                  b"\0".join(headers), source.parent)


def compile_host_library(source: Path) -> Path:
    """The cached shared library of host C source `source` (kernels/launch_chain.c), built by the same
    nvcc (its host compiler does the work): needs no CUDA headers or runtime, only a host compiler."""
    return _build(source, source.read_bytes(), ".c", "", ".so", HOST_FLAGS)


def _build(source: Path, text: bytes, unit_suffix: str, tag: str, suffix: str, flags: tuple[str, ...],
           headers: bytes = b"", include: Path | None = None) -> Path:
    """nvcc `flags` on `text` (named `source` in messages), cached by the hash of text, the `headers` it
    includes (found in `include`), nvcc version and flags."""
    nvcc = nvcc_path()
    version = nvcc_version(nvcc)
    key = hashlib.sha256(b"\0".join([text, headers, version.encode(), " ".join(flags).encode()])).hexdigest()
    out = cache_dir() / f"{source.stem}{tag}-{key[:16]}{suffix}"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    unit = out.with_suffix(f".{os.getpid()}{unit_suffix}")
    unit.write_bytes(text)
    try:
        res = subprocess.run([nvcc, *flags, *([f"-I{include}"] if include else []), "-o", str(tmp), str(unit)],
                             capture_output=True, text=True, timeout=NVCC_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise CudaUnavailable(f"nvcc took over {NVCC_TIMEOUT_S} s on {source.name}") from None
    finally:
        unit.unlink(missing_ok=True)
    if res.returncode != 0:
        tmp.unlink(missing_ok=True)
        tail = " | ".join((res.stderr or res.stdout).replace(str(unit), source.name).replace(
            str(source.parent), "kernels").replace(str(tmp), "out" + suffix).strip().splitlines()[-4:])[:600]
        what = f" for {tag[1:]}" if tag else ""
        raise CudaUnavailable(f"nvcc failed on {source.name}{what} (exit {res.returncode}): {tail}")  # no host paths
    os.replace(tmp, out)
    return out


@cache
def _driver() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise CudaUnavailable(f"the CUDA driver library does not load: {e}") from None
    _check(lib, lib.cuInit(0), "cuInit")
    return lib


def _check(lib: ctypes.CDLL, rc: int, what: str) -> None:
    if rc != 0:
        msg = ctypes.c_char_p()
        lib.cuGetErrorString(rc, ctypes.byref(msg))
        raise RuntimeError(f"{what} failed: CUDA error {rc} ({(msg.value or b'?').decode()})")


def device_attribute(index: int, attribute: int) -> int:
    """cuDeviceGetAttribute of CUDA device `index` (the ordinal torch uses): the driver's own limits."""
    lib = _driver()
    dev, value = ctypes.c_int(), ctypes.c_int()
    _check(lib, lib.cuDeviceGet(ctypes.byref(dev), index), f"cuDeviceGet({index})")
    _check(lib, lib.cuDeviceGetAttribute(ctypes.byref(value), attribute, dev), f"cuDeviceGetAttribute({attribute})")
    return value.value


class Kernel:
    """One __global__ function of a loaded module: its attributes, and launches through `Launch`."""

    def __init__(self, lib: ctypes.CDLL, fn: ctypes.c_void_p, name: str) -> None:
        self.lib, self.fn, self.name, self._smem = lib, fn, name, 0

    def attribute(self, attribute: int) -> int:
        """cuFuncGetAttribute: what the compiled function needs (registers, static shared memory) on this device."""
        value = ctypes.c_int()
        _check(self.lib, self.lib.cuFuncGetAttribute(ctypes.byref(value), attribute, self.fn),
               f"{self.name}: cuFuncGetAttribute({attribute})")
        return value.value

    def reserve_smem(self, smem: int) -> None:
        """Opt in to `smem` bytes of dynamic shared memory a launch (needed above 48 KB), once per size."""
        if smem > self._smem:
            _check(self.lib, self.lib.cuFuncSetAttribute(self.fn, _MAX_DYNAMIC_SMEM, ctypes.c_int(smem)),
                   f"{self.name}: cuFuncSetAttribute({smem} bytes)")
            self._smem = smem


class Launch:
    """One launch of a kernel, set up once: its config (grid, 1-D block, dynamic shared memory,
    programmatic dependent launch) and its arguments, 8 bytes a slot in `args` (a view of the
    caller's int64 buffer: pointers, and ints read from the low 4 bytes). A call writes the stream
    and launches on it: nothing is built per call, which is what an eager caller pays for."""

    def __init__(self, kernel: Kernel, grid: Sequence[int], block: int, smem: int, args: np.ndarray, pdl: bool) -> None:
        if args.dtype != np.int64 or not args.flags.c_contiguous:
            raise ValueError("Launch arguments must be a contiguous int64 buffer")
        kernel.reserve_smem(smem)
        self.kernel, self.args = kernel, args
        self.params = (ctypes.c_void_p * len(args))(*(args.ctypes.data + 8 * i for i in range(len(args))))
        self.config = launch_config(grid, block, smem, 0, pdl)
        self._config = ctypes.byref(self.config)
        self._launch = kernel.lib.cuLaunchKernelEx

    def __call__(self, stream: int) -> None:
        """Launch on `stream` (a raw CUstream: torch's current one, so CUDA graphs capture it)."""
        self.config.stream = stream
        rc = self._launch(self._config, self.kernel.fn, self.params, None)
        if rc:
            _check(self.kernel.lib, rc, f"launch {self.kernel.name}")


class _ChainPlan(ctypes.Structure):
    """launch_chain.c's Plan: pointers and counts, 8 bytes each."""

    _fields_ = [("launch", ctypes.c_void_p), ("n_launches", ctypes.c_int64), ("n_args", ctypes.c_int64),
                ("args", ctypes.c_void_p), ("which", ctypes.c_void_p), ("offset", ctypes.c_void_p),
                ("bases", ctypes.c_void_p), ("config", ctypes.c_void_p), ("fn", ctypes.c_void_p),
                ("params", ctypes.c_void_p)]


@cache
def host_launcher() -> tuple[ctypes.CDLL | None, str | None]:
    """(launch_chain.c built and loaded, None), or (None, why not: no nvcc, no host compiler, it does not
    load). Without it a Chain launches from Python, one driver call a launch: slower, never a failure."""
    try:
        lib = ctypes.CDLL(str(compile_host_library(HERE / LAUNCHER)))
    except (CudaUnavailable, OSError) as e:
        return None, str(e)[:300]
    lib.launch_chain.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.launch_chain.restype = ctypes.c_int64
    return lib, None


class Chain:
    """Launches set up once, made in order by one call: `bases` (n base pointers, bases[0] stays 0)
    is written by the caller, then `launch(stream)` sets each argument slot to bases[which] + offset
    and makes the launches. Through the host launcher (`host`: launch_chain.c) that is one ctypes call;
    without it, a numpy fill and one ctypes call a launch (`path` says which)."""

    def __init__(self, launches: Sequence[Launch], args: np.ndarray, which: np.ndarray, offset: np.ndarray,
                 n_bases: int, host: ctypes.CDLL | None) -> None:
        if not launches or not len(args) == len(which) == len(offset) or not 0 <= which.min() <= which.max() < n_bases:
            raise ValueError("Chain: launches, and one base index below n_bases and one offset an argument slot")
        self.launches, self.bases = list(launches), (ctypes.c_int64 * n_bases)()
        self._args, self._which = args, which.astype(np.int64)
        self._offset = np.ascontiguousarray(offset, dtype=np.int64)
        self._base_view = np.frombuffer(self.bases, dtype=np.int64)
        self.path = "c" if host is not None else "ctypes"
        if host is None:
            self.launch = self._in_python
            return
        n = len(self.launches)
        self._keep = ((ctypes.POINTER(LaunchConfig) * n)(*(ctypes.pointer(ln.config) for ln in self.launches)),
                      (ctypes.c_void_p * n)(*(ln.kernel.fn for ln in self.launches)),
                      (ctypes.c_void_p * n)(*(ctypes.cast(ln.params, ctypes.c_void_p) for ln in self.launches)))
        driver = self.launches[0].kernel.lib
        self.plan = _ChainPlan(ctypes.cast(driver.cuLaunchKernelEx, ctypes.c_void_p).value, n, len(args),
                               args.ctypes.data, self._which.ctypes.data, self._offset.ctypes.data,
                               ctypes.addressof(self.bases), *(ctypes.addressof(a) for a in self._keep))
        self._plan, self._run = ctypes.byref(self.plan), host.launch_chain
        self.launch = self._in_c

    def _in_c(self, stream: int) -> None:
        rc = self._run(self._plan, stream)
        if rc:
            launch = self.launches[(rc >> 32) - 1]
            _check(launch.kernel.lib, rc & 0xFFFFFFFF, f"launch {launch.kernel.name}")

    def _in_python(self, stream: int) -> None:
        np.add(self._base_view[self._which], self._offset, out=self._args)
        for launch in self.launches:
            launch(stream)


def launch_config(grid: Sequence[int], block: int, smem: int, stream: int, pdl: bool) -> LaunchConfig:
    """cuLaunchKernelEx's config: a 1-D block, up to 3 grid dims, and the programmatic-serialization
    attribute when `pdl` (the config holds the attribute alive)."""
    attr = LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
    return LaunchConfig(grid=(ctypes.c_uint * 3)(*(*grid, 1, 1)[:3]), block=(ctypes.c_uint * 3)(block, 1, 1),
                        smem=smem, stream=stream, attrs=ctypes.pointer(attr), num_attrs=int(pdl))


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream(index: int) -> int:
    """torch's current raw stream on device `index` (the private call torch's own extensions use: a
    tenth of the cost of torch.cuda.current_stream(), which builds a Stream object)."""
    return _RAW_STREAM(index) if _RAW_STREAM is not None else torch.cuda.current_stream(index).cuda_stream


class Module:
    """A cubin loaded into the current device's primary context."""

    def __init__(self, cubin: Path, device: torch.device) -> None:
        lib = _driver()
        torch.cuda.init()
        with torch.cuda.device(device):
            torch.empty(1, device=device)  # torch makes the primary context current on this thread
            self.lib, self.handle = lib, ctypes.c_void_p()  # the driver copies the image at load time
            _check(lib, lib.cuModuleLoadData(ctypes.byref(self.handle), cubin.read_bytes()), f"load {cubin.name}")
        self.cubin, self._kernels = cubin, {}

    def kernel(self, name: str) -> Kernel:
        if name not in self._kernels:
            fn = ctypes.c_void_p()
            _check(self.lib, self.lib.cuModuleGetFunction(ctypes.byref(fn), self.handle, name.encode()),
                   f"{self.cubin.name}: function {name}")
            self._kernels[name] = Kernel(self.lib, fn, name)
        return self._kernels[name]


@cache
def module(source_name: str, device: torch.device, prelude: str = "") -> Module:
    """kernels/<source_name> built after `prelude` (or taken from the cache) for `device`'s arch, and loaded."""
    if device.type != "cuda":
        raise CudaUnavailable(f"{source_name} needs a CUDA device, not {device.type}")
    return Module(compile_cubin(HERE / source_name, arch_of(device), prelude), device)
