"""Synthetic, schema-valid K2 measurements shaped like an H200 run of `engine.bench`.

The projection and notes tests build their inputs here (real Arrow files through engine.schema),
so they exercise the same code paths the recorded reference will; the figures follow the K2
shapes (an INT4 routed expert = 3 x 7168 x 2048 weights = 24.77 MB with scales).
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

from engine.table_files import provenance, read_table, to_table, write_table
from flows.analysis.backtest import BacktestRow

EXPERT_BYTES = 24.77e6
H, I, E, TOPK, LAYERS = 7168, 2048, 384, 8, 4
MOE_M = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def expected_experts(m: int) -> float:
    return E * (1 - (1 - TOPK / E) ** m)


def _times(t: float, spread: float) -> dict[str, float]:
    return {"time_us_p10": t * (1 - spread), "time_us_p50": t, "time_us_p90": t * (1 + spread)}


def kernel_rows(run_id: str, bw: float, tflops: float, spread: float) -> list[dict]:
    """Points whose times follow a roofline at (bw GB/s, tflops TF/s) with shape-dependent efficiency."""
    rows = []

    def point(kernel: str, impl: str, dtype: str, nbytes: float, flops: float, eff: float,
              floor_us: float = 3.0, **shape: object) -> None:
        t = max(nbytes / (bw * 1e3), flops / (tflops * 1e6)) / eff + floor_us
        rows.append({"run_id": run_id, "kernel": kernel, "impl": impl, "dtype": dtype, "device": "cuda",
                     **shape, **_times(t, spread), "repeats": 50, "bytes": nbytes, "flops": flops,
                     "achieved_gbps": nbytes / (t * 1e3), "achieved_tflops": flops / (t * 1e6),
                     "source": "measured"})

    for m in MOE_M:
        uniq = round(expected_experts(m))
        nbytes = uniq * EXPERT_BYTES + 2 * m * H * 2
        flops = 2.0 * m * TOPK * 3 * H * I
        eff = 0.55 + 0.33 * (1 - math.exp(-m / 24))
        point("moe_w4a16", "triton", "bfloat16", nbytes, flops, eff, M=m, N=2 * I, K=H, E=E, top_k=TOPK,
              unique_experts=uniq, expected_experts=expected_experts(m))
    for batch in (1, 8, 32):
        for budget in (0, 15, 63):
            ctx = 4096
            nbytes = batch * ctx * 576 * 2.0 + batch * (budget + 1) * 64 * 576 * 2
            flops = 2.0 * batch * (budget + 1) * 64 * ctx * (576 + 512)
            point("mla_tree_attention", "triton", "bfloat16", nbytes, flops, 0.7 if budget < 15 else 0.5,
                  budget=budget, context=ctx, batch=batch)
    for budget in (64, 256, 1024):
        for batch in (1, 8):
            nbytes = batch * (budget + 1) * (16 + budget / 8.0)
            point("build_tree", "triton", "float32", nbytes, batch * budget * 40.0, 0.05, floor_us=12.0,
                  budget=budget, batch=batch)
            t = 0.4 * budget * batch + 20
            # the torch reference: a Python heap on the host
            rows.append({"run_id": run_id, "kernel": "build_tree", "impl": "torch", "dtype": "float32",
                         "device": "cuda", "budget": budget, "batch": batch, **_times(t, spread),
                         "bytes": nbytes, "flops": batch * budget * 40.0, "source": "measured"})
            point("tree_accept", "triton", "int64", batch * (budget + 1) * 24.0, 0.0, 0.05, floor_us=6.0,
                  budget=budget, batch=batch)
    return rows


def e2e_rows(run_id: str, kernels: list[dict], accept: float = 3.2) -> list[dict]:
    """Steps assembled from the kernel points, so the split matches what the kernels say."""
    def t(kernel: str, **shape: int) -> float:
        pts = [k for k in kernels if k["kernel"] == kernel and k["impl"] == "triton"]
        best = min(pts, key=lambda k: sum(abs((k.get(a) or 0) - v) for a, v in shape.items()))
        return best["time_us_p50"] / 1e3

    rows = []
    for conc in (1, 4, 8):
        budget = 15
        verify = LAYERS * (t("moe_w4a16", M=conc * (budget + 1)) + t("mla_tree_attention", batch=conc, budget=budget))
        terms = {"draft_ms": 1.2 + 0.05 * conc, "tree_build_ms": t("build_tree", budget=64, batch=conc),
                 "verify_ms": verify, "accept_ms": t("tree_accept", budget=64, batch=conc),
                 "other_ms": 2.5, "comm_ms": 0.0}
        step = sum(terms.values())
        rows.append({"run_id": run_id, "config": "k2", "layers": LAYERS, "device": "cuda",
                     "concurrency": conc, "budget": budget, "synthetic_accept": 0.8,
                     "accept_len_mean": accept, "tokens_per_s": (accept + 1) * conc / step * 1e3, "steps": 64,
                     "step_ms_p50": step, "step_ms_p99": step * 1.1, **terms,
                     "kernel_ms": step - 2.0, "outside_ms": 2.0, "source": "measured"})
    return rows


def write_run(out: Path, host: str = "h200", run_id: str = "h200-20261020-1", bw: float = 4300.0,
              tflops: float = 720.0, spread: float = 0.03, gpu: str = "H200",
              started_at: str = "2026-10-20T10:00:00Z", with_comm: bool = True) -> Path:
    """A complete measured run (runs, kernels, e2e, comm) written with engine.schema into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    prov = {"run_id": run_id, "host": host, "gpu_name": gpu, "gpu_count": 1, "started_at": started_at}
    kern = kernel_rows(run_id, bw, tflops, spread)
    e2e = e2e_rows(run_id, kern)
    base = {"run_id": run_id, "host": host, "profile": "full", "status": "complete", "gpu_name": gpu,
            "gpu_count": 1, "driver": "570.86", "cuda": "12.8", "torch": "2.13.0", "triton": "3.6.0",
            "python": "3.12.3", "payload_hash": "ab12cd34", "arch": "sm_90", "device": "cuda",
            "started_at": started_at, "ended_at": started_at, "copy_gbps": bw, "matmul_tflops": tflops,
            "source": "measured"}
    suites = [("kernels", "complete", len(kern)), ("e2e", "complete", len(e2e))]
    if with_comm:
        suites.append(("comm", "skipped", 1))
        write_table(out, to_table("comm", [{"run_id": run_id, "op": "all_reduce", "world_size": 1, "bytes": 0,
                                           "status": "skipped", "skip_reason": "one GPU",
                                           "source": "measured"}], prov))
    write_table(out, to_table("runs", [{**base, "suite": s, "status": st, "points": n} for s, st, n in suites], prov))
    write_table(out, to_table("kernels", kern, prov))
    write_table(out, to_table("e2e", e2e, prov))
    return out


def evidence(spread: float, n: int = 12,
             carries: tuple[tuple[str, str], ...] = (("composition", "e2e step"), ("size", "moe_w4a16/triton"),
                                                     ("size", "mla_tree_attention/triton"), ("tp", "e2e TP-8 rank step"),
                                                     ("cross-host", "e2e tokens/s"))) -> list[BacktestRow]:
    """Stored-backtest rows whose carries missed by up to +-spread on n held-out points each: what a
    projection's bands are built from (flows.analysis.bands)."""
    ratios = tuple(1 + spread * (2 * i / (n - 1) - 1) for i in range(n))
    return [BacktestRow(kind, "h200", "h200", fam, "e2e", n, ratios=ratios, groups=tuple(map(str, range(n))))
            for kind, fam in carries]


# -- model level (schema 3): e2e rows at full depth and at a TP-8 rank ----------------------------

FULL, HEAD_BYTES = 61, 163840 * 7168 * 2.0


def model_run(out: Path, run_id: str = "h200-model-1", bw: float = 4300.0, tflops: float = 720.0,
              depths: tuple[int, ...] = (2, 6, 10, 61), accept: float = 5.3) -> Path:
    """A measured run whose e2e rows are whole-model K2 steps at tp 1 and 8 (one TP-8 rank on one GPU).

    Per layer, verify streams one MoE layer's experts for the step's tokens (a TP-8 rank: 1/8 of each)
    plus attention; the lm-head (vocab / tp) is paid once; comm is two modelled all-reduces a layer.
    Kernel points exist at full and at TP-8 shard shapes, so a projection can re-shard from kernels.
    """
    out.mkdir(parents=True, exist_ok=True)
    prov = {"run_id": run_id, "host": "h200", "gpu_name": "H200", "gpu_count": 1,
            "started_at": "2026-12-01T06:00:00Z"}
    kern = kernel_rows(run_id, bw, tflops, 0.03)
    for r in [k for k in kern if k["kernel"] == "moe_w4a16"]:   # TP-8 shards: 1/8 of each expert's bytes
        t = r["bytes"] / 8 / (bw * 1e3) / 0.45 + 3.0
        kern.append({**r, "tp": 8, "N": r["N"] // 8, "bytes": r["bytes"] / 8, "flops": r["flops"] / 8,
                     **_times(t, 0.03), "achieved_gbps": r["bytes"] / 8 / (t * 1e3),
                     "achieved_tflops": r["flops"] / 8 / (t * 1e6)})
    for r in kern:
        r.setdefault("tp", 1)

    def moe_us(m: int, tp: int) -> float:
        pts = [k for k in kern if k["kernel"] == "moe_w4a16" and k["tp"] == tp]
        return min(pts, key=lambda k: abs(k["M"] - m))["time_us_p50"]

    rows = []
    for tp in (1, 8):
        for layers in depths:
            for conc in (1, 16):
                budget = 15
                tokens = conc * (budget + 1)
                per_layer = moe_us(tokens, tp) / 1e3 + 0.05 * conc
                head = HEAD_BYTES / tp / (bw * 1e6)
                verify = layers * per_layer + head
                comm = 0.0 if tp == 1 else 2 * layers * (0.036 + tokens * 7168 * 2 * 2 * 7 / 8 / 300e6)
                terms = {"draft_ms": 1.5 + 0.05 * conc, "tree_build_ms": 0.04, "verify_ms": verify,
                         "accept_ms": 0.05, "other_ms": 0.3 + 0.002 * layers, "comm_ms": comm}
                step = sum(terms.values())
                rows.append({"run_id": run_id, "config": "k2", "layers": layers, "tp": tp,
                             "weight_sets": 4 if layers == FULL and tp == 1 else 1, "vocab": 163840,
                             "comm_source": "modelled" if tp > 1 else "none", "device": "cuda",
                             "concurrency": conc, "budget": budget, "synthetic_accept": 0.8,
                             "accept_len_mean": accept, "tokens_per_s": (accept + 1) * conc / step * 1e3,
                             "steps": 32, "step_ms_p50": step, "step_ms_p99": step * 1.05, **terms,
                             "kernel_ms": step * 0.93, "outside_ms": step * 0.07, "source": "measured"})
    return write_suites(out, prov, kern, rows, bw, tflops)


def write_suites(out: Path, prov: dict, kern: list[dict], e2e: list[dict], bw: float, tflops: float) -> Path:
    """A complete one-GPU H200 run of the kernels and e2e suites (its runs table from `prov`) into `out`."""
    base = {"run_id": prov["run_id"], "host": prov["host"], "profile": "full", "status": "complete",
            "gpu_name": "H200", "gpu_count": 1, "arch": "sm_90", "device": "cuda", "started_at": prov["started_at"],
            "ended_at": prov["started_at"], "copy_gbps": bw, "matmul_tflops": tflops, "source": "measured"}
    write_table(out, to_table("kernels", kern, prov))
    write_table(out, to_table("e2e", e2e, prov))
    write_table(out, to_table("runs", [{**base, "suite": s, "points": n}
                                       for s, n in (("kernels", len(kern)), ("e2e", len(e2e)))], prov))
    return out


def rewrite_table(run_dir: Path, table: str, change) -> None:
    """Rewrite one table of a written run: change(rows) -> rows."""
    t = read_table(run_dir / f"{table}.arrow")
    write_table(run_dir, to_table(table, change([dict(r) for r in t.to_pylist()]), provenance(t)))


def old_layout_run(root: Path, src: Path, host: str, run_id: str, index: list[dict]) -> Path:
    """What the old Store wrote: runs/host=<h>/run=<id>/<table>.arrow, a _manifest.json, an index line."""
    leaf = root / "runs" / f"host={host}" / f"run={run_id}"
    leaf.mkdir(parents=True)
    sums = {}
    for f in sorted(src.glob("*.arrow")):
        shutil.copy(f, leaf / f.name)
        sums[f.name] = hashlib.sha256(f.read_bytes()).hexdigest()
    (leaf / "_manifest.json").write_text(json.dumps({"files": sums}, indent=1, sort_keys=True))
    index.append({"host": host, "run_id": run_id, "source": "measured", "status": "complete"})
    return leaf
