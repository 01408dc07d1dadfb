"""Projection of a measured run onto another machine: a pure function of tables.

`project(tables, reference, target, evidence)` takes a measured run's tables, the machine they ran
on, the machine to project onto and the stored backtests (the evidence for the bands), and returns
projected tables in the kdbench schema; nothing here reads or writes the store, talks to Prefect or
writes prose. The assumptions travel as data (typed records, flows.analysis.assumptions, stored as a list in
every table's provenance, key `assumptions`) that the notes turn into sentences.

Kernel points of the families kdbench models are carried by their kernel models (flows.analysis.kernelfit:
latency kept, bandwidth by flows.analysis.carrier, compute by the ratio of the ceilings); the ceilings are
the reference's measured copy bandwidth and matmul throughput and the same fractions of the target's
spec sheet, so projecting a machine onto itself gives back its measurements. Other points keep
their own efficiency on the resource that bounds them (`project_point`); host-side work (a CPU
kernel, Python) is kept. Each measured e2e row becomes the step model's answer (flows.analysis.stepmodel) at
its configuration on one rank of a TP-(target GPUs) deployment, comm over the target's own links,
tokens a step as the row measured them. A figure's band comes from the held-out errors of the carries
it used (flows.analysis.bands): unknown where the evidence is too thin, and holding what the other candidate
carriers give where the carrier's form is uncertain. Every record says `source = projected`.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, replace
from typing import Any, Sequence

from engine.rows import COLUMNS, CommRow, E2ERow, KernelRow, Provenance, RunRow
from engine.schema import CommSource, PointStatus
from engine.table_files import to_table
from flows.analysis.assumptions import (Assumption, BandEvidence, Comm, E2eNotMeasured, E2eWithoutSplit, Kept,
                                        KernelModels, ReferenceCeilings, SkippedPoint, StepModel, TargetCeilings,
                                        TensorParallel, TpCarry, parse, record)
from flows.analysis.bands import MIN_GROUPS, Band, combine, evidence_in, from_reference, holding, reached, step_band
from flows.analysis.carrier import how, others
from flows.analysis.ceilings import (ALLREDUCES_PER_LAYER, DTYPE_KEYS, Ceilings, CommModel, Machine, ProjectionError,
                                     Tables, allreduce_us, comm_model, measured_ceilings, peak_tflops, rows_of)
from flows.analysis.families import (COMPUTE, HOST, HOST_SIDE, LATENCY, LATENCY_SHARE, MEMORY, bound, e2e_key,
                                     host_side, label, point_key, preferred, regime, shape_of, tp_of)
from flows.analysis.kernelfit import class_key
from flows.analysis.stepmodel import (COLUMN, FAMILIES, Model, answer, build, calibration_rows, config_of, query_of,
                                      step_spread)

__all__ = ["ALLREDUCES_PER_LAYER", "Machine", "ProjectionError", "Tables", "allreduce_us", "assumptions",
           "breakdown", "has_split", "measured_ceilings", "project", "project_point", "rows_of"]

TERMS = (COLUMNS.draft_ms, COLUMNS.tree_build_ms, COLUMNS.verify_ms, COLUMNS.accept_ms, COLUMNS.other_ms,
         COLUMNS.comm_ms)
# What launching a GPU kernel costs on the host, kept as is on any target (capped at half a point's time).
LAUNCH_FLOOR_US = 3.0
# The reference's skipped e2e points named in the assumptions (each reason cut): a bounded provenance.
NOT_MEASURED_LISTED, SKIP_REASON_CHARS = 20, 300


def assumptions(tables: Tables) -> list[Assumption]:
    """The assumption records a projection stored with its tables, typed."""
    return [parse(a) for a in Provenance.of(tables["runs"]).assumptions or []]


# -- kernel points ------------------------------------------------------------------------------

def _ideal_us(row: KernelRow, bw_gbps: float, tflops: float) -> tuple[float, float]:
    """Roofline times (us) of the point's bytes and flops at the given ceilings."""
    return row.bytes / (bw_gbps * 1e3), row.flops / (tflops * 1e6)


def launch_floor(row: KernelRow) -> float:
    return min(LAUNCH_FLOOR_US, 0.5 * row.time_us_p50)


def own_effs(row: KernelRow, t_us: float, bw: float, tfl: float) -> tuple[float, float]:
    """The point's efficiency on bandwidth and on flops: roofline time over the time above the floor."""
    tb, tf = _ideal_us(row, bw, tfl)
    work = max(t_us - launch_floor(row), 1e-9)
    return tb / work, tf / work


def family_effs(rows: Sequence[KernelRow], ceil: Ceilings) -> dict[tuple, dict[str, list[float]]]:
    """Per (kernel, impl, dtype): efficiencies of the points bound by each resource, for borrowing."""
    out: dict[tuple, dict[str, list[float]]] = {}
    for r in rows:
        if host_side(r):
            continue
        bw, tfl = ceil.of(r.dtype)
        e_bw, e_fl = own_effs(r, r.time_us_p50, bw, tfl)
        fam = out.setdefault((r.kernel, r.impl, r.dtype), {MEMORY: [], COMPUTE: []})
        which = bound(*_ideal_us(r, bw, tfl))
        fam[which].append(e_bw if which == MEMORY else e_fl)
    return out


def project_point(row: KernelRow, ref: tuple[float, float], tgt: tuple[float, float],
                  fam: dict[str, list[float]] | None) -> dict[str, Any]:
    """One kernel point on the target: time, low-high band, regime on both sides.

    `ref`/`tgt` are (GB/s, TFLOP/s) ceilings for the point's dtype. The bound resource keeps the
    point's own efficiency; the other borrows the family's (never below what the point achieved
    on it), so a point that crosses the ridge on the target is timed by its family's efficiency.
    """
    if host_side(row):
        t = row.time_us_p50
        return dict(time_us_p50=t, time_us_low=row.time_us_p10 or t, time_us_high=row.time_us_p90 or t, regime=HOST,
                    reference_regime=HOST)
    if regime(row, *ref) == LATENCY:   # kept; the band reaches the roofline-scaled time
        t, floor = row.time_us_p50, launch_floor(row)
        at_ref, at_tgt = max(_ideal_us(row, *ref)), max(_ideal_us(row, *tgt))
        scaled = floor + (t - floor) * at_tgt / at_ref if at_ref else t
        return dict(time_us_p50=t, time_us_low=min(row.time_us_p10 or t, scaled),
                    time_us_high=max(row.time_us_p90 or t, scaled), regime=LATENCY, reference_regime=LATENCY)
    floor = launch_floor(row)
    tb_ref, tf_ref = _ideal_us(row, *ref)
    tb_tgt, tf_tgt = _ideal_us(row, *tgt)
    which = bound(tb_ref, tf_ref)
    other = COMPUTE if which == MEMORY else MEMORY
    borrowed = sorted((fam or {}).get(other, []))
    cands = [statistics.median(borrowed), borrowed[0], borrowed[-1]] if borrowed else [None]
    times = [t for t in (row.time_us_p50, row.time_us_p10, row.time_us_p90) if t]
    results = []
    for t in times:
        e_bw, e_fl = own_effs(row, t, *ref)
        e_bind = e_bw if which == MEMORY else e_fl
        for c in cands:
            e_other = max(e_fl if which == MEMORY else e_bw, c if c is not None else e_bind)
            eb, ef = (e_bind, e_other) if which == MEMORY else (e_other, e_bind)
            a = tb_tgt / eb if tb_tgt else 0.0
            b = tf_tgt / ef if tf_tgt else 0.0
            results.append((max(a, b) + floor, bound(a, b)))
    t, reg = results[0]
    every = [x for x, _ in results]
    return dict(time_us_p50=t, time_us_low=min(every), time_us_high=max(every), regime=reg,
                reference_regime=which)


def _spread(row: KernelRow) -> float:
    """Half the point's p10-p90 spread, relative to its median."""
    lo, hi = row.time_us_p10, row.time_us_p90
    return (hi - lo) / 2 / row.time_us_p50 if lo and hi else 0.0


def measured_band(row: KernelRow) -> Band:
    """The point's own p10 and p90 over its median: the band of a figure carried to the machine it
    was measured on (multipliers, so a spread wider than the median never makes a time negative)."""
    lo, hi, mid = row.time_us_p10, row.time_us_p90, row.time_us_p50
    return Band(min(lo / mid, 1.0) if lo else 1.0, max(hi / mid, 1.0) if hi else 1.0)


def project_kernels(rows: list[KernelRow], model: Model, evidence: Sequence[Any], run_id: str,
                    ref_run_id: str) -> tuple[list[KernelRow], set[str]]:
    """Every measured point on the target: by its family's kernel model where kdbench has one and the point
    is of the implementation the model was fitted on (its band from the cross-host evidence of that family
    in the point's regime on the target, holding the other candidate carriers' times, never faster than the
    target's spec roofline; the p10-p90 spread on the reference's own machine), else (a
    baseline such as the torch reference) by `project_point`. Returns the rows and the carries whose band was
    pooled (flows.analysis.bands)."""
    effs = family_effs(rows, model.ref_c)
    modelled = {point_key(p) for k in {r.kernel for r in rows} for p in preferred([r for r in rows if r.kernel == k])}
    out, pooled = [], set()
    for r in rows:
        fam = model.fams.get(r.kernel)
        got = None if fam is None or host_side(r) or point_key(r) not in modelled else fam.time_us(
            class_key(r), shape_of(r), r.bytes, r.flops,
            model.carry)
        if got is None:
            p = project_point(r, model.ref_c.of(r.dtype), model.tgt_c.of(r.dtype),
                              effs.get((r.kernel, r.impl, r.dtype)))
        else:
            t = got[0].value
            reg = regime(replace(r, time_us_p50=t), *model.tgt_c.of(r.dtype))
            if model.cross_host:
                same = [e for e in evidence if e.kind == "cross-host" and e.regime == reg]
                own = [e for e in same if e.family.startswith(label(r))]
                band = combine({f"cross-host {label(r)} {reg}": (evidence_in(own), 1.0,
                                                                  evidence_in([e for e in same if e not in own]))},
                               _spread(r))
                band = holding(band, [alt[0].value / t for m in model.others()
                                      for alt in [fam.time_us(class_key(r), shape_of(r), r.bytes, r.flops, m.carry)]
                                      if alt])
                pooled.update(band.pooled)
            else:
                band = measured_band(r)
            spec = model.target.spec   # no band edge beats the target's spec roofline
            floor = min(t, max(_ideal_us(r, spec.mem_bw_gbps, peak_tflops(spec, r.dtype))))
            p = dict(time_us_p50=t, time_us_low=max(t * band.low, floor) if band.known else None,
                     time_us_high=t * band.high if band.known else None,
                     regime=reg, reference_regime=regime(r, *model.ref_c.of(r.dtype)))
        q = replace(r, **p, run_id=run_id, source="projected", reference_run_id=ref_run_id,
                    device="cpu" if model.target.spec.arch == "cpu" else "cuda", time_us_p10=None, time_us_p90=None)
        out.append(replace(q, achieved_gbps=r.bytes / (q.time_us_p50 * 1e3),
                           achieved_tflops=r.flops / (q.time_us_p50 * 1e6)))
    return out, pooled


# -- communication ----------------------------------------------------------------------------

def project_comm(model: CommModel, run_id: str) -> list[CommRow]:
    if model.n <= 1 or not model.link_gbps:
        why = "one GPU" if model.n <= 1 else "no link bandwidth in the spec sheet"
        return [CommRow(run_id=run_id, op="all_reduce", world_size=model.n, bytes=0, status=PointStatus.SKIPPED,
                        skip_reason=why, source="projected")]
    out = []
    for p in range(10, 31, 4):   # 1 KiB .. 1 GiB
        nbytes = 1 << p
        t = model.time_us(nbytes)
        alg = nbytes / (t * 1e3)
        out.append(CommRow(run_id=run_id, op="all_reduce", world_size=model.n, bytes=nbytes, time_us_p50=t,
                           algbw_gbps=alg, busbw_gbps=alg * 2 * (model.n - 1) / model.n, status=PointStatus.OK,
                           source="projected"))
    return out


# -- end to end ---------------------------------------------------------------------------------

def breakdown(row: E2ERow) -> dict[str, float]:
    """The step split in ms; whatever the terms do not cover of the p50 step counts as other_ms."""
    terms = {t: float(getattr(row, t) or 0.0) for t in TERMS}
    rest = (row.step_ms_p50 or 0.0) - sum(terms.values())
    if rest > 0:
        terms[COLUMNS.other_ms] += rest
    return terms


def has_split(row: E2ERow) -> bool:
    """Whether the row says how its step divides (an outside serving figure does not)."""
    return any(getattr(row, t) is not None for t in TERMS)


def choose_rows(rows: list[E2ERow], tp: int) -> list[E2ERow]:
    """Per e2e point (any TP degree), the row a TP-`tp` target is carried from: the nearest degree."""
    groups: dict[tuple, list[E2ERow]] = {}
    for r in rows:
        groups.setdefault(e2e_key(r, without=("tp",)), []).append(r)
    return [min(groups[k], key=lambda r: (abs(tp_of(r) - tp), -tp_of(r))) for k in sorted(groups, key=repr)]


def project_e2e(tables: Tables, model: Model, evidence: Sequence[Any], run_id: str,
                ref_run_id: str) -> tuple[list[E2ERow], list[TpCarry], set[str]]:
    """Each measured point as one rank of a TP-(target GPUs) deployment, by the step model. Returns the
    rows, per source degree how it was carried, and the carries whose band was pooled."""
    tp = max(model.target.gpus, 1)
    rows = calibration_rows(rows_of(tables, "e2e"))
    spread = step_spread(rows)
    out, carried, pooled = [], {}, set()
    for r in choose_rows([r for r in rows if has_split(r)], tp):
        s = answer(model, replace(query_of(r), tp=tp), config_of(r))
        carried[tp_of(r)] = carried.get(tp_of(r), 0) + 1
        # tokens a step as the reference measured them (accepted drafts + 1 bonus, its decode's tail included)
        per_step = r.tokens_per_s * (r.step_ms_p50 + (r.comm_ms or 0.0)) / 1e3 / r.concurrency \
            if r.tokens_per_s else (r.accept_len_mean or 0.0) + 1.0
        tps = r.concurrency * per_step / (s.step_ms + s.ms["comm"]) * 1e3
        alts = [answer(m, replace(query_of(r), tp=tp), config_of(r)) for m in model.others()]
        band = step_band(s, evidence, spread, alts)
        pooled.update(band.pooled)
        low, high = band.of_rate(tps)
        out.append(E2ERow(config=r.config, layers=r.layers, concurrency=r.concurrency, budget=r.budget,
                          context=r.context, synthetic_accept=r.synthetic_accept, accept_len_mean=r.accept_len_mean,
                          weight_sets=r.weight_sets, vocab=r.vocab,
                          **{COLUMN[f]: s.ms[f] for f in FAMILIES}, comm_ms=s.ms["comm"],
                          kernel_ms=s.step_ms - s.ms["host"], outside_ms=s.ms["host"],
                          tp=tp, comm_source=CommSource.MODELLED if tp > 1 else CommSource.NONE,
                          run_id=run_id, device="cpu" if model.target.spec.arch == "cpu" else "cuda",
                          step_ms_p50=s.step_ms, tokens_per_s=tps, tokens_per_s_low=low, tokens_per_s_high=high,
                          source="projected", reference_run_id=ref_run_id))
    return out, [TpCarry(t, "same" if t == tp else "model", n) for t, n in sorted(carried.items())], pooled


# -- whole projection ---------------------------------------------------------------------------

def projected_run_id(target: str, ref_run_id: str) -> str:
    """Deterministic, so re-projecting the same inputs rewrites the same run."""
    return f"proj-{target}-from-{ref_run_id}"[:128]


@dataclass
class _Parts:
    run_id: str
    model: Model
    kproj: list[KernelRow]
    eproj: list[E2ERow]
    tp_how: list[TpCarry]
    comm: CommModel
    skipped_e2e: int
    not_measured: list[SkippedPoint]   # the reference's skipped e2e points: nothing to carry
    pooled: list[str]                  # the carries whose band was pooled over their kind and regime


def _parts(tables: Tables, ref: Machine, target: Machine, run_id: str, evidence: Sequence[Any]) -> _Parts:
    if "runs" not in tables:
        raise ProjectionError(f"reference from {ref.name} has no runs table")
    ref_run_id = tables["runs"].column(COLUMNS.run_id)[0].as_py()
    model = build(tables, ref, target)
    evidence = from_reference(evidence, ref.name)
    kern = [r for r in rows_of(tables, "kernels") if r.source == "measured"]
    kproj, k_pooled = project_kernels(kern, model, evidence, run_id, ref_run_id)
    comm = comm_model(rows_of(tables, "comm"), ref, target)
    eproj, how, e_pooled = project_e2e(tables, model, evidence, run_id, ref_run_id)
    e2e = [r for r in rows_of(tables, "e2e") if r.source == "measured"]
    ok = [r for r in e2e if r.status == "ok"]
    skipped = [SkippedPoint(tp_of(r), r.concurrency, r.budget, r.context,
                            (r.skip_reason or "-")[:SKIP_REASON_CHARS], r.synthetic_accept)
               for r in e2e if r.status != "ok"]
    return _Parts(run_id, model, kproj, eproj, how, comm, sum(1 for r in ok if not has_split(r)), skipped,
                  sorted(k_pooled | e_pooled))


def _widen(low: float | None, high: float | None, central: float, o_low: float | None,
           o_high: float | None) -> tuple[float | None, float | None]:
    """A band widened to take in another reference's figure (`central`) and band (an unknown band stays
    unknown)."""
    if low is None or high is None:
        return low, high
    return (min(low, o_low if o_low is not None else low, central),
            max(high, o_high if o_high is not None else high, central))


def _widen_point(p: KernelRow, o: KernelRow | None) -> KernelRow:
    if o is None:
        return p
    low, high = _widen(p.time_us_low, p.time_us_high, o.time_us_p50, o.time_us_low, o.time_us_high)
    return replace(p, time_us_low=low, time_us_high=high)


def _widen_e2e(e: E2ERow, o: E2ERow | None) -> E2ERow:
    if o is None:
        return e
    low, high = _widen(e.tokens_per_s_low, e.tokens_per_s_high, o.tokens_per_s, o.tokens_per_s_low, o.tokens_per_s_high)
    return replace(e, tokens_per_s_low=low, tokens_per_s_high=high)


def project(tables: Tables, ref: Machine, target: Machine,
            also: Sequence[tuple[Tables, Machine]] = (), evidence: Sequence[Any] = ()) -> Tables:
    """The reference's measured tables carried onto `target`, bands from `evidence` (stored backtest
    rows); further references widen the band."""
    ref_runs = rows_of(tables, "runs")
    if not ref_runs:
        raise ProjectionError(f"reference from {ref.name} has no runs rows")
    ref_run_id = ref_runs[0].run_id
    run_id = projected_run_id(target.name, ref_run_id)
    main = _parts(tables, ref, target, run_id, evidence)
    for x in (_parts(t, m, target, run_id, evidence) for t, m in also):
        kern = {point_key(p): p for p in x.kproj}
        main.kproj = [_widen_point(p, kern.get(point_key(p))) for p in main.kproj]
        e2e = {e2e_key(e): e for e in x.eproj}
        main.eproj = [_widen_e2e(e, e2e.get(e2e_key(e))) for e in main.eproj]
    refs = [ref_run_id] + [t["runs"].column(COLUMNS.run_id)[0].as_py() for t, _ in also]
    records = [record(a) for a in assumption_records(ref, target, ref_run_id, main, refs, evidence)]
    prov_ref = Provenance.of(tables["runs"])
    spec_figs = target.spec.model_dump(exclude={"sources"})
    device = "cpu" if target.spec.arch == "cpu" else "cuda"
    prov = Provenance(run_id=run_id, host=target.name, gpu_name=target.spec.gpu, gpu_count=target.gpus,
                      arch=target.spec.arch, device=device, started_at=prov_ref.started_at, ended_at=prov_ref.ended_at,
                      reference_run_id=ref_run_id, reference_host=ref.name, references=refs, spec=spec_figs,
                      assumptions=records)
    if target.gpus > 1 and not any(r.suite == "comm" for r in ref_runs):
        ref_runs.append(replace(ref_runs[0], suite="comm"))
    comm_rows = project_comm(main.comm, run_id)
    runs = []
    for r in ref_runs:
        suite = r.suite
        n = {"kernels": len(main.kproj), "e2e": len(main.eproj), "comm": len(comm_rows)}.get(suite, 0)
        status = "skipped" if suite == "comm" and comm_rows[0].status == "skipped" else "complete"
        runs.append(RunRow(run_id=run_id, host=target.name, suite=suite, profile=r.profile, status=status,
                           gpu_name=target.spec.gpu, gpu_count=target.gpus, arch=target.spec.arch, device=device,
                           started_at=r.started_at, ended_at=r.ended_at, copy_gbps=main.model.tgt_c.gbps,
                           matmul_tflops=main.model.tgt_c.tflops(), points=n, source="projected",
                           note=json.dumps({"reference_run_id": ref_run_id, "spec": spec_figs,
                                            "assumptions": records}, sort_keys=True)))
    out = {"runs": to_table("runs", runs, prov)}
    if "kernels" in tables:
        out["kernels"] = to_table("kernels", main.kproj, prov)
    if "e2e" in tables:
        out["e2e"] = to_table("e2e", main.eproj, prov)
    if any(r.suite == "comm" for r in runs):
        out["comm"] = to_table("comm", comm_rows, prov)
    return out


def assumption_records(ref: Machine, target: Machine, ref_run_id: str, p: _Parts, refs: list[str],
                       evidence: Sequence[Any]) -> list[Assumption]:
    """What the projection assumed, as typed records; the notes word them."""
    ref_c, tgt_c, cal = p.model.ref_c, p.model.tgt_c, p.model.cal
    dt = DTYPE_KEYS.get(ref_c.mm_dtype, ref_c.mm_dtype)
    sides = p.model.sides
    recs: list[Assumption] = [
        ReferenceCeilings(ref.name, ref_run_id, ref.spec.gpu, ref_c.gbps, ref_c.bw_frac, ref.spec.mem_bw_gbps,
                          ref_c.tflops(), ref_c.fl_frac, peak_tflops(ref.spec, ref_c.mm_dtype), dt),
        TargetCeilings(target.name, target.spec.gpu, tgt_c.gbps, tgt_c.tflops(), dt),
        KernelModels(sorted(p.model.fams), [ref.spec.sms, target.spec.sms],
                     [ref.spec.mem_latency_ns, target.spec.mem_latency_ns], how(sides[0], sides[1]),
                     list(others(*sides))),
        Kept(LAUNCH_FLOOR_US, LATENCY_SHARE, sorted({"*/cpu"} | {f"{k}/{i}" for k, i in HOST_SIDE})),
        StepModel(cal.rows, cal.split, list(cal.tps), cal.host_fixed_ms, cal.host_per_layer_ms,
                  {f: [min(v for _, v in s), max(v for _, v in s)] for f, s in sorted(cal.factors.items())},
                  list(p.model.notes)),
        TensorParallel(max(target.gpus, 1), target.gpus, p.tp_how),
    ]
    if target.gpus > 1:
        recs.append(Comm(target.gpus, target.interconnect, p.comm.link_gbps, p.comm.alpha_us, p.comm.effs[1],
                         p.comm.effs[0], p.comm.effs[2], p.comm.calibrated, ALLREDUCES_PER_LAYER))
    if p.skipped_e2e:
        recs.append(E2eWithoutSplit(p.skipped_e2e))
    if p.not_measured:
        recs.append(E2eNotMeasured(len(p.not_measured), p.not_measured[:NOT_MEASURED_LISTED]))
    recs.append(BandEvidence(refs, MIN_GROUPS, reached(evidence, ref.name, ref.spec.mem_bw_gbps), target.spec.mem_bw_gbps,
                             p.pooled))
    return recs
