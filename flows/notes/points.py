"""Which stored points a page shows: the MoE points the engine runs, the full-depth e2e rows, the
ceilings a run measured, the step split by family, how a point is named. No formatting, no markup."""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence, TypeVar

from engine.config import CONFIGS
from engine.rows import COLUMNS, E2ERow, KernelRow
from flows.analysis.families import point_key, preferred, tp_of
from flows.inventory.hosts import Spec
from flows.notes.fmt import per
from flows.notes.views import Run

PLATEAU = 0.9           # plateau M: first M reaching this fraction of the best MoE bandwidth
HEADLINE_CONCURRENCY = (1, 16)
T = TypeVar("T")
# The per-family split of a step (GPU kernel families, the host time outside them, comm) as columns
FAMILY_NAMES = {COLUMNS.moe_ms: "moe", COLUMNS.attention_ms: "attention", COLUMNS.dense_ms: "dense",
                COLUMNS.lm_head_ms: "lm_head", COLUMNS.tree_ms: "tree", COLUMNS.gpu_other_ms: "other kernels",
                COLUMNS.outside_ms: "host", COLUMNS.comm_ms: "comm"}
FAMILY_TERMS = tuple(FAMILY_NAMES)


def ceilings_of(run: Run, spec: Spec | None) -> tuple[float | None, float | None]:
    r = run.runs_row
    return r.copy_gbps or (spec.mem_bw_gbps if spec else None), \
        r.matmul_tflops or (spec.tflops.get("bf16") if spec else None)


def moe_points(run: Run, tp: int = 1) -> list[KernelRow]:
    """MoE W4A16 points at one TP degree's shapes (1: full shapes) of the kernel the engine runs
    at each M (CUDA or Triton: `preferred`), by M. Full and shard rows are never mixed."""
    pts = [k for k in run.rows("kernels") if k.kernel == "moe_w4a16" and k.M and tp_of(k) == tp]
    return sorted(preferred(pts), key=lambda k: k.M)


def impls_of(pts: list[KernelRow]) -> str:
    """The implementations of some points, in order of first appearance: "cuda, triton"."""
    return ", ".join(dict.fromkeys(k.impl for k in pts))


def moe_degrees(run: Run) -> list[int]:
    """The TP degrees the run's MoE points were measured at: 1 (full shapes) first, then the shards."""
    return sorted({tp_of(k) for k in run.rows("kernels") if k.kernel == "moe_w4a16" and k.M})


def gbps(k: KernelRow) -> float:
    """A kernel point's achieved bandwidth, as its row carries it (NaN where the row has none)."""
    return math.nan if k.achieved_gbps is None else k.achieved_gbps


def tflops(k: KernelRow) -> float:
    """A kernel point's achieved compute rate, as its row carries it (NaN where the row has none)."""
    return math.nan if k.achieved_tflops is None else k.achieved_tflops


def plateau_m(points: list[KernelRow]) -> int | None:
    gb = [gbps(k) for k in points]
    top = max((g for g in gb if math.isfinite(g)), default=None)
    return next((k.M for k, g in zip(points, gb) if top is not None and g >= PLATEAU * top), None)


def best_moe(run: Run) -> KernelRow | None:
    """The MoE point of the highest bandwidth (None when no point has a usable one)."""
    pts = [k for k in moe_points(run) if math.isfinite(gbps(k))]
    return max(pts, key=lambda k: (gbps(k), -k.M)) if pts else None


def full_depth(row: E2ERow) -> int:
    return CONFIGS[row.config].layers if row.config in CONFIGS else row.layers or 0


def at_full_depth(run: Run) -> list[E2ERow]:
    """The run's e2e rows with a figure that decode the model's whole depth: deployment figures."""
    return [e for e in run.rows("e2e") if e.tokens_per_s and e.layers and e.layers >= full_depth(e)]


def shortest_context(rows: list[E2ERow]) -> list[E2ERow]:
    """The rows at the shortest prompts of their (tp, concurrency): the short-prompt sweep, not the
    context axis beside it (a row without a context counts as short)."""
    low: dict[tuple[int, int], int] = {}
    for e in rows:
        key = (tp_of(e), e.concurrency)
        low[key] = min(low.get(key, e.context or 0), e.context or 0)
    return [e for e in rows if (e.context or 0) == low[(tp_of(e), e.concurrency)]]


def full_model_rows(run: Run) -> dict[int, E2ERow]:
    """Per headline concurrency, the fastest full-depth e2e row at the run's largest TP degree, at
    its shortest prompts."""
    rows = shortest_context(at_full_depth(run))
    if not rows:
        return {}
    tp = max(tp_of(e) for e in rows)
    out = {}
    for c in HEADLINE_CONCURRENCY:
        at = [e for e in rows if tp_of(e) == tp and e.concurrency == c]
        if at:
            out[c] = max(at, key=lambda e: (e.tokens_per_s, -e.budget))
    return out


def no_full_depth(run: Run) -> str:
    """Why a run has no deployment figure, in words ("" when it has one or has no e2e rows)."""
    if at_full_depth(run):
        return ""
    depths = sorted({e.layers for e in run.rows("e2e") if e.layers})
    if not depths:
        return ""
    return (f"no full-depth e2e rows yet (the e2e rows here have {'/'.join(map(str, depths))} layers: "
            "kernel tests, not deployment figures)")


def point_key_sort(k: KernelRow) -> tuple:
    return tuple((v is None, v if v is not None else 0) for v in point_key(k))


def roofline_us(k: KernelRow, copy: float | None, mm: float | None) -> float | None:
    """A point's floor: max(bytes / copy bandwidth, flops / matmul rate) at the run's own ceilings (us)."""
    if not copy or not mm:
        return None
    return max(k.bytes / (copy * 1e3), k.flops / (mm * 1e6))


def family_split(row: E2ERow) -> dict[str, float] | None:
    """The step by kernel family, host time and comm (ms), where the row has the family split."""
    if row.moe_ms is None:
        return None
    return {t: float(getattr(row, t) or 0.0) for t in FAMILY_TERMS}


def spread(k: KernelRow) -> float:
    if k.time_us_p10 is None or k.time_us_p90 is None:
        return 0.0
    s = per(k.time_us_p90 - k.time_us_p10, k.time_us_p50)
    return s if math.isfinite(s) else 0.0


def group_by(rows: list[T], key: Callable[[T], Any]) -> dict[Any, list[T]]:
    out: dict[Any, list[T]] = {}
    for r in rows:
        out.setdefault(key(r), []).append(r)
    return out


def point_labels(rows: Sequence[E2ERow]) -> Callable[[E2ERow], str]:
    """How an e2e point is named in the split, busy and comparison tables: its budget and
    concurrency, plus depth, TP degree, acceptance level and context where the rows differ in them."""
    axes = [(name, get) for name, get in (("L", lambda e: e.layers), ("tp", tp_of),
                                          ("a", lambda e: e.synthetic_accept), ("ctx", lambda e: e.context))
            if len({get(e) for e in rows}) > 1]

    def name(e: E2ERow) -> str:
        return " ".join([f"B={e.budget} c={e.concurrency}"] +
                        [f"{a}={'-' if get(e) is None else format(get(e), 'g')}" for a, get in axes])
    return name
