"""What-if answers: the step model over a grid of deployments, as rows and as a stored projected run.

`answers(model, queries, evidence, spread)` answers each (tp, concurrency, context, budget, accepted)
query with its band (flows.analysis.bands). `as_tables` keeps answers as a projected run of suite "whatif"
(e2e rows with the per-family split, a configuration that does not fit memory a skipped row with
its reason and the bytes it needs), with what each answer leaned on (interpolated and extrapolated
inputs, carries, the largest term) in the run's provenance. `store_grids` stores the grid every
host page shows (concurrency x context at the measured acceptance levels); the notes read it back
with `stored_whatif` and never compute one.
"""

from __future__ import annotations

import hashlib
import json
import statistics
from dataclasses import dataclass
from typing import Any, Sequence

from engine.rows import COLUMNS, E2ERow, Provenance, RunRow
from engine.schema import CommSource, PointStatus, RunStatus
from engine.table_files import to_table
from flows.analysis.bands import Band, from_reference, step_band
from flows.analysis.ceilings import Machine, ProjectionError, Tables, rows_of
from flows.analysis.families import tp_of
from flows.analysis.reference import Dataset, load_reference, machine_of, measured_datasets
from flows.inventory.hosts import Inventory
from flows.analysis.stepmodel import (COLUMN, FAMILIES, LABEL, TERMS, Model, Query, Step, answer, build,
                                      calibration_rows, config_of, step_spread)
from flows.store.store import Store

SUITE = "whatif"
GRID_CONCURRENCY = (1, 4, 16, 64)
GRID_CONTEXT = (1024, 8192, 32768, 131072)
GRID_BUDGET = 16
MAX_QUERIES = 4096


@dataclass(frozen=True)
class Answer:
    step: Step
    band: Band
    level: float | None = None          # the synthetic acceptance level whose measured accept it used

    @property
    def tokens_band(self) -> tuple[float | None, float | None]:
        return self.band.of_rate(self.step.tokens_per_s)

    def largest_text(self) -> str:
        """'attention 61% of the step' (comm counted as a term of the step)."""
        term = self.step.largest
        return f"{LABEL[term]} {self.step.share(term):.0%} of the step"


def accept_levels(tables: Tables) -> list[tuple[float | None, float]]:
    """(synthetic level, mean accepted draft tokens a step) of the reference's full-depth e2e rows."""
    rows = [r for r in calibration_rows(rows_of(tables, "e2e"))
            if r.accept_len_mean is not None and (r.layers or 0) >= config_of(r).layers]
    by: dict[float | None, list[float]] = {}
    for r in rows:
        by.setdefault(r.synthetic_accept, []).append(r.accept_len_mean)
    return [(lv, statistics.mean(v)) for lv, v in sorted(by.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))]


def answers(model: Model, queries: Sequence[tuple[Query, float | None]], evidence: Sequence[object],
            spread: float) -> list[Answer]:
    """Each (query, its acceptance level) answered with its band."""
    out = []
    evidence = from_reference(evidence, model.ref.name)
    for q, level in queries:
        s = answer(model, q)
        out.append(Answer(s, step_band(s, evidence, spread, [answer(m, q) for m in model.others()]), level))
    return out


def grid_tp(data: Dataset, target: Machine, measured: bool) -> int:
    """The TP degree a page's grid is at: the measured host's deployment rows, else the target's GPUs."""
    if measured:
        return max((tp_of(r) for r in rows_of(data.tables, "e2e")), default=1)
    return max(target.gpus, 1)


def grid_queries(data: Dataset, tp: int) -> list[tuple[Query, float | None]]:
    """Concurrency x context at the reference's measured acceptance levels, budget GRID_BUDGET."""
    return [(Query(tp, c, GRID_BUDGET, s, acc), lv) for lv, acc in accept_levels(data.tables)
            for c in GRID_CONCURRENCY for s in GRID_CONTEXT]


def answer_row(a: Answer) -> dict[str, Any]:
    """One answer as a flat record: the query, tokens/s and its band, the step and each term's share (the
    fields an e2e row also has are named as its columns)."""
    s, q = a.step, a.step.query
    lo, hi = a.tokens_band
    return {COLUMNS.tp: q.tp, COLUMNS.concurrency: q.concurrency, COLUMNS.context: q.context,
            COLUMNS.budget: q.budget, "accept": q.accept, "fits": s.memory.fits, "memory_gb": s.memory.need / 1e9,
            COLUMNS.tokens_per_s: s.tokens_per_s,
            COLUMNS.tokens_per_s_low: lo, COLUMNS.tokens_per_s_high: hi,
            "band": "unknown: " + ", ".join(a.band.unknown) if not a.band.known
            else "pooled: " + ", ".join(a.band.pooled) if a.band.pooled else "",
            "step_ms": s.step_ms, COLUMNS.comm_ms: s.ms["comm"],
            **{f"{t}_share": s.share(t) for t in TERMS}, "largest": a.largest_text(),
            "interpolated": "; ".join(s.interpolated), "extrapolated": "; ".join(s.extrapolated),
            "carries": ", ".join(s.carries), "why_not": s.memory.why_not(), "tight": s.memory.tight()}


def whatif_run_id(host: str, ref_run_id: str, queries: Sequence[tuple[Query, float | None]]) -> str:
    """Deterministic: the same queries from the same reference rewrite the same run."""
    digest = hashlib.sha256(json.dumps([(q.__dict__, lv) for q, lv in queries], sort_keys=True).encode()).hexdigest()
    return f"whatif-{host}-{digest[:10]}-from-{ref_run_id}"[:128]


def as_tables(host: str, model: Model, items: Sequence[Answer], run_id: str, what: str) -> Tables:
    """The answers as a projected run (runs + e2e) of `host`; `what` says which question it answers."""
    spec, cfg = model.target.spec, model.cfg
    rows, notes = [], []
    for a in items:
        s, q = a.step, a.step.query
        lo, hi = a.tokens_band
        ok = s.memory.fits
        rows.append(E2ERow(run_id=run_id, config=cfg.name, layers=q.layers or cfg.layers, tp=q.tp,
                           device="cpu" if spec.arch == "cpu" else "cuda", concurrency=q.concurrency,
                           budget=q.budget, context=q.context, synthetic_accept=a.level,
                           status=PointStatus.OK if ok else PointStatus.SKIPPED, skip_reason=s.memory.why_not() or None,
                           memory_bytes=s.memory.need, accept_len_mean=q.accept,
                           comm_source=CommSource.MODELLED if q.tp > 1 else CommSource.NONE,
                           tokens_per_s=s.tokens_per_s if ok else None, step_ms_p50=s.step_ms if ok else None,
                           tokens_per_s_low=lo if ok else None, tokens_per_s_high=hi if ok else None,
                           **({COLUMN[f]: s.ms[f] for f in FAMILIES} if ok else {}),
                           comm_ms=s.ms["comm"] if ok else None,
                           kernel_ms=s.step_ms - s.ms["host"] if ok else None, outside_ms=s.ms["host"] if ok else None,
                           source="projected", reference_run_id=model.ref_run_id))
        notes.append({"largest": a.largest_text(), "largest_term": s.largest, "share": s.share(s.largest),
                      "interpolated": list(s.interpolated), "extrapolated": list(s.extrapolated),
                      "carries": list(s.carries), "band_unknown": list(a.band.unknown),
                      "band_pooled": list(a.band.pooled), "notes": list(s.notes),
                      "tight": s.memory.tight()})
    prov = Provenance(run_id=run_id, host=host, gpu_name=spec.gpu, gpu_count=model.target.gpus, arch=spec.arch,
                      device="cpu" if spec.arch == "cpu" else "cuda", reference_run_id=model.ref_run_id,
                      reference_host=model.ref.name, what=what, answers=notes)
    runs = [RunRow(run_id=run_id, host=host, suite=SUITE, profile=what, status=RunStatus.COMPLETE, gpu_name=spec.gpu,
                   gpu_count=model.target.gpus, arch=spec.arch, device=prov.device, copy_gbps=model.tgt_c.gbps,
                   matmul_tflops=model.tgt_c.tflops(), points=len(rows), source="projected",
                   note=f"step model answers from {model.ref.name} run {model.ref_run_id}")]
    return {"runs": to_table("runs", runs, prov), "e2e": to_table("e2e", rows, prov)}


def model_for(store: Store, inv: Inventory, host: str, reference: str | None) -> tuple[Dataset, Model, bool]:
    """The data a host's answers come from (its own measured run, else the reference) and the model."""
    own = {d.host: d for d in measured_datasets(store, inv)}
    measured = reference is None and host in own
    data = own[host] if measured else load_reference(store, inv, reference or "h200")
    target = machine_of(inv, host)
    if not calibration_rows(rows_of(data.tables, "e2e")):
        raise ProjectionError(f"reference {data.name!r} has no measured e2e rows to calibrate the step model on")
    return data, build(data.tables, data.machine, target), measured


def store_grids(store: Store, inv: Inventory, reference: str, evidence: Sequence[object]) -> dict[str, str]:
    """Store the what-if grid of every inventory host (from its own data when measured, else from
    `reference`); returns the hosts without one, and why."""
    own = {d.host for d in measured_datasets(store, inv)}
    failed = {}
    for host in sorted(inv.hosts):
        try:
            data, model, measured = model_for(store, inv, host, None if host in own else reference)
        except ProjectionError as e:
            failed[host] = str(e)
            continue
        queries = grid_queries(data, grid_tp(data, model.target, measured))
        items = answers(model, queries, evidence, step_spread(calibration_rows(rows_of(data.tables, "e2e"))))
        run_id = whatif_run_id(host, model.ref_run_id, queries)
        store.put_tables(host, run_id, as_tables(host, model, items, run_id, "grid"))
    return failed


def stored_whatif(store: Store, host: str, what: str = "grid") -> Tables | None:
    """The newest stored what-if run of `host` answering `what` (its tables), or None."""
    for info in reversed(store.runs(host)):
        if info.source == "projected" and SUITE in info.suites:
            tables = store.load(host, info.run_id)
            if tables["runs"].column(COLUMNS.profile)[0].as_py() == what:
                return tables
    return None
