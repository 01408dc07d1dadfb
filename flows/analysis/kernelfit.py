"""Kernel-family time models fitted on a measured sweep: an additive roofline plus each point's own residual.

A family's points at one shape class (a TP degree's shard shapes; for dense GEMMs also the op) are
fitted by `latency + bytes / bandwidth + flops / compute` (non-negative least squares in relative
error): a fixed launch chain, the weight stream, the math. A class whose bytes barely vary (a dense
GEMM's weights at every M) cannot tell the first from the second; where its fit drops the byte term while
it has memory-bound points, its bytes move at the copy bandwidth, so the stream carries with the
bandwidth. The MoE's compute rate is one for all its shape classes (the same W4A16 inner loop), so the
full shapes' large-M points inform the shards'.
A query's time is that fit at the query's bytes and flops times the measured/fit ratio interpolated
between the measured shapes (flows.analysis.interp): a measured shape comes back as measured, a shape between
two lies on the family's own curve, and one outside the sweep follows the fit (the ratio held at the
edge) and is labelled extrapolated. Carried to another machine (`Carry`), the latency stays; at a point
the fit calls memory-bound the bandwidth goes by the carrier (flows.analysis.carrier) and the compute rate by
the ratio of the compute ceilings, at one it calls compute-bound (flop term at least byte term) all of the
time beyond the latency goes by that ratio; the latency-bound tree kernels stay as measured.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from engine.config import ModelConfig
from engine.costs import build_tree_cost, expected_experts, mla_cost, moe_cost, tree_accept_cost
from engine.rows import AcceptShape, KernelRow, MlaShape, MoeShape, Shape, TreeShape
from flows.analysis.carrier import Side, memory_gbps
from flows.analysis.families import COMPUTE, MEMORY, SHAPES, bound, host_side, preferred, shape_of, tp_of
from flows.analysis.interp import Estimate, interpolate

SHARED_COMPUTE = {"moe_w4a16"}
KEPT = {"build_tree", "tree_accept"}     # latency-bound on every GPU: carried unchanged
Key = tuple                              # a shape class: (tp,) or, for dense GEMMs, (op, tp)


def along(shape: Shape) -> dict[str, float]:
    """A kernel shape as the point `interpolate` reads: its swept axes, each by the kernels column it is
    stored in (the names an estimate's extrapolated and interpolated labels carry)."""
    return {shape.COLUMNS[a]: float(getattr(shape, a) or 0) for a in shape.SWEPT}


@dataclass(frozen=True)
class Fit:
    latency_us: float
    us_per_byte: float
    us_per_flop: float

    def us(self, nbytes: float, flops: float) -> float:
        return self.latency_us + nbytes * self.us_per_byte + flops * self.us_per_flop


@dataclass(frozen=True)
class ShapeClass:
    fit: Fit | None                                           # None: a latency-bound family, no roofline
    samples: tuple[tuple[Mapping[str, float], float], ...]   # shape -> measured / fit (no fit: the time)
    tp: int
    dtype: str                                                # whose ceilings its compute term carries by


@dataclass(frozen=True)
class Carry:
    """The reference and target as the carrier sees them (ceilings of the family's dtype), and the carrier's
    form (None: the shipped one)."""

    ref: Side
    tgt: Side
    form: str | None = None

    def fit(self, f: Fit) -> Fit:
        """The fit as a memory-bound point carries it: the byte term by the carrier, the flop term by the
        ratio of the compute ceilings."""
        gbps = 1e-3 / f.us_per_byte if f.us_per_byte else None
        per_byte = 1e-3 / min(memory_gbps(gbps, self.ref, self.tgt, self.form), self.tgt.gbps) if gbps else 0.0
        return Fit(f.latency_us, per_byte, f.us_per_flop * self.ref.tflops / self.tgt.tflops)

    def us(self, f: Fit, nbytes: float, flops: float) -> float:
        """The fit's time at a point, carried. A point the fit calls compute-bound (its flop term at least its
        byte term) carries all of its time beyond the latency by the compute ceilings' ratio: the additive fit
        keeps a byte term there that the math hides, and moving it with the memory carrier would make a
        compute-bound kernel faster on a machine of more bandwidth but the same math."""
        if bound(nbytes * f.us_per_byte, flops * f.us_per_flop) == COMPUTE:
            return f.latency_us + (f.us(nbytes, flops) - f.latency_us) * self.ref.tflops / self.tgt.tflops
        return self.fit(f).us(nbytes, flops)


@dataclass(frozen=True)
class FamilyModel:
    family: str
    classes: dict[Key, ShapeClass] = field(default_factory=dict)

    @property
    def axes(self) -> tuple[str, ...]:
        """The swept axes by the kernels column each is stored in (the names an estimate's labels carry)."""
        return tuple(SHAPES[self.family].COLUMNS[a] for a in SHAPES[self.family].SWEPT)

    def pick(self, key: Key) -> tuple[Key, str] | None:
        """The measured class a query of class `key` is carried from, and how ("" when measured)."""
        if key in self.classes:
            return key, ""
        same = [k for k in self.classes if k[:-1] == key[:-1]]
        if not same:
            return None
        near = min(same, key=lambda k: (abs(math.log(k[-1] / key[-1])), k[-1]))
        return near, f"re-sharded from TP-{near[-1]} points"

    def flop_share(self, key: Key, nbytes: float, flops: float) -> float | None:
        """The share of the fitted time (this machine) that is the flop term, at a point of measured class
        `key`; None without a fit. Where it stays small over the points fitted, the compute rate is not
        identified by them (the MoE at small M): a prediction where it is large rests on a guessed rate."""
        cls = self.classes.get(key)
        if cls is None or cls.fit is None:
            return None
        total = cls.fit.us(nbytes, flops)
        return flops * cls.fit.us_per_flop / total if total > 0 else None

    def time_us(self, key: Key, shape: Shape, nbytes: float, flops: float,
                carry: Callable[[str], Carry | None] | None = None) -> tuple[Estimate, str] | None:
        """The family's time at a shape of class `key` (None when the family has no class to carry it from);
        `carry(dtype)` gives the carry to another machine for a class's dtype (None: this machine)."""
        picked = self.pick(key)
        if picked is None:
            return None
        cls = self.classes[picked[0]]
        if cls.fit is None:     # time itself along the sweep, its edge trend extended; the same on any GPU
            return interpolate(cls.samples, along(shape), self.axes, beyond="slope"), picked[1]
        to = carry(cls.dtype) if carry else None
        us = cls.fit.us(nbytes, flops) if to is None else to.us(cls.fit, nbytes, flops)
        return interpolate(cls.samples, along(shape), self.axes).scaled(us), picked[1]


def cost_of(cfg: ModelConfig, shape: Shape, tp: int = 1) -> tuple[float, float]:
    """(bytes, flops) of a kernel at a shape (engine.costs) on one rank of TP-`tp`, the routed experts at the
    expected unique count."""
    if isinstance(shape, MoeShape):
        m = int(shape.tokens)
        return moe_cost(cfg, m, expected_experts(cfg.experts, cfg.top_k, m), tp=tp)
    if isinstance(shape, MlaShape):
        return mla_cost(cfg, int(shape.batch), int(shape.budget), int(shape.context), tp=tp)
    if isinstance(shape, TreeShape):
        return build_tree_cost(cfg, int(shape.batch), int(shape.budget))
    if isinstance(shape, AcceptShape):
        return tree_accept_cost(cfg, int(shape.batch), int(shape.budget))
    raise TypeError(f"no cost of a {type(shape).__name__} here (a dense GEMM's is engine.costs.dense_op_cost)")


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares by trying every subset of free columns (a handful of them)."""
    best, best_res = np.zeros(a.shape[1]), float(np.sum(b ** 2))
    for r in range(1, a.shape[1] + 1):
        for cols in itertools.combinations(range(a.shape[1]), r):
            x, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
            if np.all(x >= 0):
                res = float(np.sum((a[:, cols] @ x - b) ** 2))
                if res < best_res - 1e-12:
                    best_res, best = res, np.zeros(a.shape[1])
                    best[list(cols)] = x
    return best


def class_key(row: KernelRow) -> Key:
    return (row.op, tp_of(row)) if row.kernel == "dense_gemm" else (tp_of(row),)


def fit_family(name: str, rows: Sequence[KernelRow], gbps: float, tflops: float) -> FamilyModel:
    """The family's model from its measured points (the engine's preferred impl at each shape).

    Classes with fewer points than parameters fall back to the roofline at the ceilings (with the
    points' own ratio to it)."""
    groups: dict[Key, list[KernelRow]] = {}
    for r in preferred([r for r in rows if r.kernel == name and not host_side(r)]):
        groups.setdefault(class_key(r), []).append(r)
    shared = name in SHARED_COMPUTE and sum(len(g) >= 2 for g in groups.values()) >= 1
    keys = sorted(groups, key=repr)
    fits = {} if name in KEPT else _fit(keys, groups, shared)
    default = Fit(0.0, 1 / (gbps * 1e3), 1 / (tflops * 1e6))
    for k, f in fits.items():
        if not f.us_per_byte and any(bound(p.bytes / (gbps * 1e3), p.flops / (tflops * 1e6)) == MEMORY
                                     for p in groups[k]):
            fits[k] = _at_copy(groups[k], default.us_per_byte)
    classes = {}
    for k in keys:
        fit = None if name in KEPT else fits.get(k) or default
        samples = tuple((along(shape_of(p)),
                         p.time_us_p50 / (fit.us(p.bytes, p.flops) if fit else 1.0)) for p in groups[k])
        classes[k] = ShapeClass(fit, samples, k[-1], groups[k][0].dtype)
    return FamilyModel(name, classes)


def _at_copy(rows: Sequence[KernelRow], us_per_byte: float) -> Fit:
    """A class whose bytes barely vary (a dense GEMM's weights at every M) gives least squares no way to
    tell a fixed cost from the weight stream, and it may put the stream in the latency, which no carrier
    scales. Where such a class has memory-bound points, its bytes move at the measured copy bandwidth and
    the latency and compute terms are fitted on the rest of each point's time."""
    t = np.array([p.time_us_p50 for p in rows])
    a = np.array([[1.0, p.flops] for p in rows])
    scale = np.maximum(np.abs(a).max(axis=0), 1e-30)
    rest = t - us_per_byte * np.array([p.bytes for p in rows])
    x = _nnls(a / t[:, None] / scale, rest / t) / scale
    return Fit(float(x[0]), us_per_byte, float(x[1]))


def _fit(keys: list[Key], groups: dict[Key, list[KernelRow]], shared: bool) -> dict[Key, Fit]:
    """Per class (latency, us/byte, us/flop); with `shared`, one us/flop for all fitted classes."""
    fitted = [k for k in keys if len(groups[k]) >= (3 if not shared else 2)]
    if not fitted:
        return {}
    blocks = [fitted] if shared else [[k] for k in fitted]
    out = {}
    for block in blocks:
        rows, ts = [], []
        width = 2 * len(block) + 1
        for i, k in enumerate(block):
            for p in groups[k]:
                v = np.zeros(width)
                v[2 * i], v[2 * i + 1], v[-1] = 1.0, p.bytes, p.flops
                rows.append(v)
                ts.append(p.time_us_p50)
        a, t = np.array(rows), np.array(ts)
        scale = np.maximum(np.abs(a).max(axis=0), 1e-30)
        x = _nnls(a / t[:, None] / scale, np.ones_like(t)) / scale
        for i, k in enumerate(block):
            out[k] = Fit(float(x[2 * i]), float(x[2 * i + 1]), float(x[-1]))
    return out


def fit_all(rows: Sequence[KernelRow], ceilings: Any) -> dict[str, FamilyModel]:
    """Every known family's model; `ceilings.of(dtype)` gives the (GB/s, TFLOP/s) of the fallback roofline."""
    out = {}
    for name in SHAPES:
        pts = [r for r in rows if r.kernel == name and not host_side(r)]
        if pts:
            out[name] = fit_family(name, pts, *ceilings.of(pts[0].dtype))
    return out
