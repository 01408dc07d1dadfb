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
experts, or one TP rank's shard). No atomics: outputs are bit-identical run to run.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

# word (two's-complement nibbles) . four bf16x2 activation pairs -> one bf16x2 partial (two sums of
# four products): each pair of nibbles dequantized to exact bf16 q (as in _ASM_W4_PAIR), then one bf16x2 FMA
# with the pair-plane of the activation (the FMA path's layout): 18 instructions for 8 weights.
_ASM_W4_DOT = tl.constexpr("""{
.reg .b32 t, u, d, acc, one, m136;
mov.b32 one, 0x3F803F80;
mov.b32 m136, 0xC308C308;
mov.b32 acc, 0;
xor.b32 t, $1, 0x88888888;
shr.u32 u, t, 4;
""" + "".join(f"""prmt.b32 d, t, u, 0x0{4 + p}0{p};
lop3.b32 d, d, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 d, d, one, m136;
fma.rn.bf16x2 acc, d, ${2 + p}, acc;
""" for p in range(4)) + "mov.b32 $0, acc;\n}")


# two words a, b (K-adjacent in the MMA operand) + their bf16 scales (one register) -> plane j (j = 0..7)
# as one bf16x2 register (nibble j of a, nibble j of b): prmt takes byte j // 2 of each word (shifted
# by 4 for odd j), one lop3 does (d & 0xF) ^ 8 | 0x4300 = bf16 128 + q + 8, then FMA -136 and FMA by
# the scales: 34 instructions for 16 weights, and no repacking for the MMA's register operand.
_ASM_W4_PAIR = tl.constexpr("""{
.reg .b32 ua, ub, d, one, m136, nz;
mov.b32 one, 0x3F803F80;
mov.b32 m136, 0xC308C308;
mov.b32 nz, 0x80008000;
shr.u32 ua, $8, 4;
shr.u32 ub, $9, 4;
""" + "".join(f"""prmt.b32 d, {"$8" if j % 2 == 0 else "ua"}, {"$9" if j % 2 == 0 else "ub"}, {hex((j // 2) * 0x11 + (4 + j // 2) * 0x1100)};
lop3.b32 d, d, 0x000F000F, 0x43084308, 0x6A;
fma.rn.bf16x2 d, d, one, m136;
fma.rn.bf16x2 ${j}, d, $10, nz;
""" for j in range(8)) + "}")


@triton.jit
def _nibble(words, j: tl.constexpr):
    """Element j of each word as fp32 without an int-to-float conversion: (q ^ 8) sits under the
    exponent of 2^23, so bitcast(nib ^ 0x4B000008) = 2^23 + q + 8 exactly."""
    return (((words >> (4 * j)) & 0xF) ^ 0x4B000008).to(tl.float32, bitcast=True) - 8388616.0


@triton.jit
def _planes(words, scales, dtype: tl.constexpr, ASM: tl.constexpr):
    """[BN, W] words + per-word scales -> 8 planes [BN, W]: plane j holds elements 8w + j, scaled.
    ASM: the pair-packed PTX dequant (bf16 on the GPU); else fp32 math (the interpreter)."""
    if ASM:
        v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
            _ASM_W4_PAIR, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r", [words, scales.to(tl.bfloat16)],
            dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16,
                   tl.bfloat16), is_pure=True, pack=2)
    else:
        sf = scales.to(tl.float32)
        v0 = (_nibble(words, 0) * sf).to(dtype)
        v1 = (_nibble(words, 1) * sf).to(dtype)
        v2 = (_nibble(words, 2) * sf).to(dtype)
        v3 = (_nibble(words, 3) * sf).to(dtype)
        v4 = (_nibble(words, 4) * sf).to(dtype)
        v5 = (_nibble(words, 5) * sf).to(dtype)
        v6 = (_nibble(words, 6) * sf).to(dtype)
        v7 = (_nibble(words, 7) * sf).to(dtype)
    return v0, v1, v2, v3, v4, v5, v6, v7


@triton.jit
def _load_planes(ap, k0, xm, W: tl.constexpr):
    """The eight activation planes of the step at k0 on plane-major rows (_plane_major): plane j
    (elements 8w + j of the step) is the contiguous run at ap + k0 + j W, ap = w."""
    return (tl.load(ap + k0 + 0 * W, mask=xm, other=0.0), tl.load(ap + k0 + 1 * W, mask=xm, other=0.0),
            tl.load(ap + k0 + 2 * W, mask=xm, other=0.0), tl.load(ap + k0 + 3 * W, mask=xm, other=0.0),
            tl.load(ap + k0 + 4 * W, mask=xm, other=0.0), tl.load(ap + k0 + 5 * W, mask=xm, other=0.0),
            tl.load(ap + k0 + 6 * W, mask=xm, other=0.0), tl.load(ap + k0 + 7 * W, mask=xm, other=0.0))


@triton.jit
def _plane_dots(words, scales, x0, x1, x2, x3, x4, x5, x6, x7, acc, dtype: tl.constexpr, ASM: tl.constexpr):
    """acc += W . x with K permuted plane-major: sum_j plane_j . x[8w + j]; no interleave needed."""
    v0, v1, v2, v3, v4, v5, v6, v7 = _planes(words, scales, dtype, ASM)
    acc = tl.dot(v0, x0, acc)
    acc = tl.dot(v1, x1, acc)
    acc = tl.dot(v2, x2, acc)
    acc = tl.dot(v3, x3, acc)
    acc = tl.dot(v4, x4, acc)
    acc = tl.dot(v5, x5, acc)
    acc = tl.dot(v6, x6, acc)
    acc = tl.dot(v7, x7, acc)
    return acc


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


# ----------------------------------------------------------------------------- decode: split-K

# (BM, BN, BK, KS, num_warps, num_stages, DOT) per kernel, by the largest M of the bucket.
# BM slots per block, BN weight rows, BK of K per step, KS of K per program.
# DOT 0: FMA GEMV, one slot per block (BM must be 1); the activation is pre-permuted so that its
#   int32 pairs line up with the weight words (same [BN, BK/8] layout: no shared-memory shuffles);
#   DOT 4: the same with the next step's words, scales and activations loaded one step ahead;
#   DOT 8 (+ 4): the same with packed bf16x2 FMAs in PTX (bf16 on the GPU; plain FMA elsewhere).
# DOT 1: plane dots on the tensor cores, slots padded to 16 (BM >= 16): the words dequantized by the
#   pair-packed PTX (two K-adjacent words a call, each plane straight into the bf16x2 register of
#   the MMA operand) against plane-major activations (_plane_major: each plane a contiguous run, so
#   the pipeliner copies them asynchronously). Runs 11-13 of NOTES.md call it DOT 49.
class SplitConfig(NamedTuple):
    """One pass's config (the fields as the comment above names them), read by name."""

    bm: int
    bn: int
    bk: int
    ks: int
    warps: int
    stages: int
    dot: int

    @property
    def tensor_cores(self) -> bool:
        """DOT 1 (plane dots on the tensor cores) rather than an FMA GEMV."""
        return bool(self.dot & 3)


_C = SplitConfig  # keeps the tables below one line a bucket
SPLIT_MAX_SLOTS = 32  # M * top-k up to this goes split-K (M <= 4 at K2's top-8)
SHARD_INTER = 1024  # experts with a smaller intermediate (K2 at TP >= 2) take the "shard" tables


def shape_class(inter: int) -> str:
    """Config table of an expert shape: "full" (K2: 2048) or "shard" (a TP rank's slice, 256 at TP-8)."""
    return "full" if inter >= SHARD_INTER else "shard"


# By shape class, then the largest M of the bucket (M above the last bucket takes the last).
# H200 sweeps (NOTES.md, runs 4, 6-8, 11-13): packed bf16x2 FMAs (+ the next step's loads in flight at
# M = 1); at the shard, short K chunks (KS 1024: 7 gate_up splits) so that M = 1 has enough programs.
SPLIT_CONFIGS: dict[str, dict[int, dict[str, SplitConfig]]] = {
    "full": {1: {"gate_up": _C(1, 64, 256, 7168, 4, 3, 12), "down": _C(1, 64, 256, 7168, 4, 3, 12)},
             4: {"gate_up": _C(1, 64, 256, 3584, 4, 3, 8), "down": _C(1, 64, 256, 3584, 4, 3, 8)}},
    "shard": {2: {"gate_up": _C(1, 64, 256, 1024, 4, 3, 12), "down": _C(1, 64, 256, 1024, 4, 3, 12)},
              4: {"gate_up": _C(1, 64, 256, 3584, 4, 3, 8), "down": _C(1, 64, 256, 3584, 4, 3, 8)}},
}


def _bucket(table: dict[int, dict[str, SplitConfig]], m: int) -> dict[str, SplitConfig]:
    return table[min((b for b in table if b >= m), default=max(table))]


def split_config(m: int, inter: int) -> dict[str, SplitConfig]:
    """The split-K config of the smallest M bucket that holds m, for experts of intermediate `inter`."""
    return _bucket(SPLIT_CONFIGS[shape_class(inter)], m)


# Grouped split-K (above SPLIT_MAX_SLOTS): the same kernel with its blocks from align() (BM slots of
# one expert, so each weight tile is dequantized once per block). H200 sweeps (NOTES.md, runs 5, 8,
# 11-13): the packed FMA up to M = 32; above, the plane dots on tensor cores (DOT 1: plane-major
# activations, pair-packed dequant; KS = all of K), BM 32 once most experts hold > 16 slots.
GROUPED_CONFIGS: dict[str, dict[int, dict[str, SplitConfig]]] = {
    "full": {32: {"gate_up": _C(1, 64, 256, 3584, 4, 3, 8), "down": _C(1, 64, 256, 3584, 4, 3, 8)},
             256: {"gate_up": _C(16, 64, 256, 7168, 4, 3, 1), "down": _C(16, 64, 256, 7168, 4, 3, 1)},
             512: {"gate_up": _C(16, 64, 256, 7168, 2, 3, 1), "down": _C(16, 64, 256, 7168, 2, 3, 1)},
             1024: {"gate_up": _C(32, 128, 128, 7168, 4, 3, 1), "down": _C(32, 128, 128, 7168, 4, 3, 1)}},
    "shard": {32: {"gate_up": _C(1, 64, 256, 3584, 4, 3, 8), "down": _C(1, 64, 256, 3584, 4, 3, 8)},
              512: {"gate_up": _C(16, 64, 256, 7168, 4, 3, 1), "down": _C(16, 64, 256, 7168, 4, 3, 1)},
              1024: {"gate_up": _C(32, 64, 256, 7168, 4, 3, 1), "down": _C(32, 64, 256, 7168, 4, 3, 1)}},
}


def grouped_config(m: int, inter: int) -> dict[str, SplitConfig]:
    """The grouped config of the smallest M bucket that holds m, for experts of intermediate `inter`."""
    return _bucket(GROUPED_CONFIGS[shape_class(inter)], m)


@triton.jit
def _block_slots(ids_ptr, b, S, BM: tl.constexpr, SP: tl.constexpr):
    """Block b of the slots grouped by expert, from topk_ids alone: slot s is a leader when its rank
    among earlier slots of its expert is a multiple of BM; block b = the (b+1)-th leader and the
    next BM - 1 slots of its expert. Returns (expert or -1 when there is no block b, slots, valid)."""
    s = tl.arange(0, SP)
    live = s < S
    ids = tl.load(ids_ptr + s, mask=live, other=-1).to(tl.int32)
    same_before = (ids[:, None] == ids[None, :]) & (s[None, :] < s[:, None])
    rank = tl.sum(same_before.to(tl.int32), axis=1)
    leader = live & (rank % BM == 0)
    hit = leader & (tl.cumsum(leader.to(tl.int32), axis=0) == b + 1)
    e = tl.max(tl.where(hit, ids, -1), axis=0)
    r0 = tl.max(tl.where(hit, rank, 0), axis=0)
    j = tl.arange(0, BM)
    member = live[None, :] & (ids[None, :] == e) & (rank[None, :] == r0 + j[:, None])
    slot = tl.sum(tl.where(member, s[None, :], 0), axis=1)
    valid = tl.sum(member.to(tl.int32), axis=1) > 0
    return e, slot, valid


@triton.jit
def _aligned_slots(slots_ptr, seg_ptr, cnt_ptr, bexp_ptr, bms_ptr, b, E, BM: tl.constexpr):
    """Block b of align()'s table: (expert or -1 for an unused block, slots, valid)."""
    e = tl.load(bexp_ptr + b)
    live = e < E
    ec = tl.minimum(e, E - 1)
    mstart = tl.load(bms_ptr + b)
    seg = tl.load(seg_ptr + ec)
    cnt = tl.load(cnt_ptr + ec)
    j = tl.arange(0, BM)
    valid = live & (mstart + j < cnt)
    slot = tl.load(slots_ptr + seg + mstart + j, mask=valid, other=0)
    return tl.where(live, e, -1), slot, valid


@triton.jit
def _unpack_pair(v, BF16: tl.constexpr):
    """int32 holding two 16-bit activations -> (low, high) as fp32 (exact)."""
    if BF16:
        lo = (v << 16).to(tl.float32, bitcast=True)
        hi = (v & -65536).to(tl.float32, bitcast=True)
    else:
        lo = v.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (v >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _load_pairs(xp, k0, W: tl.constexpr):
    """The four pair-planes (int32 words of two activations) of the FMA path's step at k0."""
    return (tl.load(xp + k0 // 2), tl.load(xp + k0 // 2 + W), tl.load(xp + k0 // 2 + 2 * W),
            tl.load(xp + k0 // 2 + 3 * W))


@triton.jit
def _lane(src, j: tl.constexpr, magic):
    """2^(4j) * q of the biased nibble at bits 4j..4j+3 (j <= 3) of src: masked under 2^23's
    exponent, no shift (2^23 + 2^(4j) (q + 8) is exact), minus the constant. `magic` (0x4B000000)
    comes in as a kernel argument so that mask-and-or is one LOP3 (it takes one immediate)."""
    return ((src & (15 << (4 * j))) | magic).to(tl.float32, bitcast=True) - (8388608.0 + 8.0 * 16**j)


@triton.jit
def _word_dot(words, x0, x1, x2, x3, x4, x5, x6, x7, magic):
    """sum_j q_j * x_j over the 8 nibbles of each word: one xor and one shift a word, a mask, a
    subtraction and an FMA a nibble, Horner steps of 2^-4 between nibble pairs (j, j + 4)."""
    lo = words ^ -2004318072  # 0x88888888: two's complement -> q + 8
    hi = lo >> 16
    t = _lane(lo, 3, magic) * x3
    t += _lane(hi, 3, magic) * x7
    t = t * 0.0625
    t += _lane(lo, 2, magic) * x2
    t += _lane(hi, 2, magic) * x6
    t = t * 0.0625
    t += _lane(lo, 1, magic) * x1
    t += _lane(hi, 1, magic) * x5
    t = t * 0.0625
    t += _lane(lo, 0, magic) * x0
    t += _lane(hi, 0, magic) * x4
    return t


@triton.jit(do_not_specialize=["S"])
def _moe_splitk(a_ptr, ids_ptr, wq_ptr, ws_ptr, part_ptr, tw_ptr, S, N, K, a_rows_per_slot, magic,
                slots_ptr, seg_ptr, cnt_ptr, bexp_ptr, bms_ptr, E,
                ALIGNED: tl.constexpr, WEIGHTED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                KS: tl.constexpr, SP: tl.constexpr, DOT: tl.constexpr, ASM: tl.constexpr, BF16: tl.constexpr):
    """part[split, slot, n] = a[row(slot), chunk] . W_e[n, chunk] (x routing weight if WEIGHTED) for
    one (block, BN rows, KS chunk of K). Words load as [BN, BK/8] (BK/2 contiguous bytes a row),
    scales as [BN, BK/32] once per step and broadcast to their 4 words in registers.
    FMA (DOT & 3 == 0): a_ptr is the activation as int32 pairs, permuted per BK chunk (see _permute);
    plane dots (DOT 1): a_ptr holds plane-major rows (see _plane_major).
    ALIGNED: block b comes from align()'s table (any slot count) instead of _block_slots."""
    b = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    if ALIGNED:
        e, slot, valid = _aligned_slots(slots_ptr, seg_ptr, cnt_ptr, bexp_ptr, bms_ptr, b, E, BM)
    else:
        e, slot, valid = _block_slots(ids_ptr, b, S, BM, SP)
    if e >= 0:
        W: tl.constexpr = BK // 8
        G: tl.constexpr = BK // 32
        rn = pid_n * BN + tl.arange(0, BN)
        rw = tl.arange(0, W)
        kbeg = split * KS
        wrow = e.to(tl.int64) * N + rn
        wq = wq_ptr + wrow[:, None] * (K // 8) + kbeg // 8 + rw[None, :]
        ws = ws_ptr + wrow[:, None] * (K // 32) + kbeg // 32 + tl.arange(0, G)[None, :]
        if DOT & 3:
            arow = (slot // a_rows_per_slot).to(tl.int64)
            ap = a_ptr + arow[None, :] * K + kbeg + rw[:, None]  # [W, BM] on plane-major rows: plane j = ap + j W
            xm = valid[None, :]
            acc = tl.zeros((BN, BM), dtype=tl.float32)
            for k0 in range(0, KS, BK):
                words = tl.load(wq + k0 // 8)
                sc = tl.load(ws + k0 // 32)
                sw = tl.reshape(tl.broadcast_to(sc[:, :, None], (BN, G, 4)), (BN, W))
                x0, x1, x2, x3, x4, x5, x6, x7 = _load_planes(ap, k0, xm, W)
                acc = _plane_dots(words, sw, x0, x1, x2, x3, x4, x5, x6, x7, acc, a_ptr.dtype.element_ty, ASM)
        else:
            tl.static_assert(BM == 1)
            arow = (tl.sum(slot, axis=0) // a_rows_per_slot).to(tl.int64)
            # pair-plane p of a chunk: W int32 words, word w = elements 8w + 2p, 8w + 2p + 1
            xp = a_ptr + arow * (K // 2) + kbeg // 2 + rw[None, :] + 0 * rn[:, None]
            acc2 = tl.zeros((BN, W), dtype=tl.float32)
            if DOT & 4:
                words_next = tl.load(wq)
                sc_next = tl.load(ws)
                p0n, p1n, p2n, p3n = _load_pairs(xp, 0, W)
            for k0 in range(0, KS, BK):
                if DOT & 4:  # registers double-buffered: the next step's loads fly during this step
                    words, sc, p0, p1, p2, p3 = words_next, sc_next, p0n, p1n, p2n, p3n
                    kn = tl.minimum(k0 + BK, KS - BK)
                    words_next = tl.load(wq + kn // 8)
                    sc_next = tl.load(ws + kn // 32)
                    p0n, p1n, p2n, p3n = _load_pairs(xp, kn, W)
                else:
                    words = tl.load(wq + k0 // 8)
                    sc = tl.load(ws + k0 // 32)
                    p0, p1, p2, p3 = _load_pairs(xp, k0, W)
                sw = tl.reshape(tl.broadcast_to(sc[:, :, None], (BN, G, 4)), (BN, W))
                if DOT & 8:  # bf16x2 FMAs in PTX: two partial sums of four products a word
                    lo, hi = _unpack_pair(tl.inline_asm_elementwise(
                        _ASM_W4_DOT, "=r,r,r,r,r,r", [words, p0, p1, p2, p3], dtype=tl.int32, is_pure=True,
                        pack=1), True)
                    acc2 += (lo + hi) * sw.to(tl.float32)
                else:
                    x0, x1 = _unpack_pair(p0, BF16)
                    x2, x3 = _unpack_pair(p1, BF16)
                    x4, x5 = _unpack_pair(p2, BF16)
                    x6, x7 = _unpack_pair(p3, BF16)
                    acc2 += _word_dot(words, x0, x1, x2, x3, x4, x5, x6, x7, magic) * sw.to(tl.float32)
            acc = tl.sum(acc2, axis=1)[:, None]
        if WEIGHTED:
            acc = acc * tl.load(tw_ptr + slot, mask=valid, other=0.0)[None, :]
        op = part_ptr + (split * S + slot).to(tl.int64)[None, :] * N + rn[:, None]
        tl.store(op, acc, mask=valid[None, :])


@triton.jit
def _silu_mul(part_ptr, h_ptr, S, I, SPLITS: tl.constexpr, PERM: tl.constexpr, PLANES: tl.constexpr,
              BLOCK: tl.constexpr):
    """h[slot, c] = silu(gate) * up, gate / up = the gate_up partials summed over the K splits.
    PERM > 0 writes h in _permute's order for that BK (the FMA down pass reads it so); PLANES > 0 in
    _plane_major's order for that BK (the plane-major dot down pass)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < S * I
    row = offs // I
    col = offs % I
    g = tl.zeros((BLOCK,), dtype=tl.float32)
    u = tl.zeros((BLOCK,), dtype=tl.float32)
    for sp in tl.static_range(SPLITS):
        base = part_ptr + (sp * S + row).to(tl.int64) * (2 * I) + col
        g += tl.load(base, mask=live, other=0.0)
        u += tl.load(base + I, mask=live, other=0.0)
    h = g / (1.0 + tl.exp(-g)) * u
    if PERM:
        r = col % PERM  # element 8w + 2p + lo of the chunk -> pair-plane p, word w, half lo
        col = col - r + (r % 8 // 2) * (PERM // 4) + (r // 8) * 2 + r % 2
    if PLANES:
        r = col % PLANES  # element 8w + j of the chunk -> plane j, position w
        col = col - r + (r % 8) * (PLANES // 8) + r // 8
    tl.store(h_ptr + row * I + col, h.to(h_ptr.dtype.element_ty), mask=live)


@triton.jit
def _sum_slots(part_ptr, out_ptr, M, S, N, TOPK: tl.constexpr, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """out[m, n] = sum over K splits and the top-k slots of m of the (weighted) down partials."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < M * N
    row = offs // N
    col = offs % N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for sp in tl.static_range(SPLITS):
        for j in tl.static_range(TOPK):
            acc += tl.load(part_ptr + (sp * S + row * TOPK + j).to(tl.int64) * N + col, mask=live, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=live)


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
    _moe_splitk[(blocks, n // bn, k // ks)](
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
    _silu_mul[(triton.cdiv(s * inter, block),)](gu, hbuf, s, inter, SPLITS=gu.shape[0],
                                               PERM=0 if dn_plan.tensor_cores else dn_plan.bk,
                                               PLANES=dn_plan.bk if dn_plan.tensor_cores else 0,
                                               BLOCK=block)
    a = hbuf if dn_plan.tensor_cores else hbuf.view(torch.int32)
    dn = _split_launch(a, ids, w2_q, w2_s, tw, h, inter, 1, True, dn_plan, bf16, dn_al)
    out = torch.empty(m, h, dtype=x.dtype, device=x.device)
    _sum_slots[(triton.cdiv(m * h, block),)](dn, out, m, s, h, TOPK=topk, SPLITS=dn.shape[0], BLOCK=block)
    return out
