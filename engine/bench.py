"""`python -m engine.bench`: run one suite on this host and write Arrow results as points complete.

    python -m engine.bench --suite kernels|e2e|comm --profile smoke|full --host NAME --out DIR
                           [--run-id ID] [--payload-hash H] [--device auto|cuda|cpu]
                           [--layers N] [--vocab V] [--accept LEVEL] [--tp N]
                           [--comm-model JSON]                            (e2e only)

Writes DIR/<suite>.arrow and DIR/runs.arrow after every point (status "partial" until the suite
ends) plus DIR/manifest.json, and prints one `KDBENCH {json}` line per point and one at the end.
Exit 0 when done, 1 when a point failed (the others still run; status "partial", failures in
the runs note), 2 on bad usage or device, 143/130 when stopped by SIGTERM/SIGINT (files stay
readable, status "partial").
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import torch

from engine import bench_comm, bench_e2e, bench_kernels, comm_model
from engine import tp as tpar
from engine.config import CONFIGS, make_config
from engine.env import UsageError, facts, fail, now_iso, pick_device
from engine.results import SuiteWriter, Terminated, install_signal_handlers
from engine.rows import CommRow
from engine.schema import PointStatus, RunStatus
from engine.timing import METHOD as TIMING_METHOD, copy_gbps, matmul_tflops

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:+-]{0,127}\Z")


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m engine.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", required=True, choices=("kernels", "e2e", "comm"))
    ap.add_argument("--profile", required=True, choices=("smoke", "full"),
                    help="smoke: a few points (CPU: k2-mini, seconds); full: the whole sweep")
    ap.add_argument("--host", required=True, help="inventory name of this host (recorded, not contacted)")
    ap.add_argument("--out", required=True, type=Path, help="directory for the .arrow files and manifest.json")
    ap.add_argument("--run-id", help="defaults to <host>-<UTC timestamp>")
    ap.add_argument("--payload-hash", help="content hash of the deployed payload (recorded)")
    ap.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    ap.add_argument("--layers", type=int, help="e2e: target layers, at most the config's (default: the "
                                               "profile's; CUDA full runs all 61 of k2)")
    ap.add_argument("--vocab", type=int, help="e2e: smaller lm-head vocab if memory demands (recorded)")
    ap.add_argument("--accept", type=float, help="e2e: one synthetic acceptance level of the steered drafter, "
                                                 "0..1, instead of the profile's sweep and the context axis's level "
                                                 "(recorded as synthetic_accept)")
    ap.add_argument("--tp", type=int, help="e2e: one tensor-parallel degree instead of the profile's (the context "
                                           "axis's too): rank 0 of a TP-N deployment at one GPU's shapes; must "
                                           "divide heads, the expert and dense intermediates and the vocab "
                                           "(recorded as tp)")
    ap.add_argument("--comm-model", help='e2e: the modelled all-reduce for tp > 1, JSON {"alpha_us": .., '
                                         '"busbw_gbps": .., "source": ".."} (default: a fit of the h200 '
                                         'reference 2-GPU all-reduce)')
    a = ap.parse_args(argv)
    a.run_id = a.run_id or f"{a.host}-{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}"
    for flag, v in (("--host", a.host), ("--run-id", a.run_id), ("--payload-hash", a.payload_hash)):
        if v is not None and not _NAME.match(v):
            raise UsageError(f"{flag} {v!r}: use letters, digits and . _ : + - (at most 128, no leading symbol)")
    if a.layers is not None and a.layers < 1:
        raise UsageError(f"--layers must be >= 1, got {a.layers}")
    if a.vocab is not None and a.vocab < 2:
        raise UsageError(f"--vocab must be >= 2, got {a.vocab}")
    if a.accept is not None and not 0.0 <= a.accept <= 1.0:
        raise UsageError(f"--accept must be within 0..1, got {a.accept}")
    try:
        a.comm_model = comm_model.DEFAULT if a.comm_model is None else comm_model.parse(a.comm_model)
    except ValueError as e:
        raise UsageError(f"--comm-model: {e}") from None
    return a


def e2e_profile(a: argparse.Namespace, device: torch.device) -> bench_e2e.E2EProfile:
    """The e2e profile with the flags applied, checked against its config (UsageError names the flag)."""
    prof = bench_e2e.PROFILES[(device.type, a.profile)]

    def axis(**change: object) -> bench_e2e.ContextAxis | None:
        return None if prof.context is None else dataclasses.replace(prof.context, **change)

    if a.accept is not None:
        prof = dataclasses.replace(prof, levels=(a.accept,), context=axis(level=a.accept))
    if a.tp is not None:
        prof = dataclasses.replace(prof, tps=(a.tp,), context=axis(tp=a.tp))
    cfg = CONFIGS[prof.config]
    if a.layers is not None and a.layers > cfg.layers:
        raise UsageError(f"--layers {a.layers}: {cfg.name} has {cfg.layers} layers")
    cfg = make_config(prof.config, vocab=a.vocab)
    for tp in prof.tps:
        try:
            tpar.check(cfg, tp)
        except ValueError as e:
            flag = "--vocab" if a.vocab is not None and "vocab" in str(e) and a.tp is None else "--tp"
            raise UsageError(f"{flag}: {e}") from None
    return prof


def provenance(a: argparse.Namespace, f: dict, device: torch.device) -> dict:
    return {"run_id": a.run_id, "host": a.host, "gpu_name": f["gpu_name"],
            "gpu_count": f["gpu_count"], "driver": f["driver"], "cuda": f["cuda"], "torch": f["torch"],
            "triton": f["triton"], "python": f["python"], "payload_hash": a.payload_hash,
            "arch": f["arch_found"], "device": device.type, "started_at": now_iso(), "ended_at": None}


def run_suite(a: argparse.Namespace, device: torch.device, prov: dict) -> int:
    key = (device.type, a.profile)
    if a.suite == "comm":
        reason = bench_comm.skip_reason(device)
        n = 0 if reason else len(bench_comm.OPS) * len(bench_comm.SIZES[a.profile])
        w = SuiteWriter(a.out, "comm", a.profile, prov, max(n, 1))
        w.start(copy_gbps=copy_gbps(device), matmul_tflops=matmul_tflops(device))
        if reason:
            w.add(CommRow(op="all_reduce", world_size=torch.cuda.device_count() if device.type == "cuda" else 0,
                          bytes=0, status=PointStatus.SKIPPED, skip_reason=reason))
            w.finish(RunStatus.SKIPPED, reason)
            return 0
        return _loop(w, [], lambda on: bench_comm.run(a.profile, on))
    if a.suite == "kernels":
        kb = bench_kernels.KernelBench(bench_kernels.PROFILES[key], device)
        points, note = kb.points(), f"kernels at {kb.p.cfg.name} shapes, {str(kb.dtype).removeprefix('torch.')}"
        if device.type == "cuda":
            note += f"; {TIMING_METHOD}"
    else:
        eb = bench_e2e.E2EBench(e2e_profile(a, device), device, layers=a.layers, vocab=a.vocab, comm=a.comm_model)
        points, note = eb.points(), eb.note()
    if device.type == "cpu":
        note += "; CPU timings (perf_counter), matmul_tflops is float32"
    w = SuiteWriter(a.out, a.suite, a.profile, prov, len(points))
    w.start(copy_gbps=copy_gbps(device), matmul_tflops=matmul_tflops(device), note=note)
    return _loop(w, points, None)


def _loop(w: SuiteWriter, points: list[tuple[str, Callable[[], Any]]],
          driver: Callable[[Callable[[Any], None]], None] | None) -> int:
    """Run the points (or let `driver` push rows), writing each as it completes.

    A failing point is reported and skipped (the suite ends "partial" with the failures in its
    note), so one bad shape does not cost the rest of a GPU session; SIGTERM stops at once.
    """
    failed: list[str] = []
    try:
        if driver is not None:
            driver(w.add)
        else:
            for label, fn in points:
                try:
                    w.add(fn())
                except Terminated:
                    raise
                except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
                    traceback.print_exc()
                    failed.append(f"{label}: {type(e).__name__}: {e}"[:200])
    except Terminated as t:
        w.finish(RunStatus.PARTIAL, f"stopped by signal {t.args[0]} after {len(w.rows)} of {w.n} points")
        return 128 + int(t.args[0])
    except Exception as e:  # the comm driver failed: keep what was measured
        traceback.print_exc()
        w.finish(RunStatus.PARTIAL, f"failed after {len(w.rows)} of {w.n} points: {type(e).__name__}: {e}"[:500])
        return 1
    if failed:
        w.finish(RunStatus.PARTIAL, f"{len(failed)} of {w.n} points failed: " + " | ".join(failed))
        return 1
    w.finish(RunStatus.COMPLETE)
    return 0


def main(argv: list[str] | None = None) -> int:
    install_signal_handlers()
    try:
        a = parse(argv)
        f = facts()
        device = pick_device(a.device, f)
        if a.suite == "e2e":
            e2e_profile(a, device)
    except UsageError as e:
        fail(str(e))
    prov = provenance(a, f, device)
    try:
        return run_suite(a, device, prov)
    except Terminated as t:
        return 128 + int(t.args[0])


if __name__ == "__main__":
    sys.exit(main())
