"""GPU busy time per decode step, from the profiler's device records.

The step's wall time minus the time the GPU spent running kernels (and copies) in it is the time
outside kernels: Python, launches, synchronisation. Each timed step is bracketed in the device
stream by a marker kernel (torch.cuda._sleep's `spin_kernel`), so harness work between steps
(the steering hints) never counts.
"""

from __future__ import annotations

from typing import Callable, Iterable, TypeVar

import torch
from torch.profiler import ProfilerActivity, profile

MARK = "spin_kernel"
T = TypeVar("T")


def mark() -> None:
    """One marker kernel on the current stream (a one-cycle spin)."""
    torch.cuda._sleep(1)


def busy_per_window(activities: Iterable[tuple[str, int, int]]) -> list[float]:
    """(name, start_ns, end_ns) device activities -> busy seconds of each window between two marks.

    Markers alternate open / close; busy = the union of the other activities' intervals inside a
    window (kernels of one stream never overlap, copies on another stream may).
    """
    out: list[float] = []
    inside, busy, cur_end = False, 0, None
    for name, start, end in sorted(activities, key=lambda a: a[1]):
        if MARK in name:
            if inside:
                out.append(busy / 1e9)
            inside, busy, cur_end = not inside, 0, None
            continue
        if not inside:
            continue
        if cur_end is None or start >= cur_end:
            busy += end - start
            cur_end = end
        elif end > cur_end:
            busy += end - cur_end
            cur_end = end
    return out


def profiled(fn: Callable[[], T], windows: Callable[[T], int]) -> tuple[T, list[float]]:
    """Run fn under the CUDA activity profiler; return its result and the busy seconds per marked
    window, checked against the number of windows the result says it marked."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        res = fn()
        torch.cuda.synchronize()
    acts = [(e.name(), e.start_ns(), e.start_ns() + e.duration_ns()) for e in prof.profiler.kineto_results.events()
            if e.device_type() != torch.autograd.DeviceType.CPU]
    busy = busy_per_window(acts)
    if len(busy) != windows(res):
        names = sorted({a[0] for a in acts})
        raise RuntimeError(f"gpu_busy: {len(busy)} marked windows for {windows(res)} steps "
                           f"({len(acts)} device activities, e.g. {names[:6]})")
    return res, busy
