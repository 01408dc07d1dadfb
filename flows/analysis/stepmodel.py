"""The DDTree step of any deployment, composed from kernel-family models and calibrated on measured steps.

`build(tables, ref, target)` makes a model from one measured run (its kernel sweep and its e2e rows)
and the machine to answer for; `answer(model, query)` gives the step of a (tp, concurrency, budget,
context, accepted length) query on that machine. Pure functions of tables: no I/O, no Prefect.

The step's GPU time is the sum of its kernel families, each at the step's shapes on one rank of TP-tp:
- moe: the routed experts at M = C (B + 1) tokens, once per MoE layer;
- attention: MLA tree verify at batch C, budget B, context S, heads / tp, once per layer;
- dense: every other GEMM (engine.costs.dense_ops) at its own M, per layer, MoE layer or step;
- lm_head: the target's lm-head shard and the drafter's full-vocab head;
- tree: tree build and accept;
- gpu_other: the kernels no suite times (norms, rope, routing, copies).
Each suite family is taken from its kernel model (flows.analysis.kernelfit) and scaled by its in-step/suite
factor: the measured e2e rows' per-family GPU time over the suite's at the same shapes, interpolated
across the rows' (tp, tokens, depth, context): a step's depth before its context, since a family's
per-step ops weigh more in a shallow step than a prompt length moves its factor. gpu_other is what the rows' GPU time leaves: a fixed part and
a part per layer (split by the rows' depth series). Where the rows have no per-family split, the
factors are 1 and gpu_other holds everything the suite does not explain. The per-layer part is a line
in tokens at each TP degree (a + b x tokens; a degree with one token count borrows the nearest
degree's relative growth, as the in-step factors borrow a token trend), linear in log tp between degrees. The host time outside the
kernels is fitted from the rows' outside_ms (fixed + per layer) and kept on any machine, as is
gpu_other (small latency-bound kernels); without a depth series both are taken as all per layer.
Comm is two all-reduces a layer over the target's links.
Tokens/s = C x (accepted + 1) / (step + comm): the steady state of a full batch.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace
from typing import Sequence

from engine.config import CONFIGS, ModelConfig
from engine.costs import dense_op_cost, dense_op_rows, dense_ops
from engine.rows import COLUMNS, CommRow, DenseShape, E2ERow, Shape
from flows.analysis.carrier import SHARE, Side, how, others
from flows.analysis.families import E2E_CONTEXT, e2e_key, shape_at, tp_of
from flows.analysis.interp import Estimate, Sample, interpolate, interpolate_borrowing
from flows.analysis.kernelfit import Carry, FamilyModel, cost_of, fit_all
from flows.analysis.ceilings import (ALLREDUCES_PER_LAYER, Ceilings, CommModel, Machine, Tables, comm_model,
                                     measured_ceilings, rows_of)
from flows.analysis.stepmemory import Memory, memory

FAMILIES = ("moe", "attention", "dense", "lm_head", "tree", "gpu_other")
SUITE = FAMILIES[:-1]
TERMS = (*FAMILIES, "host", "comm")
COLUMN = {f: f"{f}_ms" for f in FAMILIES}
LABEL = {"moe": "MoE", "attention": "attention", "dense": "dense GEMMs", "lm_head": "lm-heads", "tree": "tree kernels",
         "gpu_other": "other kernels", "host": "host time", "comm": "comm"}   # a term in words
HEADS = ("lm_head", "draft_head")          # the dense ops the lm_head family holds
CAL_AXES = ("tp", "tokens", "context")
BEYOND_TOKENS = "beyond calibrated tokens"   # the stratum of an answer whose calibrated terms leave the rows' tokens
FACTOR_AXES = ("tp", "tokens", "layers", "context")   # an in-step factor's: a step's depth before its context


@dataclass(frozen=True)
class Query:
    tp: int
    concurrency: int
    budget: int
    context: int
    accept: float                  # accepted draft tokens a step (tokens a step = accept + 1)
    layers: int | None = None      # default: the model's full depth


@dataclass(frozen=True)
class Step:
    query: Query
    ms: dict[str, float]           # every TERMS entry
    tokens_per_s: float
    memory: Memory
    extrapolated: tuple[str, ...]  # "moe M", "attention context", "moe in-step factor tokens", "gpu_other tokens" ...
    interpolated: tuple[str, ...]
    carries: tuple[str, ...]       # the kinds of carry the figure leans on (flows.analysis.bands)
    notes: tuple[str, ...]         # what this answer assumed beyond the model's common assumptions

    @property
    def step_ms(self) -> float:
        """The step on one rank without its collectives (what e2e rows call step_ms)."""
        return sum(v for k, v in self.ms.items() if k != "comm")

    def share(self, term: str) -> float:
        return self.ms[term] / (self.step_ms + self.ms["comm"])

    @property
    def stratum(self) -> str:
        """The kind of composition carry (flows.analysis.bands): BEYOND_TOKENS where an in-step factor or
        gpu_other leaves the tokens its TP degree's rows measured (held, or following another degree's
        trend), else "" (inside them, or beyond a context or depth only)."""
        calibrated = [e for e in self.extrapolated if " in-step factor " in e or e.startswith("gpu_other ")]
        return BEYOND_TOKENS if any(e.endswith(" tokens") for e in calibrated) else ""

    @property
    def largest(self) -> str:
        return max(TERMS, key=lambda t: (self.ms[t], t))


@dataclass(frozen=True)
class PerLayer:
    """gpu_other's ms per layer at one TP degree: a + b x tokens, fitted over tokens lo..hi."""

    tp: int
    a: float
    b: float
    lo: int
    hi: int


@dataclass(frozen=True)
class Calibration:
    factors: dict[str, tuple[Sample, ...]]   # family -> in-step / suite, by (tp, tokens, context)
    fixed: tuple[Sample, ...]                # gpu_other's fixed ms, by (tp, tokens, context)
    per_layer: tuple[PerLayer, ...]          # gpu_other's ms per layer, by TP degree
    host_fixed_ms: float
    host_per_layer_ms: float
    rows: int
    split: bool                              # whether the rows carried the per-family split
    tps: tuple[int, ...]


@dataclass(frozen=True)
class Model:
    cfg: ModelConfig
    fams: dict[str, FamilyModel]
    ref: Machine
    target: Machine
    ref_c: Ceilings
    tgt_c: Ceilings
    comm_rows: tuple[CommRow, ...]
    cal: Calibration
    ref_run_id: str
    notes: tuple[str, ...] = field(default_factory=tuple)
    form: str | None = None        # the memory-bound carrier's form (flows.analysis.carrier; None: the shipped one)

    @property
    def cross_host(self) -> bool:
        return self.target.spec.name != self.ref.spec.name

    def carry(self, dtype: str) -> Carry | None:
        if not self.cross_host:
            return None
        return Carry(Side.of(self.ref.spec, *self.ref_c.of(dtype)), Side.of(self.target.spec, *self.tgt_c.of(dtype)),
                     self.form)

    @property
    def sides(self) -> tuple[Side, Side]:
        """The reference's and the target's spec sheets as the carrier reads them, ceilings aside: which
        carrier forms apply (carrier.how, carrier.others) depends on these alone."""
        return Side.of(self.ref.spec, 1.0, 1.0), Side.of(self.target.spec, 1.0, 1.0)

    def others(self) -> tuple["Model", ...]:
        """The same model under each other candidate carrier whose figure a band must hold (carrier.others)."""
        if not self.cross_host:
            return ()
        return tuple(replace(self, form=f) for f in others(*self.sides))


def config_of(row: E2ERow) -> ModelConfig:
    return CONFIGS.get(str(row.config).split("/")[0], CONFIGS["k2"])


def layer_counts(cfg: ModelConfig, layers: int) -> dict[str, int]:
    dense = min(cfg.dense_layers, layers)
    return {"layer": layers, "dense_layer": dense, "moe_layer": layers - dense, "step": 1}


# -- the suite families at a step's shapes ---------------------------------------------------------

@dataclass
class _Acc:
    ms: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SUITE, 0.0))
    extrapolated: list[str] = field(default_factory=list)
    interpolated: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, fam: str, label: str, est: Estimate, count: int, how_: str) -> None:
        self.ms[fam] += est.value * count / 1e3
        self.extrapolated += [f"{label} {a}" for a in est.extrapolated]
        self.interpolated += [f"{label} {a}" for a in est.interpolated]
        if how_:
            self.notes.append(f"{label}: {how_}")


def suite_ms(m: Model, cfg: ModelConfig, q: Query, on_target: bool = True) -> _Acc:
    """Each suite family's time (ms) in one step of `q`, on the target (else on the reference)."""
    acc = _Acc()
    layers = q.layers or cfg.layers
    n = layer_counts(cfg, layers)
    c, b, tp = q.concurrency, q.budget, q.tp
    tokens = c * (b + 1)

    def timed(name: str, key: tuple, shape: Shape, cost: tuple[float, float]) -> tuple[Estimate, str] | None:
        fam = m.fams.get(name)
        return fam.time_us(key, shape, *cost, m.carry if on_target else None) if fam else None

    for fam, name, count in (("moe", "moe_w4a16", n["moe_layer"]), ("attention", "mla_tree_attention", layers),
                             ("tree", "build_tree", 1), ("tree", "tree_accept", 1)):
        degree = tp if name in ("moe_w4a16", "mla_tree_attention") else 1   # the tree kernels are not sharded
        shape = shape_at(name, cfg, degree, tokens=tokens, batch=c, budget=b, context=q.context)
        got = timed(name, (degree,), shape, cost_of(cfg, shape, degree))
        if got is None:
            acc.notes.append(f"{fam}: no {name} points; left out")
            continue
        acc.add(fam, fam if fam != "tree" else name, got[0], count, got[1])
    full = {op.name: op for op in dense_ops(cfg, 1)}
    for op in dense_ops(cfg, tp):
        fam, rows = ("lm_head" if op.name in HEADS else "dense"), dense_op_rows(op, cfg, c, b)
        cost = dense_op_cost(op, rows)
        key = (op.name, 1) if op == full.get(op.name) else (op.name, tp)   # a replicated op is timed at TP-1
        got = timed("dense_gemm", key, DenseShape(op.name, rows, op.n, op.k, op.heads), cost)
        if got is None:   # not measured: the roofline at the machine's copy and matmul ceilings
            ceil = m.tgt_c if on_target else m.ref_c
            gbps, tflops = ceil.of(op.dtype)
            got = (Estimate(max(cost[0] / (gbps * 1e3), cost[1] / (tflops * 1e6))), "")
            if "dense ops at the copy/matmul ceilings (no dense_gemm points)" not in acc.notes:
                acc.notes.append("dense ops at the copy/matmul ceilings (no dense_gemm points)")
        acc.add(fam, op.name, got[0], n[op.per], got[1])
    return acc


# -- calibration on the measured e2e rows ------------------------------------------------------------

def cal_shape(tp: int, tokens: int, context: int | None) -> dict[str, float]:
    return {"tp": tp, "tokens": tokens, "context": context or E2E_CONTEXT}


def query_of(row: E2ERow) -> Query:
    return Query(tp_of(row), row.concurrency, row.budget, row.context or E2E_CONTEXT,
                 row.accept_len_mean or 0.0, row.layers)


def calibration_rows(rows: Sequence[E2ERow]) -> list[E2ERow]:
    """The measured e2e rows a calibration can use: ok, with a step."""
    return [r for r in rows if r.source == "measured" and r.status == "ok" and r.step_ms_p50]


def _gpu_ms(row: E2ERow) -> float:
    """The row's GPU time a step (the whole step where it was not profiled: then host time is in it)."""
    return row.kernel_ms if row.kernel_ms is not None else row.step_ms_p50


def _line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(intercept, slope) of least squares; slope 0 with one distinct x."""
    mx, my = statistics.mean(xs), statistics.mean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def calibrate(m: Model, rows: Sequence[E2ERow]) -> Calibration:
    """Per-family in-step/suite factors, gpu_other (fixed + per layer) and host time, from `rows`."""
    factors: dict[str, list[Sample]] = {f: [] for f in SUITE}
    other: dict[tuple, list[tuple[int, float]]] = {}
    split = bool(rows) and all(r.moe_ms is not None for r in rows)
    for r in rows:
        cfg, q = config_of(r), query_of(r)
        acc = suite_ms(m, cfg, q, on_target=False)
        shape = cal_shape(q.tp, q.concurrency * (q.budget + 1), r.context)
        if split:
            for f in SUITE:
                if getattr(r, COLUMN[f]) is not None and acc.ms[f] > 0 and getattr(r, COLUMN[f]) > 0:
                    factors[f].append(({**shape, "layers": q.layers or cfg.layers}, getattr(r, COLUMN[f]) / acc.ms[f]))
            rest = r.gpu_other_ms
        else:
            rest = _gpu_ms(r) - sum(acc.ms.values())
        other.setdefault(tuple(shape.values()), []).append((q.layers or cfg.layers, rest))
    fixed, per_layer = [], []
    for key, pts in other.items():
        if len({n for n, _ in pts}) >= 2:
            d, g = _line([n for n, _ in pts], [v for _, v in pts])
            fixed.append((dict(zip(CAL_AXES, key)), d))
    for key, pts in other.items():
        shape = dict(zip(CAL_AXES, key))
        d = interpolate(fixed, shape, CAL_AXES, log_value=False).value if fixed else 0.0
        per_layer += [(shape, (v - d) / n) for n, v in pts]
    host = [(r.layers or config_of(r).layers, r.outside_ms) for r in rows if r.outside_ms is not None]
    h0, h1 = _line([n for n, _ in host], [v for _, v in host]) if len({n for n, _ in host}) >= 2 else (0.0, -1.0)
    if h0 < 0 or h1 < 0:   # one depth (or a line through zero's wrong side): all of it per layer
        h0, h1 = (0.0, statistics.median(v / n for n, v in host)) if host else (0.0, 0.0)
    return Calibration({f: tuple(s) for f, s in factors.items() if s}, tuple(fixed), per_layer_lines(per_layer), h0, h1,
                       len(rows), split, tuple(sorted({tp_of(r) for r in rows})))


def per_layer_lines(samples: Sequence[Sample]) -> tuple[PerLayer, ...]:
    """gpu_other per layer as a + b x tokens at each TP degree; a degree measured at one token count
    takes the relative growth of the nearest degree measured at two or more: that degree's slope times
    the ratio of the two degrees' levels at the tokens measured (these kernels, norms, rope, routing and
    copies, keep the hidden state whole on every rank, so TP neither shards their growth with tokens
    nor leaves it untouched: only the level tells; no such degree: a flat line)."""
    by_tp: dict[int, list[tuple[float, float]]] = {}
    for shape, v in samples:
        by_tp.setdefault(int(shape["tp"]), []).append((shape["tokens"], v))
    lines = {tp: _line(*zip(*pts)) for tp, pts in by_tp.items() if len({t for t, _ in pts}) >= 2}
    out = []
    for tp, pts in sorted(by_tp.items()):
        xs, ys = [t for t, _ in pts], [v for _, v in pts]
        if tp in lines:
            a, b = lines[tp]
        else:
            near = min(lines, key=lambda t: (abs(math.log(t / tp)), t)) if lines else None
            b = 0.0
            if near is not None:
                a_n, b_n = lines[near]
                level = a_n + b_n * statistics.mean(xs)
                b = max(b_n, 0.0) * statistics.mean(ys) / level if level > 0 else 0.0
            a = statistics.mean(y - b * x for x, y in zip(xs, ys))
        out.append(PerLayer(tp, a, b, int(min(xs)), int(max(xs))))
    return tuple(out)


def per_layer_at(lines: Sequence[PerLayer], tp: int, tokens: int) -> Estimate:
    """gpu_other ms per layer at (tp, tokens): each degree's line, linear in log tp between degrees;
    beyond them the nearest degree's line with its slope scaled by the degrees (as in per_layer_lines)."""
    def at(ln: PerLayer, scale: float = 1.0) -> float:
        return max(ln.a + ln.b * scale * tokens, 0.0)

    near = min(lines, key=lambda ln: (abs(math.log(ln.tp / tp)), ln.tp))
    outside = ("tokens",) if not near.lo <= tokens <= near.hi else ()
    tps = sorted(ln.tp for ln in lines)
    if not tps[0] <= tp <= tps[-1]:
        return Estimate(at(near, near.tp / tp), ("tp", *outside))
    got = interpolate([({"tp": ln.tp}, at(ln)) for ln in lines], {"tp": tp}, ("tp",), log_value=False)
    return Estimate(got.value, outside, got.interpolated)


def in_step_factor(samples: Sequence[Sample], shape: dict[str, float]) -> Estimate:
    """A family's in-step/suite factor at (tp, tokens[, layers], context): per TP degree over its own
    tokens, depths and contexts, a degree whose tokens do not reach the query's following the token trend of the nearest
    degree that does (as gpu_other's per-layer lines borrow a slope: the trend, routing spread and
    launch tails, is the batch's, and TP only scales it), then linear in log tp between degrees."""
    return interpolate_borrowing(samples, shape, tuple(a for a in FACTOR_AXES if a in shape))


# -- building and answering -------------------------------------------------------------------------

def build(tables: Tables, ref: Machine, target: Machine, rows: Sequence[E2ERow] | None = None) -> Model:
    """The step model of `target` from a measured run of `ref`, calibrated on `rows` (default: the run's
    measured e2e rows; a backtest passes its calibration side)."""
    ref_c = measured_ceilings(tables["runs"], ref.spec)
    kern = [k for k in rows_of(tables, "kernels") if k.source == "measured"]
    e2e = calibration_rows(rows_of(tables, "e2e") if rows is None else rows)
    cfg = config_of(e2e[0]) if e2e else CONFIGS["k2"]
    m = Model(cfg, fit_all(kern, ref_c), ref, target, ref_c, ref_c.carried_to(target.spec),
              tuple(rows_of(tables, "comm")), Calibration({}, (), (), 0.0, 0.0, 0, False, ()),
              tables["runs"].column(COLUMNS.run_id)[0].as_py())
    notes = []
    if m.cross_host and how(*m.sides) == SHARE:
        notes.append("kernel bandwidth carried as a share of the copy ceiling (a spec sheet lacks the SM count)")
    return replace(m, cal=calibrate(m, e2e), notes=tuple(notes))


def comm_ms(m: Model, cfg: ModelConfig, q: Query) -> float:
    """Two all-reduces a layer of tokens x hidden x 2 bytes over the target's links at TP-tp."""
    if q.tp <= 1:
        return 0.0
    machine = replace(m.target, gpus=q.tp)
    model: CommModel = comm_model(list(m.comm_rows), m.ref, machine)
    tokens = q.concurrency * (q.budget + 1)
    return ALLREDUCES_PER_LAYER * (q.layers or cfg.layers) * model.time_us(tokens * cfg.hidden * 2) / 1e3


def answer(m: Model, q: Query, cfg: ModelConfig | None = None) -> Step:
    """The step of `q` on the model's target."""
    cfg = cfg or m.cfg
    acc = suite_ms(m, cfg, q)
    layers = q.layers or cfg.layers
    shape = cal_shape(q.tp, q.concurrency * (q.budget + 1), q.context)
    ext, inter = list(acc.extrapolated), list(acc.interpolated)
    ms = {}
    for f in SUITE:
        samples = m.cal.factors.get(f)
        factor = in_step_factor(samples, {**shape, "layers": layers}) if samples and acc.ms[f] else Estimate(1.0)
        ms[f] = acc.ms[f] * factor.value
        ext += [f"{f} in-step factor {a}" for a in factor.extrapolated]
    fixed = interpolate(m.cal.fixed, shape, CAL_AXES, log_value=False) if m.cal.fixed else Estimate(0.0)
    per = per_layer_at(m.cal.per_layer, q.tp, q.concurrency * (q.budget + 1)) if m.cal.per_layer else Estimate(0.0)
    ms["gpu_other"] = max(fixed.value + layers * per.value, 0.0)
    ext += [f"gpu_other {a}" for a in per.extrapolated]
    ms["host"] = m.cal.host_fixed_ms + m.cal.host_per_layer_ms * layers
    ms["comm"] = comm_ms(m, cfg, q)
    step = sum(v for k, v in ms.items() if k != "comm")
    carries = ["composition"]
    if m.cal.tps and q.tp not in m.cal.tps:
        carries.append("tp")
    for fam in ("moe", "attention"):   # a kernel family beyond its sweep (any axis): the size backtest's evidence
        if any(e.startswith(f"{fam} ") for e in acc.extrapolated):
            carries.append(f"size:{fam}")
    if m.cross_host:
        carries.append("cross-host")
    tokens_per_s = q.concurrency * (q.accept + 1) / (step + ms["comm"]) * 1e3
    return Step(q, ms, tokens_per_s, memory(cfg, q, m.target.spec), tuple(dict.fromkeys(ext)),
                tuple(dict.fromkeys(inter)), tuple(carries), tuple(dict.fromkeys([*m.notes, *acc.notes])))


def step_spread(rows: Sequence[E2ERow]) -> float:
    """The measurement spread of a step: half the range of the steps one configuration measured at its
    acceptance levels, relative to their mean, the median over configurations."""
    groups: dict[tuple, list[float]] = {}
    for r in rows:
        groups.setdefault(e2e_key(r, without=("synthetic_accept",)), []).append(r.step_ms_p50)
    spreads = [(max(v) - min(v)) / 2 / statistics.mean(v) for v in groups.values() if len(v) > 1]
    return statistics.median(spreads) if spreads else 0.0
