"""GPU busy time per decode step, and how it divides among kernel families, from the profiler's
device records.

The step's wall time minus the time the GPU spent running kernels (and copies) in it is the time
outside kernels: Python, launches, synchronisation. Each timed step is bracketed in the device
stream by a marker kernel (torch.cuda._sleep's `spin_kernel`), so harness work between steps
(the steering hints) never counts.

Inside a step, the engine brackets the calls of each kernel family it knows (`section`: the routed
MoE, attention, the lm-heads, the tree kernels) with a marker kernel of that family's own name, so
every kernel such a call launches counts to its family whatever it is called; of the kernels outside
the sections, GEMMs (by name) are `dense` and the rest `other`. The section markers are launched
only while `sections()` is on (the profiled decode, whose CUDA graphs capture them), never in the
measured one.
"""

from __future__ import annotations

import contextlib
import re
from typing import Callable, Iterable, Iterator, TypeVar

import torch
from torch.profiler import ProfilerActivity, profile

MARK = "spin_kernel"
FAMILIES = ("moe", "attention", "dense", "lm_head", "tree", "other")
SECTIONS = ("moe", "attention", "lm_head", "tree")
SECTION_MARK = "kdbench_section_"  # + family: the marker kernel's name
# cuBLAS / cuBLASLt / CUTLASS GEMM and GEMV kernels (and cuBLAS's split-K reduction) as the profiler names them
GEMM = re.compile(r"gemm|gemv|nvjet|cutlass|xmma|splitKreduce", re.IGNORECASE)
T = TypeVar("T")
_on = False
_markers: dict[str, Callable[[], None]] = {}


def mark() -> None:
    """One marker kernel on the current stream (a one-cycle spin)."""
    torch.cuda._sleep(1)


@contextlib.contextmanager
def sections() -> Iterator[None]:
    """Launch the family markers of `section` while inside (a profiled decode)."""
    global _on
    _on, before = True, _on
    try:
        yield
    finally:
        _on = before


@contextlib.contextmanager
def section(family: str) -> Iterator[None]:
    """Bracket the kernels launched inside with `family`'s marker, while `sections()` is on."""
    if not _on:
        yield
        return
    marker = _markers.get(family) or _markers.setdefault(family, _section_marker(family))
    marker()
    try:
        yield
    finally:
        marker()


def _section_marker(family: str) -> Callable[[], None]:
    """A launch of the empty kernel named SECTION_MARK + family (a Triton kernel takes its function's name)."""
    import triton

    @triton.jit
    def kdbench_section_moe(x):
        pass

    @triton.jit
    def kdbench_section_attention(x):
        pass

    @triton.jit
    def kdbench_section_lm_head(x):
        pass

    @triton.jit
    def kdbench_section_tree(x):
        pass

    kernels = {"moe": kdbench_section_moe, "attention": kdbench_section_attention,
               "lm_head": kdbench_section_lm_head, "tree": kdbench_section_tree}
    if family not in kernels:
        raise ValueError(f"unknown section {family!r}; one of {SECTIONS}")
    kernel, flag = kernels[family], torch.zeros(1, device="cuda")
    return lambda: kernel[(1,)](flag)


def split_per_window(activities: Iterable[tuple[str, int, int]]) -> list[dict[str, float]]:
    """(name, start_ns, end_ns) device activities -> busy seconds by family of each window between
    two step marks.

    Step marks alternate open / close; a family's section marks likewise inside a step. Busy is the
    union of the other activities' intervals inside a window (kernels of one stream never overlap,
    copies on another stream may): each activity adds what it runs beyond those before it, to its
    section's family, else `dense` for a GEMM and `other` for the rest.
    """
    out: list[dict[str, float]] = []
    inside, cur_end, open_section = False, None, None
    busy = dict.fromkeys(FAMILIES, 0)
    for name, start, end in sorted(activities, key=lambda a: a[1]):
        if MARK in name:
            if inside:
                out.append({f: ns / 1e9 for f, ns in busy.items()})
            inside, cur_end, open_section = not inside, None, None
            busy = dict.fromkeys(FAMILIES, 0)
            continue
        if SECTION_MARK in name:
            fam = name[name.index(SECTION_MARK) + len(SECTION_MARK):].split("(")[0]
            open_section = None if open_section == fam else fam
            continue
        if not inside or (cur_end is not None and end <= cur_end):
            continue
        fam = open_section or ("dense" if GEMM.search(name) else "other")
        busy[fam] += end - max(start, cur_end if cur_end is not None else start)
        cur_end = end
    return out


def busy_per_window(activities: Iterable[tuple[str, int, int]]) -> list[float]:
    """Busy seconds of each window between two step marks (all families together)."""
    return [sum(w.values()) for w in split_per_window(activities)]


def profiled(fn: Callable[[], T], windows: Callable[[T], int]) -> tuple[T, list[dict[str, float]]]:
    """Run fn under the CUDA activity profiler with the family sections on; return its result and
    the busy seconds by family per marked window, checked against the number of windows the result
    says it marked."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof, sections():
        res = fn()
        torch.cuda.synchronize()
    acts = [(e.name(), e.start_ns(), e.start_ns() + e.duration_ns()) for e in prof.profiler.kineto_results.events()
            if e.device_type() != torch.autograd.DeviceType.CPU]
    split = split_per_window(acts)
    if len(split) != windows(res):
        names = sorted({a[0] for a in acts})
        raise RuntimeError(f"gpu_busy: {len(split)} marked windows for {windows(res)} steps "
                           f"({len(acts)} device activities, e.g. {names[:6]})")
    return res, split
