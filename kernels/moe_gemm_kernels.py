"""The MoE's split-K passes as Triton kernels: a block's slots, the GEMM pass, and the two combines.

`moe_splitk` writes fp32 partials per K split for one (block, BN rows, KS chunk); `silu_mul` sums
gate_up's splits into h (in the layout the down pass reads), `sum_slots` sums down's over the splits
and the top-k in a fixed order. kernels/moe_gemm.py plans and launches them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.moe_gemm_dequant import ASM_W4_DOT, load_pairs, load_planes, plane_dots, unpack_pair, word_dot


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
    """Block b of moe_gemm.align()'s table: (expert or -1 for an unused block, slots, valid)."""
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


@triton.jit(do_not_specialize=["S"])
def moe_splitk(a_ptr, ids_ptr, wq_ptr, ws_ptr, part_ptr, tw_ptr, S, N, K, a_rows_per_slot, magic,
               slots_ptr, seg_ptr, cnt_ptr, bexp_ptr, bms_ptr, E,
               ALIGNED: tl.constexpr, WEIGHTED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               KS: tl.constexpr, SP: tl.constexpr, DOT: tl.constexpr, ASM: tl.constexpr, BF16: tl.constexpr):
    """part[split, slot, n] = a[row(slot), chunk] . W_e[n, chunk] (x routing weight if WEIGHTED) for
    one (block, BN rows, KS chunk of K). Words load as [BN, BK/8] (BK/2 contiguous bytes a row),
    scales as [BN, BK/32] once per step and broadcast to their 4 words in registers.
    FMA (DOT & 3 == 0): a_ptr is the activation as int32 pairs, permuted per BK chunk (see
    moe_gemm._permute); plane dots (DOT 1): a_ptr holds plane-major rows (see moe_gemm._plane_major).
    ALIGNED: block b comes from moe_gemm.align()'s table (any slot count) instead of _block_slots."""
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
                x0, x1, x2, x3, x4, x5, x6, x7 = load_planes(ap, k0, xm, W)
                acc = plane_dots(words, sw, x0, x1, x2, x3, x4, x5, x6, x7, acc, a_ptr.dtype.element_ty, ASM)
        else:
            tl.static_assert(BM == 1)
            arow = (tl.sum(slot, axis=0) // a_rows_per_slot).to(tl.int64)
            # pair-plane p of a chunk: W int32 words, word w = elements 8w + 2p, 8w + 2p + 1
            xp = a_ptr + arow * (K // 2) + kbeg // 2 + rw[None, :] + 0 * rn[:, None]
            acc2 = tl.zeros((BN, W), dtype=tl.float32)
            if DOT & 4:
                words_next = tl.load(wq)
                sc_next = tl.load(ws)
                p0n, p1n, p2n, p3n = load_pairs(xp, 0, W)
            for k0 in range(0, KS, BK):
                if DOT & 4:  # registers double-buffered: the next step's loads fly during this step
                    words, sc, p0, p1, p2, p3 = words_next, sc_next, p0n, p1n, p2n, p3n
                    kn = tl.minimum(k0 + BK, KS - BK)
                    words_next = tl.load(wq + kn // 8)
                    sc_next = tl.load(ws + kn // 32)
                    p0n, p1n, p2n, p3n = load_pairs(xp, kn, W)
                else:
                    words = tl.load(wq + k0 // 8)
                    sc = tl.load(ws + k0 // 32)
                    p0, p1, p2, p3 = load_pairs(xp, k0, W)
                sw = tl.reshape(tl.broadcast_to(sc[:, :, None], (BN, G, 4)), (BN, W))
                if DOT & 8:  # bf16x2 FMAs in PTX: two partial sums of four products a word
                    lo, hi = unpack_pair(tl.inline_asm_elementwise(
                        ASM_W4_DOT, "=r,r,r,r,r,r", [words, p0, p1, p2, p3], dtype=tl.int32, is_pure=True,
                        pack=1), True)
                    acc2 += (lo + hi) * sw.to(tl.float32)
                else:
                    x0, x1 = unpack_pair(p0, BF16)
                    x2, x3 = unpack_pair(p1, BF16)
                    x4, x5 = unpack_pair(p2, BF16)
                    x6, x7 = unpack_pair(p3, BF16)
                    acc2 += word_dot(words, x0, x1, x2, x3, x4, x5, x6, x7, magic) * sw.to(tl.float32)
            acc = tl.sum(acc2, axis=1)[:, None]
        if WEIGHTED:
            acc = acc * tl.load(tw_ptr + slot, mask=valid, other=0.0)[None, :]
        op = part_ptr + (split * S + slot).to(tl.int64)[None, :] * N + rn[:, None]
        tl.store(op, acc, mask=valid[None, :])


@triton.jit
def silu_mul(part_ptr, h_ptr, S, I, SPLITS: tl.constexpr, PERM: tl.constexpr, PLANES: tl.constexpr,
             BLOCK: tl.constexpr):
    """h[slot, c] = silu(gate) * up, gate / up = the gate_up partials summed over the K splits.
    PERM > 0 writes h in moe_gemm._permute's order for that BK (the FMA down pass reads it so); PLANES > 0 in
    moe_gemm._plane_major's order for that BK (the plane-major dot down pass)."""
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
def sum_slots(part_ptr, out_ptr, M, S, N, TOPK: tl.constexpr, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
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


