"""W4A16 MoE grouped GEMM (K2 INT4 format): two paths, picked by M * top-k.

Every pass is a split-K kernel: one program streams one [BN rows, KS of K] chunk of one expert's
weights for a block of <= BM token-expert slots routed to it, writing fp32 partials per K split;
two tiny kernels combine them in a fixed order (SiLU x up after gate_up; the routing-weighted sum
over splits and top-k after down):

  gate_up: h[slot] = silu(x[tok] . gate_e) * (x[tok] . up_e)
  down:    y[slot] = topk_weight[slot] * (h[slot] . W2_e),     out[m] = sum_j y[m*k + j]

Decode (at most SPLIT_MAX_SLOTS slots, M <= 4 at top-8; path="split") finds each program's block
from topk_ids in registers (no alignment launches). Above (path="grouped") the blocks come from
align(), the slots sorted by expert on the GPU with torch ops (no host sync), so any slot count
works and each weight tile is dequantized once per block. Up to M = 32 the inner loop is an FMA
GEMV with packed bf16x2 FMAs (PTX); above, plane dots on the tensor cores: the words dequantized in
registers straight into the MMA's operand layout, against plane-major activations whose loads the
pipeliner copies asynchronously (NOTES.md v7). Configs are chosen per M and per shape class (full
experts, or one TP rank's shard; kernels/moe_gemm_configs.py). No atomics: outputs are bit-identical
run to run.

This module plans a call and launches the passes (kernels/moe_gemm_kernels.py) on activations laid out
for them; the dequant steps they inline are kernels/moe_gemm_dequant.py.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from kernels.moe_gemm_configs import SPLIT_MAX_SLOTS, SplitConfig, grouped_config, split_config
from kernels.moe_gemm_kernels import moe_splitk, silu_mul, sum_slots


def align(topk_ids: Tensor, experts: int, bm: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, int]:
    """Group slots (token*k + j) by expert and cut each group into BM-blocks, all on the device.

    Returns sorted slots, per-expert segment start and count, per-block expert (== experts for
    unused blocks) and start row, and the host-known upper bound on the number of blocks.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    s = flat.numel()
    slots = torch.argsort(flat, stable=True).to(torch.int32)
    counts = torch.zeros(experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    seg_end = torch.cumsum(counts, 0)
    nblk = (counts + bm - 1) // bm
    blk_end = torch.cumsum(nblk, 0)
    ub = triton.cdiv(s, bm) + min(experts, s)
    b = torch.arange(ub, device=flat.device)
    bexp = torch.searchsorted(blk_end, b, right=True)
    bms = (b - (blk_end - nblk)[bexp.clamp(max=experts - 1)]) * bm
    return (slots, (seg_end - counts).to(torch.int32), counts.to(torch.int32), bexp.to(torch.int32),
            bms.to(torch.int32), ub)


def moe_w4a16(x: Tensor, w13_q: Tensor, w13_s: Tensor, w2_q: Tensor, w2_s: Tensor,
              topk_ids: Tensor, topk_weights: Tensor, configs: dict | None = None,
              path: str | None = None) -> Tensor:
    """Triton MoE. `path`: "split" (decode split-K, blocks found in registers; default when
    M * top-k <= SPLIT_MAX_SLOTS), "grouped" (split-K over GPU-aligned expert blocks; default above).
    `configs` overrides the path's config (the GPU sweep uses it)."""
    m, h = x.shape
    e, two_i, _ = w13_q.shape
    inter = two_i // 2
    topk = topk_ids.shape[1]
    x = x.contiguous()
    tw = topk_weights.reshape(-1).float().contiguous()
    path = path or ("split" if m * topk <= SPLIT_MAX_SLOTS else "grouped")
    if path == "split":
        return _moe_split(x, w13_q, w13_s, w2_q, w2_s, topk_ids, tw, configs or split_config(m, inter), False)
    if path == "grouped":
        return _moe_split(x, w13_q, w13_s, w2_q, w2_s, topk_ids, tw, configs or grouped_config(m, inter), True)
    raise ValueError(f"moe_w4a16: unknown path {path!r}")


def _plan(cfg: SplitConfig, n: int, k: int, on_gpu: bool, bf16_gpu: bool) -> SplitConfig:
    """The config as it will run on an [n, k] weight: chunks clipped to the shape."""
    bm, bn, bk, ks, warps, stages, dot = cfg
    bn, ks = min(bn, n), min(ks, k)
    while k % ks and ks > 32:  # small models (the engine's k2-mini): the largest chunk that tiles
        ks //= 2
    bk = min(bk, ks)
    if dot not in (0, 1, 4, 8, 12):
        raise ValueError(f"moe_w4a16: unknown DOT {dot} (0 / 4 / 8 / 12 FMA, 1 plane dots)")
    if dot == 1 and bk < 128 and on_gpu:
        dot = 8  # plane dots need K >= 16 per plane on the GPU: the packed FMA GEMV instead
    bm = max(bm, 16) if dot & 3 else 1  # tl.dot needs 16 columns (padding slots masked); FMA: one slot
    if dot & 8 and not bf16_gpu:
        dot -= 8  # the packed bf16x2 FMA is bf16 and PTX only
    if n % bn or k % ks or ks % bk or bk % 32:
        raise ValueError(f"moe_w4a16: N={n}, K={k} do not tile by BN={bn}, KS={ks}, BK={bk}")
    return SplitConfig(bm, bn, bk, ks, warps, stages, dot)


def _plane_major(a: Tensor, bk: int) -> Tensor:
    """Activation rows with each BK chunk plane-major: position j * BK/8 + w holds element 8w + j, so
    each plane dot's operand is a contiguous run (loads the pipeliner can copy asynchronously)."""
    m, k = a.shape
    return a.view(m, k // bk, bk // 8, 8).transpose(2, 3).contiguous().view(m, k)


def _permute(a: Tensor, bk: int) -> Tensor:
    """Activation rows as int32 pairs, each BK chunk pair-plane major (FMA path's layout)."""
    m, k = a.shape
    return a.view(torch.int32).view(m, k // bk, bk // 8, 4).transpose(2, 3).contiguous().view(m, k // 2)


def _split_launch(a: Tensor, ids: Tensor, wq: Tensor, ws: Tensor, tw: Tensor, n: int, k: int,
                  a_rows_per_slot: int, weighted: bool, plan: SplitConfig, bf16: bool, al: tuple | None) -> Tensor:
    """fp32 partials [K / KS, slots, n] of one split-K pass; blocks from align()'s table `al` if given."""
    bm, bn, bk, ks, warps, stages, dot = plan
    s = ids.numel()
    experts = wq.shape[0]
    if al is None:
        blocks = min(s, min(experts, s) + s // bm)  # leaders: one per BM slots of each expert
        slots = seg = cnt = bexp = bms = ids
    else:
        slots, seg, cnt, bexp, bms, blocks = al
    part = torch.empty(k // ks, s, n, dtype=torch.float32, device=wq.device)
    moe_splitk[(blocks, n // bn, k // ks)](
        a, ids, wq, ws, part, tw, s, n, k, a_rows_per_slot, 0x4B000000, slots, seg, cnt, bexp, bms, experts,
        ALIGNED=al is not None, WEIGHTED=weighted, BM=bm, BN=bn, BK=bk, KS=ks,
        SP=32 if s <= 32 or al is not None else triton.next_power_of_2(s), DOT=dot,  # two variants up to 128 slots
        ASM=bool(dot & 3 and bf16 and wq.is_cuda), BF16=bf16, num_warps=warps, num_stages=stages)
    return part


def _moe_split(x: Tensor, w13_q: Tensor, w13_s: Tensor, w2_q: Tensor, w2_s: Tensor, topk_ids: Tensor,
               tw: Tensor, cfg: dict[str, SplitConfig], aligned: bool) -> Tensor:
    m, h = x.shape
    inter = w13_q.shape[1] // 2
    topk = topk_ids.shape[1]
    s = m * topk
    bf16 = x.dtype == torch.bfloat16
    ids = topk_ids.reshape(-1).contiguous()
    gu_plan = _plan(cfg["gate_up"], 2 * inter, h, x.is_cuda, bf16 and x.is_cuda)
    dn_plan = _plan(cfg["down"], h, inter, x.is_cuda, bf16 and x.is_cuda)
    e = w13_q.shape[0]
    gu_al = align(topk_ids, e, gu_plan.bm) if aligned else None
    dn_al = (gu_al if dn_plan.bm == gu_plan.bm else align(topk_ids, e, dn_plan.bm)) if aligned else None
    a = _plane_major(x, gu_plan.bk) if gu_plan.tensor_cores else _permute(x, gu_plan.bk)
    gu = _split_launch(a, ids, w13_q, w13_s, tw, 2 * inter, h, topk, False, gu_plan, bf16, gu_al)
    hbuf = torch.empty(s, inter, dtype=x.dtype, device=x.device)
    block = 1024
    silu_mul[(triton.cdiv(s * inter, block),)](gu, hbuf, s, inter, SPLITS=gu.shape[0],
                                              PERM=0 if dn_plan.tensor_cores else dn_plan.bk,
                                              PLANES=dn_plan.bk if dn_plan.tensor_cores else 0,
                                              BLOCK=block)
    a = hbuf if dn_plan.tensor_cores else hbuf.view(torch.int32)
    dn = _split_launch(a, ids, w2_q, w2_s, tw, h, inter, 1, True, dn_plan, bf16, dn_al)
    out = torch.empty(m, h, dtype=x.dtype, device=x.device)
    sum_slots[(triton.cdiv(m * h, block),)](dn, out, m, s, h, TOPK=topk, SPLITS=dn.shape[0], BLOCK=block)
    return out
