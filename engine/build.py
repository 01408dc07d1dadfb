"""`python -m engine.build --arch ARCH --out DIR`: warm and check every kernel the benches use.

On a GPU: each kernel runs as the benches run it (impl "auto": the CUDA MoE where it built, the
MLA's Gluon kernel where it is picked, else Triton) at every shape the kernels and e2e suites will ask
for (so the caches are warm before anything is timed) and is compared with its PyTorch reference at
a few of them: status "ok" or "mismatch" (with the largest error over those shapes: the norm
relative error ||got - want|| / ||want|| for the tensor kernels, 0 or 1 for the bit-exact tree
kernels), "reference" where no
Triton kernel exists (the engine then runs the reference), "error" when it raised. The CUDA MoE
also runs, here, what each other arch would run under its own shared-memory limit where that
differs (`arch_checks`; build.json's `moe_w4a16.arches`), which never fails this host's build. On the CPU
(`--arch cpu`): the references run at the CPU bench shapes, status "reference".
Writes DIR/build.json; exit 0 when nothing mismatched or failed, 1 otherwise, 2 on a wrong arch.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from engine import bench_e2e, bench_kernels
from engine.bench_kernels import KernelBench, KernelProfile
from engine.config import SHARD_TP
from engine.env import UsageError, check_arch, facts, fail, now_iso
from kernels import ops
from kernels.moe_configs import ARCH_SMEM_OPTIN

ARCHES = ("sm_90", "sm_100", "sm_103", "sm_120", "cpu")
MODULES = {"moe_w4a16": "moe_gemm", "mla_tree_attention": "mla_tree_attention",
           "build_tree": "build_tree", "tree_accept": "tree_accept"}
TOL = {"moe_w4a16": 1e-2, "mla_tree_attention": 1e-2}  # bf16 kernels vs float32 references


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want||: the measure the kernels issue sets its 1e-2 bound in; NaN fails."""
    g, w = got.double(), want.double()
    err = float((g - w).norm() / w.norm().clamp(min=1e-12))
    return err if err == err else float("inf")


def tree_err(a: ops.Tree | tuple, b: ops.Tree | tuple) -> float:
    """0.0 when the integer outputs agree exactly (the tree ops must be bit-identical), else 1.0."""
    fa = [a.tokens, a.parents, a.depths, a.mask] if isinstance(a, ops.Tree) else list(a)
    fb = [b.tokens, b.parents, b.depths, b.mask] if isinstance(b, ops.Tree) else list(b)
    return 0.0 if all(torch.equal(x.cpu(), y.cpu()) for x, y in zip(fa, fb)) else 1.0


# M compared against the reference besides each sweep's smallest and largest: one in each range of
# the CUDA MoE's configs of another kind (one-token stages, 8- and 16-slot blocks; 32 at the largest)
COMPARE_M = (1, 16, 128, 512)
MOE_TP = (1, SHARD_TP)  # the MoE's shapes: the full experts and one rank's shard


# Chunked-prefill shapes of MLA's causal mode at one rank of TP-SHARD_TP: (batch, chunk tokens, prefix)
MLA_CAUSAL = ((1, 1024, 3000), (2, 300, 5001))


def moe_shapes(p: KernelProfile, e2e_m: set[int]) -> list[tuple[int, int, bool]]:
    """(tp, M, compare?) of the MoE check: the full shapes at the kernel suite's and the e2e suite's M,
    then one rank's shard (TP-SHARD_TP) at the shard sweep's M (its own configs)."""
    out = []
    for tp, ms in ((1, sorted(set(p.moe_m) | e2e_m)), (SHARD_TP, sorted(p.moe_tp_m))):
        out += [(tp, m, m in COMPARE_M or m in (ms[0], ms[-1])) for m in ms]
    return out


def cases(kb: KernelBench, device: torch.device) -> dict[str, list[tuple[Callable[[str], Any], bool]]]:
    """Per kernel: (run(impl), compare-with-reference?) at every bench shape."""
    p = kb.p
    out: dict[str, list] = {k: [] for k in MODULES}
    for tp, m, compare in moe_shapes(p, _e2e_moe_m(device)):
        def moe(impl: str, m: int = m, tp: int = tp) -> Any:
            x, ids, tw = kb.moe_inputs(m)
            return ops.moe_w4a16(x, *kb.moe_weights(tp), ids, tw, impl=impl)
        out["moe_w4a16"].append((moe, compare))
    for tp, shapes in ((1, p.attn), (SHARD_TP, p.attn_tp)):
        for b, n, c in shapes:
            def att(impl: str, b: int = b, n: int = n, c: int = c, tp: int = tp) -> Any:
                return ops.mla_tree_attention(*kb.attention_inputs(b, n, c, tp), impl=impl)
            out["mla_tree_attention"].append((att, c <= 4096 and n <= 256 and b * n <= 1024))
    for b, n, c in MLA_CAUSAL if device.type == "cuda" else ():
        def chunk(impl: str, b: int = b, n: int = n, c: int = c) -> Any:
            *args, _, scale = kb.attention_inputs(b, n - 1, c, SHARD_TP)
            return ops.mla_tree_attention(*args, None, scale, impl=impl, causal=True)
        out["mla_tree_attention"].append((chunk, True))
    for b, n in p.tree:
        out["build_tree"].append((lambda impl, b=b, n=n: ops.build_tree(*kb.draft(b), n, impl=impl), True))
        out["tree_accept"].append((lambda impl, b=b, n=n: ops.tree_accept(*kb.accept_inputs(b, n), impl=impl), True))
    return out


def _e2e_moe_m(device: torch.device) -> set[int]:
    """Token counts the e2e suite sends through the MoE: C*(B+1) per verify, C per plain decode step."""
    ms: set[int] = set()
    for prof in (bench_e2e.PROFILES[(device.type, "smoke")], bench_e2e.PROFILES[(device.type, "full")]):
        for c in prof.concurrency:
            ms.add(c)
            ms.update(c * (b + 1) for b in prof.budgets)
    return ms if device.type == "cuda" else set()


def check(name: str, runs: list[tuple[Callable[[str], Any], bool]], kb: KernelBench) -> dict[str, Any]:
    """Run one kernel at all its shapes; compare against the reference where asked."""
    device = kb.dev
    if device.type == "cpu" or ops.kernel_module(MODULES[name]) is None:
        try:
            for run, _ in runs[:2] if device.type == "cuda" else runs:
                run("torch")
        except Exception as e:  # report, keep checking the others
            return {"status": "error", "rel_err": None, "detail": f"{type(e).__name__}: {e}"[:300]}
        return {"status": "reference", "rel_err": None, "shapes": len(runs)}
    worst, worst_at = 0.0, None
    try:
        for i, (run, compare) in enumerate(runs):
            kb.reseed()
            got = run("auto")  # what the benches will run: the CUDA MoE where it built, else Triton
            if compare:
                kb.reseed()
                want = run("torch")
                err = tree_err(got, want) if name in ("build_tree", "tree_accept") else rel_err(got, want)
                if err > worst or worst_at is None:
                    worst, worst_at = max(worst, err), i
        torch.cuda.synchronize()
    except Exception as e:
        traceback.print_exc()
        return {"status": "error", "rel_err": None, "detail": f"{type(e).__name__}: {e}"[:300]}
    ok = worst <= TOL.get(name, 0.0)
    return {"status": "ok" if ok else "mismatch", "rel_err": worst, "worst_shape": worst_at,
            "shapes": len(runs)}


def moe_cuda_build(device: torch.device, kb: KernelBench) -> dict[str, Any]:
    """Which MoE kernel this host runs, and why: the CUDA C++ one needs the host's nvcc, and each M
    bucket's configs must fit this device (per bucket and shape: the full experts and one rank's shard);
    how its launches are made: "c" through the host launcher (kernels/launch_chain.c, built by the
    same nvcc), "ctypes" from Python where that did not build (with the reason); and what each other
    arch would run, checked here (`arch_checks`)."""
    cfg = kb.p.cfg
    cuda = ops.kernel_module("moe_cuda")
    reason = "kernels.moe_cuda does not import" if cuda is None else cuda.unavailable_reason(device)
    if reason is not None:
        print(f"moe_w4a16: CUDA kernel unavailable ({reason}); the Triton kernel runs")
        return {"impl": "triton", "cuda_unavailable": reason[:300]}
    from kernels import cuda_build
    nvcc, arch = cuda_build.nvcc_version(cuda_build.nvcc_path()), cuda_build.arch_of(device)
    limits = cuda.device_limits(device.index)
    launcher, launcher_why = cuda_build.host_launcher()
    buckets = [r for tp in MOE_TP for r in cuda.bucket_records(device, cfg.moe_inter // tp, cfg.hidden)]
    print(f"moe_w4a16: CUDA kernel built for {arch} by nvcc {nvcc}; shared memory a block up to "
          f"{limits.smem_per_block:,} bytes" + (f" (lowered from {limits.lowered_from:,})" if limits.lowered_from else ""))
    print("moe_w4a16: launches through the host launcher (launch_chain.c)" if launcher is not None else
          f"moe_w4a16: launches from Python, one driver call a launch (host launcher unavailable: {launcher_why})")
    for r in buckets:
        if not r["table_pick"]:
            print(f"moe_w4a16 {r['shape']} M <= {r['bucket_max_m']}: {r['impl']} "
                  f"(gate_up: {r['gate_up']['reason']}; down: {r['down']['reason']})")
    impls = sorted({r["impl"] for r in buckets})
    arches = arch_checks(kb, device, arch)
    for other, r in arches.items():
        print(f"moe_w4a16 as {other} would run it ({r['smem_per_block']:,} bytes a block): {r['status']}"
              + (f" (rel_err {r['rel_err']:.2e} over {len(r['checked'])} M)" if r.get("rel_err") is not None else "")
              + (f"; {r['same_as_here']} M run what this device runs" if "same_as_here" in r else "")
              + (f"; {r['detail']}" if "detail" in r else ""))
    return {"impl": ", ".join(impls), "nvcc": nvcc, "cuda_arch": arch, "arches": arches,
            "launcher": "c" if launcher is not None else "ctypes",
            **({} if launcher is not None else {"launcher_unavailable": launcher_why}),
            "limits": {"smem_per_block": limits.smem_per_block, "smem_lowered_from": limits.lowered_from,
                       "regs_per_block": limits.regs_per_block, "regs_per_sm": limits.regs_per_sm},
            "buckets": buckets}


def arch_checks(kb: KernelBench, device: torch.device, here: str) -> dict[str, dict[str, Any]]:
    """What the MoE would run on each other arch the inventory may name (its table under its shared-memory
    opt-in), run on this device wherever it differs from this device's own choice and compared with the
    reference at the smallest and largest bench M of each such bucket: a config that fits only the
    machine it was tuned on, or a fallback that computes wrongly, shows here before a host of that arch
    runs it."""
    cuda = ops.kernel_module("moe_cuda")
    index, cfg = device.index or 0, kb.p.cfg
    own = cuda.device_limits(index).smem_per_block
    out: dict[str, dict[str, Any]] = {}
    for arch in (a for a in ARCHES if a not in ("cpu", here)):
        smem = ARCH_SMEM_OPTIN[arch]
        if smem > own:
            out[arch] = {"status": "not checkable here", "smem_per_block": smem,
                         "detail": f"needs more shared memory a block than this device's {own:,}"}
            continue
        worst, runs, same = 0.0, [], 0
        try:
            for tp, ms in ((1, kb.p.moe_m), (SHARD_TP, kb.p.moe_tp_m)):
                inter = cfg.moe_inter // tp
                differ: dict[Any, list[int]] = {}
                for m in ms:
                    c, mine = cuda.choice(m, inter, cfg.hidden, index, arch), cuda.choice(m, inter, cfg.hidden, index)
                    if c.cuda and mine.cuda and c.configs == mine.configs:
                        same += 1
                    else:
                        differ.setdefault(c, []).append(m)
                for c, at in differ.items():
                    for m in sorted({at[0], at[-1]}):
                        err = _arch_run(kb, cuda, c, m, tp)
                        worst = max(worst, err)
                        runs.append({**c.record(cfg.hidden, inter), "m": m, "rel_err": err})
        except Exception as e:  # report; this host's own check stands
            traceback.print_exc()
            out[arch] = {"status": "error", "smem_per_block": smem, "detail": f"{type(e).__name__}: {e}"[:300]}
            continue
        out[arch] = {"status": "ok" if worst <= TOL["moe_w4a16"] else "mismatch", "smem_per_block": smem,
                     "rel_err": worst if runs else None, "same_as_here": same, "checked": runs}
    return out


def _arch_run(kb: KernelBench, cuda: Any, c: Any, m: int, tp: int) -> float:
    """One M under another arch's choice `c` (its CUDA configs, else Triton), against the reference."""
    kb.reseed()
    x, ids, tw = kb.moe_inputs(m)
    w = kb.moe_weights(tp)
    got = cuda.moe_w4a16(x, *w, ids, tw, configs=c.configs) if c.cuda else ops.moe_w4a16(x, *w, ids, tw, impl="triton")
    return rel_err(got, ops.moe_w4a16(x, *w, ids, tw, impl="torch"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.build", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", required=True, choices=ARCHES, help="the arch the inventory says this host has")
    ap.add_argument("--out", required=True, type=Path, help="directory for build.json")
    a = ap.parse_args(argv)
    f = facts()
    try:
        check_arch(a.arch, f)
    except UsageError as e:
        fail(str(e))
    started = now_iso()
    device = torch.device("cuda", 0) if f["device"] == "cuda" else torch.device("cpu")
    kb = KernelBench(bench_kernels.PROFILES[(device.type, "full")], device)
    moe_build = moe_cuda_build(device, kb) if device.type == "cuda" else {}
    kernels = {name: check(name, runs, kb) for name, runs in cases(kb, device).items()}
    kernels["moe_w4a16"].update(moe_build)
    body = {"arch_asked": a.arch, "device_found": {k: f[k] for k in ("device", "arch_found", "gpu_name", "gpu_count")},
            "versions": {k: f[k] for k in ("torch", "triton", "cuda", "driver", "python")},
            "started_at": started, "ended_at": now_iso(), "kernels": kernels}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "build.json").write_text(json.dumps(body, indent=1, sort_keys=True))
    bad = [k for k, v in kernels.items() if v["status"] in ("mismatch", "error")]
    for k, v in kernels.items():
        print(f"{k}: {v['status']}" + (f" (rel_err {v['rel_err']:.2e})" if v.get("rel_err") is not None else ""))
    if bad:
        print(f"error: kernels failed their check: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
