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
None when it can; `supports` says whether the inputs' M bucket is one it serves. ops runs the Triton
kernel otherwise, and engine.build records which one runs.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
from torch import Tensor

from kernels import cuda_build
from kernels.moe_gemm import shape_class

SOURCE = "moe_w4a16.cu"
STEP = 256  # K per pipeline step (the kernel's STEP)
AROW = 512 + 64  # bytes per token row of a stage's activations (the kernel's AROW)
XREC = 32  # bytes of one token's group sums a step (the kernel's XREC)
MAX_EXPERTS = 1024  # moe_align's one-CTA table

# (NT, WARPS, R, STAGES, H, TA, SC, SPAN, KS): 8 * NT slots per block, WARPS warps of R strips of
# 16 rows (a tile), a STAGES-deep cp.async ring of H K steps a stage holding the activations of TA
# tokens (8 * NT, or fewer at decode sizes: M <= TA), SC 1 for weights scaled before the MMA (0:
# the sums scaled after it, moe_w4a16.cu's top says when which), SPAN tiles one after the other per
# CTA, KS of K per CTA (K / KS splits). The first seven name a kernel that moe_w4a16.cu
# instantiates (KERNELS, below).
CudaConfig = tuple[int, int, int, int, int, int, int, int, int]

# By shape class, then the largest M of the bucket (M above the last bucket takes the last); None
# would mean the Triton kernel is as fast or faster there. Picked from whole-MoE timings of
# candidate configs on an H200 (NOTES.md v10; v11 re-picked three down passes, v12 the SC ones, v13
# the full shapes' M = 2..16 under the reading L2 flush): 4-warp tiles with 256-byte row reads (H = 2)
# and one 8-slot block an expert up to M = 64, full shapes at M <= 4 (and the TP-8 down pass at M =
# 1) with stages holding only M tokens' activations (TA = 1, 2, 4: more CTAs' weights in flight), TP-8 shards
# with K split over CTAs at M <= 2 and the down pass (K = 256, one step) walking 2-14 tiles a CTA so
# the ring stays full; warps of 2 strips from M = 128, then 16- and 32-slot blocks (NT = 2, 4) at
# M = 512 and 1024 with 2-4 strips a warp, so each activation fragment read from shared memory
# serves 32-64 rows. Weights scaled before the MMA (SC = 1) where that timed faster: every 32-slot
# pass, the TP-8 16-slot ones and the TP-8 down pass from M = 17 (15-19 % at M = 700..1500).
CUDA_CONFIGS: dict[str, dict[int, dict[str, CudaConfig] | None]] = {
    "full": {1: {"gate_up": (1, 4, 1, 2, 2, 1, 0, 1, 7168), "down": (1, 4, 1, 2, 2, 1, 0, 2, 2048)},
             2: {"gate_up": (1, 4, 1, 2, 2, 2, 0, 2, 7168), "down": (1, 4, 1, 2, 2, 2, 0, 2, 2048)},
             4: {"gate_up": (1, 4, 1, 2, 2, 4, 0, 1, 7168), "down": (1, 4, 1, 2, 2, 8, 0, 2, 2048)},
             32: {"gate_up": (1, 4, 1, 2, 2, 8, 0, 1, 7168), "down": (1, 4, 1, 2, 2, 8, 0, 2, 2048)},
             64: {"gate_up": (1, 4, 1, 2, 2, 8, 0, 1, 7168), "down": (1, 4, 1, 4, 1, 8, 0, 1, 2048)},
             256: {"gate_up": (1, 4, 2, 3, 1, 8, 0, 1, 7168), "down": (1, 4, 2, 3, 1, 8, 0, 2, 2048)},
             512: {"gate_up": (2, 4, 4, 2, 1, 16, 0, 1, 7168), "down": (2, 4, 4, 2, 1, 16, 0, 1, 2048)},
             1024: {"gate_up": (4, 4, 4, 2, 1, 32, 1, 1, 7168), "down": (4, 4, 4, 2, 1, 32, 1, 2, 2048)}},
    "shard": {1: {"gate_up": (1, 4, 1, 4, 1, 8, 0, 1, 1792), "down": (1, 4, 1, 4, 1, 1, 0, 2, 256)},
              2: {"gate_up": (1, 4, 1, 4, 1, 8, 0, 1, 1792), "down": (1, 4, 1, 4, 1, 8, 0, 4, 256)},
              4: {"gate_up": (1, 4, 1, 3, 2, 8, 0, 1, 7168), "down": (1, 4, 1, 4, 1, 8, 0, 8, 256)},
              8: {"gate_up": (1, 4, 1, 2, 2, 8, 0, 1, 7168), "down": (1, 4, 1, 4, 1, 8, 0, 14, 256)},
              16: {"gate_up": (1, 4, 1, 2, 2, 8, 0, 1, 3584), "down": (1, 4, 2, 3, 1, 8, 0, 8, 256)},
              256: {"gate_up": (1, 4, 1, 2, 2, 8, 0, 1, 7168), "down": (1, 4, 2, 2, 1, 8, 1, 8, 256)},
              512: {"gate_up": (2, 4, 2, 2, 1, 16, 1, 1, 7168), "down": (2, 4, 2, 2, 1, 16, 1, 8, 256)},
              1024: {"gate_up": (4, 4, 4, 2, 1, 32, 1, 1, 7168), "down": (4, 4, 2, 2, 1, 32, 1, 8, 256)}},
}
# The kernels moe_w4a16.cu instantiates: exactly those the table picks (a test reads the source).
KERNELS = {cfg[:7] for table in CUDA_CONFIGS.values() for bucket in table.values() if bucket for cfg in bucket.values()}


def cuda_config(m: int, inter: int) -> dict[str, CudaConfig] | None:
    """The config of the smallest M bucket that holds m, for experts of intermediate `inter`; None
    where the Triton kernel runs."""
    table = CUDA_CONFIGS[shape_class(inter)]
    return table[min((b for b in table if b >= m), default=max(table))]


def kernel_name(cfg: CudaConfig) -> str:
    nt, warps, r, stages, h, ta, sc = cfg[:7]
    return f"moe_w4a16_nt{nt}_w{warps}_r{r}_s{stages}_h{h}_a{ta}_sc{sc}"


def smem_bytes(cfg: CudaConfig, k: int) -> int:
    """Dynamic shared memory of a config on K = k: (weights + scales + activations + group sums) of
    one K step, times the ring stages a CTA's steps can fill (one tile of one step needs one: more
    CTAs fit an SM)."""
    nt, warps, r, stages, h, ta, sc, span, ks = cfg
    strips = warps * r
    sub = strips * 16 * 8 * 16 + strips * 16 * 16 + ta * (AROW + XREC)
    return min(stages, span * (min(ks, k) // (STEP * h))) * h * sub


def fits(cfg: CudaConfig, n: int, k: int) -> bool:
    """Whether a config runs on an [n, k] weight: whole spans of row tiles, whole stages and splits of K."""
    nt, warps, r, stages, h, ta, sc, span, ks = cfg
    ks = min(ks, k)
    return (tuple(cfg[:7]) in KERNELS and n % (warps * r * 16 * span) == 0 and ks % (STEP * h) == 0
            and k % ks == 0)


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
    `configs`), shapes the configs tile, and no more tokens an expert (at most M) than a stage holds."""
    m, h = x.shape
    e, two_i, _ = w13_q.shape
    cfg = configs or cuda_config(m, two_i // 2)
    return (cfg is not None and x.is_cuda and x.dtype == torch.bfloat16 and e <= MAX_EXPERTS
            and fits(cfg["gate_up"], two_i, h) and fits(cfg["down"], h, two_i // 2)
            and all(c[5] >= min(8 * c[0], m) for c in cfg.values()))


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
          weighted: bool, cfg: CudaConfig, table: Table, s: int, early: bool) -> Tensor:
    """Partials [K / KS, slots, n] of one projection, bf16 when `weighted` (the down pass: moe_sum
    reads them back) and fp32 otherwise; `early`: the table was finished before the launch before
    this one (the down pass), so the first weight stages load before the wait."""
    nt, warps, r, stages, h, ta, sc, span, ks = cfg
    ks = min(ks, k)
    slots, seg, cnt, bexp, bms, ub = table
    part = torch.empty(k // ks, s, n, dtype=torch.bfloat16 if weighted else torch.float32, device=wq.device)
    _launch(wq.device, kernel_name(cfg), (ub, n // (warps * r * 16 * span), k // ks), warps * 32,
            smem_bytes(cfg, k), [*a, wq, ws, part, tw, slots, seg, cnt, bexp, bms, s, n, k, ks, span,
                                 a_rows_per_slot, wq.shape[0], weighted, early])
    return part


def moe_w4a16(x: Tensor, w13_q: Tensor, w13_s: Tensor, w2_q: Tensor, w2_s: Tensor,
              topk_ids: Tensor, topk_weights: Tensor, configs: dict[str, CudaConfig] | None = None) -> Tensor:
    """Routed-expert MoE: [M, H] bf16 -> [M, H]; `configs` overrides the M bucket's (the GPU sweep uses it).
    Five launches: table + activations, gate_up, SiLU + prepare, down, sum (one more table when
    the passes' block sizes differ)."""
    m, h = x.shape
    e, two_i, _ = w13_q.shape
    inter = two_i // 2
    topk = topk_ids.shape[1]
    s = m * topk
    cfg = configs or cuda_config(m, inter)
    if not supports(x, w13_q, w2_q, cfg):
        raise ValueError(f"moe_cuda: unsupported input (dtype {x.dtype}, H {h}, I {inter}, E {e}, config {cfg})")
    ids = topk_ids.reshape(-1).to(torch.int64).contiguous()
    tw = topk_weights.reshape(-1).float().contiguous()
    bm_gu, bm_dn = 8 * cfg["gate_up"][0], 8 * cfg["down"][0]
    table_gu, xprep = align(ids, e, bm_gu, x.contiguous())
    table_dn = table_gu if bm_dn == bm_gu else align(ids, e, bm_dn)[0]
    gu = _pass(xprep, w13_q, w13_s, tw, two_i, h, topk, False, cfg["gate_up"], table_gu, s, False)
    dn = _pass(silu_prep(gu, inter), w2_q, w2_s, tw, h, inter, 1, True, cfg["down"], table_dn, s, True)
    out = torch.empty(m, h, dtype=x.dtype, device=x.device)
    _launch(x.device, "moe_sum", (triton.cdiv(m * h // 4, 256),), 256, 0, [dn, dn.shape[0], s, m, h, topk, out])
    return out
