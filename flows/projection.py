"""Roofline/Amdahl projection of measured tables onto another machine: a pure function of tables.

`project(tables, reference, target)` takes a measured run's tables, the machine they ran on and
the machine to project onto, and returns projected tables in the kdbench schema; nothing here reads
or writes the store, talks to Prefect or writes prose. The assumptions travel as data (a list of
records in every table's provenance, key `assumptions`) that the notes turn into sentences.

The carrier from one machine to another is efficiency: how close each measured kernel point came
to the reference's own ceilings. The ceilings are the reference's measured copy bandwidth and
matmul throughput (runs.copy_gbps / matmul_tflops); the target's ceilings are its spec-sheet
peaks scaled by the same measured-to-spec fraction, so projecting a machine onto itself gives
back its measurements. Host-side work (a CPU kernel, Python, launch floors) does not scale with
the GPU and is kept. An e2e row is one rank of a TP-N deployment: the target runs TP = its GPU
count, a row of another degree is re-sharded, and communication is 2 all-reduces per layer times
the layers over the target's own links (alpha-beta). Every figure carries a low-high band, and every
record says `source = projected`.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from typing import Any, Sequence

import pyarrow as pa

from engine.config import CONFIGS
from engine.schema import provenance, to_table
from flows.families import (COMPUTE, HOST, HOST_SIDE, LATENCY, LATENCY_SHARE, MEMORY, TERM_FAMILIES, bound,
                            e2e_key, family, host_side, point_key, preferred, regime, step_shapes, tp_of)
from flows.inventory import Spec

TERMS = ("draft_ms", "tree_build_ms", "verify_ms", "accept_ms", "other_ms", "comm_ms")
# What launching a GPU kernel costs on the host, kept as is on any target (capped at half a point's time).
LAUNCH_FLOOR_US = 3.0
# All-reduce constants used when the reference has no comm measurement of its own.
DEFAULT_ALPHA_US = {"nvlink": 8.0, "pcie": 15.0}
DEFAULT_LINK_EFF = (0.6, 0.75, 0.9)   # low, central, high fraction of the link's spec bandwidth
ALLREDUCES_PER_LAYER = 2              # after attention and after the MoE
# The reference's skipped e2e points named in the assumptions (each reason cut): a bounded provenance.
NOT_MEASURED_LISTED, SKIP_REASON_CHARS = 20, 300


class ProjectionError(Exception):
    """A projection that cannot be made; the message names the host, spec or reference."""


@dataclass(frozen=True)
class Machine:
    """What a projection needs of a machine: its spec sheet, GPU count and links."""

    name: str
    spec: Spec
    gpus: int
    interconnect: str


Tables = dict[str, pa.Table]


def rows_of(tables: Tables, name: str) -> list[dict[str, Any]]:
    return tables[name].to_pylist() if name in tables else []


def assumptions(tables: Tables) -> list[dict[str, Any]]:
    """The assumption records a projection stored with its tables."""
    return list(provenance(tables["runs"]).get("assumptions", []))


# -- ceilings -----------------------------------------------------------------------------------

# engine.bench writes torch dtype names; spec sheets key their peaks by the short names
DTYPE_KEYS = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64",
              "float8_e4m3fn": "fp8", "int8": "int8"}


def peak_tflops(spec: Spec, dtype: str) -> float:
    """Dense peak of the kernel's math dtype; mixed formats (w4a16) and integers run on bf16 units."""
    for key in (DTYPE_KEYS.get(dtype, dtype), "bf16", "fp16"):
        if spec.tflops.get(key):
            return spec.tflops[key]
    return max(spec.tflops.values())


@dataclass(frozen=True)
class Ceilings:
    """Attainable GB/s and TFLOP/s of a device: its spec peaks times the fractions a measurement reached."""

    spec: Spec
    bw_frac: float
    fl_frac: float
    mm_dtype: str          # the dtype of the measured matmul ceiling

    @property
    def gbps(self) -> float:
        return self.spec.mem_bw_gbps * self.bw_frac

    def tflops(self, dtype: str | None = None) -> float:
        return peak_tflops(self.spec, dtype or self.mm_dtype) * self.fl_frac

    def of(self, dtype: str) -> tuple[float, float]:
        return self.gbps, self.tflops(dtype)

    def carried_to(self, spec: Spec) -> "Ceilings":
        """The same fractions of another spec sheet: how the reference's ceilings travel."""
        return Ceilings(spec, self.bw_frac, self.fl_frac, self.mm_dtype)


def measured_ceilings(runs: pa.Table, spec: Spec) -> Ceilings:
    """runs.copy_gbps / matmul_tflops against the spec (the spec itself when not measured)."""
    rows = runs.to_pylist()
    copy = max((r["copy_gbps"] for r in rows if r["copy_gbps"]), default=None)
    mm = max((r["matmul_tflops"] for r in rows if r["matmul_tflops"]), default=None)
    mm_dtype = "float32" if any(r["device"] == "cpu" for r in rows) else "bfloat16"   # as engine.bench times it
    return Ceilings(spec, copy / spec.mem_bw_gbps if copy else 1.0,
                    mm / peak_tflops(spec, mm_dtype) if mm else 1.0, mm_dtype)


# -- kernel points ------------------------------------------------------------------------------

def _ideal_us(row: dict[str, Any], bw_gbps: float, tflops: float) -> tuple[float, float]:
    """Roofline times (us) of the point's bytes and flops at the given ceilings."""
    return row["bytes"] / (bw_gbps * 1e3), row["flops"] / (tflops * 1e6)


def launch_floor(row: dict[str, Any]) -> float:
    return min(LAUNCH_FLOOR_US, 0.5 * row["time_us_p50"])


def own_effs(row: dict[str, Any], t_us: float, bw: float, tfl: float) -> tuple[float, float]:
    """The point's efficiency on bandwidth and on flops: roofline time over the time above the floor."""
    tb, tf = _ideal_us(row, bw, tfl)
    work = max(t_us - launch_floor(row), 1e-9)
    return tb / work, tf / work


def family_effs(rows: Sequence[dict[str, Any]], ceil: Ceilings) -> dict[tuple, dict[str, list[float]]]:
    """Per (kernel, impl, dtype): efficiencies of the points bound by each resource, for borrowing."""
    out: dict[tuple, dict[str, list[float]]] = {}
    for r in rows:
        if host_side(r):
            continue
        bw, tfl = ceil.of(r["dtype"])
        e_bw, e_fl = own_effs(r, r["time_us_p50"], bw, tfl)
        fam = out.setdefault((r["kernel"], r["impl"], r["dtype"]), {MEMORY: [], COMPUTE: []})
        which = bound(*_ideal_us(r, bw, tfl))
        fam[which].append(e_bw if which == MEMORY else e_fl)
    return out


def project_point(row: dict[str, Any], ref: tuple[float, float], tgt: tuple[float, float],
                  fam: dict[str, list[float]] | None) -> dict[str, Any]:
    """One kernel point on the target: time, low-high band, regime on both sides.

    `ref`/`tgt` are (GB/s, TFLOP/s) ceilings for the point's dtype. The bound resource keeps the
    point's own efficiency; the other borrows the family's (never below what the point achieved
    on it), so a point that crosses the ridge on the target is timed by its family's efficiency.
    """
    if host_side(row):
        t = row["time_us_p50"]
        return {"time_us_p50": t, "time_us_low": row["time_us_p10"] or t,
                "time_us_high": row["time_us_p90"] or t, "regime": HOST, "reference_regime": HOST}
    if regime(row, *ref) == LATENCY:   # kept; the band reaches the roofline-scaled time
        t, floor = row["time_us_p50"], launch_floor(row)
        at_ref, at_tgt = max(_ideal_us(row, *ref)), max(_ideal_us(row, *tgt))
        scaled = floor + (t - floor) * at_tgt / at_ref if at_ref else t
        return {"time_us_p50": t, "time_us_low": min(row["time_us_p10"] or t, scaled),
                "time_us_high": max(row["time_us_p90"] or t, scaled), "regime": LATENCY,
                "reference_regime": LATENCY}
    floor = launch_floor(row)
    tb_ref, tf_ref = _ideal_us(row, *ref)
    tb_tgt, tf_tgt = _ideal_us(row, *tgt)
    which = bound(tb_ref, tf_ref)
    other = COMPUTE if which == MEMORY else MEMORY
    borrowed = sorted((fam or {}).get(other, []))
    cands = [statistics.median(borrowed), borrowed[0], borrowed[-1]] if borrowed else [None]
    times = [row[k] for k in ("time_us_p50", "time_us_p10", "time_us_p90") if row.get(k)]
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
    return {"time_us_p50": t, "time_us_low": min(every), "time_us_high": max(every),
            "regime": reg, "reference_regime": which}


def project_kernels(rows: list[dict[str, Any]], ref_c: Ceilings, tgt_c: Ceilings, target: Machine,
                    run_id: str, ref_run_id: str) -> list[dict[str, Any]]:
    fams = family_effs(rows, ref_c)
    out = []
    for r in rows:
        p = project_point(r, ref_c.of(r["dtype"]), tgt_c.of(r["dtype"]),
                          fams.get((r["kernel"], r["impl"], r["dtype"])))
        t = p["time_us_p50"]
        out.append({**r, **p, "run_id": run_id, "source": "projected", "reference_run_id": ref_run_id,
                    "device": "cpu" if target.spec.arch == "cpu" else "cuda",
                    "time_us_p10": None, "time_us_p90": None,
                    "achieved_gbps": r["bytes"] / (t * 1e3), "achieved_tflops": r["flops"] / (t * 1e6)})
    return out


# -- communication ----------------------------------------------------------------------------

def link_gbps(spec: Spec, interconnect: str) -> float | None:
    if interconnect == "nvlink":
        return spec.nvlink_gbps or spec.pcie_gbps
    if interconnect == "pcie":
        return spec.pcie_gbps
    return None


def allreduce_us(nbytes: float, n: int, alpha_us: float, bw_gbps: float) -> float:
    """Ring all-reduce: latency + 2(n-1)/n x bytes / link bandwidth; free on one GPU."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return alpha_us + 2 * (n - 1) / n * nbytes / (bw_gbps * 1e3)


@dataclass(frozen=True)
class CommModel:
    alpha_us: float
    effs: tuple[float, float, float]   # low, central, high fraction of the link bandwidth
    link_gbps: float | None
    n: int
    calibrated: bool

    def time_us(self, nbytes: float, which: int = 1, n: int | None = None) -> float:
        n = self.n if n is None else n
        if n <= 1 or not self.link_gbps:
            return 0.0
        return allreduce_us(nbytes, n, self.alpha_us, self.link_gbps * self.effs[which])


def comm_model(comm_rows: list[dict[str, Any]], ref: Machine, target: Machine) -> CommModel:
    """Alpha and link efficiency from the reference's all-reduce measurements, else defaults."""
    link = link_gbps(target.spec, target.interconnect)
    rows = [r for r in comm_rows
            if r["op"] == "all_reduce" and r["status"] == "ok" and r["time_us_p50"] and r["busbw_gbps"]]
    ref_link = link_gbps(ref.spec, ref.interconnect)
    if rows and ref_link:
        small = min(r["bytes"] for r in rows)
        alpha = min(r["time_us_p50"] for r in rows if r["bytes"] == small)
        effs = sorted(min(r["busbw_gbps"] / ref_link, 1.0) for r in rows if r["bytes"] >= 1 << 24) \
            or sorted(min(r["busbw_gbps"] / ref_link, 1.0) for r in rows)
        return CommModel(alpha, (effs[0], effs[-1], effs[-1]), link, target.gpus, True)
    alpha = DEFAULT_ALPHA_US.get(target.interconnect, DEFAULT_ALPHA_US["pcie"])
    return CommModel(alpha, DEFAULT_LINK_EFF, link, target.gpus, False)


def project_comm(model: CommModel, run_id: str) -> list[dict[str, Any]]:
    if model.n <= 1 or not model.link_gbps:
        why = "one GPU" if model.n <= 1 else "no link bandwidth in the spec sheet"
        return [{"run_id": run_id, "op": "all_reduce", "world_size": model.n, "bytes": 0,
                 "status": "skipped", "skip_reason": why, "source": "projected"}]
    out = []
    for p in range(10, 31, 4):   # 1 KiB .. 1 GiB
        nbytes = 1 << p
        t = model.time_us(nbytes)
        alg = nbytes / (t * 1e3)
        out.append({"run_id": run_id, "op": "all_reduce", "world_size": model.n, "bytes": nbytes,
                    "time_us_p50": t, "algbw_gbps": alg, "busbw_gbps": alg * 2 * (model.n - 1) / model.n,
                    "status": "ok", "source": "projected"})
    return out


def step_comm_us(row: dict[str, Any], model: CommModel, n: int, which: int = 1) -> float:
    """One step's all-reduces: 2 per layer of tokens x hidden x 2 bytes, over a ring of n ranks."""
    cfg = CONFIGS.get(row["config"].split("/")[0], CONFIGS["k2"])
    tokens = row["concurrency"] * (row["budget"] + 1)
    count = ALLREDUCES_PER_LAYER * (row["layers"] or cfg.layers)
    return count * model.time_us(tokens * cfg.hidden * 2, which, n)


# -- end to end ---------------------------------------------------------------------------------

def breakdown(row: dict[str, Any]) -> dict[str, float]:
    """The step split in ms; whatever the terms do not cover of the p50 step counts as other_ms."""
    terms = {t: float(row.get(t) or 0.0) for t in TERMS}
    rest = (row.get("step_ms_p50") or 0.0) - sum(terms.values())
    if rest > 0:
        terms["other_ms"] += rest
    return terms


def has_split(row: dict[str, Any]) -> bool:
    """Whether the row says how its step divides (an outside serving figure does not)."""
    return any(row.get(t) is not None for t in TERMS)


def nearest(rows: list[dict[str, Any]], want: dict[str, float]) -> dict[str, Any] | None:
    def dist(r: dict[str, Any]) -> tuple:
        return (sum(abs((r.get(k) or 0) - v) / max(v, 1) for k, v in want.items()), point_key(r))
    return min(rows, key=dist) if rows else None


def _picked(rows: list[dict[str, Any]], fam: str, shape: dict[str, float], tp: int) -> dict[str, Any] | None:
    """The point of a family nearest to a step's shape, at TP degree tp (full shapes when absent)."""
    cands = [r for r in rows if family(r["kernel"]) == fam and not host_side(r)]
    at_tp = [r for r in cands if tp_of(r) == tp] or [r for r in cands if tp_of(r) == 1]
    return nearest(preferred(at_tp), shape)


def term_ratios(kern: list[dict[str, Any]], proj: list[dict[str, Any]],
                e2e: dict[str, Any]) -> dict[str, tuple[float, float, float]]:
    """Projected/measured time ratio (central, low, high) of each GPU term of one e2e point."""
    by_key = {point_key(m): p for m, p in zip(kern, proj)}
    shapes = step_shapes(e2e)
    out: dict[str, tuple[float, float, float]] = {}
    for term, families in TERM_FAMILIES.items():
        picked = [m for fam in families for m in [_picked(kern, fam, shapes[fam], tp_of(e2e))] if m]
        if picked:
            ref_t = sum(m["time_us_p50"] for m in picked)
            out[term] = tuple(sum(by_key[point_key(m)][k] for m in picked) / ref_t
                              for k in ("time_us_p50", "time_us_low", "time_us_high"))
    # the block drafter streams its weights for a few tokens: it scales like the memory-bound points
    mem = sorted((p["time_us_p50"] / m["time_us_p50"], p["time_us_low"] / m["time_us_p50"],
                  p["time_us_high"] / m["time_us_p50"])
                 for m, p in zip(kern, proj) if p["reference_regime"] == MEMORY)
    if mem:
        c = statistics.median(x[0] for x in mem)
        out["draft_ms"] = (c, min(x[1] for x in mem), max(x[2] for x in mem))
    return out


def reshard_ratio(group: list[dict[str, Any]], src: dict[str, Any], tp: int,
                  kern: list[dict[str, Any]]) -> tuple[tuple[float, float, float], str]:
    """verify on one rank at TP `tp` over verify at the source row's TP (central, low, high) and how.

    fit: two measured degrees of the same point give verify = fixed + sharded / tp;
    kernels: the verify families' points at both shard shapes; bytes: everything shards (1/N),
    with the band reaching no speed-up at all.
    """
    src_tp = tp_of(src)
    others = [r for r in group if tp_of(r) != src_tp and r.get("verify_ms")]
    if others and src.get("verify_ms"):
        o = others[0]
        a, b = 1 / src_tp, 1 / tp_of(o)
        sharded = (src["verify_ms"] - o["verify_ms"]) / (a - b)
        fixed = src["verify_ms"] - sharded * a
        r = max(fixed + sharded / tp, 0.0) / src["verify_ms"]
        return (r, r, r), "fit"
    shapes = step_shapes(src)
    num = den = 0.0
    for fam in TERM_FAMILIES["verify_ms"]:
        here = [k for k in kern if family(k["kernel"]) == fam and tp_of(k) == src_tp]
        there = [k for k in kern if family(k["kernel"]) == fam and tp_of(k) == tp]
        a, b = nearest(preferred(here), shapes[fam]), nearest(preferred(there), shapes[fam])
        if a and b:
            den, num = den + a["time_us_p50"], num + b["time_us_p50"]
    if den:
        r = num / den
        return (r, r, r), "kernels"
    r = src_tp / tp
    return (r, min(r, 1.0), max(r, 1.0)), "bytes"


def choose_rows(rows: list[dict[str, Any]], tp: int) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """Per e2e point, the row a TP-`tp` target is carried from (same degree if measured), with its group."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(e2e_key(r, without=("tp",)), []).append(r)
    out = []
    for key in sorted(groups, key=repr):
        g = groups[key]
        out.append((min(g, key=lambda r: (abs(tp_of(r) - tp), -tp_of(r))), g))
    return out


def project_e2e(rows: list[dict[str, Any]], kern: list[dict[str, Any]], proj: list[dict[str, Any]],
                at_ref: CommModel, comm: CommModel, target: Machine, run_id: str,
                ref_run_id: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Carry each measured step over term by term, as one rank of a TP-(target GPUs) deployment.

    GPU terms scale by their kernels' ratios, verify is re-sharded when the row ran at another
    degree, host terms are kept, comm is modelled over the target's links (scaled by how the
    reference's own measured comm compared with the model). Returns the rows and, per source
    degree, how it was carried.
    """
    tp = max(target.gpus, 1)
    out, how = [], {}
    for r, group in choose_rows([r for r in rows if has_split(r) and r["step_ms_p50"]], tp):
        ratios = term_ratios(kern, proj, r)
        shard, way = ((1.0, 1.0, 1.0), "same") if tp_of(r) == tp else reshard_ratio(group, r, tp, kern)
        entry = how.setdefault(tp_of(r), {"from_tp": tp_of(r), "how": way, "points": 0})
        entry["points"] += 1
        terms = breakdown(r)
        cols, lo_sum, hi_sum = {}, 0.0, 0.0
        for term, ms in terms.items():
            if term == "comm_ms":
                measured = r.get("comm_source") == "measured" or (r.get("comm_source") is None and ms > 0)
                modelled = step_comm_us(r, at_ref, tp_of(r)) / 1e3
                fix = ms / modelled if measured and ms > 0 and modelled > 0 and tp_of(r) == tp else 1.0
                c, lo, hi = (fix * step_comm_us(r, comm, tp, i) / 1e3 for i in (1, 2, 0))
            elif term == "verify_ms":
                c, lo, hi = (ms * x * s for x, s in zip(ratios.get(term, (1.0, 1.0, 1.0)), shard))
            elif term in ratios:
                c, lo, hi = (ms * x for x in ratios[term])
            else:
                c = lo = hi = ms
            cols[term] = c
            lo_sum += lo
            hi_sum += hi
        step = sum(cols.values())
        # tokens/s = tokens per step x concurrency / step time; the reference's measured tokens/s
        # already holds its tokens per step (accepted drafts + 1 bonus), so only the step changes
        per_step = (r["accept_len_mean"] or 0.0) + 1.0
        tps = r["tokens_per_s"] * sum(terms.values()) / step if r["tokens_per_s"] else \
            per_step * r["concurrency"] / step * 1e3
        scale = tps * step
        out.append({**{k: r.get(k) for k in ("config", "layers", "concurrency", "budget", "context", "synthetic_accept",
                                              "accept_len_mean", "weight_sets", "vocab")},
                    **cols, "tp": tp, "comm_source": "modelled" if tp > 1 else "none",
                    "run_id": run_id, "device": "cpu" if target.spec.arch == "cpu" else "cuda",
                    "step_ms_p50": step, "tokens_per_s": tps,
                    "tokens_per_s_low": scale / hi_sum, "tokens_per_s_high": scale / lo_sum,
                    "source": "projected", "reference_run_id": ref_run_id})
    return out, [how[k] for k in sorted(how)]


# -- whole projection ---------------------------------------------------------------------------

def projected_run_id(target: str, ref_run_id: str) -> str:
    """Deterministic, so re-projecting the same inputs rewrites the same run."""
    return f"proj-{target}-from-{ref_run_id}"[:128]


@dataclass
class _Parts:
    run_id: str
    kern: list[dict[str, Any]]
    kproj: list[dict[str, Any]]
    eproj: list[dict[str, Any]]
    tp_how: list[dict[str, Any]]
    comm: CommModel
    ref_c: Ceilings
    tgt_c: Ceilings
    skipped_e2e: int
    not_measured: list[dict[str, Any]]   # the reference's skipped e2e points: nothing to carry


def _parts(tables: Tables, ref: Machine, target: Machine, run_id: str) -> _Parts:
    if "runs" not in tables:
        raise ProjectionError(f"reference from {ref.name} has no runs table")
    ref_run_id = tables["runs"].column("run_id")[0].as_py()
    ref_c = measured_ceilings(tables["runs"], ref.spec)
    tgt_c = ref_c.carried_to(target.spec)
    kern = [r for r in rows_of(tables, "kernels") if r["source"] == "measured"]
    kproj = project_kernels(kern, ref_c, tgt_c, target, run_id, ref_run_id)
    comm_rows = rows_of(tables, "comm")
    comm = comm_model(comm_rows, ref, target)
    at_ref = comm_model(comm_rows, ref, ref)
    e2e = [r for r in rows_of(tables, "e2e") if r["source"] == "measured"]
    ok = [r for r in e2e if r["status"] == "ok"]
    eproj, how = project_e2e(ok, kern, kproj, at_ref, comm, target, run_id, ref_run_id)
    skipped = [{"tp": tp_of(r), **{k: r[k] for k in ("concurrency", "budget", "context", "synthetic_accept")},
                "reason": (r["skip_reason"] or "-")[:SKIP_REASON_CHARS]} for r in e2e if r["status"] != "ok"]
    return _Parts(run_id, kern, kproj, eproj, how, comm, ref_c, tgt_c,
                  sum(1 for r in ok if not has_split(r)), skipped)


def project(tables: Tables, ref: Machine, target: Machine,
            also: Sequence[tuple[Tables, Machine]] = ()) -> Tables:
    """The reference's measured tables carried onto `target`; further references widen the band."""
    ref_runs = tables["runs"].to_pylist() if "runs" in tables else []
    if not ref_runs:
        raise ProjectionError(f"reference from {ref.name} has no runs rows")
    ref_run_id = ref_runs[0]["run_id"]
    run_id = projected_run_id(target.name, ref_run_id)
    main = _parts(tables, ref, target, run_id)
    extras = [_parts(t, m, target, run_id) for t, m in also]
    for x in extras:
        other = {point_key(p): p for p in x.kproj}
        for p in main.kproj:
            o = other.get(point_key(p))
            if o:
                p["time_us_low"] = min(p["time_us_low"], o["time_us_low"], o["time_us_p50"])
                p["time_us_high"] = max(p["time_us_high"], o["time_us_high"], o["time_us_p50"])
        other = {e2e_key(e): e for e in x.eproj}
        for e in main.eproj:
            o = other.get(e2e_key(e))
            if o:
                e["tokens_per_s_low"] = min(e["tokens_per_s_low"], o["tokens_per_s_low"], o["tokens_per_s"])
                e["tokens_per_s_high"] = max(e["tokens_per_s_high"], o["tokens_per_s_high"], o["tokens_per_s"])
    refs = [ref_run_id] + [t["runs"].column("run_id")[0].as_py() for t, _ in also]
    records = assumption_records(ref, target, ref_run_id, main, refs)
    prov_ref = provenance(tables["runs"])
    spec_figs = target.spec.model_dump(exclude={"sources"})
    device = "cpu" if target.spec.arch == "cpu" else "cuda"
    prov = {"run_id": run_id, "host": target.name, "gpu_name": target.spec.gpu, "gpu_count": target.gpus,
            "arch": target.spec.arch, "device": device,
            "started_at": prov_ref.get("started_at"), "ended_at": prov_ref.get("ended_at"),
            "reference_run_id": ref_run_id, "reference_host": ref.name, "references": refs,
            "spec": spec_figs, "assumptions": records}
    if target.gpus > 1 and not any(r["suite"] == "comm" for r in ref_runs):
        ref_runs.append({**ref_runs[0], "suite": "comm"})
    comm_rows = project_comm(main.comm, run_id)
    runs = []
    for r in ref_runs:
        suite = r["suite"]
        n = {"kernels": len(main.kproj), "e2e": len(main.eproj), "comm": len(comm_rows)}.get(suite, 0)
        status = "skipped" if suite == "comm" and comm_rows[0]["status"] == "skipped" else "complete"
        runs.append({"run_id": run_id, "host": target.name, "suite": suite, "profile": r["profile"],
                     "status": status, "gpu_name": target.spec.gpu, "gpu_count": target.gpus,
                     "arch": target.spec.arch, "device": device, "started_at": r["started_at"],
                     "ended_at": r["ended_at"], "copy_gbps": main.tgt_c.gbps, "matmul_tflops": main.tgt_c.tflops(),
                     "points": n, "source": "projected",
                     "note": json.dumps({"reference_run_id": ref_run_id, "spec": spec_figs,
                                         "assumptions": records}, sort_keys=True)})
    out = {"runs": to_table("runs", runs, prov)}
    if "kernels" in tables:
        out["kernels"] = to_table("kernels", main.kproj, prov)
    if "e2e" in tables:
        out["e2e"] = to_table("e2e", main.eproj, prov)
    if any(r["suite"] == "comm" for r in runs):
        out["comm"] = to_table("comm", comm_rows, prov)
    return out


def assumption_records(ref: Machine, target: Machine, ref_run_id: str, p: _Parts,
                       refs: list[str]) -> list[dict[str, Any]]:
    """What the projection assumed, as records (`what` names the kind); the notes word them."""
    dt = DTYPE_KEYS.get(p.ref_c.mm_dtype, p.ref_c.mm_dtype)
    recs: list[dict[str, Any]] = [
        {"what": "reference_ceilings", "host": ref.name, "run_id": ref_run_id, "gpu": ref.spec.gpu,
         "copy_gbps": p.ref_c.gbps, "copy_fraction": p.ref_c.bw_frac, "spec_gbps": ref.spec.mem_bw_gbps,
         "matmul_tflops": p.ref_c.tflops(), "matmul_fraction": p.ref_c.fl_frac,
         "spec_tflops": peak_tflops(ref.spec, p.ref_c.mm_dtype), "dtype": dt},
        {"what": "target_ceilings", "host": target.name, "gpu": target.spec.gpu, "copy_gbps": p.tgt_c.gbps,
         "matmul_tflops": p.tgt_c.tflops(), "dtype": dt},
        {"what": "kernel_carrier", "bound": "own efficiency", "other": "family efficiency",
         "band": "family min to max"},
        {"what": "kept", "launch_floor_us": LAUNCH_FLOOR_US, "latency_share": LATENCY_SHARE,
         "host_side": sorted({"*/cpu"} | {f"{k}/{i}" for k, i in HOST_SIDE})},
        {"what": "e2e_terms", "terms": {t: list(f) for t, f in TERM_FAMILIES.items()},
         "draft_ms": "memory-bound kernel points", "kept": ["other_ms"]},
        {"what": "tensor_parallel", "target_tp": max(target.gpus, 1), "gpus": target.gpus, "rows": p.tp_how},
    ]
    if target.gpus > 1:
        recs.append({"what": "comm", "gpus": target.gpus, "interconnect": target.interconnect,
                     "link_gbps": p.comm.link_gbps, "alpha_us": p.comm.alpha_us,
                     "efficiency": p.comm.effs[1], "efficiency_low": p.comm.effs[0],
                     "efficiency_high": p.comm.effs[2], "calibrated": p.comm.calibrated,
                     "allreduces_per_layer": ALLREDUCES_PER_LAYER})
    if p.skipped_e2e:
        recs.append({"what": "e2e_without_split", "rows": p.skipped_e2e})
    if p.not_measured:
        recs.append({"what": "e2e_not_measured", "count": len(p.not_measured),
                     "points": p.not_measured[:NOT_MEASURED_LISTED]})
    recs.append({"what": "band", "references": refs})
    return recs
