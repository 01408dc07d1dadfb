"""`python -m engine.moe_sweep --out DIR`: time candidate CUDA MoE configs on this GPU and write the
config table they pick, as kernels/moe_configs.py reads it.

Per shape class (the full K2 experts; one rank's shard at TP-SHARD_TP, engine.config) and M, the
table's pick for M's bucket on this device (kernels/moe_configs.py, after the limit check) is the
baseline. The candidates of each pass are every bucket's pick of that pass and the sweep-only
kernels (SWEEP_KERNELS, which only the sweep's build of moe_w4a16.cu has) at a few spans, each only
where it tiles the shape, holds M's tokens and fits this device. The gate_up candidates run with the
baseline's down pass, then the down candidates with the fastest gate_up (`pick`). Each is first
checked against the float32 reference (norm relative error under 1e-2; a wrong one is recorded and
never timed), then timed whole with engine.timing.time_op (CUDA-graph replays, L2 evicted by a read
before each, median).

Writes DIR/moe_sweep.csv (every candidate) as it goes, prints per (shape, M) the fastest against the
baseline, and at the end writes DIR/moe_configs_<arch>.py: the picks as a table of
kernels/moe_configs.py (each swept M the largest M of a bucket), ready to paste there and key in
CUDA_CONFIGS by the arch. On a new arch: `python -m engine.moe_sweep --out DIR` (the default --m is
every bucket of the current table), paste the block, and drop from SWEEP_KERNELS any sweep-only
kernel it picks (the block's comment names them): the shipped build instantiates what the tables pick.
"""

from __future__ import annotations

import argparse
import csv
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import torch

from engine.bench_kernels import PROFILES, KernelBench
from engine.build import rel_err
from engine.config import SHARD_TP
from engine.timing import METHOD, time_op
from kernels import moe_cuda, reference
from kernels.moe_configs import KERNELS, SWEEP_KERNELS, Bucket, PassConfig, table_for
from kernels.moe_gemm_configs import shape_class

TP = {"full": 1, "shard": SHARD_TP}
SPANS = {("full", "gate_up"): (1, 2), ("full", "down"): (1, 2), ("shard", "gate_up"): (1, 2),
         ("shard", "down"): (4, 8)}
FIELDS = ("shape", "M", "pass", "gate_up", "down", "us", "rel_err", "error")
MAX_REL_ERR = 1e-2  # a candidate further from the reference is recorded, never timed


@dataclass(frozen=True)
class Trial:
    """One candidate's outcome at one (shape, M): its error against the reference and its time
    (None where it was not timed: a wrong result, or an error, which `error` says)."""

    rel_err: float | None = None
    us: float | None = None
    error: str | None = None


# A candidate's trial, or None where it does not run here (does not tile, hold M's tokens or fit)
Measure = Callable[[Bucket], "Trial | None"]


def pass_candidates(shape: str, name: str, base: PassConfig, table: Mapping[int, Bucket]) -> list[PassConfig]:
    """The baseline pass first, then every bucket's pick of this pass and the sweep kernels (at the
    baseline's K chunk and the class's spans), each once."""
    out = [base, *(getattr(b, name) for _, b in sorted(table.items()))]
    out += [PassConfig.of(k, span, base.k_chunk) for k in SWEEP_KERNELS for span in SPANS[shape, name]]
    return list(dict.fromkeys(out))


def pick(shape: str, m: int, base: Bucket, table: Mapping[int, Bucket], measure: Measure,
         record: Callable[[str, Bucket, Trial], None]) -> tuple[Bucket, float, float]:
    """(the fastest configs, its us, the baseline's us) at (shape, M = m): the baseline, then each
    gate_up candidate with the baseline's down pass, then each down candidate with the fastest
    gate_up among those; every trial goes to `record` (the pass it tried, its configs)."""
    timed: dict[Bucket, float] = {}

    def run(which: str, cfg: Bucket) -> None:
        if cfg in timed:
            return
        trial = measure(cfg)
        if trial is None:
            return
        record(which, cfg, trial)
        if trial.us is not None:
            timed[cfg] = trial.us

    run("baseline", base)
    if base not in timed:
        raise RuntimeError(f"{shape} M = {m}: the table's own pick failed its check (see the csv)")
    for gu in pass_candidates(shape, "gate_up", base.gate_up, table):
        run("gate_up", Bucket(gu, base.down))
    best_gu = min((c for c in timed if c.down == base.down), key=timed.__getitem__).gate_up
    for dn in pass_candidates(shape, "down", base.down, table):
        run("down", Bucket(best_gu, dn))
    best = min(timed, key=timed.__getitem__)
    return best, timed[best], timed[base]


def _label(p: PassConfig) -> str:
    return f"{p.kernel.removeprefix('moe_w4a16_')} span {p.span} k {p.k_chunk}"


def _spec(p: PassConfig) -> str:
    return f'("{p.kernel.removeprefix("moe_w4a16_")}", {p.span}, {p.k_chunk})'


def table_block(arch: str, picks: Mapping[str, Mapping[int, Bucket]], origin: str) -> str:
    """The picks as a kernels/moe_configs.py table (`_b` lines, one a bucket), with comments saying
    where they come from, how to key them and which sweep-only kernels they need instantiated."""
    name = arch.upper().replace("_", "")
    lines = [f"# {origin}", f"# Paste into kernels/moe_configs.py and key it there: CUDA_CONFIGS[{arch!r}] = {name}."]
    sweep_only = sorted({p.kernel for b in (b for c in picks.values() for b in c.values())
                         for p in (b.gate_up, b.down)} - KERNELS)
    if sweep_only:
        lines.append("# Sweep-only kernels it picks (drop them from SWEEP_KERNELS: the shipped build then has "
                     "them): " + ", ".join(sweep_only))
    lines.append(f"{name}: Table = {{")
    for shape, buckets in picks.items():
        lines.append(f'    "{shape}": {{')
        lines += [f"        {m}: _b({_spec(b.gate_up)}, {_spec(b.down)})," for m, b in sorted(buckets.items())]
        lines.append("    },")
    return "\n".join(lines + ["}"]) + "\n"


def sweep(kb: KernelBench, shape: str, m: int, writer: csv.DictWriter, repeats: int) -> tuple[Bucket, float, float]:
    """`pick` at one (shape, M) on this GPU: every candidate checked, then timed (see the module doc)."""
    tp = TP[shape]
    w = kb.moe_weights(tp)
    kb.reseed()
    x, ids, tw = kb.moe_inputs(m)
    want = reference.moe_w4a16(x, *w, ids, tw)
    inter, hidden = kb.p.cfg.moe_inter // tp, kb.p.cfg.hidden
    index = kb.dev.index or 0
    _, table = table_for(moe_cuda.device_limits(index).arch)

    def measure(cfg: Bucket) -> Trial | None:
        if not moe_cuda.supports(x, w[0], w[2], cfg):
            return None
        err = None
        try:
            err = rel_err(moe_cuda.moe_w4a16(x, *w, ids, tw, configs=cfg), want)
            if not err < MAX_REL_ERR:
                return Trial(err, error="wrong result")
            return Trial(err, time_op(lambda: moe_cuda.moe_w4a16(x, *w, ids, tw, configs=cfg), kb.dev, repeats).p50_us)
        except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
            return Trial(err, error=f"{type(e).__name__}: {e}"[:300])

    def record(which: str, cfg: Bucket, t: Trial) -> None:
        writer.writerow({"shape": shape, "M": m, "pass": which, "gate_up": _label(cfg.gate_up),
                         "down": _label(cfg.down), "us": t.us, "rel_err": t.rel_err, "error": t.error})

    base = moe_cuda.choice(m, inter, hidden, index).configs
    return pick(shape, m, base, table[shape_class(inter)], measure, record)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.moe_sweep", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path, help="directory for moe_sweep.csv and moe_configs_<arch>.py")
    ap.add_argument("--m", help="comma list of M, each the largest M of a bucket of the table written "
                                "(default: every bucket of this arch's current table, per shape)")
    ap.add_argument("--shapes", default="full,shard", help="comma list of full, shard (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=10, help="timed replays a candidate (default: %(default)s)")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: the sweep needs a CUDA GPU", file=sys.stderr)
        return 2
    shapes = a.shapes.split(",")
    if bad := [s for s in shapes if s not in TP]:
        print(f"error: --shapes: unknown {bad} (full, shard)", file=sys.stderr)
        return 2
    kb = KernelBench(PROFILES[("cuda", "full")], torch.device("cuda", 0))
    arch = moe_cuda.device_limits(0).arch
    _, table = table_for(arch)
    a.out.mkdir(parents=True, exist_ok=True)
    print(f"timing: {METHOD}; {a.repeats} replays a candidate")
    picks: dict[str, dict[int, Bucket]] = {}
    with open(a.out / "moe_sweep.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, FIELDS)
        writer.writeheader()
        for shape in shapes:
            ms = [int(v) for v in a.m.split(",")] if a.m else \
                sorted(table[shape_class(kb.p.cfg.moe_inter // TP[shape])])
            for m in ms:
                best, us, base_us = sweep(kb, shape, m, writer, a.repeats)
                picks.setdefault(shape_class(kb.p.cfg.moe_inter // TP[shape]), {})[m] = best
                f.flush()
                print(f"{shape} M = {m}: {base_us:,.1f} us as the table picks, {us:,.1f} us with "
                      f"gate_up {best.gate_up.kernel} span {best.gate_up.span}, down {best.down.kernel} "
                      f"span {best.down.span} ({100 * (us / base_us - 1):+.1f} %)", flush=True)
    origin = f"python -m engine.moe_sweep on {torch.cuda.get_device_name(0)} ({arch}); {METHOD}"
    path = a.out / f"moe_configs_{arch}.py"
    path.write_text(table_block(arch, picks, origin))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
