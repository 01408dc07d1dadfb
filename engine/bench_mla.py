"""Check and time MLA tree verify on one GPU against FlashMLA's figures: `python -m engine.bench_mla --out DIR`.

Ceilings first (engine.timing), then the kernel configs `--check` names against the float32 reference
(and a float64 one, to tell a kernel's error from the reference's) with inputs seeded per case and
every buffer the kernel allocates poisoned (NaN), at 8 and 64 heads: real DDTree masks (built on the
GPU), the all-True mask, plain decode, budget 1024, 128k context, contexts that do not divide the key
block, forced splits and the causal (chunked prefill) mode. Then the kernels `--kernels` names, timed
with engine.timing's `time_op` (CUDA-graph replays, L2 evicted by a read before each, medians) at
every shape of FlashMLA's comparison grid (`--grid short`: contexts 128-4096 instead, where
mla_tree_attention.SHORT_WORK picks), each on the same inputs, with the all-True mask so that the
work is FlashMLA's; with `--flashmla CSV` (shared/data/mla-flashmla-h200.csv) each row carries
FlashMLA's time beside ours, outside data that is never fitted on; with `--baseline FILE` (an older
kernels/mla_verify.py, e.g. `git show 4a06ed9:kernels/mla_verify.py`) that kernel is timed too.
`--sweep` times tile configs and split counts at a few shapes (the table in kernels/mla_tree_attention.py
comes from it). `--plans` times the split planner's pick beside a sweep of split counts, each count the
planner's own candidate for it, at v7's sweep shapes and every grid shape of under four waves of row
tiles, and prints the pick's regret (its time over the best count's) per shape. Writes
DIR/mla_check.csv, DIR/mla_time.csv, ... (each row written as it is measured, added to what DIR holds)
and prints the time table last; `--deadline-s` bounds the timing, and the points it could not reach are
written as skipped.
"""

from __future__ import annotations

import argparse
import csv
import os
import importlib.util
import statistics
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch

from engine.bench_kernels import budgeted_repeats
from engine.build import rel_err
from engine.config import K2
from engine.costs import mla_cost
from engine.gpu_check import poisoned, unpoisoned
from engine.timing import copy_gbps, matmul_tflops, time_op
from kernels import build_tree, mla_tree_attention, reference

DEVICE, DTYPE = torch.device("cuda"), torch.bfloat16
DL, DR = K2.kv_lora, K2.rope_dim
SCALE = 1.0 / K2.qk_dim ** 0.5
# FlashMLA's comparison grid: (heads, batch, budget, context)
GRID = [(h, b, n, c) for h in (8, 64) for b in (1, 8, 16) for n in (16, 64, 256) for c in (4096, 16384, 32768, 65536)]
# Below FlashMLA's grid: the contexts of the e2e suite's short prompts, where SHORT_WORK picks
SHORT_GRID = [(h, b, n, c) for h in (8, 64) for b in (1, 4, 16) for n in (16, 64) for c in (128, 256, 512, 1024, 2048, 4096)]
GRIDS = {"flashmla": GRID, "short": SHORT_GRID}
# (heads, batch, T, contexts, mask, extra kwargs): mask "tree" (real DDTrees), "all" or "causal"
CHECKS: list[tuple[int, int, int, list[int], str, dict[str, Any]]] = [
    (8, 2, 17, [3000, 7100], "tree", {}), (64, 2, 65, [3000, 7100], "tree", {}),
    (8, 3, 1, [5000, 1, 8191], "tree", {}), (64, 3, 1, [5000, 1, 8191], "tree", {}),
    (8, 1, 257, [20000], "tree", {}), (64, 1, 257, [20000], "tree", {}),
    (8, 2, 1025, [1000, 33001], "tree", {}), (8, 1, 17, [131072], "tree", {}),
    (8, 2, 65, [4096, 4097], "all", {}), (64, 16, 17, [4095, 4096] * 8, "all", {}),
    (8, 1, 17, [16384], "tree", {"splits": 1}), (8, 1, 17, [16384], "tree", {"splits": 7}),
    (8, 1, 17, [16384], "tree", {"splits": 64}), (64, 2, 65, [9000, 100], "tree", {"splits": 5}),
    (8, 2, 512, [3000, 5001], "causal", {}), (64, 1, 300, [2048], "causal", {}),
    (8, 1, 2048, [30000], "causal", {}), (8, 2, 1, [7000, 1], "causal", {}),
]
# Sweep: tile configs at a few shapes, then split counts.
C = mla_tree_attention.Config
CONFIG_SWEEP = [C("triton", 64, 128, 8, 1), C("triton", 64, 32, 8, 3)]  # besides NAMED's, timed in the grid
SMALL_SWEEP = [C("triton", 16, 64, 4, 3), C("triton", 16, 64, 4, 2), C("triton", 16, 32, 4, 3),
               C("triton", 64, 64, 8, 2), C("gluon", 64, 64, 8, 1)]
# The kernels --kernels names: the table's pick, each kernel at its main config, an older file's kernel
NAMED = {"triton": C("triton", 64, 64, 8, 2), "gluon": C("gluon", 64, 64, 8, 1), "gluon_ws": C("gluon_ws", 64, 64, 4, 1)}
SWEEP_SHAPES = [(8, 8, 256, 16384), (64, 8, 64, 16384), (8, 16, 16, 32768), (8, 1, 16, 65536)]
DECODE_SHAPES = [(8, 1, 0, 16384), (8, 16, 0, 32768), (64, 16, 0, 32768)]  # budget 0: T = 1, plain decode
SPLIT_SHAPES = [(8, 1, 16, 4096), (8, 1, 16, 65536), (8, 8, 16, 16384), (64, 1, 16, 16384), (8, 16, 16, 4096)]
# --plans: v7's split-sweep shapes (kernels/NOTES.md section 2), then the grid's shapes of under PLAN_WAVES waves
PLAN_SHAPES = [(64, 8, 16, 4096), (8, 16, 64, 4096), (8, 16, 16, 4096), (64, 16, 16, 16384), (8, 8, 64, 16384),
               (8, 12, 16, 12288), (64, 4, 32, 8192), (8, 8, 32, 24576), (64, 12, 16, 8192)]
PLAN_COUNTS = (1, 2, 3, 4, 5, 6, 8, 11, 16, 24, 32, 48, 64)
PLAN_WAVES = 4  # grid shapes of this many waves of row tiles or more are left out: one split at each

Row = dict[str, Any]
PlanPoint = tuple[tuple[int, int, int, int], int, list[tuple[int, int]], tuple[int, int]]


class Out:
    """Appends rows to DIR/<name>.csv as they come (a killed run keeps what it measured; a later run
    into the same DIR adds to the rows already there)."""

    def __init__(self, out: Path, deadline: float, flashmla: dict[tuple[int, int, int, int], float]) -> None:
        self.out, self.deadline, self.flashmla = out, deadline, flashmla
        self.rows: dict[str, list[Row]] = {}
        out.mkdir(parents=True, exist_ok=True)

    def __call__(self, name: str, **row: Any) -> None:
        path = self.out / f"{name}.csv"
        if name not in self.rows:
            with open(path) if path.exists() else open(os.devnull) as f:
                self.rows[name] = list(csv.DictReader(f))
        rows = self.rows[name]
        rows.append(row)
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
    dev = DEVICE
    qn = torch.randn(batch, t, heads, DL, device=dev, dtype=DTYPE)
    qr = torch.randn(batch, t, heads, DR, device=dev, dtype=DTYPE)
    ckv = torch.randn(batch, s, DL, device=dev, dtype=DTYPE)
    kpe = torch.randn(batch, s, DR, device=dev, dtype=DTYPE)
    lens = torch.tensor(ctx, device=dev, dtype=torch.int64)
    if mask == "causal":
        tm = None
    elif mask == "all" or t == 1:
        tm = torch.ones(batch, t, t, dtype=torch.bool, device=dev)
    else:  # a DDTree of T nodes from drafter-like log-probs, built on the GPU (K2's L 16, k 8)
        lp = torch.log_softmax(torch.randn(batch, K2.draft_len, 64, device=dev) * 2, -1).topk(K2.draft_topk, -1).values
        tok = torch.randint(0, 1000, (batch, K2.draft_len, K2.draft_topk), device=dev)
        tm = build_tree.build_tree(lp, tok, torch.zeros(batch, dtype=torch.int64, device=dev), t - 1).mask
    return qn, qr, ckv, kpe, lens, tm


def check(out: Out, configs: list[mla_tree_attention.Config | None]) -> None:
    """Each CHECKS case with each config (None: the table's pick), every buffer the kernel allocates NaN.

    Inputs are seeded by the case's index (two runs check the same inputs); the error is against the
    float32 reference (the bound, 1e-2) and, to tell a kernel's error from the reference's, against
    float64; `worst_seq` is the sequence with the largest float32 error."""
    for i, (heads, batch, t, ctx, mask, kw) in enumerate(CHECKS):
        torch.manual_seed(1000 + i)
        args = inputs(heads, batch, t, ctx, mask)
        causal = mask == "causal"
        want = reference.mla_tree_attention(*args, SCALE, causal=causal)
        exact = reference.mla_tree_attention(*args, SCALE, causal=causal, compute_dtype=torch.float64)
        for cfg in configs:
            poisoned(mla_tree_attention)
            error, seqs, err64 = "", [float("inf")], float("inf")
            try:
                got = mla_tree_attention.mla_tree_attention(*args, SCALE, causal=causal, config=cfg, **kw)
                seqs = [rel_err(got[b], want[b]) for b in range(batch)]
                err, err64 = rel_err(got, want), rel_err(got, exact)
            except Exception as e:  # recorded; the other cases still run
                err, error = float("inf"), f"{type(e).__name__}: {e}"[:200]
            finally:
                unpoisoned(mla_tree_attention)
            out("mla_check", config=" ".join(map(str, cfg)) if cfg else "auto", heads=heads, batch=batch, T=t,
                ctx=" ".join(map(str, ctx)), mask=mask, splits=kw.get("splits", "plan"), rel_err=err, ok=err < 1e-2,
                rel_err_f64=err64, ref_f32_vs_f64=rel_err(want, exact), worst_seq=max(range(len(seqs)), key=seqs.__getitem__),
                worst_seq_err=max(seqs), error=error)
        del args, want, exact
    torch.cuda.empty_cache()


def timed(out: Out, name: str, kernel: str, fn: Callable[[], Any], shape: tuple[int, int, int, int],
          reps: int = 50, **extra: Any) -> float | None:
    """Time fn at one grid shape; one row with the shape's flops, TFLOP/s and FlashMLA's figures."""
    heads, batch, budget, context = shape
    base = dict(kernel=kernel, heads=heads, batch=batch, budget=budget, context=context, **extra)
    if out.left() < 5:
        out(name, **base, status="skipped: deadline")
        return None
    t = time_op(fn, DEVICE, budgeted_repeats(fn, DEVICE, reps))
    _, flops = mla_cost(K2, batch, budget, context, tp=K2.heads // heads)
    row = dict(base, us_p50=t.p50_us, us_p10=t.p10_us, us_p90=t.p90_us, repeats=t.repeats, graph=t.graph,
               flops=flops, tflops=flops / t.p50_us / 1e6, status="ok")
    fm = out.flashmla.get(shape)
    if fm is not None:
        row.update(flashmla_us=fm, vs_flashmla=t.p50_us / fm)
    out(name, **row)
    return t.p50_us


def time_grid(out: Out, names: list[str], baseline: ModuleType | None, grid: list[tuple[int, int, int, int]]) -> None:
    """Every `grid` shape, each named kernel ("auto": the table's pick) in turn on the same inputs."""
    kernels: list[tuple[str, Callable[..., Any]]] = []
    for name in names:
        if name == "baseline":
            if baseline is None:
                raise SystemExit("--kernels baseline needs --baseline FILE")
            kernels.append((name, baseline.mla_tree_attention))
        else:
            cfg = NAMED.get(name)
            kernels.append((name, lambda *a, cfg=cfg: mla_tree_attention.mla_tree_attention(*a, config=cfg)))
    for heads, batch, budget, context in grid:
        args = inputs(heads, batch, budget + 1, [context] * batch, "all")
        for name, fn in kernels:
            try:
                timed(out, "mla_time", name, lambda fn=fn: fn(*args, SCALE), (heads, batch, budget, context))
            except Exception as e:  # one kernel failing leaves the others' rows
                out("mla_time", kernel=name, heads=heads, batch=batch, budget=budget, context=context,
                    status=f"error: {type(e).__name__}: {e}"[:200])
        del args
    torch.cuda.empty_cache()


def sweep(out: Out) -> None:
    """Configs at the sweep shapes (T = budget + 1) and the decode shapes (T = 1), then split counts."""
    for shapes, configs in ((SWEEP_SHAPES, CONFIG_SWEEP), (DECODE_SHAPES, SMALL_SWEEP)):
        for shape in shapes:
            heads, batch, budget, context = shape
            args = inputs(heads, batch, budget + 1, [context] * batch, "all")
            for cfg in configs:
                name = " ".join(map(str, cfg))
                try:
                    timed(out, "mla_sweep", cfg.kernel,
                          lambda cfg=cfg: mla_tree_attention.mla_tree_attention(*args, SCALE, config=cfg), shape, reps=20, config=name)
                except Exception as e:  # a config that does not fit (shared memory) is recorded, not fatal
                    out("mla_sweep", kernel=cfg.kernel, heads=heads, batch=batch, budget=budget, context=context,
                        config=name, status=f"error: {type(e).__name__}: {e}"[:200])
            del args
    for shape in SPLIT_SHAPES:  # the table's pick at each split count
        heads, batch, budget, context = shape
        args = inputs(heads, batch, budget + 1, [context] * batch, "all")
        cfg = mla_tree_attention.pick_config(mla_tree_attention.capability(DEVICE), DTYPE, batch, (budget + 1) * heads,
                                             context + budget + 1)
        tiles = batch * -(-(budget + 1) * heads // cfg.bm)
        planned, _ = mla_tree_attention.plan_splits(tiles, context + budget + 1, cfg.bn, mla_tree_attention.sm_count(DEVICE),
                                                     mla_tree_attention.PLAN_COSTS[cfg.kernel])
        for n in sorted({1, 4, 16, 64, planned // 2 or 1, planned, 2 * planned}):
            timed(out, "mla_splits", cfg.kernel, lambda n=n: mla_tree_attention.mla_tree_attention(*args, SCALE, splits=n),
                  shape, reps=20, splits=n, planned=planned, tiles=tiles)
        del args
    torch.cuda.empty_cache()


def plan_points(cap: tuple[int, int] | None, sms: int) -> list[PlanPoint]:
    """(shape, row tiles, plans, the shipped pick) per --plans shape: plans are (splits, key blocks a
    split), the planner's candidate at each PLAN_COUNTS count and its own pick, each once."""
    points = []
    for heads, batch, budget, context in PLAN_SHAPES + [g for g in GRID if g not in PLAN_SHAPES]:
        t, s = budget + 1, context + budget + 1
        cfg = mla_tree_attention.pick_config(cap, DTYPE, batch, t * heads, s)
        tiles, costs = batch * -(-t * heads // cfg.bm), mla_tree_attention.PLAN_COSTS[cfg.kernel]
        if tiles >= PLAN_WAVES * sms:
            continue
        n, chunk = mla_tree_attention.plan_splits(tiles, s, cfg.bn, sms, costs)
        pick = (n, chunk // cfg.bn)
        plans = {mla_tree_attention.split_plan(-(-s // cfg.bn), c, costs.unit) for c in PLAN_COUNTS} | {pick}
        points.append(((heads, batch, budget, context), tiles, sorted(plans), pick))
    return points


def time_plans(out: Out) -> None:
    """Each plan_points plan, forced by its split count, on the same inputs per shape (the all-True mask)."""
    cap = mla_tree_attention.capability(DEVICE)
    for shape, tiles, plans, pick in plan_points(cap, mla_tree_attention.sm_count(DEVICE)):
        heads, batch, budget, context = shape
        kernel = mla_tree_attention.pick_config(cap, DTYPE, batch, (budget + 1) * heads, context + budget + 1).kernel
        args = inputs(heads, batch, budget + 1, [context] * batch, "all")
        for n, per in plans:
            timed(out, "mla_plans", kernel, lambda n=n: mla_tree_attention.mla_tree_attention(*args, SCALE, splits=n),
                  shape, reps=20, splits=n, per_blocks=per, tiles=tiles, planned=(n, per) == pick)
        del args
    torch.cuda.empty_cache()


def plan_regret(out: Out) -> None:
    """Per --plans shape: the shipped pick's time over the best plan's; then the median and the worst."""
    shapes: dict[tuple[str, ...], list[Row]] = {}
    for r in out.rows.get("mla_plans", []):
        if r.get("status") == "ok":
            shapes.setdefault(tuple(str(r[k]) for k in ("heads", "batch", "budget", "context")), []).append(r)
    regrets = []
    for shape, rows in shapes.items():
        best = min(rows, key=lambda r: float(r["us_p50"]))
        pick = [r for r in rows if str(r["planned"]) == "True"]
        if pick:
            regrets.append(float(pick[0]["us_p50"]) / float(best["us_p50"]))
            print(f"plans {' '.join(shape):>18}: pick {pick[0]['splits']} x {pick[0]['per_blocks']} {float(pick[0]['us_p50']):9.1f} us, "
                  f"best {best['splits']} x {best['per_blocks']} {float(best['us_p50']):9.1f} us, regret {regrets[-1]:.3f}")
    if regrets:
        print(f"plans: regret median {statistics.median(regrets):.3f}, worst {max(regrets):.3f} over {len(regrets)} shapes")


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


def summary(out: Out, grid: list[tuple[int, int, int, int]]) -> None:
    """The time table: each kernel's time and its ratio to FlashMLA's (the goal: <= 1.25) per shape."""
    rows = [r for r in out.rows.get("mla_time", []) if r.get("status") == "ok"]
    names = list(dict.fromkeys(r["kernel"] for r in rows))
    by = {(r["kernel"], *(int(r[k]) for k in ("heads", "batch", "budget", "context"))): r for r in rows}
    print(f"{'shape (heads batch budget context)':>34} {'flashmla us':>11} " + " ".join(f"{n + ' us (x fm, TF/s)':>28}" for n in names))
    for h, b, n, c in grid:
        cells = []
        for name in names:
            r = by.get((name, h, b, n, c))
            cells.append(f"{float(r['us_p50']):>10.1f} ({float(r.get('vs_flashmla', 'nan')):5.2f}, {float(r['tflops']):5.0f})"
                         if r else f"{'-':>28}")
        print(f"{f'{h} {b} {n} {c}':>34} {out.flashmla.get((h, b, n, c), float('nan')):>11.1f} " + " ".join(f"{x:>28}" for x in cells))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="folder for mla_check.csv, mla_time.csv, ...")
    ap.add_argument("--flashmla", type=Path, help="FlashMLA's figures (shared/data/mla-flashmla-h200.csv)")
    ap.add_argument("--baseline", type=Path, help="an older kernels/mla_tree_attention.py to time beside this one")
    ap.add_argument("--kernels", default="auto", help="comma list for the grid: auto (the table's pick), "
                    "triton, gluon, gluon_ws (each at its main config), baseline (--baseline's kernel); none: no grid")
    ap.add_argument("--grid", choices=sorted(GRIDS), default="flashmla", help="the shapes --kernels times: "
                    "flashmla (FlashMLA's comparison grid, 4k-64k) or short (128-4096 context, where SHORT_WORK picks)")
    ap.add_argument("--check", default="auto", help="comma list of configs to check: auto, triton, gluon, gluon_ws; none")
    ap.add_argument("--sweep", action="store_true", help="also time tile configs and split counts")
    ap.add_argument("--plans", action="store_true", help="also time the split planner's pick beside a sweep of "
                    "split counts (mla_plans.csv) and print the pick's regret per shape")
    ap.add_argument("--deadline-s", type=float, default=480, help="stop timing when this runs out")
    ap.add_argument("--once", metavar="KERNEL:H,B,N,C", help="only run one named kernel twice at heads H, batch "
                    "B, budget N, context C (for a profiler: profile its second launch) and exit")
    return ap


def main() -> None:
    a = parser().parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("engine.bench_mla needs a CUDA GPU")
    if a.once:
        name, shape = a.once.split(":")
        h, b, n, c = (int(x) for x in shape.split(","))
        args = inputs(h, b, n + 1, [c] * b, "all")
        for _ in range(2):
            mla_tree_attention.mla_tree_attention(*args, SCALE, config=NAMED.get(name))
        torch.cuda.synchronize()
        return
    out = Out(a.out, time.time() + a.deadline_s, read_flashmla(a.flashmla) if a.flashmla else {})
    out("mla_ceilings", gpu=torch.cuda.get_device_name(), sms=mla_tree_attention.sm_count(DEVICE),
        copy_gbps=copy_gbps(DEVICE), bf16_tflops=matmul_tflops(DEVICE), torch=torch.__version__,
        triton=__import__("triton").__version__)
    if a.check != "none":
        check(out, [NAMED.get(n) for n in a.check.split(",")])
    if a.kernels != "none":
        time_grid(out, a.kernels.split(","), load_baseline(a.baseline) if a.baseline else None, GRIDS[a.grid])
    if a.sweep:
        sweep(out)
    if a.plans:
        time_plans(out)
    summary(out, GRIDS[a.grid])
    plan_regret(out)


if __name__ == "__main__":
    main()
