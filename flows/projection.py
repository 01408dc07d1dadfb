"""Roofline/Amdahl projection of a measured run onto another host's spec sheet, and its backtest.

The carrier from one machine to another is efficiency: how close each measured kernel point came
to the reference's own ceilings. The ceilings are the reference's measured copy bandwidth and
matmul throughput (runs.copy_gbps / matmul_tflops); the target's ceilings are its spec-sheet
peaks scaled by the same measured-to-spec fraction, so projecting a host onto its own spec gives
back its measurements. Host-side work (a CPU kernel, Python, launch floors) does not scale with
the GPU and is kept; communication follows an alpha-beta model of the target's links. Every figure
carries a low-high band, and every record says `source = projected`.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import pyarrow as pa
from prefect import task
from prefect.cache_policies import NONE

from engine.config import CONFIGS
from engine.schema import provenance, to_table
from flows.inventory import Host, Inventory, Spec
from flows.store import Store

MEMORY, COMPUTE, HOST = "memory", "compute", "host"
TERMS = ("draft_ms", "tree_build_ms", "verify_ms", "accept_ms", "other_ms", "comm_ms")
POINT_KEY = ("kernel", "impl", "dtype", "M", "N", "K", "E", "top_k", "budget", "context", "batch")
# What launching a GPU kernel costs on the host, kept as is on any target (capped at half a point's time).
LAUNCH_FLOOR_US = 3.0
# All-reduce constants used when the reference has no comm measurement of its own.
DEFAULT_ALPHA_US = {"nvlink": 8.0, "pcie": 15.0}
DEFAULT_LINK_EFF = (0.6, 0.75, 0.9)   # low, central, high fraction of the link's spec bandwidth
# Kernel names as engine.bench writes them; the family names are accepted as aliases.
ALIASES = {"mla_verify": "mla_tree_attention", "tree_build": "build_tree"}
# The torch references of the tree kernels are Python loops on the host: GPU speed does not move them.
HOST_SIDE = {("build_tree", "torch"), ("tree_accept", "torch")}
# Term of the e2e step -> kernel families whose projected/measured ratio scales it.
TERM_FAMILIES = {"verify_ms": ("moe_w4a16", "mla_tree_attention"), "tree_build_ms": ("build_tree",),
                 "accept_ms": ("tree_accept",)}
E2E_CONTEXT = 512   # typical context of an e2e step (prompts of 256-512 tokens plus the new ones)


class ProjectionError(Exception):
    """A projection that cannot be made; the message names the host, spec or reference."""


@dataclass(frozen=True)
class Reference:
    """One measured dataset used as the carrier, with the spec of the host it ran on."""

    name: str
    host: str
    run_id: str
    spec: Spec
    gpus: int
    interconnect: str
    tables: dict[str, pa.Table]

    @property
    def e2e_gpus(self) -> int:
        """GPUs the e2e steps ran on: all of the host's when they paid for communication, else one."""
        rows = self.tables["e2e"].to_pylist() if "e2e" in self.tables else []
        return self.gpus if any((r["comm_ms"] or 0) > 0 for r in rows) else 1


@dataclass
class Projection:
    """Projected tables of one target plus the assumptions written into them."""

    run_id: str
    target: str
    reference: Reference
    tables: dict[str, pa.Table]
    assumptions: list[str] = field(default_factory=list)


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


def host_side(row: dict[str, Any]) -> bool:
    """Points that run on the host whatever the GPU: CPU kernels and the Python tree references."""
    return row["impl"] == "cpu" or (family(row["kernel"]), row["impl"]) in HOST_SIDE


def family(kernel: str) -> str:
    return ALIASES.get(kernel, kernel)


# -- reference data -------------------------------------------------------------------------

def load_reference(store: Store, inv: Inventory, name: str) -> Reference:
    """A committed reference set `name`, else the latest complete measured run of host `name`."""
    if name in store.references():
        return as_reference(name, store.reference(name), inv)
    runs = [r for r in store.runs(name) if r.source == "measured" and r.status == "complete"]
    if not runs:
        raise ProjectionError(
            f"no reference data {name!r}: artifacts/reference/{name}/ is absent and host {name} "
            "has no complete measured run in the store")
    return as_reference(name, store.load(name, runs[-1].run_id), inv)


def as_reference(name: str, tables: dict[str, pa.Table], inv: Inventory) -> Reference:
    """Measured tables plus the spec sheet, GPU count and links of the host they ran on."""
    row = tables["runs"].to_pylist()[0]
    host_name, run_id = row["host"], row["run_id"]
    host = inv.hosts.get(host_name)
    spec_name = host.spec if host else host_name
    if spec_name not in inv.specs:
        raise ProjectionError(f"reference {name!r} ran on host {host_name!r}, whose spec sheet "
                              f"{spec_name!r} is not in hosts/specs/")
    return Reference(name=name, host=host_name, run_id=run_id, spec=inv.specs[spec_name],
                     gpus=max(host.gpus, 1) if host else max(row["gpu_count"] or 1, 1),
                     interconnect=host.interconnect if host else "none", tables=tables)


# -- kernel points ------------------------------------------------------------------------------

def point_key(row: dict[str, Any]) -> tuple:
    return tuple(row.get(k) for k in POINT_KEY)


def regime(t_bytes: float, t_flops: float) -> str:
    return MEMORY if t_bytes >= t_flops else COMPUTE


def _ideal_us(row: dict[str, Any], bw_gbps: float, tflops: float) -> tuple[float, float]:
    """Roofline times (us) of the point's bytes and flops at the given ceilings."""
    return row["bytes"] / (bw_gbps * 1e3), row["flops"] / (tflops * 1e6)


def _floor(row: dict[str, Any]) -> float:
    return min(LAUNCH_FLOOR_US, 0.5 * row["time_us_p50"])


def _own_effs(row: dict[str, Any], t_us: float, bw: float, tfl: float) -> tuple[float, float]:
    tb, tf = _ideal_us(row, bw, tfl)
    work = max(t_us - _floor(row), 1e-9)
    return tb / work, tf / work


def family_effs(rows: Sequence[dict[str, Any]], ceil: Ceilings) -> dict[tuple, dict[str, list[float]]]:
    """Per (kernel, impl, dtype): efficiencies of the points bound by each resource, for borrowing."""
    out: dict[tuple, dict[str, list[float]]] = {}
    for r in rows:
        if host_side(r):
            continue
        bw, tfl = ceil.of(r["dtype"])
        e_bw, e_fl = _own_effs(r, r["time_us_p50"], bw, tfl)
        fam = out.setdefault((r["kernel"], r["impl"], r["dtype"]), {MEMORY: [], COMPUTE: []})
        bound = regime(*_ideal_us(r, bw, tfl))
        fam[bound].append(e_bw if bound == MEMORY else e_fl)
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
    floor = _floor(row)
    tb_ref, tf_ref = _ideal_us(row, *ref)
    tb_tgt, tf_tgt = _ideal_us(row, *tgt)
    bound = regime(tb_ref, tf_ref)
    other = COMPUTE if bound == MEMORY else MEMORY
    borrowed = sorted((fam or {}).get(other, []))
    cands = [statistics.median(borrowed), borrowed[0], borrowed[-1]] if borrowed else [None]
    times = [row[k] for k in ("time_us_p50", "time_us_p10", "time_us_p90") if row.get(k)]
    results = []
    for t in times:
        e_bw, e_fl = _own_effs(row, t, *ref)
        e_bind = e_bw if bound == MEMORY else e_fl
        for c in cands:
            e_other = max(e_fl if bound == MEMORY else e_bw, c if c is not None else e_bind)
            eb, ef = (e_bind, e_other) if bound == MEMORY else (e_other, e_bind)
            a = tb_tgt / eb if tb_tgt else 0.0
            b = tf_tgt / ef if tf_tgt else 0.0
            results.append((max(a, b) + floor, regime(a, b)))
    t, reg = results[0]
    every = [x for x, _ in results]
    return {"time_us_p50": t, "time_us_low": min(every), "time_us_high": max(every),
            "regime": reg, "reference_regime": bound}


@dataclass(frozen=True)
class Target:
    """What the projection needs of the target: its spec sheet, GPU count and links."""

    name: str
    spec: Spec
    gpus: int
    interconnect: str


def project_kernels(ref: Reference, target: Target, run_id: str) -> list[dict[str, Any]]:
    if "kernels" not in ref.tables:
        return []
    ref_c = measured_ceilings(ref.tables["runs"], ref.spec)
    tgt_c = ref_c.carried_to(target.spec)
    rows = [r for r in ref.tables["kernels"].to_pylist() if r["source"] == "measured"]
    fams = family_effs(rows, ref_c)
    out = []
    for r in rows:
        p = project_point(r, ref_c.of(r["dtype"]), tgt_c.of(r["dtype"]),
                          fams.get((r["kernel"], r["impl"], r["dtype"])))
        t = p["time_us_p50"]
        out.append({**r, **p, "run_id": run_id, "source": "projected", "reference_run_id": ref.run_id,
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

    def time_us(self, nbytes: float, which: int = 1) -> float:
        if self.n <= 1 or not self.link_gbps:
            return 0.0
        return allreduce_us(nbytes, self.n, self.alpha_us, self.link_gbps * self.effs[which])


def comm_model(ref: Reference, target: Target) -> CommModel:
    """Alpha and link efficiency from the reference's all-reduce measurements, else defaults."""
    link = link_gbps(target.spec, target.interconnect)
    rows = [r for r in ref.tables["comm"].to_pylist()
            if r["op"] == "all_reduce" and r["status"] == "ok" and r["time_us_p50"] and r["busbw_gbps"]] \
        if "comm" in ref.tables else []
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


# -- end to end ---------------------------------------------------------------------------------

def breakdown(row: dict[str, Any]) -> dict[str, float]:
    """The step split in ms; whatever the terms do not cover of the p50 step counts as other_ms."""
    terms = {t: float(row.get(t) or 0.0) for t in TERMS}
    rest = (row.get("step_ms_p50") or 0.0) - sum(terms.values())
    if rest > 0:
        terms["other_ms"] += rest
    return terms


def _nearest(rows: list[dict[str, Any]], want: dict[str, float]) -> dict[str, Any] | None:
    def dist(r: dict[str, Any]) -> tuple:
        return (sum(abs((r.get(k) or 0) - v) / max(v, 1) for k, v in want.items()), point_key(r))
    return min(rows, key=dist) if rows else None


def term_ratios(kern: list[dict[str, Any]], proj: list[dict[str, Any]],
                e2e: dict[str, Any]) -> dict[str, tuple[float, float, float]]:
    """Projected/measured time ratio (central, low, high) of each GPU term of one e2e point."""
    pairs = [(m, p) for m, p in zip(kern, proj) if not host_side(m)]
    conc, budget = e2e["concurrency"], e2e["budget"]
    shape = {"moe_w4a16": {"M": conc * (budget + 1)},
             "mla_tree_attention": {"batch": conc, "budget": budget, "context": E2E_CONTEXT},
             "build_tree": {"batch": conc, "budget": budget}, "tree_accept": {"batch": conc, "budget": budget}}
    out: dict[str, tuple[float, float, float]] = {}
    for term, families in TERM_FAMILIES.items():
        picked = []
        for fam in families:
            cands = [(m, p) for m, p in pairs if family(m["kernel"]) == fam]
            prefer = [c for c in cands if c[0]["impl"] == "triton"] or cands
            best = _nearest([m for m, _ in prefer], shape[fam])
            picked += [(m, p) for m, p in prefer if m is best]
        if picked:
            ref_t = sum(m["time_us_p50"] for m, _ in picked)
            out[term] = tuple(sum(p[k] for _, p in picked) / ref_t
                              for k in ("time_us_p50", "time_us_low", "time_us_high"))
    # the block drafter streams its weights for a few tokens: it scales like the memory-bound points
    mem = sorted((p["time_us_p50"] / m["time_us_p50"], p["time_us_low"] / m["time_us_p50"],
                  p["time_us_high"] / m["time_us_p50"]) for m, p in pairs if p["reference_regime"] == MEMORY)
    if mem:
        c = statistics.median(x[0] for x in mem)
        out["draft_ms"] = (c, min(x[1] for x in mem), max(x[2] for x in mem))
    return out


def project_e2e(ref: Reference, target: Target, run_id: str, kern: list[dict[str, Any]],
                proj: list[dict[str, Any]], comm: CommModel) -> list[dict[str, Any]]:
    """Carry each measured step over term by term: GPU terms by their kernels' ratios, host terms kept,
    comm from the target's links (scaled by how the reference's own comm compared with the model)."""
    if "e2e" not in ref.tables:
        return []
    at_ref = comm_model(ref, Target(ref.host, ref.spec, ref.e2e_gpus, ref.interconnect))
    out = []
    for r in ref.tables["e2e"].to_pylist():
        if r["source"] != "measured" or not r["step_ms_p50"]:
            continue
        cfg = CONFIGS.get(r["config"].split("/")[0], CONFIGS["k2"])
        ratios = term_ratios(kern, proj, r)
        split = ref.e2e_gpus / max(target.gpus, 1)   # tensor parallel: the target forward divides over the GPUs
        terms = breakdown(r)
        cols = {}
        bands = {"low": 0.0, "high": 0.0}
        for term, ms in terms.items():
            if term == "comm_ms":
                tokens = r["concurrency"] * (r["budget"] + 1)
                nbytes = tokens * cfg.hidden * 2
                count = 2 * (r["layers"] or cfg.layers)
                modelled = at_ref.time_us(nbytes) * count / 1e3
                fix = ms / modelled if ms > 0 and modelled > 0 else 1.0   # measured comm corrects the model
                c, lo, hi = (fix * count * comm.time_us(nbytes, i) / 1e3 for i in (1, 2, 0))
            elif term in ratios:
                c, lo, hi = (ms * x * (split if term == "verify_ms" else 1.0) for x in ratios[term])
            else:
                c = lo = hi = ms
            cols[term] = c
            bands["low"] += lo
            bands["high"] += hi
        step = sum(cols.values())
        # tokens/s = tokens per step x concurrency / step time; the reference's measured tokens/s
        # already holds its tokens per step (accepted drafts + 1 bonus), so only the step changes
        per_step = (r["accept_len_mean"] or 0.0) + 1.0
        tps = r["tokens_per_s"] * sum(terms.values()) / step if r["tokens_per_s"] else \
            per_step * r["concurrency"] / step * 1e3
        scale = tps * step
        out.append({**{k: r[k] for k in ("config", "layers", "concurrency", "budget", "synthetic_accept",
                                          "accept_len_mean")},
                    **cols, "run_id": run_id, "device": "cpu" if target.spec.arch == "cpu" else "cuda",
                    "step_ms_p50": step, "tokens_per_s": tps,
                    "tokens_per_s_low": scale / bands["high"], "tokens_per_s_high": scale / bands["low"],
                    "source": "projected", "reference_run_id": ref.run_id})
    return out


# -- whole projection ---------------------------------------------------------------------------

def projected_run_id(target: str, ref_run_id: str) -> str:
    """Deterministic, so re-projecting the same inputs rewrites the same run."""
    return f"proj-{target}-from-{ref_run_id}"[:128]


def project(refs: Sequence[Reference], target: Target) -> Projection:
    """Project onto `target` from refs[0]; further references widen the band point by point."""
    if not refs:
        raise ProjectionError(f"no reference to project {target.name} from")
    ref = refs[0]
    run_id = projected_run_id(target.name, ref.run_id)
    kern = [r for r in ref.tables["kernels"].to_pylist() if r["source"] == "measured"] \
        if "kernels" in ref.tables else []
    kproj = project_kernels(ref, target, run_id)
    for extra in refs[1:]:
        other = {point_key(p): p for p in project_kernels(extra, target, run_id)}
        for p in kproj:
            o = other.get(point_key(p))
            if o:
                p["time_us_low"] = min(p["time_us_low"], o["time_us_low"], o["time_us_p50"])
                p["time_us_high"] = max(p["time_us_high"], o["time_us_high"], o["time_us_p50"])
    comm = comm_model(ref, target)
    eproj = project_e2e(ref, target, run_id, kern, kproj, comm)
    for extra in refs[1:]:
        ek = [r for r in extra.tables["kernels"].to_pylist() if r["source"] == "measured"] \
            if "kernels" in extra.tables else []
        other = {(e["config"], e["concurrency"], e["budget"]): e for e in project_e2e(
            extra, target, run_id, ek, project_kernels(extra, target, run_id), comm_model(extra, target))}
        for e in eproj:
            o = other.get((e["config"], e["concurrency"], e["budget"]))
            if o:
                e["tokens_per_s_low"] = min(e["tokens_per_s_low"], o["tokens_per_s_low"], o["tokens_per_s"])
                e["tokens_per_s_high"] = max(e["tokens_per_s_high"], o["tokens_per_s_high"], o["tokens_per_s"])
    ref_c = measured_ceilings(ref.tables["runs"], ref.spec)
    tgt_c = ref_c.carried_to(target.spec)
    assumptions = assumptions_text(ref, target, ref_c, tgt_c, comm, refs)
    prov_ref = provenance(ref.tables["runs"])
    spec_figs = target.spec.model_dump(exclude={"sources"})
    prov = {"run_id": run_id, "host": target.name, "gpu_name": target.spec.gpu, "gpu_count": target.gpus,
            "arch": target.spec.arch, "device": "cpu" if target.spec.arch == "cpu" else "cuda",
            "started_at": prov_ref.get("started_at"), "ended_at": prov_ref.get("ended_at"),
            "reference_run_id": ref.run_id, "reference_host": ref.host,
            "references": [x.run_id for x in refs], "spec": spec_figs, "assumptions": assumptions}
    ref_runs = ref.tables["runs"].to_pylist()
    if target.gpus > 1 and not any(r["suite"] == "comm" for r in ref_runs):
        ref_runs.append({**ref_runs[0], "suite": "comm"})
    runs = []
    for r in ref_runs:
        suite = r["suite"]
        n = {"kernels": len(kproj), "e2e": len(eproj)}.get(suite, 0)
        status = "complete"
        if suite == "comm":
            rows = project_comm(comm, run_id)
            status = "skipped" if rows[0]["status"] == "skipped" else "complete"
            n = len(rows)
        runs.append({"run_id": run_id, "host": target.name, "suite": suite, "profile": r["profile"],
                     "status": status, "gpu_name": target.spec.gpu, "gpu_count": target.gpus,
                     "arch": target.spec.arch, "device": prov["device"], "started_at": r["started_at"],
                     "ended_at": r["ended_at"], "copy_gbps": tgt_c.gbps, "matmul_tflops": tgt_c.tflops(),
                     "points": n, "source": "projected",
                     "note": json.dumps({"reference_run_id": ref.run_id, "spec": spec_figs,
                                         "assumptions": assumptions}, sort_keys=True)})
    tables = {"runs": to_table("runs", runs, prov)}
    if "kernels" in ref.tables:
        tables["kernels"] = to_table("kernels", kproj, prov)
    if "e2e" in ref.tables:
        tables["e2e"] = to_table("e2e", eproj, prov)
    if any(r["suite"] == "comm" for r in runs):
        tables["comm"] = to_table("comm", project_comm(comm, run_id), prov)
    return Projection(run_id=run_id, target=target.name, reference=ref, tables=tables,
                      assumptions=assumptions)


def assumptions_text(ref: Reference, target: Target, ref_c: Ceilings, tgt_c: Ceilings, comm: CommModel,
                     refs: Sequence[Reference]) -> list[str]:
    """The projection's assumptions in words, stored with the records and printed in the notes."""
    dt = DTYPE_KEYS.get(ref_c.mm_dtype, ref_c.mm_dtype)
    lines = [
        f"reference {ref.host} run {ref.run_id} on {ref.spec.gpu}: measured ceilings {ref_c.gbps:.4g} GB/s copy "
        f"({ref_c.bw_frac:.1%} of its {ref.spec.mem_bw_gbps:.4g} GB/s spec) and {ref_c.tflops():.4g} TFLOP/s "
        f"{dt} matmul ({ref_c.fl_frac:.1%} of its {peak_tflops(ref.spec, ref_c.mm_dtype):.4g} spec)",
        f"target {target.name} on {target.spec.gpu}: the same fractions of its spec sheet give "
        f"{tgt_c.gbps:.4g} GB/s and {tgt_c.tflops():.4g} TFLOP/s {dt}",
        "each kernel point keeps its measured efficiency on the resource that bounds it; the other "
        "resource borrows its kernel family's efficiency (band: the family's min to max)",
        f"a launch floor of up to {LAUNCH_FLOOR_US:g} us per kernel, CPU kernels and the Python tree "
        "references are kept as measured",
        "e2e: draft scales like the memory-bound kernel points, verify like MoE W4A16 + MLA at the step's "
        "token count, tree build and accept like their kernels; other (Python, host) is kept",
    ]
    if target.gpus > 1:
        link = f"{comm.link_gbps:.0f} GB/s {target.interconnect}" if comm.link_gbps else "no link figure"
        how = "calibrated on the reference's all-reduce" if comm.calibrated else "default constants"
        lines.append(f"{target.gpus} GPUs tensor parallel: verify divides by {target.gpus} (draft, tree and "
                     f"accept run replicated); comm = 2 "
                     f"all-reduces per layer of tokens x hidden x 2 bytes, alpha {comm.alpha_us:g} us, "
                     f"{comm.effs[1]:.0%} ({comm.effs[0]:.0%}-{comm.effs[2]:.0%}) of {link} ({how})")
    else:
        lines.append("one GPU: no communication term")
    lines.append("band: the reference's p10-p90 times" + (
        f" and the spread across {len(refs)} references" if len(refs) > 1 else ""))
    return lines


def target_of(inv: Inventory, name: str) -> Target:
    host: Host | None = inv.hosts.get(name)
    spec_name = host.spec if host else name
    if spec_name not in inv.specs:
        raise ProjectionError(f"host {name!r}: spec sheet {spec_name!r} not found in hosts/specs/")
    return Target(name=name, spec=inv.specs[spec_name], gpus=max(host.gpus, 1) if host else 1,
                  interconnect=host.interconnect if host else "none")


def project_host(store: Store, inv: Inventory, target: str, reference: str = "h200",
                 also: Sequence[str] = ()) -> str:
    """Project `target` from the reference (plus `also` for the band), store it, return the run id."""
    refs = [load_reference(store, inv, name) for name in (reference, *also)]
    proj = project(refs, target_of(inv, target))
    store.put_tables(target, proj.run_id, proj.tables)
    return proj.run_id


@task(name="project", cache_policy=NONE)
def project_task(store_root: str, hosts_dir: str, target: str, reference: str = "h200") -> str:
    """Prefect wrapper of project_host for the flows (store and inventory rebuilt from paths)."""
    from pathlib import Path

    from flows.inventory import load_inventory
    return project_host(Store(store_root), load_inventory(Path(hosts_dir)), target, reference)


# -- backtest -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class BacktestRow:
    reference: str
    target: str
    family: str             # kernel family "kernel/impl", or "e2e tokens/s"
    points: int
    median_error: float     # projected / measured - 1, median over matched points
    worst_error: float      # the largest |error|, signed
    in_band: float          # fraction of measured points inside the projected band


def measured_datasets(store: Store, inv: Inventory) -> list[Reference]:
    """The newest complete measured data of every host: its latest store run, else a committed reference."""
    by_host: dict[str, Reference] = {}
    for name in store.references():
        ref = as_reference(name, store.reference(name), inv)
        by_host.setdefault(ref.host, ref)
    for info in store.runs():   # oldest first, so the newest run of a host wins
        if info.source == "measured" and info.status == "complete":
            try:
                by_host[info.host] = as_reference(info.host, store.load(info.host, info.run_id), inv)
            except ProjectionError:
                continue
    return [by_host[h] for h in sorted(by_host)]


def _errors(pairs: Iterable[tuple[float, float, float, float]]) -> tuple[int, float, float, float]:
    errs, inside = [], 0
    for meas, proj, lo, hi in pairs:
        errs.append(proj / meas - 1)
        inside += lo <= meas <= hi
    worst = max(errs, key=abs)
    return len(errs), statistics.median(errs), worst, inside / len(errs)


def backtest(store: Store, inv: Inventory) -> list[BacktestRow]:
    """Project every measured host from every measured host (itself included, as a consistency check)."""
    data = measured_datasets(store, inv)
    rows: list[BacktestRow] = []
    for ref in data:
        for tgt in data:
            # the target as it was measured: e2e on as many GPUs as its measurement used
            proj = project([ref], Target(tgt.host, tgt.spec, tgt.e2e_gpus, tgt.interconnect))
            rows += compare(ref.host, tgt.host, proj.tables, tgt.tables)
    return rows


def compare(ref: str, target: str, proj: dict[str, pa.Table], meas: dict[str, pa.Table]) -> list[BacktestRow]:
    """Projection error per kernel family and for e2e tokens/s, on the points both sides have."""
    out = []
    if "kernels" in proj and "kernels" in meas:
        got = {point_key(p): p for p in proj["kernels"].to_pylist()}
        fams: dict[str, list[tuple[float, float, float, float]]] = {}
        for m in meas["kernels"].to_pylist():
            p = got.get(point_key(m))
            if p:
                fams.setdefault(f"{m['kernel']}/{m['impl']}", []).append(
                    (m["time_us_p50"], p["time_us_p50"], p["time_us_low"], p["time_us_high"]))
        out += [BacktestRow(ref, target, f, *_errors(v)) for f, v in sorted(fams.items())]
    if "e2e" in proj and "e2e" in meas:
        got = {(e["config"], e["concurrency"], e["budget"]): e for e in proj["e2e"].to_pylist()}
        pairs = [(m["tokens_per_s"], p["tokens_per_s"], p["tokens_per_s_low"], p["tokens_per_s_high"])
                 for m in meas["e2e"].to_pylist() if m["tokens_per_s"]
                 for p in [got.get((m["config"], m["concurrency"], m["budget"]))] if p]
        if pairs:
            out.append(BacktestRow(ref, target, "e2e tokens/s", *_errors(pairs)))
    return out
