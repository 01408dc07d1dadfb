"""W4A16 MoE on mma.sync tensor cores in CUDA C++ (kernels/moe_w4a16.cu), built by the host's nvcc.

The passes of kernels/moe_gemm.py's grouped path, the block table and both projections in CUDA:
moe_align (slots grouped by expert, one launch instead of torch's sort and scans), then per
projection one GEMM pass writing partials per K split (fp32 for gate_up, bf16 for down: its
weighted per-slot outputs, as vLLM's fused MoE keeps them), on activations permuted to the
dequant's pairs and their group sums (prepared by the align launch for gate_up, by moe_silu_prep,
which also applies SiLU x up, for down); moe_sum adds the down partials over the splits and top-k
in fp32, in a fixed order. Weights stay in K2's own layout (kernels/int4.py): nothing is repacked. On sm_90
and later the five launches are programmatic dependent launches (moe_w4a16.cu's top says how they
wait), so each kernel's CTAs start while the one before drains.

`unavailable_reason(device)` says why this host cannot run it (no nvcc, the cubin does not build),
None when it can. The configs come from kernels/moe_configs.py's table for the device's arch, each
checked against the device's limits (`device_limits`: the driver's shared-memory opt-in and
registers; `kernel_resources`: the loaded kernel's own); `supports` says whether the inputs' M
bucket runs here. ops runs the Triton kernel otherwise, and engine.build records, per bucket, which
one runs and why.
"""

from __future__ import annotations

import os
from functools import cache

import torch
import triton
from torch import Tensor

from kernels import cuda_build
from kernels.moe_configs import (Bucket, Choice, DeviceLimits, KernelResources, PassConfig, bucket_of, choose, misfit,
                                 table_for)
from kernels.moe_gemm import shape_class

SOURCE = "moe_w4a16.cu"
MAX_EXPERTS = 1024  # moe_align's one-CTA table
# Lowers the shared memory a block may use below the driver's opt-in (bytes): runs a smaller
# device's configs here, e.g. sm_120's 101,376 on an H200. It can only lower the limit.
SMEM_LIMIT_ENV = "KDBENCH_CUDA_SMEM_LIMIT"


@cache
def device_limits(index: int) -> DeviceLimits:
    """The driver's limits of CUDA device `index`, the shared memory lowered by $KDBENCH_CUDA_SMEM_LIMIT."""
    optin = cuda_build.device_attribute(index, cuda_build.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
    smem, lowered = optin, None
    cap = os.environ.get(SMEM_LIMIT_ENV, "").strip()
    if cap:
        if not cap.isdigit():
            raise ValueError(f"${SMEM_LIMIT_ENV} must be a number of bytes, got {cap[:40]!r}")
        if int(cap) < optin:
            smem, lowered = int(cap), optin
    return DeviceLimits(cuda_build.arch_of(torch.device("cuda", index)), smem,
                        cuda_build.device_attribute(index, cuda_build.MAX_REGISTERS_PER_BLOCK),
                        cuda_build.device_attribute(index, cuda_build.MAX_REGISTERS_PER_MULTIPROCESSOR), lowered)


def kernel_resources(index: int, name: str) -> KernelResources:
    """Registers, static shared memory and the thread limit of kernel `name` as loaded on device `index`."""
    k = _module(torch.device("cuda", index)).kernel(name)
    return KernelResources(k.attribute(cuda_build.FUNC_NUM_REGS), k.attribute(cuda_build.FUNC_SHARED_SIZE_BYTES),
                           k.attribute(cuda_build.FUNC_MAX_THREADS_PER_BLOCK))


@cache
def bucket_choice(index: int, inter: int, hidden: int, bucket: int) -> Choice:
    """What M bucket `bucket` runs on device `index` for experts [2 inter, hidden] / [hidden, inter]."""
    key, _ = table_for(device_limits(index).arch)
    return choose(key, shape_class(inter), bucket, 2 * inter, hidden, hidden, inter, device_limits(index),
                  lambda name: kernel_resources(index, name))


def choice(m: int, inter: int, hidden: int, index: int) -> Choice:
    """What M = m runs on device `index` (its bucket's choice)."""
    _, table = table_for(device_limits(index).arch)
    return bucket_choice(index, inter, hidden, bucket_of(table[shape_class(inter)], m))


def bucket_records(device: torch.device, inter: int, hidden: int) -> list[dict[str, object]]:
    """build.json's per-bucket records of one expert shape on `device`: impl, kernels, why."""
    index = _cuda(device).index
    _, table = table_for(device_limits(index).arch)
    return [bucket_choice(index, inter, hidden, b).record(hidden, inter) for b in sorted(table[shape_class(inter)])]


@cache
def _unavailable(index: int) -> str | None:
    try:
        cuda_build.module(SOURCE, torch.device("cuda", index))
    except cuda_build.CudaUnavailable as e:
        return str(e)
    return None


def unavailable_reason(device: torch.device) -> str | None:
    """None when the CUDA kernel runs on `device`; else why not (no nvcc, build failed, not CUDA)."""
    if device.type != "cuda":
        return f"not a CUDA device ({device.type})"
    return _unavailable(_cuda(device).index)


def supports(x: Tensor, w13_q: Tensor, w2_q: Tensor, configs: Bucket | None = None) -> bool:
    """bf16 activations on CUDA, at most MAX_EXPERTS experts, and configs (`configs`, else the M
    bucket's choice on this device) that tile the shapes, hold every token an expert can get and fit
    the device."""
    m, h = x.shape
    e, two_i, _ = w13_q.shape
    inter = two_i // 2
    if not (x.is_cuda and x.dtype == torch.bfloat16 and e <= MAX_EXPERTS and tuple(w2_q.shape[1:]) == (h, inter // 8)):
        return False
    index = _cuda(x.device).index
    if configs is None:
        return choice(m, inter, h, index).cuda
    limits = device_limits(index)
    return all(c.tiles(n, k) and c.holds(m) and misfit(c, k, limits, kernel_resources(index, c.kernel)) is None
               for c, n, k in ((configs.gate_up, two_i, h), (configs.down, h, inter)))


def _cuda(device: torch.device) -> torch.device:
    """cuda:N with N spelled out, so "cuda" and "cuda:0" share one loaded module."""
    return torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())


def _module(device: torch.device) -> cuda_build.Module:
    return cuda_build.module(SOURCE, _cuda(device))


@cache
def _pdl(index: int) -> bool:
    """Programmatic dependent launch: sm_90 and later."""
    return torch.cuda.get_device_capability(index)[0] >= 9


def _launch(dev: torch.device, name: str, grid: tuple[int, ...], block: int, smem: int, args: list[object]) -> None:
    _module(dev).kernel(name)(grid, block, smem, args, pdl=_pdl(_cuda(dev).index))


Table = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, int]
Prepared = tuple[Tensor, Tensor]  # activations in the dequant's pair order, their group sums


def align(ids: Tensor, experts: int, bm: int, x: Tensor | None = None) -> tuple[Table, Prepared | None]:
    """moe_gemm.align()'s table (same tensors, same meaning) from one moe_align launch, which also
    prepares activations `x` for the GEMM when given (emit_word's comment says how)."""
    s = ids.numel()
    ub = triton.cdiv(s, bm) + min(experts, s)
    dev = ids.device
    slots = torch.empty(s, dtype=torch.int32, device=dev)
    seg = torch.empty(experts, dtype=torch.int32, device=dev)
    cnt = torch.empty(experts, dtype=torch.int32, device=dev)
    bexp = torch.empty(ub, dtype=torch.int32, device=dev)
    bms = torch.empty(ub, dtype=torch.int32, device=dev)
    prep, args, grid = None, [None, 0, 0, None, None], 1
    if x is not None:
        rows, k = x.shape
        prep = (torch.empty_like(x), torch.empty(rows, k // 16, dtype=x.dtype, device=dev))
        args, grid = [x, rows, k, *prep], 1 + triton.cdiv(rows * k // 8, 1024)
    _launch(dev, "moe_align", (grid,), 1024, 0, [ids, s, experts, bm, ub, slots, seg, cnt, bexp, bms, *args])
    return (slots, seg, cnt, bexp, bms, ub), prep


def silu_prep(gu: Tensor, inter: int) -> Prepared:
    """h = silu(gate) * up from the gate_up partials, prepared for the down GEMM in one launch."""
    splits, s, _ = gu.shape
    hp = torch.empty(s, inter, dtype=torch.bfloat16, device=gu.device)
    hs = torch.empty(s, inter // 16, dtype=torch.bfloat16, device=gu.device)
    grid = (triton.cdiv(s * inter // 8, 256),)
    _launch(gu.device, "moe_silu_prep", grid, 256, 0, [gu, splits, s, inter, hp, hs])
    return hp, hs


def _pass(a: Prepared, wq: Tensor, ws: Tensor, tw: Tensor, n: int, k: int, a_rows_per_slot: int,
          weighted: bool, cfg: PassConfig, table: Table, s: int, early: bool) -> Tensor:
    """Partials [K / KS, slots, n] of one projection, bf16 when `weighted` (the down pass: moe_sum
    reads them back) and fp32 otherwise; `early`: the table was finished before the launch before
    this one (the down pass), so the first weight stages load before the wait."""
    ks = min(cfg.k_chunk, k)
    slots, seg, cnt, bexp, bms, ub = table
    part = torch.empty(k // ks, s, n, dtype=torch.bfloat16 if weighted else torch.float32, device=wq.device)
    _launch(wq.device, cfg.kernel, (ub, n // (cfg.rows * cfg.span), k // ks), cfg.threads,
            cfg.smem_bytes(k), [*a, wq, ws, part, tw, slots, seg, cnt, bexp, bms, s, n, k, ks, cfg.span,
                                a_rows_per_slot, wq.shape[0], weighted, early])
    return part


def moe_w4a16(x: Tensor, w13_q: Tensor, w13_s: Tensor, w2_q: Tensor, w2_s: Tensor,
              topk_ids: Tensor, topk_weights: Tensor, configs: Bucket | None = None) -> Tensor:
    """Routed-expert MoE: [M, H] bf16 -> [M, H]; `configs` overrides the M bucket's (the GPU sweep uses it).
    Five launches: table + activations, gate_up, SiLU + prepare, down, sum (one more table when
    the passes' block sizes differ)."""
    m, h = x.shape
    e, two_i, _ = w13_q.shape
    inter = two_i // 2
    topk = topk_ids.shape[1]
    s = m * topk
    if not supports(x, w13_q, w2_q, configs):
        raise ValueError(f"moe_cuda: unsupported input (dtype {x.dtype}, H {h}, I {inter}, E {e}, configs {configs})")
    cfg = configs or choice(m, inter, h, _cuda(x.device).index).configs
    ids = topk_ids.reshape(-1).to(torch.int64).contiguous()
    tw = topk_weights.reshape(-1).float().contiguous()
    table_gu, xprep = align(ids, e, cfg.gate_up.slots, x.contiguous())
    table_dn = table_gu if cfg.down.slots == cfg.gate_up.slots else align(ids, e, cfg.down.slots)[0]
    gu = _pass(xprep, w13_q, w13_s, tw, two_i, h, topk, False, cfg.gate_up, table_gu, s, False)
    dn = _pass(silu_prep(gu, inter), w2_q, w2_s, tw, h, inter, 1, True, cfg.down, table_dn, s, True)
    out = torch.empty(m, h, dtype=x.dtype, device=x.device)
    _launch(x.device, "moe_sum", (triton.cdiv(m * h // 4, 256),), 256, 0, [dn, dn.shape[0], s, m, h, topk, out])
    return out
