"""Kernel timing and the device's own ceilings.

On CUDA: warm-up, then per repeat an L2 flush (`flush_l2`: a buffer larger than L2 is read)
followed by a pair of device events around the op, replayed from a CUDA graph when the op allows
capture (launch gaps would otherwise dominate small ops), eager otherwise. On the CPU: perf_counter
around each call; those rows carry device "cpu". `host_us`: the host side of an eager call.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

FLUSH_BYTES = 256 << 20  # > L2 of every GPU in the fleet (H200 50 MB, B300 ~128 MB)
METHOD = (f"CUDA-graph replays (eager where an op cannot be captured), median, each after a read of "
          f"{FLUSH_BYTES >> 20} MB (L2 cold and clean)")


@dataclass
class Timing:
    p10_us: float
    p50_us: float
    p90_us: float
    repeats: int
    graph: bool


def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100] (numpy's default method)."""
    if not xs:
        raise ValueError("percentile of an empty list")
    return float(np.percentile(xs, q))


def _summary(us: list[float], graph: bool) -> Timing:
    p10, p50, p90 = (float(v) for v in np.percentile(us, [10, 50, 90]))
    return Timing(p10, p50, p90, len(us), graph)


def _try_graph(fn: Callable[[], object], device: torch.device) -> "torch.cuda.CUDAGraph | None":
    """Capture fn in a CUDA graph, or None when it cannot be captured (host syncs, CPU work).

    A dry run under sync-debug "error" first: an op that waits on the host is never captured,
    so a failed capture never has to be cleaned up.
    """
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError:
        return None
    finally:
        torch.cuda.set_sync_debug_mode(prev)
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(device).wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        g.replay()
        torch.cuda.synchronize(device)
        return g
    except Exception:  # capture is best effort: any failure means eager timing
        torch.cuda.synchronize(device)
        return None


def flush_l2(scratch: torch.Tensor) -> None:
    """Evict L2 by reading `scratch` (larger than L2), leaving it holding clean lines.

    Why a read: zeroing the buffer (Triton do_bench's flush) leaves L2 full of dirty lines, and the
    timed op pays for writing them back (kernels/NOTES.md v13 measured what that adds to a MoE call).
    Before a layer of a real step L2 holds mostly clean lines.
    """
    scratch.max()


def time_op(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 3,
            graph: bool = True, flush: bool = True, before: Callable[[], object] | None = None) -> Timing:
    """Per-call time of fn on `device` (see module doc). `before` runs ahead of each timed call, outside
    the timing: the comm suite's barrier, so every rank enters each collective together."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        us = []
        for _ in range(repeats):
            if before is not None:
                before()
            t = time.perf_counter()
            fn()
            us.append((time.perf_counter() - t) * 1e6)
        return _summary(us, False)
    torch.cuda.synchronize(device)
    g = _try_graph(fn, device) if graph else None
    run = g.replay if g is not None else fn
    scratch = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device) if flush else None
    pairs = []
    for _ in range(repeats):
        if scratch is not None:
            flush_l2(scratch)
        if before is not None:
            before()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        pairs.append((a, b))
    torch.cuda.synchronize(device)
    return _summary([a.elapsed_time(b) * 1e3 for a, b in pairs], g is not None)


def host_us(fn: Callable[[], object], device: torch.device, calls: int = 10, rounds: int = 20, warmup: int = 3) -> float:
    """Host time of one eager call of fn, called back to back: no graph, no synchronization between
    the calls of a round (the GPU runs behind), the device idle at each round's start; the median over
    `rounds` rounds of a round's mean over its `calls` calls. What an eager caller (prefill, the first
    decode steps) pays on the CPU per call, beside the GPU time, slow calls included: while the GPU is
    milliseconds behind, some calls take several times the median one (kernels/NOTES.md v18), so a
    round's mean scatters, and the many rounds keep one round from moving the figure."""
    for _ in range(warmup):
        fn()
    per_call = []
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter() - t) * 1e6 / calls)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return float(np.median(per_call))


def copy_gbps(device: torch.device) -> float:
    """Device copy bandwidth in GB/s, counting bytes read + written (1 GiB on CUDA, 64 MiB on CPU)."""
    n = (1 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    t = time_op(lambda: dst.copy_(src), device, repeats=20 if device.type == "cuda" else 5,
                graph=False, flush=False)
    return 2 * n / (t.p50_us * 1e-6) / 1e9


def matmul_tflops(device: torch.device) -> float:
    """Dense matmul rate: bf16 8192^3 on CUDA, float32 1024^3 on the CPU (bf16 is emulated there)."""
    if device.type == "cuda":
        n, dtype = 8192, torch.bfloat16
    else:
        n, dtype = 1024, torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    t = time_op(lambda: a @ b, device, repeats=20 if device.type == "cuda" else 5, graph=False, flush=False)
    return 2 * n**3 / (t.p50_us * 1e-6) / 1e12
