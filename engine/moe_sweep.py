"""`python -m engine.moe_sweep --out DIR`: time candidate CUDA MoE configs on this GPU, print what they pick.

Per shape class (the full K2 experts; one TP-8 rank's shard) and M, the table's pick for M's bucket
on this device (kernels/moe_configs.py, after the limit check) is the baseline. The candidates of
each pass are every bucket's pick of that pass and the sweep-only kernels (SWEEP_KERNELS, built from
moe_w4a16.cu with MOE_SWEEP defined) at a few spans, each only where it tiles the shape, holds M's
tokens and fits this device. The gate_up candidates run with the baseline's down pass, then the down
candidates with the fastest gate_up. Each is first checked against the float32 reference (norm
relative error under 1e-2; a wrong one is recorded and never timed), then timed whole with
engine.timing.time_op (CUDA-graph replays, L2 evicted by a read before each, median).

Writes DIR/moe_sweep.csv (every candidate) as it goes and prints, per (shape, M), the fastest
against the baseline. Re-run on a new arch to make its table (CUDA_CONFIGS keyed by that arch).
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import torch

from engine.bench_kernels import PROFILES, KernelBench
from engine.build import rel_err
from engine.timing import METHOD, time_op
from kernels import moe_cuda, reference
from kernels.moe_configs import SWEEP_KERNELS, Bucket, PassConfig, table_for
from kernels.moe_gemm import shape_class

TP = {"full": 1, "shard": 8}
SPANS = {("full", "gate_up"): (1, 2), ("full", "down"): (1, 2), ("shard", "gate_up"): (1, 2),
         ("shard", "down"): (4, 8)}
FIELDS = ("shape", "M", "pass", "gate_up", "down", "us", "rel_err", "error")


def pass_candidates(shape: str, name: str, base: PassConfig, table: dict[int, Bucket]) -> list[PassConfig]:
    """The baseline pass first, then every bucket's pick of this pass and the sweep kernels (at the
    baseline's K chunk and the class's spans), each once."""
    out = [base, *(getattr(b, name) for _, b in sorted(table.items()))]
    out += [PassConfig.of(k, span, base.k_chunk) for k in SWEEP_KERNELS for span in SPANS[shape, name]]
    return list(dict.fromkeys(out))


def _label(p: PassConfig) -> str:
    return f"{p.kernel.removeprefix('moe_w4a16_')} span {p.span} k {p.k_chunk}"


def sweep(kb: KernelBench, shape: str, m: int, writer: csv.DictWriter, repeats: int) -> tuple[Bucket, float, float]:
    """(fastest configs, its us, the baseline's us) at one (shape, M)."""
    tp = TP[shape]
    w = kb.moe_weights(tp)
    kb.reseed()
    x, ids, tw = kb.moe_inputs(m)
    want = reference.moe_w4a16(x, *w, ids, tw)
    inter, hidden = kb.p.cfg.moe_inter // tp, kb.p.cfg.hidden
    index = kb.dev.index or 0
    _, table = table_for(moe_cuda.device_limits(index).arch)
    base = moe_cuda.choice(m, inter, hidden, index).configs
    timed: dict[Bucket, float] = {}

    def run(which: str, cfg: Bucket) -> None:
        row = {"shape": shape, "M": m, "pass": which, "gate_up": _label(cfg.gate_up), "down": _label(cfg.down)}
        if cfg in timed or not moe_cuda.supports(x, w[0], w[2], cfg):
            return
        try:
            err = rel_err(moe_cuda.moe_w4a16(x, *w, ids, tw, configs=cfg), want)
            row["rel_err"] = err
            if err < 1e-2:
                timed[cfg] = row["us"] = time_op(lambda: moe_cuda.moe_w4a16(x, *w, ids, tw, configs=cfg), kb.dev,
                                                 repeats).p50_us
            else:
                row["error"] = "wrong result"
        except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        writer.writerow(row)

    run("baseline", base)
    if base not in timed:
        raise RuntimeError(f"{shape} M = {m}: the table's own pick failed its check (see the csv)")
    for gu in pass_candidates(shape, "gate_up", base.gate_up, table[shape_class(inter)]):
        run("gate_up", Bucket(gu, base.down))
    best_gu = min((c for c in timed if c.down == base.down), key=timed.__getitem__).gate_up
    for dn in pass_candidates(shape, "down", base.down, table[shape_class(inter)]):
        run("down", Bucket(best_gu, dn))
    best = min(timed, key=timed.__getitem__)
    return best, timed[best], timed[base]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.moe_sweep", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path, help="directory for moe_sweep.csv")
    ap.add_argument("--m", default="1024,2048,4096", help="comma list of M (default: %(default)s)")
    ap.add_argument("--shapes", default="full,shard", help="comma list of full, shard (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=10, help="timed replays a candidate (default: %(default)s)")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: the sweep needs a CUDA GPU", file=sys.stderr)
        return 2
    ms = [int(v) for v in a.m.split(",")]
    shapes = a.shapes.split(",")
    if bad := [s for s in shapes if s not in TP]:
        print(f"error: --shapes: unknown {bad} (full, shard)", file=sys.stderr)
        return 2
    kb = KernelBench(PROFILES[("cuda", "full")], torch.device("cuda", 0))
    a.out.mkdir(parents=True, exist_ok=True)
    print(f"timing: {METHOD}; {a.repeats} replays a candidate")
    with open(a.out / "moe_sweep.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, FIELDS)
        writer.writeheader()
        for shape in shapes:
            for m in ms:
                best, us, base_us = sweep(kb, shape, m, writer, a.repeats)
                f.flush()
                print(f"{shape} M = {m}: {base_us:,.1f} us as the table picks, {us:,.1f} us with "
                      f"gate_up {best.gate_up.kernel} span {best.gate_up.span}, down {best.down.kernel} "
                      f"span {best.down.span} ({100 * (us / base_us - 1):+.1f} %)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
