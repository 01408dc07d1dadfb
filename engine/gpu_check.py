"""Check and time the MoE and tree kernels at K2 shapes on one GPU: `python -m engine.gpu_check --out DIR`
(MLA tree verify has its own: `python -m engine.bench_mla`).

Order: ceilings first (device-to-device copy bandwidth, bf16 matmul rate: engine.timing's), then
each kernel against its reference in bf16 with fresh random inputs and every kernel-allocated
buffer poisoned (NaN / sentinel), then timings (engine.timing.time_op: CUDA-graph replays after a
reading L2 flush, median) with the floors beside them. The CUDA C++ MoE has its own sweep,
engine/moe_sweep.py. Writes
DIR/gpu_check.jsonl (one record per measurement) and DIR/gpu_check.md (the table); sections that
fail are logged and the rest still run.
"""

from __future__ import annotations

import argparse
import importlib
import json
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch
import torch.nn.functional as F
import triton

from engine.build import rel_err
from engine.config import K2, SHARD_TP
from engine.timing import copy_gbps, matmul_tflops, time_op
from kernels import build_tree, moe_gemm, reference, tree_accept
from kernels.moe_gemm_configs import SPLIT_MAX_SLOTS
from kernels.moe_gemm_configs import SplitConfig as C
from kernels.reference import Tree

E, H, I, TOPK = K2.experts, K2.hidden, K2.moe_inter, K2.top_k


class Log:
    """Collects records, prints one line each, and rewrites the output files after each."""

    def __init__(self, out: Path, deadline: float) -> None:
        self.out, self.rows, self.deadline = out, [], deadline
        out.mkdir(parents=True, exist_ok=True)

    def __call__(self, **rec: Any) -> None:
        self.rows.append(rec)
        print(json.dumps(rec), flush=True)
        with open(self.out / "gpu_check.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")

    def time_left(self) -> float:
        return self.deadline - time.time()


def poisoned(mod: Any) -> None:
    """Make the module's torch.empty / empty_like hand out NaN (float) or sentinel (int) memory."""
    real = torch

    def fill(t: torch.Tensor) -> torch.Tensor:
        if t.dtype.is_floating_point:
            return t.fill_(float("nan"))
        if t.dtype == torch.bool:
            return t.fill_(True)
        return t.fill_(-123456)

    ns = SimpleNamespace(**{k: getattr(real, k) for k in dir(real) if not k.startswith("__")})
    ns.empty = lambda *a, **k: fill(real.empty(*a, **k))
    ns.empty_like = lambda *a, **k: fill(real.empty_like(*a, **k))
    mod.torch = ns


def unpoisoned(mod: Any) -> None:
    mod.torch = torch


def bench(fn: Callable[[], Any], graph: bool = True, rep: int = 60) -> float:
    """Median microseconds of `rep` timed calls by engine.timing.time_op (the bench runner's harness:
    L2 evicted by a read before each; CUDA-graph replays when `graph`, which strips launch gaps)."""
    return time_op(fn, torch.device("cuda"), repeats=rep, graph=graph).p50_us


# ----------------------------------------------------------------------------- ceilings


def ceilings(log: Log) -> tuple[float, float]:
    """The device's copy bandwidth and bf16 matmul rate, measured as the bench runner measures them."""
    dev = torch.device("cuda")
    bw, tf = copy_gbps(dev) * 1e9, matmul_tflops(dev) * 1e12
    log(section="ceiling", copy_gbps=bw / 1e9, bf16_tflops=tf / 1e12, gpu=torch.cuda.get_device_name(),
        sms=torch.cuda.get_device_properties(0).multi_processor_count, torch=torch.__version__,
        triton=triton.__version__)
    return bw, tf


# ----------------------------------------------------------------------------- MoE


def routing(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.rand(m, E, device="cuda").topk(TOPK, -1).indices
    wts = torch.softmax(torch.randn(m, TOPK, device="cuda"), -1)
    return ids, wts


# ----------------------------------------------------------------------------- MoE on tensor cores, full and TP shard

TC_M = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
TC_TP = (1, SHARD_TP)  # full shapes, and one rank's shard (each expert's intermediate / SHARD_TP)
# (path, (BM, BN, BK, KS, warps, stages, DOT)); DOT 1: plane dots on tensor cores; 12 / 8: the packed
# FMA GEMV with / without the next step's loads in flight. The fastest of runs 11-13 (NOTES.md v7).
TC_SWEEP: list[tuple[str, Any]] = [  # a config, or (gate_up config, down config)
    ("grouped", C(16, 64, 256, 7168, 4, 3, 1)), ("grouped", C(16, 64, 256, 7168, 4, 2, 1)),
    ("grouped", C(16, 64, 256, 7168, 2, 3, 1)), ("grouped", C(16, 64, 128, 7168, 4, 3, 1)),
    ("grouped", C(16, 128, 128, 7168, 2, 3, 1)), ("grouped", C(16, 128, 256, 7168, 8, 4, 1)),
    ("grouped", C(32, 128, 128, 7168, 4, 3, 1)), ("grouped", C(32, 64, 256, 7168, 4, 3, 1)),
    ("grouped", C(32, 64, 256, 7168, 2, 3, 1)),
    ("grouped", (C(16, 64, 256, 7168, 4, 3, 1), C(16, 128, 128, 7168, 4, 3, 1))),
    ("split", C(1, 64, 256, 1024, 4, 3, 12)), ("split", C(1, 64, 256, 7168, 4, 3, 12)),
    ("split", C(1, 64, 256, 3584, 4, 3, 8)), ("grouped", C(1, 64, 256, 1024, 4, 3, 8)),
]


def _pass_cfgs(c: C | tuple[C, C]) -> dict[str, C]:
    """A sweep entry as moe_w4a16's configs: one config for both passes, or a (gate_up, down) pair."""
    return {"gate_up": c, "down": c} if isinstance(c, C) else {"gate_up": c[0], "down": c[1]}


def _tc_weights(e: int, inter: int, seed: int | None = None) -> tuple[torch.Tensor, ...]:
    """Packed words (every nibble value) and positive bf16 scales for e experts of intermediate `inter`."""
    g = torch.Generator(device="cuda").manual_seed(int(time.time() * 1e3) if seed is None else seed)
    return (torch.randint(-2**31, 2**31 - 1, (e, 2 * inter, H // 8), device="cuda", dtype=torch.int32, generator=g),
            (torch.rand(e, 2 * inter, H // 32, device="cuda", generator=g) * 2e-3 + 1e-3).to(torch.bfloat16),
            torch.randint(-2**31, 2**31 - 1, (e, H, inter // 8), device="cuda", dtype=torch.int32, generator=g),
            (torch.rand(e, H, inter // 32, device="cuda", generator=g) * 2e-3 + 1e-3).to(torch.bfloat16))


def _warm_tc(cfgs: list) -> str:
    """Compile `cfgs` ((path, config) pairs) at both shapes in a child process (fills the Triton cache)."""
    e, errs = 16, []
    for tp in TC_TP:
        w = _tc_weights(e, I // tp, seed=1)
        for m in (1, 32):
            x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)
            ids = torch.rand(m, e, device="cuda").topk(TOPK, -1).indices
            wts = torch.softmax(torch.randn(m, TOPK, device="cuda"), -1)
            for path, c in cfgs:
                if path == "split" and m * TOPK > SPLIT_MAX_SLOTS:
                    continue
                try:
                    moe_gemm.moe_w4a16(x, *w, ids, wts, configs=_pass_cfgs(c), path=path)
                except Exception as exc:
                    errs.append(f"tp{tp} {path} {c}: {exc!r}"[:300])
        moe_gemm.moe_w4a16(x, *w, ids, wts)  # the shipped dispatch too
    torch.cuda.synchronize()
    return "; ".join(errs)


def moe_tc_section(log: Log, bw: float) -> None:
    """Tensor-core grouped MoE at full and TP-8 shard shapes: compile in parallel, check every
    config against the reference, time over several weight sets (CUDA graphs; sets x bytes >> L2),
    the shipped dispatch as the baseline, pick per (tp, M), re-check the picks poisoned on fresh
    inputs, and check that two launches give bit-identical outputs (the engine's decode must repeat)."""
    import multiprocessing as mp

    t0 = time.time()
    with mp.get_context("spawn").Pool(16) as pool:
        warm = importlib.import_module("engine.gpu_check")._warm_tc
        errs = pool.map(warm, [[c] for c in TC_SWEEP])
    log(section="moetc_compile", wall_s=time.time() - t0, errors=[x for x in errs if x])
    nsets = {1: 2, SHARD_TP: 8}  # weight sets: their bytes together well over L2
    sets = {tp: [_tc_weights(E, I // tp) for _ in range(nsets[tp])] for tp in TC_TP}
    inputs = {(tp, m): [(torch.randn(m, H, device="cuda", dtype=torch.bfloat16), *routing(m)) for _ in sets[tp]]
              for tp in TC_TP for m in TC_M}
    ebytes = {tp: 3 * H * (I // tp) // 2 + 3 * H * (I // tp) // 32 * 2 for tp in TC_TP}
    nbytes = {(tp, m): sum(int(torch.unique(ids).numel()) * ebytes[tp] + 2 * m * H * 2 for _, ids, _ in inputs[tp, m])
              / nsets[tp] for tp in TC_TP for m in TC_M}

    def run(tp: int, m: int, i: int, path: str | None, c: Any) -> torch.Tensor:
        x, ids, wts = inputs[tp, m][i]
        return moe_gemm.moe_w4a16(x, *sets[tp][i], ids, wts, configs=None if c is None else _pass_cfgs(c),
                                  path=path)

    def timed(tp: int, m: int, path: str | None, c: Any) -> float:
        n = nsets[tp]
        return bench(lambda: [run(tp, m, i, path, c) for i in range(n)], rep=10) / n

    def rec(tp: int, m: int, us: float) -> dict[str, float]:
        nb = nbytes[tp, m]
        return {"us": us, "gbps": nb / us / 1e3, "pct_copy_bw": 100 * nb / bw / (us * 1e-6), "floor_us": nb / bw * 1e6}

    rows, best = [], {}
    for m in (1, 16, 512, 1024, 64, 4, 256, 128, 8, 32, 2):  # the ends and the targets first
        for tp in TC_TP:
            ref = reference.moe_w4a16(inputs[tp, m][0][0], *sets[tp][0], *inputs[tp, m][0][1:])
            for path, c in [(None, None), *TC_SWEEP]:  # None: the shipped dispatch (baseline)
                if log.time_left() < 40:
                    break
                if (path == "split" and m * TOPK > SPLIT_MAX_SLOTS) or (c and not _pass_cfgs(c)["gate_up"].tensor_cores and m > 16):
                    continue  # the FMA GEMV scales with the slots: decode sizes only
                try:
                    err = rel_err(run(tp, m, 0, path, c), ref)
                    if not err < 1e-2:
                        log(section="moetc_sweep", tp=tp, m=m, path=path, cfg=str(c), rel_err=err, error="wrong result")
                        continue
                    us = timed(tp, m, path, c)
                except Exception as exc:
                    log(section="moetc_sweep", tp=tp, m=m, path=path, cfg=str(c), error=repr(exc)[-300:])
                    continue
                r = dict(section="moetc_sweep", tp=tp, m=m, path=path or "shipped", cfg=str(c), rel_err=err, **rec(tp, m, us))
                log(**r)
                rows.append(r)
                if c is not None and ((tp, m) not in best or us < best[tp, m][1]):
                    best[tp, m] = ((path, c), us)
    poisoned(moe_gemm)
    for (tp, m), ((path, c), us) in sorted(best.items()):  # picks re-checked on fresh inputs, poisoned
        i = m % nsets[tp]
        x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)
        ids, wts = routing(m)
        cfg = _pass_cfgs(c)
        out = moe_gemm.moe_w4a16(x, *sets[tp][i], ids, wts, configs=cfg, path=path)
        err = rel_err(out, reference.moe_w4a16(x, *sets[tp][i], ids, wts))
        same = torch.equal(out, moe_gemm.moe_w4a16(x, *sets[tp][i], ids, wts, configs=cfg, path=path))
        log(section="moetc_pick", tp=tp, m=m, path=path, cfg=str(c), rel_err=err, ok=err < 1e-2,
            deterministic=same, **rec(tp, m, us))
    unpoisoned(moe_gemm)
    for tp in TC_TP:  # the shipped dispatch: bit-identical across launches (and across a graph replay)
        for m in (1, 5, 16, 130, 1025):
            x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)
            ids, wts = routing(m)
            outs = [moe_gemm.moe_w4a16(x, *sets[tp][0], ids, wts) for _ in range(3)]
            log(section="moetc_determinism", tp=tp, m=m, identical=all(torch.equal(outs[0], o) for o in outs[1:]))
    import csv
    with open(log.out / "moetc_sweep.csv", "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=["tp", "m", "path", "cfg", "us", "gbps", "pct_copy_bw", "floor_us", "rel_err"],
                            extrasaction="ignore")
        wr.writeheader()
        wr.writerows(rows)
    del sets


# ----------------------------------------------------------------------------- tree build + accept


def draft(bt: int, length: int, k: int, ties: bool) -> tuple[torch.Tensor, torch.Tensor]:
    lp = F.log_softmax(torch.randn(bt, length, 100, device="cuda") * 2, -1).topk(k, -1).values
    if ties:  # coarse grid: many equal scores, so the insertion-counter tie-break decides
        lp = (lp * 2).round() / 2
        lp = lp.sort(-1, descending=True).values
    tok = torch.randint(0, 163840, (bt, length, k), device="cuda")
    return lp.contiguous(), tok


def accept_target(tree: Tree, follow: float) -> torch.Tensor:
    """Target argmax that follows a random child with probability `follow`, else a random token."""
    bt, n1 = tree.tokens.shape
    am = torch.randint(0, 163840, (bt, n1), device="cuda")
    par = tree.parents.cpu()
    tok = tree.tokens.cpu()
    amc = am.cpu()
    for b in range(bt):
        kids: dict[int, list[int]] = {}
        for i in range(1, n1):
            kids.setdefault(int(par[b, i]), []).append(i)
        for node, ch in kids.items():
            if torch.rand(()) < follow:
                amc[b, node] = tok[b, ch[int(torch.randint(len(ch), ()))]]
    return amc.cuda()


def tree_section(log: Log) -> None:
    poisoned(build_tree)
    poisoned(tree_accept)
    for budget, ties in ((64, False), (256, True), (1024, False), (1024, True), (512, None)):
        lp, tok = draft(16, 16, 8, bool(ties))
        if ties is None:  # every score equal: the insertion counters decide the whole tree
            lp.zero_()
        root = torch.randint(0, 1000, (16,), device="cuda")
        gpu = build_tree.build_tree(lp, tok, root, budget)
        cpu = reference.build_tree(lp, tok, root, budget)
        same = {f: bool(torch.equal(getattr(gpu, f), getattr(cpu, f))) for f in ("tokens", "parents", "depths", "scores", "mask")}
        log(section="tree_check", budget=budget, ties=ties, same=same, ok=all(same.values()))
        am = accept_target(cpu, 0.85)
        got = tree_accept.tree_accept(gpu, am)
        want = reference.tree_accept(cpu, am)
        ok = all(bool(torch.equal(a, b)) for a, b in zip(got, want))
        log(section="accept_check", budget=budget, ok=ok, mean_accept=float(want[1].float().mean()))
    unpoisoned(build_tree)
    unpoisoned(tree_accept)
    for budget in (64, 256, 1024):
        lp, tok = draft(16, 16, 8, False)
        root = torch.randint(0, 1000, (16,), device="cuda")
        for warps in (1, 2, 4):
            us = bench(lambda: build_tree.build_tree(lp, tok, root, budget, num_warps=warps))
            log(section="tree_time", budget=budget, bt=16, num_warps=warps, us=us)
        t0 = time.perf_counter()
        for _ in range(3):
            cpu = reference.build_tree(lp, tok, root, budget)
        torch.cuda.synchronize()
        log(section="tree_cpu_heap", budget=budget, bt=16, us=(time.perf_counter() - t0) / 3 * 1e6)
        am = accept_target(cpu, 0.85)
        us = bench(lambda: tree_accept.tree_accept(cpu, am))
        log(section="accept_time", budget=budget, bt=16, us=us)


def write_table(log: Log) -> None:
    lines = ["| section | fields |", "| --- | --- |"]
    for r in log.rows:
        sec = r.get("section")
        body = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items() if k != "section")
        lines.append(f"| {sec} | {body} |")
    (log.out / "gpu_check.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget-s", type=float, default=420, help="stop timing sections when this runs out")
    ap.add_argument("--only", default="moetc,tree", help="comma list of sections (moetc, tree)")
    a = ap.parse_args()
    log = Log(a.out, time.time() + a.budget_s)
    bw, _ = ceilings(log)
    sections = {"tree": lambda: tree_section(log), "moetc": lambda: moe_tc_section(log, bw)}
    for name in a.only.split(","):
        t0 = time.time()
        try:
            sections[name]()
        except Exception:
            log(section=name, error=traceback.format_exc()[-1500:])
        log(section=name, wall_s=time.time() - t0)
        torch.cuda.empty_cache()
    write_table(log)


if __name__ == "__main__":
    main()
