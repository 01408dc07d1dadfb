"""MLA tree verify for Hopper (sm_90) in Gluon: the kernel of kernels/mla_tree_attention.py with its MMAs laid out by hand.

Triton lays out the first of two chained dots with all warps along M; with a 64-row tile and two
warpgroups that makes both warpgroups compute the same 64 x 64 score block (kernels/NOTES.md
section 2). Here the score block is split by keys between the warpgroups (warps [4, 2]: each
computes its 32 keys over all 576 K columns, no work done twice), the row max crosses them through
shared memory each block (the row sums only once, at the end), P goes to shared memory, and each
warpgroup accumulates its 256 of the 512 output columns. Latent and rope blocks stream in by TMA
(one bulk tensor copy each, completion by an mbarrier's expected bytes; the compute warps spend no
issue slots or registers on the loads), two stages deep (block j + 1 in flight while block j is
computed); queries load once by cp.async and stay in shared memory. The cache is seen as 2-D
[batch * S, D] descriptors (`mla_tree_attention.key_args`): rows past a split's `end` come from the
next keys, the next sequence or (past the last) TMA's zero fill; their scores are masked, and in the
block that holds `end` the latent rows past it are zeroed in shared memory before P V, so unwritten
cache slots (NaN, Inf) cannot reach the output through 0 * V. Same programs, row tiles, splits,
masks and outputs as `_mla_rows`, which the wrapper shares; 8 warps, BM = BN = 64 (Q + two stages +
P: 225 KB of shared memory).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

NUM_WARPS = gl.constexpr(8)
KEY_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)  # the descriptors' tiles


@gluon.jit
def issue(c_desc, kp_desc, c_dst, kp_dst, bar, row):
    """TMA of keys row .. row + BN - 1 of the flattened cache into one stage, completing on `bar`."""
    mbarrier.expect(bar, c_desc.block_type.nbytes + kp_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(c_desc, [row, 0], bar, c_dst)
    tma.async_copy_global_to_shared(kp_desc, [row, 0], bar, kp_dst)


@gluon.jit
def zero_past(c_s, valid, BN: gl.constexpr, DL: gl.constexpr, WARPS: gl.constexpr):
    """Latent rows `valid` .. BN - 1 of a landed stage set to zero by WARPS warps (16-row chunks: few registers)."""
    CH: gl.constexpr = 16
    LD: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [WARPS, 1], [1, 0])
    for k in gl.static_range(BN // CH):
        part = c_s.slice(k * CH, CH, dim=0)
        r = k * CH + gl.arange(0, CH, layout=gl.SliceLayout(1, LD))
        part.store(gl.where((r < valid)[:, None], part.load(LD), 0.0))
    fence_async_shared()  # generic-proxy stores, read next by wgmma through the async proxy
    gl.thread_barrier()


@gluon.jit
def key_range(pid_m, pid_s, ctx, T, S, chunk, H: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, CAUSAL: gl.constexpr):
    """A program's keys: its split's start and end, where its whole prefix blocks end, its blocks."""
    start = pid_s * chunk
    end = gl.minimum(gl.minimum(start + chunk, ctx + T), S)  # the tree sits inside the cache
    if CAUSAL:  # no row of this tile sees past its last token's own key
        end = gl.minimum(end, ctx + gl.minimum((pid_m * BM + BM - 1) // H, T - 1) + 1)
    prefix_end = start + gl.maximum(gl.minimum(end, ctx) - start, 0) // BN * BN
    return start, end, prefix_end, gl.cdiv(gl.maximum(end - start, 0), BN)


@gluon.jit
def masked(s, n0, ctx, end, rs, rows, tok, mask_ptr, b, T, BN: gl.constexpr, CAUSAL: gl.constexpr):
    """Scores of keys n0 .. n0 + BN - 1 with the invisible ones at -inf: past `end`, or in the tree
    (key ctx + u) where tree_mask[b, token, u] is False (causal: u > token)."""
    rn = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, s.type.layout))
    rel = rn - ctx
    kval = rn < end
    if CAUSAL:
        seen = rel[None, :] <= tok[:, None]
    else:
        in_tree = (rs < rows)[:, None] & (kval & (rel >= 0))[None, :]
        mrow = mask_ptr + (b.to(gl.int64) * T + tok) * T
        seen = gl.load(mrow[:, None] + rel[None, :], mask=in_tree, other=0) != 0
    return gl.where(kval[None, :] & ((rel < 0)[None, :] | seen), s, float("-inf"))


@gluon.jit
def mla_rows_sm90(qn_ptr, qr_ptr, c_desc, kp_desc, ctx_ptr, mask_ptr, o_ptr, lse_ptr,
                  qk_scale, T, S, chunk, n_splits,
                  H: gl.constexpr, DL: gl.constexpr, DR: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                  CAUSAL: gl.constexpr, ONE_SPLIT: gl.constexpr):
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BN // 2, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, DL // 2, 16])
    LD_C: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [NUM_WARPS, 1], [1, 0])  # 16-byte copies
    LD_R: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])
    SH: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    ROW_S: gl.constexpr = gl.SliceLayout(1, S_L)
    ROW_O: gl.constexpr = gl.SliceLayout(1, O_L)

    pid_m = gl.program_id(0)
    pid_s = gl.program_id(1)
    b = gl.program_id(2)
    rows = T * H
    ctx = gl.load(ctx_ptr + b).to(gl.int32)
    q_n = gl.allocate_shared_memory(gl.bfloat16, [BM, DL], SH)
    q_r = gl.allocate_shared_memory(gl.bfloat16, [BM, DR], SH)
    c_buf = gl.allocate_shared_memory(gl.bfloat16, [2, BN, DL], c_desc.layout)
    kp_buf = gl.allocate_shared_memory(gl.bfloat16, [2, BN, DR], kp_desc.layout)
    p_buf = gl.allocate_shared_memory(gl.bfloat16, [BM, BN], SH)
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for k in gl.static_range(2):
        mbarrier.init(ready.index(k), count=1)

    # queries: rows past the sequence's last repeat it (computed, never stored)
    rq = b.to(gl.int64) * rows + gl.minimum(pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, LD_C)), rows - 1)
    cp.async_copy_global_to_shared(q_n, qn_ptr + rq[:, None] * DL + gl.arange(0, DL, layout=gl.SliceLayout(0, LD_C))[None, :])
    rq2 = b.to(gl.int64) * rows + gl.minimum(pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, LD_R)), rows - 1)
    cp.async_copy_global_to_shared(q_r, qr_ptr + rq2[:, None] * DR + gl.arange(0, DR, layout=gl.SliceLayout(0, LD_R))[None, :])
    cp.commit_group()

    start, end, prefix_end, n_blocks = key_range(pid_m, pid_s, ctx, T, S, chunk, H, BM, BN, CAUSAL)
    base = b * S  # this sequence's first row in the flattened cache
    if n_blocks > 0:
        issue(c_desc, kp_desc, c_buf.index(0), kp_buf.index(0), ready.index(0), base + start)
    cp.wait_group(0)
    fence_async_shared()
    gl.thread_barrier()  # every thread's query copies landed

    rs = pid_m * BM + gl.arange(0, BM, layout=ROW_S)
    tok = gl.minimum(rs, rows - 1) // H
    m_i = gl.full([BM], float("-inf"), gl.float32, ROW_S)
    l_2d = gl.zeros([BM, BN], gl.float32, S_L)  # row sums kept per column: one cross-warpgroup sum at the end
    acc = gl.zeros([BM, DL], gl.float32, O_L)
    for j in range(n_blocks):
        n0 = start + j * BN
        st = j % 2
        mbarrier.wait(ready.index(st), (j // 2) & 1)  # block j landed
        gl.thread_barrier()  # every warpgroup is done with block j - 1 (its stage is refilled next) and P
        if j + 1 < n_blocks:  # into the stage block j - 1 held, in flight while block j is computed
            issue(c_desc, kp_desc, c_buf.index(1 - st), kp_buf.index(1 - st), ready.index(1 - st), base + n0 + BN)
        c_s = c_buf.index(st)
        if n0 + BN > end:  # the block holding `end`: what lies past it is not this sequence's keys
            zero_past(c_s, end - n0, BN, DL, NUM_WARPS)
        s = warpgroup_mma(q_n, c_s.permute((1, 0)), gl.zeros([BM, BN], gl.float32, S_L), is_async=True)
        s = warpgroup_mma(q_r, kp_buf.index(st).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(0, deps=[s]) * qk_scale
        if n0 + BN > prefix_end:  # the prefix's tail block and the tree
            s = masked(s, n0, ctx, end, rs, rows, tok, mask_ptr, b, T, BN, CAUSAL)
        m_new = gl.maximum(m_i, gl.max(s, 1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row may have seen no key yet
        p = gl.exp2(s - m_use[:, None])
        alpha = gl.exp2(m_i - m_use)
        l_2d = l_2d * alpha[:, None] + p
        m_i = m_new
        acc = acc * gl.convert_layout(alpha, ROW_O)[:, None]
        p_buf.store(p.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()
        acc = warpgroup_mma(p_buf, c_s, acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
    for k in gl.static_range(2):
        mbarrier.invalidate(ready.index(k))
    l_i = gl.sum(l_2d, 1)
    l_safe = gl.where(l_i == 0.0, 1.0, l_i)
    out = acc / gl.convert_layout(l_safe, ROW_O)[:, None]
    ro = pid_m * BM + gl.arange(0, BM, layout=ROW_O)
    rd = gl.arange(0, DL, layout=gl.SliceLayout(0, O_L))
    row = b.to(gl.int64) * rows + ro
    if ONE_SPLIT:
        gl.store(o_ptr + row[:, None] * DL + rd[None, :], out.to(o_ptr.dtype.element_ty), mask=(ro < rows)[:, None])
    else:
        gl.store(o_ptr + (row * n_splits + pid_s)[:, None] * DL + rd[None, :], out, mask=(ro < rows)[:, None])
        lse = gl.where(l_i == 0.0, float("-inf"), m_i + gl.log2(l_safe))
        gl.store(lse_ptr + (b.to(gl.int64) * rows + rs) * n_splits + pid_s, lse, mask=rs < rows)
