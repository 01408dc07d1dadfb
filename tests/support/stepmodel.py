"""A synthetic k2-mini reference whose e2e steps are made of its own kernel sweep, by hand.

Every kernel point follows a known additive roofline (latency + bytes / bandwidth + flops / compute,
the MoE's compute rate one for both shape classes), the tree kernels a known curve in budget, and each
e2e row is built here from those formulas (not from flows.analysis.stepmodel): each family's suite time times a
known in-step factor, gpu_other = a fixed part + a x tokens-dependent part per layer, host time =
fixed + per layer. So a step model that composes correctly must give the rows back, and its
calibration must find the factors. Written with engine.schema (support.runs.write_suites).
"""

from __future__ import annotations

from pathlib import Path

from engine.config import K2_MINI, make_config
from engine.costs import (build_tree_cost, dense_op_cost, dense_op_rows, dense_ops, expected_experts, mla_cost,
                          moe_cost, tree_accept_cost)

from support.runs import write_suites

CFG = K2_MINI
RUN_ID = "mini-1"
BW, TF = 4000.0, 700.0                      # the run's measured copy GB/s and matmul TFLOP/s
# (latency us, GB/s, TFLOP/s) of each family's additive roofline, per TP class
MOE = {1: (15.0, 3000.0), 2: (18.0, 2800.0)}
MOE_TF = 250.0
MLA = {1: (30.0, 1500.0, 200.0), 2: (25.0, 1200.0, 90.0)}
DENSE = (4.0, 3500.0, 500.0)
FACTORS = {"moe": 1.12, "attention": 1.3, "dense": 1.05, "lm_head": 1.0, "tree": 1.0}
OTHER_FIXED_MS = 0.05
OTHER_A_US, OTHER_B_US = 40.0, 0.3          # gpu_other per layer: a + b x tokens / tp (us)
HOST_FIXED_MS, HOST_PER_LAYER_MS = 0.2, 0.03
MOE_M = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
ATTN = [(b, n, c) for b in (1, 4, 16) for n in (4, 16, 64) for c in (64, 256, 1024)]
TREE = [(b, n) for b in (1, 4, 16) for n in (4, 16, 64)]
DENSE_M = (1, 4, 16, 64, 256, 1024)
E2E = [(tp, c, b, ctx, layers) for tp in (1, 2) for c in (1, 4, 16) for b in (4, 16) for ctx in (64, 256)
       for layers in (1, 3)]


def moe_us(m: int, tp: int) -> float:
    lat, gbps = MOE[tp]
    nbytes, flops = moe_cost(CFG, m, expected_experts(CFG.experts, CFG.top_k, m), tp=tp)
    return lat + nbytes / (gbps * 1e3) + flops / (MOE_TF * 1e6)


def mla_us(batch: int, budget: int, context: int, tp: int) -> float:
    lat, gbps, tf = MLA[tp]
    nbytes, flops = mla_cost(CFG, batch, budget, context, tp=tp)
    return lat + nbytes / (gbps * 1e3) + flops / (tf * 1e6)


def tree_us(kernel: str, batch: int, budget: int) -> float:
    return (6.0 + 0.5 * budget) if kernel == "build_tree" else (4.0 + 0.05 * budget * batch ** 0.5)


def dense_us(op, m: int) -> float:
    lat, gbps, tf = DENSE
    nbytes, flops = dense_op_cost(op, m)
    return lat + nbytes / (gbps * 1e3) + flops / (tf * 1e6)


def _point(kernel: str, t: float, nbytes: float, flops: float, **shape: object) -> dict:
    return {"run_id": RUN_ID, "kernel": kernel, "impl": "torch" if kernel == "dense_gemm" else "triton",
            "dtype": {"build_tree": "float32", "tree_accept": "int64"}.get(kernel, "bfloat16"), "device": "cuda",
            **shape, "time_us_p10": t * 0.98, "time_us_p50": t, "time_us_p90": t * 1.02, "repeats": 20,
            "bytes": nbytes, "flops": flops, "source": "measured"}


def kernel_rows() -> list[dict]:
    rows = []
    for tp in (1, 2):
        for m in MOE_M:
            rows.append(_point("moe_w4a16", moe_us(m, tp), *moe_cost(CFG, m, expected_experts(CFG.experts, CFG.top_k, m),
                                                                     tp=tp),
                               M=m, N=2 * CFG.moe_inter // tp, K=CFG.hidden, E=CFG.experts, top_k=CFG.top_k, tp=tp))
        for b, n, c in ATTN:
            rows.append(_point("mla_tree_attention", mla_us(b, n, c, tp), *mla_cost(CFG, b, n, c, tp=tp),
                               batch=b, budget=n, context=c, N=CFG.heads // tp, tp=tp))
        seen = {op.name: op for op in dense_ops(CFG, 1)}
        for op in dense_ops(CFG, tp):
            if tp > 1 and seen.get(op.name) == op:
                continue            # a replicated op is timed once, at TP-1
            rows += [_point("dense_gemm", dense_us(op, m), *dense_op_cost(op, m), op=op.name, M=m, N=op.n, K=op.k,
                            batch=op.heads, tp=tp) for m in DENSE_M]
    for kernel, cost in (("build_tree", build_tree_cost), ("tree_accept", tree_accept_cost)):
        rows += [_point(kernel, tree_us(kernel, b, n), *cost(CFG, b, n), batch=b, budget=n) for b, n in TREE]
    return rows


def family_ms(tp: int, c: int, b: int, ctx: int, layers: int) -> dict[str, float]:
    """The measured per-family split of one step, by hand."""
    cfg = make_config("k2-mini", layers=layers)
    dense_layers = min(cfg.dense_layers, layers)
    count = {"layer": layers, "dense_layer": dense_layers, "moe_layer": layers - dense_layers, "step": 1}
    tokens = c * (b + 1)
    suite = {"moe": count["moe_layer"] * moe_us(tokens, tp), "attention": layers * mla_us(c, b, ctx, tp),
             "dense": 0.0, "lm_head": 0.0,
             "tree": tree_us("build_tree", c, b) + tree_us("tree_accept", c, b)}
    for op in dense_ops(cfg, tp):
        fam = "lm_head" if op.name in ("lm_head", "draft_head") else "dense"
        suite[fam] += count[op.per] * dense_us(op, dense_op_rows(op, cfg, c, b))
    out = {f: FACTORS[f] * us / 1e3 for f, us in suite.items()}
    out["gpu_other"] = OTHER_FIXED_MS + layers * (OTHER_A_US + OTHER_B_US * tokens / tp) / 1e3
    return out


def e2e_rows() -> list[dict]:
    rows = []
    for tp, c, b, ctx, layers in E2E:
        fams = family_ms(tp, c, b, ctx, layers)
        kernel = sum(fams.values())
        host = HOST_FIXED_MS + HOST_PER_LAYER_MS * layers
        step = kernel + host
        accept = 2.5
        rows.append({"run_id": RUN_ID, "config": "k2-mini", "layers": layers, "tp": tp, "device": "cuda",
                     "concurrency": c, "budget": b, "context": ctx, "synthetic_accept": 0.8, "status": "ok",
                     "accept_len_mean": accept, "tokens_per_s": c * (accept + 1) / step * 1e3, "steps": 16,
                     "step_ms_p50": step, "step_ms_p99": step * 1.05, "draft_ms": fams["lm_head"],
                     "tree_build_ms": fams["tree"], "verify_ms": kernel - fams["lm_head"] - fams["tree"],
                     "accept_ms": 0.0, "other_ms": host, "comm_ms": 0.0,
                     "comm_source": "modelled" if tp > 1 else "none", "kernel_ms": kernel, "outside_ms": host,
                     **{f"{f}_ms": v for f, v in fams.items()}, "source": "measured"})
    return rows


def mini_run(out: Path, host: str = "h200") -> Path:
    """The run's tables (runs, kernels, e2e) under `out`, as a reference set of `host`."""
    out.mkdir(parents=True, exist_ok=True)
    prov = {"run_id": RUN_ID, "host": host, "gpu_name": "H200", "gpu_count": 1, "started_at": "2026-12-01T20:00:00Z"}
    return write_suites(out, prov, kernel_rows(), e2e_rows(), BW, TF)
