"""Check and time MLA tree verify on one GPU against FlashMLA's figures: `python -m engine.bench_mla --out DIR`.

Ceilings first (engine.timing), then the Triton kernel against the float32 reference with fresh
random inputs and every buffer it allocates poisoned (NaN), at 8 and 64 heads: real DDTree masks
(built on the GPU), the all-True mask, plain decode, budget 1024, 128k context, contexts that do
not divide the key block, forced splits and the causal (chunked prefill) mode. Then timings with
engine.timing's `time_op` (CUDA-graph replays, L2 evicted by a read before each, medians) at every
shape of FlashMLA's comparison grid, with the all-True mask so that the work is FlashMLA's; with
`--flashmla CSV` (shared/data/mla-flashmla-h200.csv) each row carries FlashMLA's time beside ours,
outside data that is never fitted on; with `--baseline FILE` (an older kernels/mla_verify.py, e.g.
`git show 4a06ed9:kernels/mla_verify.py`) that kernel is timed at the same shapes. `--sweep` times
tile configs and split counts at a few shapes (the table in kernels/mla_verify.py comes from it).
Writes DIR/mla_check.csv, DIR/mla_time.csv (one row a kernel a shape, each written as it is
measured) and prints the time table last; `--deadline-s` bounds the run and the points it could not
reach are written as skipped.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch

from engine.bench_kernels import budgeted_repeats
from engine.config import K2
from engine.costs import mla_cost
from engine.timing import copy_gbps, matmul_tflops, time_op
from kernels import mla_verify, reference, tree_build
from kernels.gpu_check import poisoned, rel_err, unpoisoned

DL, DR = K2.kv_lora, K2.rope_dim
SCALE = 1.0 / K2.qk_dim ** 0.5
# FlashMLA's comparison grid: (heads, batch, budget, context)
GRID = [(h, b, n, c) for h in (8, 64) for b in (1, 8, 16) for n in (16, 64, 256) for c in (4096, 16384, 32768, 65536)]
# (heads, batch, T, contexts, mask, extra kwargs): mask "tree" (real DDTrees), "all" or "causal"
CHECKS: list[tuple[int, int, int, list[int], str, dict[str, Any]]] = [
    (8, 2, 17, [3000, 7100], "tree", {}), (64, 2, 65, [3000, 7100], "tree", {}),
    (8, 3, 1, [5000, 1, 8191], "tree", {}), (64, 3, 1, [5000, 1, 8191], "tree", {}),
    (8, 1, 257, [20000], "tree", {}), (64, 1, 257, [20000], "tree", {}),
    (8, 4, 1025, [1000, 33001], "tree", {}), (8, 1, 17, [131072], "tree", {}),
    (8, 2, 65, [4096, 4097], "all", {}), (64, 16, 17, [4095, 4096], "all", {}),
    (8, 1, 17, [16384], "tree", {"splits": 1}), (8, 1, 17, [16384], "tree", {"splits": 7}),
    (8, 1, 17, [16384], "tree", {"splits": 64}), (64, 2, 65, [9000, 100], "tree", {"splits": 5}),
    (8, 2, 512, [3000, 5001], "causal", {}), (64, 1, 300, [2048], "causal", {}),
    (8, 1, 2048, [30000], "causal", {}), (8, 2, 1, [7000, 1], "causal", {}),
]
# Sweep: tile configs (BM, BN, num_warps, num_stages) at a few shapes, then split counts.
CONFIG_SWEEP = [(64, 64, 8, 2), (64, 128, 8, 1), (64, 32, 8, 3), (64, 32, 8, 2), (64, 64, 8, 1)]
SMALL_SWEEP = [(16, 64, 4, 3), (16, 64, 4, 2), (16, 32, 4, 3), (16, 128, 4, 2), (64, 64, 8, 2)]
SWEEP_SHAPES = [(8, 8, 256, 16384), (64, 8, 64, 16384), (8, 16, 16, 32768), (8, 1, 16, 65536),
                (64, 1, 16, 65536), (8, 1, 256, 32768)]
DECODE_SHAPES = [(8, 1, 0, 16384), (8, 16, 0, 32768), (64, 16, 0, 32768)]  # budget 0: T = 1
SPLIT_SHAPES = [(8, 1, 16, 4096), (8, 1, 16, 65536), (8, 8, 16, 16384), (64, 1, 16, 16384),
                (8, 1, 64, 32768), (8, 16, 16, 4096)]

Row = dict[str, Any]


class Out:
    """Appends rows to DIR/<name>.csv as they come (a killed run keeps what it measured)."""

    def __init__(self, out: Path, deadline: float, flashmla: dict[tuple[int, int, int, int], float]) -> None:
        self.out, self.deadline, self.flashmla = out, deadline, flashmla
        self.rows: dict[str, list[Row]] = {}
        out.mkdir(parents=True, exist_ok=True)

    def __call__(self, name: str, **row: Any) -> None:
        rows = self.rows.setdefault(name, [])
        rows.append(row)
        path = self.out / f"{name}.csv"
        fields = list(dict.fromkeys(k for r in rows for k in r))
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields)
            w.writeheader()
            w.writerows(rows)
        print(name, {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items()}, flush=True)

    def left(self) -> float:
        return self.deadline - time.time()


def inputs(heads: int, batch: int, t: int, ctx: list[int], mask: str, s: int | None = None) -> tuple:
    """Random bf16 latents for T tokens over contexts `ctx` (cache of s rows, default max(ctx) + T)."""
    s = s or max(ctx) + t
    dev = torch.device("cuda")
    qn = torch.randn(batch, t, heads, DL, device=dev, dtype=torch.bfloat16)
    qr = torch.randn(batch, t, heads, DR, device=dev, dtype=torch.bfloat16)
    ckv = torch.randn(batch, s, DL, device=dev, dtype=torch.bfloat16)
    kpe = torch.randn(batch, s, DR, device=dev, dtype=torch.bfloat16)
    lens = torch.tensor(ctx, device=dev, dtype=torch.int64)
    if mask == "causal":
        tm = None
    elif mask == "all" or t == 1:
        tm = torch.ones(batch, t, t, dtype=torch.bool, device=dev)
    else:  # a DDTree of T nodes from drafter-like log-probs, built on the GPU (K2's L 16, k 8)
        lp = torch.log_softmax(torch.randn(batch, K2.draft_len, 64, device=dev) * 2, -1).topk(K2.draft_topk, -1).values
        tok = torch.randint(0, 1000, (batch, K2.draft_len, K2.draft_topk), device=dev)
        tm = tree_build.build_tree(lp, tok, torch.zeros(batch, dtype=torch.int64, device=dev), t - 1).mask
    return qn, qr, ckv, kpe, lens, tm


def check(out: Out) -> None:
    for heads, batch, t, ctx, mask, kw in CHECKS:
        args = inputs(heads, batch, t, ctx, mask)
        causal = mask == "causal"
        poisoned(mla_verify)
        try:
            got = mla_verify.mla_tree_attention(*args, SCALE, causal=causal, **kw)
        finally:
            unpoisoned(mla_verify)
        want = reference.mla_tree_attention(*args, SCALE, causal=causal)
        err = rel_err(got, want)
        out("mla_check", heads=heads, batch=batch, T=t, ctx=" ".join(map(str, ctx)), mask=mask,
            splits=kw.get("splits", "plan"), rel_err=err, ok=err < 1e-2)
        del args, got, want
    torch.cuda.empty_cache()


def timed(out: Out, name: str, kernel: str, fn: Callable[[], Any], shape: tuple[int, int, int, int],
          reps: int = 50, **extra: Any) -> float | None:
    """Time fn at one grid shape; one row with the shape's flops, TFLOP/s and FlashMLA's figures."""
    heads, batch, budget, context = shape
    base = dict(kernel=kernel, heads=heads, batch=batch, budget=budget, context=context, **extra)
    if out.left() < 5:
        out(name, **base, status="skipped: deadline")
        return None
    dev = torch.device("cuda")
    t = time_op(fn, dev, budgeted_repeats(fn, dev, reps))
    _, flops = mla_cost(K2, batch, budget, context, tp=K2.heads // heads)
    row = dict(base, us_p50=t.p50_us, us_p10=t.p10_us, us_p90=t.p90_us, repeats=t.repeats,
               flops=flops, tflops=flops / t.p50_us / 1e6, status="ok")
    fm = out.flashmla.get(shape)
    if fm is not None:
        row.update(flashmla_us=fm, vs_flashmla=t.p50_us / fm)
    out(name, **row)
    return t.p50_us


def time_grid(out: Out, baseline: ModuleType | None) -> None:
    kernels: list[tuple[str, Callable[..., Any]]] = [("triton", mla_verify.mla_tree_attention)]
    if baseline is not None:
        kernels.append(("baseline", baseline.mla_tree_attention))
    for heads, batch, budget, context in GRID:
        args = inputs(heads, batch, budget + 1, [context] * batch, "all")
        for name, fn in kernels:
            timed(out, "mla_time", name, lambda fn=fn: fn(*args, SCALE), (heads, batch, budget, context))
        del args
    torch.cuda.empty_cache()


def sweep(out: Out) -> None:
    for shape in SWEEP_SHAPES:
        heads, batch, budget, context = shape
        args = inputs(heads, batch, budget + 1, [context] * batch, "all")
        for cfg in CONFIG_SWEEP:
            try:
                timed(out, "mla_sweep", "triton", lambda cfg=cfg: mla_verify.mla_tree_attention(*args, SCALE, config=cfg),
                      shape, reps=20, config=" ".join(map(str, cfg)))
            except Exception as e:  # a config that does not fit (shared memory) is recorded, not fatal
                out("mla_sweep", kernel="triton", heads=heads, batch=batch, budget=budget, context=context,
                    config=" ".join(map(str, cfg)), status=f"error: {type(e).__name__}: {e}"[:200])
        del args
    for shape in DECODE_SHAPES:
        heads, batch, _, context = shape
        args = inputs(heads, batch, 1, [context] * batch, "all")
        for cfg in SMALL_SWEEP:
            try:
                timed(out, "mla_sweep", "triton", lambda cfg=cfg: mla_verify.mla_tree_attention(*args, SCALE, config=cfg),
                      shape, reps=20, config=" ".join(map(str, cfg)))
            except Exception as e:
                out("mla_sweep", kernel="triton", heads=heads, batch=batch, budget=0, context=context,
                    config=" ".join(map(str, cfg)), status=f"error: {type(e).__name__}: {e}"[:200])
        del args
    for shape in SPLIT_SHAPES:
        heads, batch, budget, context = shape
        args = inputs(heads, batch, budget + 1, [context] * batch, "all")
        rows = (budget + 1) * heads
        bm, bn, _, _ = mla_verify.pick_config(torch.device("cuda"), rows)
        tiles = batch * -(-rows // bm)
        planned, _ = mla_verify.plan_splits(tiles, context + budget + 1, bn, mla_verify.sm_count(torch.device("cuda")))
        for n in sorted({1, 2, 4, 8, 16, 32, 64, 128, planned}):
            timed(out, "mla_splits", "triton", lambda n=n: mla_verify.mla_tree_attention(*args, SCALE, splits=n),
                  shape, reps=20, splits=n, planned=planned, tiles=tiles)
        del args
    torch.cuda.empty_cache()


def load_baseline(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("mla_baseline", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--baseline: cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def read_flashmla(path: Path) -> dict[tuple[int, int, int, int], float]:
    """flashmla_us by (heads, batch, budget, context) from the comparison CSV."""
    with open(path) as f:
        return {(int(r["heads"]), int(r["batch"]), int(r["budget"]), int(r["context"])): float(r["flashmla_us"])
                for r in csv.DictReader(f)}


def summary(out: Out) -> None:
    """The time table: ours, the baseline, FlashMLA, and the goal (<= 1.25x FlashMLA) per shape."""
    rows = out.rows.get("mla_time", [])
    by = {(r["kernel"], r["heads"], r["batch"], r["budget"], r["context"]): r for r in rows if r.get("status") == "ok"}
    print(f"{'heads':>5} {'batch':>5} {'budget':>6} {'context':>7} {'triton us':>10} {'TFLOP/s':>8} "
          f"{'baseline us':>11} {'flashmla us':>11} {'x flashmla':>10}")
    for h, b, n, c in GRID:
        r = by.get(("triton", h, b, n, c))
        if r is None:
            continue
        old = by.get(("baseline", h, b, n, c))
        print(f"{h:>5} {b:>5} {n:>6} {c:>7} {r['us_p50']:>10.1f} {r['tflops']:>8.1f} "
              f"{(old['us_p50'] if old else float('nan')):>11.1f} {r.get('flashmla_us', float('nan')):>11.1f} "
              f"{r.get('vs_flashmla', float('nan')):>10.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="folder for mla_check.csv, mla_time.csv, ...")
    ap.add_argument("--flashmla", type=Path, help="FlashMLA's figures (shared/data/mla-flashmla-h200.csv)")
    ap.add_argument("--baseline", type=Path, help="an older kernels/mla_verify.py to time beside this one")
    ap.add_argument("--sweep", action="store_true", help="also time tile configs and split counts")
    ap.add_argument("--no-grid", action="store_true", help="skip the timing grid (checks and sweep only)")
    ap.add_argument("--deadline-s", type=float, default=480, help="stop timing when this runs out")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("engine.bench_mla needs a CUDA GPU")
    out = Out(a.out, time.time() + a.deadline_s, read_flashmla(a.flashmla) if a.flashmla else {})
    dev = torch.device("cuda")
    out("mla_ceilings", gpu=torch.cuda.get_device_name(), sms=mla_verify.sm_count(dev),
        copy_gbps=copy_gbps(dev), bf16_tflops=matmul_tflops(dev), torch=torch.__version__,
        triton=__import__("triton").__version__)
    check(out)
    if a.sweep:
        sweep(out)
    if not a.no_grid:
        time_grid(out, load_baseline(a.baseline) if a.baseline else None)
    summary(out)


if __name__ == "__main__":
    main()
