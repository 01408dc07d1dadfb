"""Hold-out backtests of the projection on measured data, stored as data for the notes.

Each backtest predicts measured points from other measured points and reports, per kernel family
and for e2e, the median and worst error (projected / measured - 1) and the share of measured
points inside the predicted band:

- composition: each e2e step from the kernel suite's points plus the dense weights at the measured
  ceilings, with the terms no kernel covers (draft, other, comm) taken as measured;
- depth: the full-depth step from a straight line through the shallower depths of the same point;
- size: a family's largest sizes from its smaller ones (MoE M >= 256 from M <= 128, context 64k from
  <= 32k, tree budget 1024 from <= 256), each carried by the nearest calibrated point's efficiency;
- tp: the TP-N rank from the TP-1 rows (and kernel shards from full shapes);
- cross-host: every measured host from every other one, and outside figures where they match.

A backtest without the data it needs is a row with `skipped` saying why. Nothing is calibrated
on the points it is judged on: every prediction uses only the calibration side.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Iterable, Sequence

import pyarrow as pa

from engine.config import CONFIGS, ModelConfig
from engine.costs import (BF16, build_tree_cost, dense_step_bytes, expected_experts, mla_cost, moe_cost,
                          tree_accept_cost)
from flows.families import (LATENCY, MEMORY, POINT_KEY, SIZE_AXIS, e2e_key, family, host_side, label, point_key, preferred, regime,
                            step_shapes, tp_of)
from flows.projection import (TERMS, ProjectionError, breakdown, has_split, launch_floor, measured_ceilings,
                              project, rows_of)
from flows.inventory import Inventory
from flows.reference import Dataset, is_outside, measured_datasets, project_host, unmeasured_hosts
from flows.store import Store, StoreError

GOAL_MEDIAN = {MEMORY: 0.10, "e2e": 0.20}   # median |error| goals by regime (none set for the others)
GOAL_IN_BAND = 0.90
STORED = "backtest/backtest.json"
# the size backtest: held-out sizes (axis value >= cut) predicted from the smaller ones
HOLD_OUT = {"M": 256, "context": 65536, "budget": 1024}


@dataclass(frozen=True)
class BacktestRow:
    kind: str               # composition | depth | size | tp | cross-host
    reference: str
    target: str
    family: str             # "kernel/impl", or an e2e quantity such as "e2e step"
    regime: str             # memory | compute | host | e2e: which goal applies
    points: int
    median_error: float | None = None   # projected / measured - 1, median over the points
    worst_error: float | None = None    # the largest |error|, signed
    in_band: float | None = None        # share of measured points inside the predicted band
    detail: str = ""                    # what was predicted from what, or why the backtest was skipped

    @property
    def skipped(self) -> bool:
        return self.points == 0


def goal_gap(row: BacktestRow) -> tuple[float | None, float | None]:
    """How far the row misses its goals: (median |error| over its goal, in-band share under 90%)."""
    if row.skipped:
        return None, None
    goal = GOAL_MEDIAN.get(row.regime)
    med = max(abs(row.median_error) - goal, 0.0) if goal is not None else None
    return med, max(GOAL_IN_BAND - row.in_band, 0.0)


Pair = tuple[float, float, float, float]   # measured, predicted, band low, band high


def summarise(kind: str, ref: str, target: str, fam: str, reg: str, pairs: Sequence[Pair],
              detail: str) -> BacktestRow:
    if not pairs:
        return BacktestRow(kind, ref, target, fam, reg, 0, detail=detail)
    errs = [p / m - 1 for m, p, _, _ in pairs]
    inside = sum(lo * (1 - 1e-9) <= m <= hi * (1 + 1e-9) for m, _, lo, hi in pairs)
    return BacktestRow(kind, ref, target, fam, reg, len(errs), statistics.median(errs),
                       max(errs, key=abs), inside / len(errs), detail)


# -- carrying a point to a nearby shape ----------------------------------------------------------

def cost_of(fam: str, cfg: ModelConfig, shape: dict[str, float], tp: int = 1) -> tuple[float, float]:
    """(bytes, flops) of a family at a shape, from engine.costs."""
    if fam == "moe_w4a16":
        m = int(shape["M"])
        return moe_cost(cfg, m, expected_experts(cfg.experts, cfg.top_k, m), tp=tp)
    if fam == "mla_tree_attention":
        return mla_cost(cfg, int(shape["batch"]), int(shape["budget"]), int(shape["context"]), tp=tp)
    if fam == "build_tree":
        return build_tree_cost(cfg, int(shape["batch"]), int(shape["budget"]))
    return tree_accept_cost(cfg, int(shape["batch"]), int(shape["budget"]))


def carried(point: dict[str, Any], nbytes: float, flops: float, gbps: float, tflops: float) -> tuple[float, float, float]:
    """The point's time (p50, p10, p90) at another shape's bytes and flops, keeping its own efficiency
    on the resource that bounds it (host-side points keep their time)."""
    times = [point["time_us_p50"], point.get("time_us_p10") or point["time_us_p50"],
             point.get("time_us_p90") or point["time_us_p50"]]
    if host_side(point):
        return times[0], times[1], times[2]
    ideal = lambda b, f: max(b / (gbps * 1e3), f / (tflops * 1e6))  # noqa: E731
    scale = ideal(nbytes, flops) / max(ideal(point["bytes"], point["flops"]), 1e-12)
    floor = launch_floor(point)
    return tuple(floor + (t - floor) * scale for t in times)  # type: ignore[return-value]


def _dist(point: dict[str, Any], want: dict[str, float]) -> float:
    return sum(abs(math.log(max(point.get(k) or 1, 1) / max(v, 1))) for k, v in want.items())


def at_shape(points: list[dict[str, Any]], fam: str, want: dict[str, float], cfg: ModelConfig,
             gbps: float, tflops: float, tp: int = 1) -> tuple[float, float, float] | None:
    """A family's time at a shape: its nearest measured point (log distance) carried there."""
    cands = preferred([p for p in points if family(p["kernel"]) == fam and tp_of(p) == tp])
    if not cands:
        return None
    best = min(cands, key=lambda p: (_dist(p, want), point_key(p)))
    return carried(best, *cost_of(fam, cfg, {**{k: best.get(k) for k in want}, **want}, tp), gbps, tflops)


def carry_misses(kern: list[dict[str, Any]], fam: str, axes: list[str], cfg: ModelConfig, gbps: float,
                 tflops: float, tp: int = 1) -> tuple[float, float]:
    """How far carrying a family's nearest other point missed each of its measured points (measured /
    carried, min and max): the band a carry to an unmeasured shape gets, from the kernel suite alone."""
    pts = preferred([p for p in kern if family(p["kernel"]) == fam and tp_of(p) == tp])
    ratios = []
    for p in pts:
        others = [q for q in pts if q is not p]
        got = at_shape(others, fam, {k: p[k] for k in axes}, cfg, gbps, tflops, tp) if others else None
        if got:
            ratios.append(p["time_us_p50"] / got[0])
    return (min(ratios), max(ratios)) if ratios else (1.0, 1.0)


def config_of(row: dict[str, Any]) -> ModelConfig:
    return CONFIGS.get(row["config"].split("/")[0], CONFIGS["k2"])


# -- composition ---------------------------------------------------------------------------------

def compose_step(row: dict[str, Any], kern: list[dict[str, Any]], gbps: float,
                 tflops: float) -> dict[str, tuple[float, float, float]] | None:
    """Predicted (ms, low, high) of verify, tree_build and accept for one e2e row, from kernel points."""
    cfg, tp = config_of(row), tp_of(row)
    layers = row["layers"] or cfg.layers
    moe_layers = layers - min(cfg.dense_layers, layers)
    shapes = step_shapes(row)
    got: dict[str, tuple[float, float, float]] = {}
    for f in shapes:
        at = at_shape(kern, f, shapes[f], cfg, gbps, tflops, tp)
        if at is None:
            return None
        lo, hi = carry_misses(kern, f, list(shapes[f]), cfg, gbps, tflops, tp)
        got[f] = (at[0], min(at[1], at[0] * lo), max(at[2], at[0] * hi))
    tokens = row["concurrency"] * (row["budget"] + 1)
    dense = dense_step_bytes(cfg, layers, row.get("vocab"), tp)
    dense_us = max(dense / (gbps * 1e3), 2.0 * tokens * dense / BF16 / (tflops * 1e6))
    verify = [layers * a + moe_layers * m + dense_us for a, m in zip(got["mla_tree_attention"], got["moe_w4a16"])]
    return {"verify_ms": tuple(v / 1e3 for v in verify),  # type: ignore[dict-item]
            "tree_build_ms": tuple(v / 1e3 for v in got["build_tree"]),  # type: ignore[dict-item]
            "accept_ms": tuple(v / 1e3 for v in got["tree_accept"])}  # type: ignore[dict-item]


def composition(data: Dataset) -> list[BacktestRow]:
    rows = [r for r in rows_of(data.tables, "e2e") if r["source"] == "measured" and has_split(r)]
    kern = [k for k in rows_of(data.tables, "kernels") if k["source"] == "measured"]
    name = data.name
    why = "each step from the kernel points (nearest shape, own efficiency; band: how far the same carry missed " \
          "the family's measured points from their neighbours) plus the dense weights at the measured copy/matmul " \
          "ceilings; draft, other and comm as measured"
    if not rows or not kern:
        return [BacktestRow("composition", name, name, "e2e step", "e2e", 0,
                            detail="needs kernel points and e2e rows with a step split in one run")]
    ceil = measured_ceilings(data.tables["runs"], data.machine.spec)
    gbps, tflops = ceil.gbps, ceil.tflops()
    pairs: dict[str, list[Pair]] = {}
    for r in rows:
        pred = compose_step(r, kern, gbps, tflops)
        if pred is None:
            continue
        terms = breakdown(r)
        total = [sum(terms[t] for t in TERMS if t not in pred)] * 3
        for t, (c, lo, hi) in pred.items():
            pairs.setdefault(t.removesuffix("_ms"), []).append((terms[t], c, min(lo, c), max(hi, c)))
            total = [total[0] + c, total[1] + min(lo, c), total[2] + max(hi, c)]
        pairs.setdefault("e2e step", []).append((sum(terms.values()), *total))
    out = [summarise("composition", name, name, "e2e step", "e2e", pairs.get("e2e step", []), why)]
    for t in ("verify", "tree_build", "accept"):
        out.append(summarise("composition", name, name, f"e2e {t} term", "e2e", pairs.get(t, []),
                             "the term alone, predicted as above"))
    return out


# -- depth ---------------------------------------------------------------------------------------

def _line(xs: Sequence[float], ys: Sequence[float]) -> Callable[[float], float]:
    mx, my = statistics.mean(xs), statistics.mean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return lambda x: my + b * (x - mx)


def depth(data: Dataset) -> list[BacktestRow]:
    rows = [r for r in rows_of(data.tables, "e2e") if r["source"] == "measured" and r["step_ms_p50"]]
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(e2e_key(r, without=("layers",)), []).append(r)
    pairs: list[Pair] = []
    for g in groups.values():
        full = config_of(g[0]).layers
        deep = [r for r in g if r["layers"] == full]
        shallow = sorted((r for r in g if r["layers"] and r["layers"] < full), key=lambda r: r["layers"])
        if not deep or len({r["layers"] for r in shallow}) < 2:
            continue
        xs, ys = [r["layers"] for r in shallow], [r["step_ms_p50"] for r in shallow]
        c = _line(xs, ys)(full)
        # the band: the same line fitted with each shallow depth left out in turn (when 3 or more)
        alt = [_line(xs[:i] + xs[i + 1:], ys[:i] + ys[i + 1:])(full) for i in range(len(xs))] if len(xs) > 2 else []
        pairs.append((deep[0]["step_ms_p50"], c, min([c, *alt]), max([c, *alt])))
    depths = sorted({r["layers"] for r in rows if r["layers"]})
    detail = ("full-depth step from a straight line through the shallower depths of the same point" if pairs else
              f"needs rows at 2 or more shallow depths and at full depth (61 for k2) of the same point; "
              f"this data has layers {', '.join(map(str, depths)) or 'none'}")
    return [summarise("depth", data.name, data.name, "e2e step", "e2e", pairs, detail)]


# -- size ----------------------------------------------------------------------------------------

def size(data: Dataset) -> list[BacktestRow]:
    kern = [k for k in rows_of(data.tables, "kernels") if k["source"] == "measured"]
    ceil = measured_ceilings(data.tables["runs"], data.machine.spec)
    out = []
    fams: dict[str, list[dict[str, Any]]] = {}
    for k in kern:
        if family(k["kernel"]) in SIZE_AXIS and not host_side(k):
            fams.setdefault(label(k), []).append(k)
    for fam, pts in sorted(fams.items()):
        axis = SIZE_AXIS[family(pts[0]["kernel"])]
        cut = HOLD_OUT[axis]
        others = [a for a in ("batch", "budget", "context", "tp", "dtype") if a != axis]
        pairs: list[Pair] = []
        regimes = []
        for h in (p for p in pts if (p.get(axis) or 0) >= cut):
            same = [p for p in pts if (p.get(axis) or 0) < cut and all(p.get(a) == h.get(a) for a in others)]
            if not same:
                continue
            gbps, tflops = ceil.of(h["dtype"])
            calib = sorted(same, key=lambda p: p.get(axis) or 0)
            if regime(calib[-1], gbps, tflops) == LATENCY and len(calib) > 1:
                # neither bandwidth nor flops sets the time: extend the calibrated trend (a power law)
                def carry(prev: list[dict[str, Any]], to: dict[str, Any]) -> tuple[float, ...]:
                    return trend(prev, to, axis)
            else:
                def carry(prev: list[dict[str, Any]], to: dict[str, Any]) -> tuple[float, ...]:
                    return carried(prev[-1], to["bytes"], to["flops"], gbps, tflops)
            c, lo, hi = carry(calib, h)
            # the band: how far the same carry missed each calibrated size from the smaller ones
            misses = [b["time_us_p50"] / carry(calib[:i], b)[0] for i, b in enumerate(calib) if i >= 2]
            pairs.append((h["time_us_p50"], c, min([lo, *(c * m for m in misses)]), max([hi, *(c * m for m in misses)])))
            regimes.append(regime(h, gbps, tflops))
        reg = statistics.mode(regimes) if regimes else regime(pts[0], *ceil.of(pts[0]["dtype"]))
        detail = (f"{axis} >= {cut} from {axis} < {cut}: the largest calibrated size's efficiency carried (latency-"
                  "bound families: the calibrated power-law trend); band: its p10-p90 and how far the same carry "
                  "missed each calibrated size from the smaller ones")
        out.append(summarise("size", data.name, data.name, fam, reg, pairs,
                             detail if pairs else f"no points at {axis} >= {cut} with smaller ones of the same shape"))
    return out


def trend(prev: list[dict[str, Any]], to: dict[str, Any], axis: str) -> tuple[float, float, float]:
    """Time at `to` by the power law through the two largest of `prev` (sorted along `axis`)."""
    a, b = prev[-2], prev[-1]
    slope = math.log(b["time_us_p50"] / a["time_us_p50"]) / math.log(b[axis] / a[axis])
    scale = (to[axis] / b[axis]) ** slope
    return tuple(scale * (b.get(k) or b["time_us_p50"]) for k in ("time_us_p50", "time_us_p10", "time_us_p90"))  # type: ignore[return-value]


# -- tensor parallel -----------------------------------------------------------------------------

def tensor_parallel(data: Dataset) -> list[BacktestRow]:
    e2e = [r for r in rows_of(data.tables, "e2e") if r["source"] == "measured" and has_split(r)]
    degrees = sorted({tp_of(r) for r in e2e})
    kern = [k for k in rows_of(data.tables, "kernels") if k["source"] == "measured"]
    out = []
    ceil = measured_ceilings(data.tables["runs"], data.machine.spec)
    # kernels: a shard shape from the full shape's point, own efficiency kept
    shard = [k for k in kern if tp_of(k) > 1 and not host_side(k)]
    fams: dict[str, list[Pair]] = {}
    for k in shard:
        full = [p for p in kern if tp_of(p) == 1 and unsharded_key(p) == unsharded_key(k)]
        if full:
            c, lo, hi = carried(full[0], k["bytes"], k["flops"], *ceil.of(k["dtype"]))
            fams.setdefault(label(k), []).append((k["time_us_p50"], c, lo, hi))
    for fam, pairs in sorted(fams.items()):
        reg = regime(next(k for k in shard if label(k) == fam), *ceil.of("bfloat16"))
        out.append(summarise("tp", data.name, data.name, fam, reg, pairs,
                             "TP-N shard shapes from the full shapes (own efficiency at the shard's bytes/flops)"))
    if 1 not in degrees or len(degrees) < 2:
        out.append(BacktestRow("tp", data.name, data.name, "e2e rank step", "e2e", 0,
                               detail=f"needs e2e rows at TP-1 and TP-N of the same point; this data has tp "
                                      f"{', '.join(map(str, degrees)) or 'none'}"))
        return out
    one = {**data.tables, "e2e": _only(data.tables["e2e"], [r for r in e2e if tp_of(r) == 1])}
    for n in degrees[1:]:
        target = replace(data.machine, gpus=n)
        proj = {e2e_key(p, without=("tp",)): p for p in project(one, data.machine, target)["e2e"].to_pylist()}
        rank, real = [], []
        for m in (r for r in e2e if tp_of(r) == n):
            p = proj.get(e2e_key(m, without=("tp",)))
            if not p:
                continue
            if m.get("comm_source") == "measured":   # a real N-GPU run: the whole step, comm included
                real.append((m["step_ms_p50"], p["step_ms_p50"], *_step_band(p)))
            else:                                    # one rank on one GPU: its compute, comm left out
                mc, pc = breakdown(m)["comm_ms"], p["comm_ms"] or 0.0
                lo, hi = _step_band(p)
                real_ms = sum(breakdown(m).values()) - mc
                rank.append((real_ms, p["step_ms_p50"] - pc, lo - pc, hi - pc))
        out.append(summarise("tp", data.name, data.name, f"e2e TP-{n} rank step", "e2e", rank,
                             f"TP-{n} rank compute (step without comm) from the TP-1 rows, re-sharded as the "
                             "projection does"))
        if real:
            out.append(summarise("tp", data.name, data.name, f"e2e {n}-GPU step", "e2e", real,
                                 f"a real {n}-GPU run (measured comm) from the 1-GPU rows"))
    return out


def unsharded_key(row: dict[str, Any]) -> tuple:
    """A point's key without what sharding changes (its TP degree and the sharded N)."""
    return tuple(v for k, v in zip(POINT_KEY, point_key(row)) if k not in ("N", "tp"))


def _step_band(p: dict[str, Any]) -> tuple[float, float]:
    """A projected row's step band, from its tokens/s band."""
    return p["tokens_per_s"] * p["step_ms_p50"] / p["tokens_per_s_high"], \
        p["tokens_per_s"] * p["step_ms_p50"] / p["tokens_per_s_low"]


def _only(table: pa.Table, rows: list[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=table.schema)


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
            out += compare(ref.name, tgt.name, proj, tgt.tables, relax_impl=is_outside(tgt.tables))
    return out


def compare(ref: str, target: str, proj: dict, meas: dict, relax_impl: bool = False) -> list[BacktestRow]:
    """Projection error per kernel family and for e2e tokens/s, on the points both sides have.

    `relax_impl` matches an outside kernel (another implementation) with kdbench's at the same shape."""
    out = []
    drop = lambda k: k[:1] + k[2:] if relax_impl else k  # noqa: E731  (point_key[1] is impl)
    got: dict[tuple, dict[str, Any]] = {}
    for p in preferred(rows_of(proj, "kernels")) if relax_impl else rows_of(proj, "kernels"):
        got.setdefault(drop(point_key(p)), p)
    fams: dict[str, list[Pair]] = {}
    regs: dict[str, str] = {}
    for m in rows_of(meas, "kernels"):
        p = got.get(drop(point_key(m)))
        if p:
            name = f"{label(p)} vs {m['impl']}" if relax_impl and p["impl"] != m["impl"] else label(m)
            fams.setdefault(name, []).append((m["time_us_p50"], p["time_us_p50"], p["time_us_low"], p["time_us_high"]))
            regs[name] = p["regime"] or "-"
    detail = "outside figures of another implementation: the gap is kdbench's kernel against theirs, " \
             "not only projection error" if relax_impl else "projected from the reference's own run"
    out += [summarise("cross-host", ref, target, f, regs[f], v, detail) for f, v in sorted(fams.items())]
    # an outside serving figure states no tree budget or acceptance: it meets the fastest projected
    # row of the same config, depth, TP degree and concurrency
    key = (lambda e: e2e_key(e, without=("budget", "context", "synthetic_accept"))) if relax_impl else e2e_key
    got_e: dict[tuple, dict[str, Any]] = {}
    for e in rows_of(proj, "e2e"):
        if key(e) not in got_e or e["tokens_per_s"] > got_e[key(e)]["tokens_per_s"]:
            got_e[key(e)] = e
    pairs = [(m["tokens_per_s"], p["tokens_per_s"], p["tokens_per_s_low"], p["tokens_per_s_high"])
             for m in rows_of(meas, "e2e") if m["tokens_per_s"]
             for p in [got_e.get(key(m))] if p]
    what = "config, layers, tp, concurrency" + ("" if relax_impl else ", budget, acceptance")
    out.append(summarise("cross-host", ref, target, "e2e tokens/s", "e2e", pairs,
                         (f"{detail}; each outside row against the fastest projected row of the same {what}"
                          if relax_impl else detail) if pairs else
                         f"no e2e point of the target matches a projected one ({what})"))
    return out


# -- all of them ---------------------------------------------------------------------------------

def backtest(data: Sequence[Dataset], outside: Sequence[Dataset] = ()) -> list[BacktestRow]:
    """Every backtest over kdbench's measured datasets (and outside figures for cross-host)."""
    rows: list[BacktestRow] = []
    for d in data:
        rows += composition(d) + depth(d) + size(d) + tensor_parallel(d)
    return rows + cross_host(data, outside)


def backtests_of(store: Store, inv: Inventory) -> list[BacktestRow]:
    """Every backtest over the store's measured data (none when there is none)."""
    own = measured_datasets(store, inv)
    if not own:
        return []
    return backtest(own, [d for d in measured_datasets(store, inv, outside=True) if is_outside(d.tables)])


def store_backtest(store: Store, rows: Iterable[BacktestRow]) -> None:
    store.put_json(STORED, [asdict(r) for r in rows])


def stored_backtest(store: Store) -> list[BacktestRow]:
    """The backtest rows `kdbench backtest` (or the flow) stored last; empty when never run."""
    return [BacktestRow(**r) for r in store.get_json(STORED) or []]



def refresh(store: Store, inv: Inventory, reference: str) -> dict[str, str]:
    """Store what the notes read and never compute: a projection from `reference` of every inventory
    host without a measured run, and the backtests. Returns the hosts that could not be projected, and why."""
    failed = {}
    for host in unmeasured_hosts(store, inv):
        try:
            project_host(store, inv, host, reference)
        except (ProjectionError, StoreError) as e:
            failed[host] = str(e)
    store_backtest(store, backtests_of(store, inv))
    return failed
