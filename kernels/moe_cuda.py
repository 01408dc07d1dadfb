"""W4A16 MoE on mma.sync tensor cores in CUDA C++ (kernels/moe_w4a16.cu), built by the host's nvcc.

The passes of kernels/moe_gemm.py's grouped path, the block table and both projections in CUDA:
moe_align (slots grouped by expert, one launch instead of torch's sort and scans), then per
projection one CUDA pass writing fp32 partials per K split, combined in a fixed order by
moe_gemm's Triton kernels (SiLU x up after gate_up; the routing-weighted sum over splits and
top-k after down). Weights stay in K2's own layout (kernels/int4.py): nothing is repacked.

`unavailable_reason(device)` says why this host cannot run it (no nvcc, the cubin does not build),
None when it can; `supports` says whether the inputs' M bucket is one it serves. ops runs the Triton
kernel otherwise, and engine.build records which one runs.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
from torch import Tensor

from kernels import cuda_build
from kernels.moe_gemm import _silu_mul, _sum_slots, shape_class

SOURCE = "moe_w4a16.cu"
STEP = 256  # K per pipeline step (the kernel's STEP)
AROW = 512 + 64  # bytes per token row of a stage's activations (the kernel's AROW)
MAX_EXPERTS = 1024  # moe_align's one-CTA table

# (NT, WARPS, R, STAGES, KS): 8 * NT slots per block, WARPS warps of R strips of 16 rows, a
# STAGES-deep cp.async ring, KS of K per CTA (K / KS splits). Every tuple names a kernel that
# moe_w4a16.cu instantiates (KERNELS).
CudaConfig = tuple[int, int, int, int, int]
KERNELS = {(1, 4, 1, 4), (1, 4, 2, 4), (1, 8, 1, 4), (1, 8, 2, 4), (2, 4, 1, 4), (2, 4, 2, 4), (2, 8, 1, 4),
           (2, 8, 2, 4), (2, 4, 4, 4), (4, 4, 2, 4), (4, 8, 1, 4), (4, 8, 2, 3), (4, 4, 4, 3)}

# By shape class, then the largest M of the bucket (M above the last bucket takes the last); None:
# the Triton kernel is faster there. H200 sweeps (NOTES.md v8): CUDA wins from M = 8 while each
# expert holds a few slots (72-74% of copy bandwidth at M = 8..32 on full experts); at M <= 4 the
# Triton split-K GEMV (no table launch, K split for more programs) and at M >= 512 its wgmma plane
# dots are faster, so those buckets keep it.
CUDA_CONFIGS: dict[str, dict[int, dict[str, CudaConfig] | None]] = {
    "full": {4: None,
             64: {"gate_up": (1, 4, 1, 4, 7168), "down": (1, 4, 1, 4, 2048)},
             128: {"gate_up": (1, 8, 1, 4, 7168), "down": (1, 4, 2, 4, 2048)},
             256: {"gate_up": (1, 8, 1, 4, 7168), "down": (2, 8, 1, 4, 2048)},
             1024: None},
    "shard": {4: None,
              16: {"gate_up": (1, 8, 1, 4, 3584), "down": (1, 4, 1, 4, 256)},
              64: {"gate_up": (1, 8, 1, 4, 7168), "down": (1, 4, 1, 4, 256)},
              128: {"gate_up": (2, 4, 1, 4, 7168), "down": (2, 4, 1, 4, 256)},
              1024: None},
}


def cuda_config(m: int, inter: int) -> dict[str, CudaConfig] | None:
    """The config of the smallest M bucket that holds m, for experts of intermediate `inter`; None
    where the Triton kernel runs."""
    table = CUDA_CONFIGS[shape_class(inter)]
    return table[min((b for b in table if b >= m), default=max(table))]


def kernel_name(cfg: CudaConfig) -> str:
    nt, warps, r, stages, _ = cfg
    return f"moe_w4a16_nt{nt}_w{warps}_r{r}_s{stages}"


def smem_bytes(cfg: CudaConfig) -> int:
    """Dynamic shared memory of a config: STAGES x (weights + scales + activations) of one step."""
    nt, warps, r, stages, _ = cfg
    strips = warps * r
    return stages * (strips * 2 * 2 * 32 * 16 + strips * 2 * 32 * 4 + 8 * nt * AROW)


def fits(cfg: CudaConfig, n: int, k: int) -> bool:
    """Whether a config runs on an [n, k] weight: whole strips of rows, whole steps and splits of K."""
    nt, warps, r, stages, ks = cfg
    ks = min(ks, k)
    return (nt, warps, r, stages) in KERNELS and n % (warps * r * 16) == 0 and ks % STEP == 0 and k % ks == 0


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


def supports(x: Tensor, w13_q: Tensor, w2_q: Tensor, configs: dict[str, CudaConfig] | None = None) -> bool:
    """bf16 activations on CUDA, at most MAX_EXPERTS experts, an M bucket the CUDA kernel serves (or
    `configs`), and shapes the configs tile."""
    m, h = x.shape
    e, two_i, _ = w13_q.shape
    cfg = configs or cuda_config(m, two_i // 2)
    return (cfg is not None and x.is_cuda and x.dtype == torch.bfloat16 and e <= MAX_EXPERTS
            and fits(cfg["gate_up"], two_i, h) and fits(cfg["down"], h, two_i // 2))


def _cuda(device: torch.device) -> torch.device:
    """cuda:N with N spelled out, so "cuda" and "cuda:0" share one loaded module."""
    return torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())


def _module(device: torch.device) -> cuda_build.Module:
    return cuda_build.module(SOURCE, _cuda(device))


def align(ids: Tensor, experts: int, bm: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, int]:
    """moe_gemm.align()'s table (same tensors, same meaning) from one moe_align launch."""
    s = ids.numel()
    ub = triton.cdiv(s, bm) + min(experts, s)
    dev = ids.device
    slots = torch.empty(s, dtype=torch.int32, device=dev)
    seg = torch.empty(experts, dtype=torch.int32, device=dev)
    cnt = torch.empty(experts, dtype=torch.int32, device=dev)
    bexp = torch.empty(ub, dtype=torch.int32, device=dev)
    bms = torch.empty(ub, dtype=torch.int32, device=dev)
    _module(dev).kernel("moe_align")((1,), 1024, 0, [ids, s, experts, bm, ub, slots, seg, cnt, bexp, bms])
    return slots, seg, cnt, bexp, bms, ub


def _pass(a: Tensor, wq: Tensor, ws: Tensor, tw: Tensor, n: int, k: int, a_rows_per_slot: int,
          weighted: bool, cfg: CudaConfig, table: tuple, s: int) -> Tensor:
    """fp32 partials [K / KS, slots, n] of one projection."""
    nt, warps, r, stages, ks = cfg
    ks = min(ks, k)
    slots, seg, cnt, bexp, bms, ub = table
    part = torch.empty(k // ks, s, n, dtype=torch.float32, device=a.device)
    _module(a.device).kernel(kernel_name(cfg))(
        (ub, n // (warps * r * 16), k // ks), warps * 32, smem_bytes(cfg),
        [a, wq, ws, part, tw, slots, seg, cnt, bexp, bms, s, n, k, ks, a_rows_per_slot, wq.shape[0], weighted])
    return part


def moe_w4a16(x: Tensor, w13_q: Tensor, w13_s: Tensor, w2_q: Tensor, w2_s: Tensor,
              topk_ids: Tensor, topk_weights: Tensor, configs: dict[str, CudaConfig] | None = None) -> Tensor:
    """Routed-expert MoE: [M, H] bf16 -> [M, H]; `configs` overrides the M bucket's (the GPU sweep uses it)."""
    m, h = x.shape
    e, two_i, _ = w13_q.shape
    inter = two_i // 2
    topk = topk_ids.shape[1]
    s = m * topk
    cfg = configs or cuda_config(m, inter)
    if not supports(x, w13_q, w2_q, cfg):
        raise ValueError(f"moe_cuda: unsupported input (dtype {x.dtype}, H {h}, I {inter}, E {e}, config {cfg})")
    x = x.contiguous()
    ids = topk_ids.reshape(-1).to(torch.int64).contiguous()
    tw = topk_weights.reshape(-1).float().contiguous()
    tables: dict[int, tuple] = {}
    for c in (cfg["gate_up"], cfg["down"]):
        if 8 * c[0] not in tables:
            tables[8 * c[0]] = align(ids, e, 8 * c[0])
    gu = _pass(x, w13_q, w13_s, tw, two_i, h, topk, False, cfg["gate_up"], tables[8 * cfg["gate_up"][0]], s)
    hbuf = torch.empty(s, inter, dtype=x.dtype, device=x.device)
    block = 1024
    _silu_mul[(triton.cdiv(s * inter, block),)](gu, hbuf, s, inter, SPLITS=gu.shape[0], PERM=0, PLANES=0,
                                               BLOCK=block)
    dn = _pass(hbuf, w2_q, w2_s, tw, h, inter, 1, True, cfg["down"], tables[8 * cfg["down"][0]], s)
    out = torch.empty(m, h, dtype=x.dtype, device=x.device)
    _sum_slots[(triton.cdiv(m * h, block),)](dn, out, m, s, h, TOPK=topk, SPLITS=dn.shape[0], BLOCK=block)
    return out
