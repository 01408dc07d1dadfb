"""Hold-out backtests of the projection on measured data, stored as data for the notes and the bands.

Each backtest predicts measured points from other measured points and reports, per kernel family
and for e2e, the median and worst error (projected / measured - 1), the held-out ratios measured /
projected (the evidence flows.analysis.bands builds every projected figure's band from), and how a band from
that evidence does on the points themselves (`judged`, by the bands' own rule): each point's band comes from
the other configurations' ratios only (for e2e rows the acceptance levels of one configuration are one group,
in every backtest), pooled over the rows of the same kind, data and regime where the row's own are too few;
its coverage is the share of points inside, its width the median half-width.

- composition: each e2e step from the step model (flows.analysis.stepmodel) calibrated on the other
  configurations' rows (leave one configuration out), each point with its answer's stratum (bands);
- depth: the full-depth step from a straight line through the shallower depths of the same point;
- size: a family's largest sizes from its smaller ones (MoE M >= 256 from M < 256, context 64k and
  up from less, tree budget 1024 from less, dense GEMM M >= 256 from less), its kernel model fitted on the
  smaller ones alone; the row says how much of the fitted time the flop term is on each side (a compute
  rate fitted where its term barely shows is not identified there: the MoE's at M < 256);
- tp: the TP-N kernel shards from the full shapes, and the TP-N rank step from the step model
  calibrated on the TP-1 rows (with the measured shard-shape kernels);
- cross-host: every measured host from every other one, and outside figures where they match, per kernel
  family and regime; a target's point that ran other code than the reference's (its `impl`) is a row of
  kind "kernel changed", never carrier error, and when the attention kernel changed the e2e steps are
  judged less their attention term too. Where the target's comm was modelled, not measured, its
  tokens/s are compared at that same comm.

A backtest without the data it needs is a row with `skipped` saying why. Nothing is calibrated
on the points it is judged on.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from engine.rows import COLUMNS, E2ERow, KernelRow
from engine.schema import CommSource
from flows.analysis.bands import Point, jackknife
from flows.analysis.families import (POINT_KEY, SHAPES, SIZE_AXIS, e2e_key, host_side, label, point_key, preferred,
                                     regime, shape_of, tp_of)
from flows.analysis.kernelfit import class_key, fit_family
from flows.analysis.projection import breakdown, measured_ceilings, project, rows_of
from flows.analysis.reference import Dataset, is_outside
from flows.analysis.stepmodel import FAMILIES, COLUMN, answer, build, calibration_rows, config_of, query_of

GOAL_MEDIAN = {"memory": 0.10, "e2e": 0.20}   # median |error| goals by regime (none set for the others)
# issue 25's goals for a kind of carry: (kind, family prefix, regime) -> median |error|
GOAL_KIND = {("composition", "e2e step", "e2e"): 0.05, ("tp", "e2e", "e2e"): 0.10,
             ("cross-host", "", "memory"): 0.20}
GOAL_IN_BAND = 0.90
# the size backtest: held-out sizes (axis value >= cut) predicted from the smaller ones
HOLD_OUT = {COLUMNS.M: 256, COLUMNS.context: 65536, COLUMNS.budget: 1024}


@dataclass(frozen=True)
class BacktestRow:
    kind: str               # composition | depth | size | tp | cross-host | kernel changed
    reference: str
    target: str
    family: str             # "kernel/impl", or an e2e quantity such as "e2e step"
    regime: str             # memory | compute | host | latency | e2e: which goal applies
    points: int
    median_error: float | None = None   # projected / measured - 1, median over the points
    worst_error: float | None = None    # the largest |error|, signed
    in_band: float | None = None        # share of points inside their band (of those with a known band)
    detail: str = ""                    # what was predicted from what, or why the backtest was skipped
    median_abs_error: float | None = None  # the median of |error|: what the goals are on
    half_width: float | None = None     # median half-width of the bands, relative to the prediction
    unknown: int = 0                    # points whose band is unknown (too little other evidence)
    pooled: int = 0                     # points whose band is pooled over the same kind and regime (bands)
    ratios: tuple[float, ...] = ()      # measured / projected of each point: a carry's evidence
    groups: tuple[str, ...] = ()        # the group of each point (one configuration's acceptance levels)
    strata: tuple[str, ...] = ()        # the stratum of each point's answer (flows.analysis.bands; empty: one)
    target_gbps: float | None = None    # cross-host: the target's spec copy bandwidth, how fast a machine the carry reached

    @property
    def skipped(self) -> bool:
        return self.points == 0


PER_POINT = ("ratios", "groups", "strata")   # the evidence of each point: stored for the bands, not printed


def goal_gap(row: BacktestRow) -> tuple[float | None, float | None]:
    """How far the row misses its goals: (median |error| over its goal, in-band share under 90%)."""
    if row.skipped:
        return None, None
    goal = next((g for (kind, fam, reg), g in GOAL_KIND.items()
                 if row.kind == kind and row.family.startswith(fam) and row.regime == reg), GOAL_MEDIAN.get(row.regime))
    med = max((row.median_abs_error if row.median_abs_error is not None else abs(row.median_error)) - goal, 0.0) \
        if goal is not None else None
    return med, None if row.in_band is None else max(GOAL_IN_BAND - row.in_band, 0.0)


Pair = tuple[float, float, object]   # measured, predicted, group (points of one group share a band's blind spot)
Stratified = tuple[float, float, object, str]   # a pair and its answer's stratum (flows.analysis.bands)


def summarise(kind: str, ref: str, target: str, fam: str, reg: str, pairs: Sequence[Pair | Stratified],
              detail: str) -> BacktestRow:
    """A backtest row of its points' errors and evidence; its bands come after, with its siblings' (`judged`)."""
    pairs = [p for p in pairs if p[0] and p[1]]
    if not pairs:
        return BacktestRow(kind, ref, target, fam, reg, 0, detail=detail)
    errs = [p[1] / p[0] - 1 for p in pairs]
    strata = tuple(p[3] if len(p) > 3 else "" for p in pairs)
    return BacktestRow(kind, ref, target, fam, reg, len(errs), statistics.median(errs), max(errs, key=abs),
                       detail=detail, median_abs_error=statistics.median(abs(e) for e in errs),
                       ratios=tuple(p[0] / p[1] for p in pairs), groups=tuple(str(p[2]) for p in pairs),
                       strata=strata if any(strata) else ())


def _points(row: BacktestRow) -> list[Point]:
    return list(zip(row.ratios, row.groups, row.strata or ("",) * len(row.ratios)))


def judged(rows: Sequence[BacktestRow]) -> list[BacktestRow]:
    """Each row with how a band from evidence does on its points (flows.analysis.bands.jackknife): each point's
    band from the other groups of its family, pooled with the rows of the same kind, data and regime where
    those are too few; in band = the share of points with a band that hold, half-width its median."""
    out = []
    for r in rows:
        if r.skipped:
            out.append(r)
            continue
        pool = [p for o in rows if o is not r and (o.kind, o.reference, o.target, o.regime) ==
                (r.kind, r.reference, r.target, r.regime) for p in _points(o)]
        bands = jackknife(_points(r), pool)
        known = [(x, b) for x, b in zip(r.ratios, bands) if b is not None]
        inside = sum(lo * (1 - 1e-9) <= x <= hi * (1 + 1e-9) for x, (lo, hi, _) in known)
        out.append(replace(r, in_band=inside / len(known) if known else None,
                           half_width=statistics.median((hi - lo) / 2 for _, (lo, hi, _) in known) if known else None,
                           unknown=len(bands) - len(known), pooled=sum(b[2] for _, b in known)))
    return out


def configuration(row: E2ERow) -> tuple:
    """An e2e row's group: the acceptance levels of one (tp, C, B, context, depth) are one piece of evidence."""
    return e2e_key(row, without=("synthetic_accept",))


def _groups(rows: Sequence[E2ERow]) -> dict[tuple, list[E2ERow]]:
    """e2e rows by configuration."""
    out: dict[tuple, list[E2ERow]] = {}
    for r in rows:
        out.setdefault(configuration(r), []).append(r)
    return out


# -- composition ---------------------------------------------------------------------------------

def composition(data: Dataset) -> list[BacktestRow]:
    rows = calibration_rows(rows_of(data.tables, "e2e"))
    name = data.name
    groups = _groups(rows)
    if len(groups) < 2 or not rows_of(data.tables, "kernels"):
        return [BacktestRow("composition", name, name, "e2e step", "e2e", 0,
                            detail="needs kernel points and e2e rows of two or more configurations in one run")]
    split = all(r.moe_ms is not None for r in rows)
    pairs: dict[str, list[Stratified]] = {}
    for key, held in groups.items():
        model = build(data.tables, data.machine, data.machine, [r for r in rows if configuration(r) != key])
        for r in held:
            s = answer(model, query_of(r), config_of(r))
            pairs.setdefault("e2e step", []).append((r.step_ms_p50, s.step_ms, key, s.stratum))
            if r.kernel_ms is not None:
                pairs.setdefault("e2e GPU time", []).append((r.kernel_ms, s.step_ms - s.ms["host"], key, s.stratum))
                pairs.setdefault("e2e host time", []).append((r.outside_ms, s.ms["host"], key, s.stratum))
            if split:
                for f in FAMILIES:
                    pairs.setdefault(f"e2e {f}", []).append((getattr(r, COLUMN[f]), s.ms[f], key, s.stratum))
    why = ("each configuration's steps from the step model calibrated on the other configurations' rows "
           "(kernel models at the step's shapes x in-step factors + gpu_other + host)")
    out = [summarise("composition", name, name, "e2e step", "e2e", pairs["e2e step"], why)]
    for fam in (k for k in pairs if k != "e2e step"):
        out.append(summarise("composition", name, name, fam, "e2e", pairs[fam], "the term alone, predicted as above"))
    return out


# -- depth ---------------------------------------------------------------------------------------

def _line(xs: Sequence[float], ys: Sequence[float]) -> Callable[[float], float]:
    mx, my = statistics.mean(xs), statistics.mean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return lambda x: my + b * (x - mx)


def depth(data: Dataset) -> list[BacktestRow]:
    rows = [r for r in rows_of(data.tables, "e2e") if r.source == "measured" and r.step_ms_p50]
    groups: dict[tuple, list[E2ERow]] = {}
    for r in rows:
        groups.setdefault(e2e_key(r, without=("layers",)), []).append(r)
    pairs: list[Pair] = []
    for key, g in groups.items():
        full = config_of(g[0]).layers
        deep = [r for r in g if r.layers == full]
        shallow = sorted((r for r in g if r.layers and r.layers < full), key=lambda r: r.layers)
        if not deep or len({r.layers for r in shallow}) < 2:
            continue
        c = _line([r.layers for r in shallow], [r.step_ms_p50 for r in shallow])(full)
        pairs.append((deep[0].step_ms_p50, c, key))
    depths = sorted({r.layers for r in rows if r.layers})
    detail = ("full-depth step from a straight line through the shallower depths of the same point" if pairs else
              f"needs rows at 2 or more shallow depths and at full depth (61 for k2) of the same point; "
              f"this data has layers {', '.join(map(str, depths)) or 'none'}")
    return [summarise("depth", data.name, data.name, "e2e step", "e2e", pairs, detail)]


# -- size ----------------------------------------------------------------------------------------

def size(data: Dataset) -> list[BacktestRow]:
    kern = [k for k in rows_of(data.tables, "kernels") if k.source == "measured" and not host_side(k)]
    ceil = measured_ceilings(data.tables["runs"], data.machine.spec)
    out = []
    fams: dict[str, list[KernelRow]] = {}
    for k in kern:
        if k.kernel in SIZE_AXIS:
            fams.setdefault(label(k), []).append(k)
    for fam_label, pts in sorted(fams.items()):
        fam = pts[0].kernel
        axis, cut = SIZE_AXIS[fam], HOLD_OUT[SIZE_AXIS[fam]]
        calib = [p for p in pts if (getattr(p, axis) or 0) < cut]
        held = [p for p in pts if (getattr(p, axis) or 0) >= cut]
        model = fit_family(fam, calib, *ceil.of(pts[0].dtype)) if calib else None
        pairs: list[Pair] = []
        regimes = []
        for h in held:
            if model is None or class_key(h) not in model.classes:
                continue
            got = model.time_us(class_key(h), shape_of(h), h.bytes, h.flops)
            if got:
                pairs.append((h.time_us_p50, got[0].value, point_key(h)))
                regimes.append(regime(h, *ceil.of(h.dtype)))
        reg = statistics.mode(regimes) if regimes else regime(pts[0], *ceil.of(pts[0].dtype))
        detail = (f"{axis} >= {cut} from {axis} < {cut}: the family's kernel model (latency + bytes / bandwidth + "
                  "flops / compute, fitted on the smaller sizes) times the nearest calibrated point's residual"
                  + "".join(f"; {fam_label} on {data.name}: its flop term is at most {seen:.0%} of a smaller size's fitted "
                            f"time and up to {asked:.0%} of a held-out one's"
                            for seen, asked in [_flop_shares(model, calib, held)] if seen is not None))
        out.append(summarise("size", data.name, data.name, fam_label, reg, pairs,
                             detail if pairs else f"no points at {axis} >= {cut} with smaller ones of the same shape"))
    return out


def _flop_shares(model: Any, calib: Sequence[KernelRow], held: Sequence[KernelRow]) -> tuple[float | None, float | None]:
    """The largest share of the fitted time that is the flop term, on the smaller sizes and on the held-out
    ones: a compute rate fitted where its term barely shows is not identified by them, so a held-out point
    where the term is large rests on a guessed rate."""
    def most(pts: Sequence[KernelRow]) -> float | None:
        got = [model.flop_share(class_key(p), p.bytes, p.flops) for p in pts] if model else []
        return max((g for g in got if g is not None), default=None)

    seen, asked = most(calib), most(held)
    return (seen, asked) if seen is not None and asked is not None else (None, None)


def trend(prev: list[KernelRow], to: KernelRow, axis: str) -> tuple[float, float, float]:
    """Time at `to` by the power law through the two largest of `prev` (sorted along `axis`)."""
    a, b = prev[-2], prev[-1]
    slope = math.log(b.time_us_p50 / a.time_us_p50) / math.log(getattr(b, axis) / getattr(a, axis))
    scale = (getattr(to, axis) / getattr(b, axis)) ** slope
    times = (b.time_us_p50, b.time_us_p10, b.time_us_p90)
    return tuple(scale * (t or b.time_us_p50) for t in times)  # type: ignore[return-value]


# -- tensor parallel -----------------------------------------------------------------------------

def tensor_parallel(data: Dataset) -> list[BacktestRow]:
    kern = [k for k in rows_of(data.tables, "kernels") if k.source == "measured" and not host_side(k)]
    ceil = measured_ceilings(data.tables["runs"], data.machine.spec)
    out = []
    by_fam: dict[str, list[KernelRow]] = {}
    for k in preferred(kern):
        if k.kernel in SHAPES:
            by_fam.setdefault(label(k), []).append(k)
    for fam_label, pts in sorted(by_fam.items()):
        fam = pts[0].kernel
        full = [p for p in pts if tp_of(p) == 1]
        shard = [p for p in pts if tp_of(p) > 1]
        if not full or not shard:
            continue
        model = fit_family(fam, full, *ceil.of(pts[0].dtype))
        pairs = [(k.time_us_p50, got[0].value, point_key(k)) for k in shard
                 for got in [model.time_us(class_key(k), shape_of(k), k.bytes, k.flops)] if got]
        out.append(summarise("tp", data.name, data.name, fam_label, regime(shard[0], *ceil.of(shard[0].dtype)),
                             pairs, "TP-N shard shapes from the full shapes' kernel model (at the shard's bytes/flops)"))
    e2e = calibration_rows(rows_of(data.tables, "e2e"))
    degrees = sorted({tp_of(r) for r in e2e})
    if 1 not in degrees or len(degrees) < 2:
        out.append(BacktestRow("tp", data.name, data.name, "e2e rank step", "e2e", 0,
                               detail=f"needs e2e rows at TP-1 and TP-N of the same point; this data has tp "
                                      f"{', '.join(map(str, degrees)) or 'none'}"))
        return out
    model = build(data.tables, data.machine, data.machine, [r for r in e2e if tp_of(r) == 1])
    for n in degrees[1:]:
        rank, real = [], []
        for m in (r for r in e2e if tp_of(r) == n):
            s = answer(model, query_of(m), config_of(m))
            key = configuration(m)
            if m.comm_source == CommSource.MEASURED:   # a real N-GPU run: the whole step, comm included
                real.append((m.step_ms_p50 + breakdown(m)[COLUMNS.comm_ms], s.step_ms + s.ms["comm"], key))
            else:                                    # one rank on one GPU: its compute, comm left out
                rank.append((m.step_ms_p50, s.step_ms, key))
        out.append(summarise("tp", data.name, data.name, f"e2e TP-{n} rank step", "e2e", rank,
                             f"TP-{n} rank step (without comm) from the step model calibrated on the TP-1 rows, "
                             f"with the measured TP-{n} shard kernels where there are"))
        if real:
            out.append(summarise("tp", data.name, data.name, f"e2e {n}-GPU step", "e2e", real,
                                 f"a real {n}-GPU run (measured comm) from the 1-GPU rows"))
    return out


# -- cross-host ----------------------------------------------------------------------------------

def cross_host(data: Sequence[Dataset], outside: Sequence[Dataset] = ()) -> list[BacktestRow]:
    own = [d for d in data if not is_outside(d.tables)]
    out: list[BacktestRow] = []
    if len(own) < 2 and not outside:
        return [BacktestRow("cross-host", own[0].name if own else "-", "-", "all", "e2e", 0,
                            detail="needs a second measured host (or imported outside figures)")]
    for ref in own:
        for tgt in [*own, *outside]:
            if tgt.name == ref.name:
                continue
            tps = {tp_of(r) for r in rows_of(tgt.tables, "e2e")} or {1}
            machine = replace(tgt.machine, gpus=max(tps))   # the target as its e2e rows ran
            proj = project(ref.tables, ref.machine, machine)
            out += [replace(r, target_gbps=tgt.machine.spec.mem_bw_gbps)
                    for r in compare(ref, tgt, machine, proj, relax_impl=is_outside(tgt.tables))]
    return out


CHANGED = "kernel changed"   # the backtest kind of a target's points that ran other code than the reference's


def compare(ref: Dataset, tgt: Dataset, machine: Any, proj: dict, relax_impl: bool = False) -> list[BacktestRow]:
    """Projection error per kernel family and regime (on the target, as projected) and for e2e tokens/s,
    on the points both sides have.

    `relax_impl` matches an outside kernel (another implementation) with kdbench's at the same shape.
    Otherwise a target's point whose implementation differs from the reference's at the same shape ran other
    code: its rows are of kind CHANGED, never carrier error (no band rests on them); and when the attention
    kernel changed, the e2e steps are judged without their attention term as well."""
    out = []
    at = POINT_KEY.index("impl")
    drop = lambda k: k[:at] + k[at + 1:]  # noqa: E731
    exact = {} if relax_impl else {point_key(p): p for p in rows_of(proj, "kernels")}
    loose: dict[tuple, KernelRow] = {}   # the engine's own kernel at each shape
    for p in preferred(rows_of(proj, "kernels")):
        loose.setdefault(drop(point_key(p)), p)
    fams: dict[tuple[str, str, str], list[Pair]] = {}
    changed: set[str] = set()
    for m in rows_of(tgt.tables, "kernels"):
        p = exact.get(point_key(m)) or (loose.get(drop(point_key(m))) if relax_impl or m.impl != "torch" else None)
        if p is None:
            continue
        if p.impl == m.impl:
            kind, name = "cross-host", label(m)
        elif relax_impl:
            kind, name = "cross-host", f"{label(p)} vs {m.impl}"
        else:
            kind, name = CHANGED, f"{label(m)} vs {p.impl}"
            changed.add(m.kernel)
        fams.setdefault((kind, name, p.regime or "-"), []).append((m.time_us_p50, p.time_us_p50, point_key(m)))
    detail = "outside figures of another implementation: the gap is kdbench's kernel against theirs, " \
             "not only projection error" if relax_impl else "projected from the reference's own run"
    moved = ("kernel changed since the reference: the target ran {}, the reference {} at these shapes; "
             "the gap is the code's as much as the carrier's, so no band rests on it")
    for (kind, f, reg), v in sorted(fams.items()):
        what = moved.format(*f.split("/", 1)[1].split(" vs ")) if kind == CHANGED else detail
        out.append(summarise(kind, ref.name, tgt.name, f, reg, v, what))
    pairs = _e2e_pairs(ref, tgt, machine, proj, relax_impl)
    what = "config, layers, tp, concurrency" + ("" if relax_impl else ", budget, acceptance")
    if "mla_tree_attention" in changed:
        out.append(summarise(CHANGED, ref.name, tgt.name, "e2e tokens/s", "e2e", pairs,
                             "the attention kernel changed since the reference (kernel rows above): each step's "
                             "attention term ran other code, so its error is not the carrier's alone"))
        less = _e2e_less_attention(tgt, proj)
        out.append(summarise("cross-host", ref.name, tgt.name, "e2e step less attention", "e2e", less,
                             "each e2e step's time less its attention term, measured against projected: the "
                             "terms the two runs ran the same code for (MoE, dense, lm-head, tree, other, host)"
                             if less else "no e2e row of the target has the per-family split"))
        return out
    out.append(summarise("cross-host", ref.name, tgt.name, "e2e tokens/s", "e2e", pairs,
                         (f"{detail}; each outside row against the step model at its configuration (the "
                          "reference's budget and shortest prompts, the median over its measured acceptances: the source states none)" if relax_impl else detail)
                         if pairs else f"no e2e point of the target matches a projected one ({what})"))
    return out


def _at_comm_of(p: E2ERow, m: E2ERow) -> float:
    """The projected tokens/s with the measured row's comm term where that term was not measured (one
    rank on one GPU, its all-reduces modelled by the bench): a model judged against a model says nothing
    of the carrier."""
    if m.comm_source == CommSource.MEASURED or not p.step_ms_p50:
        return p.tokens_per_s
    return p.tokens_per_s * (p.step_ms_p50 + (p.comm_ms or 0.0)) / (p.step_ms_p50 + (m.comm_ms or 0.0))


def _e2e_less_attention(tgt: Dataset, proj: dict) -> list[Pair]:
    """(measured, projected, group) step time less the attention term, of the target's rows with the split."""
    got = {e2e_key(e): e for e in rows_of(proj, "e2e")}
    return [(m.step_ms_p50 - m.attention_ms, p.step_ms_p50 - p.attention_ms, configuration(m))
            for m in rows_of(tgt.tables, "e2e") if m.step_ms_p50 and m.attention_ms is not None
            for p in [got.get(e2e_key(m))] if p and p.attention_ms is not None]


def _e2e_pairs(ref: Dataset, tgt: Dataset, machine: Any, proj: dict, relax_impl: bool) -> list[Pair]:
    """(measured, projected, group) tokens/s of the target's e2e rows."""
    if not relax_impl:
        got = {e2e_key(e): e for e in rows_of(proj, "e2e")}
        return [(m.tokens_per_s, _at_comm_of(p, m), configuration(m)) for m in rows_of(tgt.tables, "e2e")
                if m.tokens_per_s for p in [got.get(e2e_key(m))] if p]
    # an outside serving figure states no tree budget, acceptance or prompt length: the step model
    # answers it at the reference's budget and shortest prompts, at each acceptance the reference
    # measured, and the median answer stands for it (the fastest would be biased up by construction)
    model = build(ref.tables, ref.machine, machine)
    levels = calibration_rows(rows_of(ref.tables, "e2e"))
    out: list[Pair] = []
    for m in rows_of(tgt.tables, "e2e"):
        cands = [r for r in levels if r.layers == m.layers]
        if not m.tokens_per_s or not cands:
            continue
        queries = [query_of(r) for r in cands]
        shortest = min(q.context for q in queries)
        answers = [answer(model, replace(q, tp=tp_of(m), concurrency=m.concurrency, context=shortest),
                          config_of(r)).tokens_per_s for q, r in zip(queries, cands)]
        out.append((m.tokens_per_s, statistics.median(answers), configuration(m)))
    return out


# -- all of them ---------------------------------------------------------------------------------

def backtest(data: Sequence[Dataset], outside: Sequence[Dataset] = ()) -> list[BacktestRow]:
    """Every backtest over kdbench's measured datasets (and outside figures for cross-host)."""
    rows: list[BacktestRow] = []
    for d in data:
        rows += composition(d) + depth(d) + size(d) + tensor_parallel(d)
    return judged(rows + cross_host(data, outside))
