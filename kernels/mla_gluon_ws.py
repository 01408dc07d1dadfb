"""MLA tree verify for Hopper (sm_90) in Gluon, FlashMLA's schedule: two warpgroups out of phase, key blocks by TMA.

mla_gluon.py's kernel runs both warpgroups in lockstep, each computing half the keys of a block
(N = 32 wgmmas), with CTA-wide barriers between the score MMA, the row max and P V, so nothing
overlaps the softmax with the tensor cores (kernels/NOTES.md section 2). Here the two warpgroups are
warp-specialized partitions that meet only at mbarriers: warpgroup 0 takes the even key blocks
(shared buffer 0), warpgroup 1 the odd ones (buffer 1), each computing a whole 64 x 64 score block
(N = 64) over all 576 K columns, so one's softmax runs while the other's QK^T or P V is on the
tensor cores. Each accumulates P V for its 256 of the 512 output columns from both blocks of a
pair: P of each block and the running row max cross through shared memory, and the accumulator is
rescaled at each max change so both halves stay at one scale (the row sums too, added once after
the loop). Each warpgroup loads its own blocks by TMA (mla_gluon.issue: one bulk tensor copy each
for the latent and rope block, completion on its `land` mbarrier; rows past a split's end masked in
the scores and zeroed in shared memory before either warpgroup's P V reads them); the other's reads
are ordered by mbarriers (ready / free per buffer). Queries: nope part in shared memory (both read
it), rope part in registers (wgmma's A from registers), which is what makes Q + two blocks + two P
fit in 227 KB. Same programs, row tiles, splits, masks and outputs as `_mla_rows`; 4 + 4 warps,
BM = BN = 64.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait

from kernels.mla_gluon import issue, key_range, masked, zero_past

NUM_WARPS = gl.constexpr(4)  # a partition's: the default one (warpgroup 0) and the worker (warpgroup 1)
WORKER_REGS = gl.constexpr(256)


@gluon.jit
def _signal(bar):
    """Arrive once for the whole warpgroup, after every thread's shared-memory writes and wgmmas."""
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(bar)


@gluon.jit
def _warpgroup(qn_ptr, qr_ptr, c_desc, kp_desc, ctx_ptr, mask_ptr, o_ptr, lse_ptr,
               qk_scale, T, S, chunk, n_splits, q_buf, c_buf, kp_buf, p_buf, m_buf, l_buf, bars, land,
               H: gl.constexpr, DL: gl.constexpr, DR: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
               CAUSAL: gl.constexpr, ONE_SPLIT: gl.constexpr, ROLE: gl.constexpr):
    """One warpgroup's part: ROLE 0 the even key blocks and output columns 0 .. DL/2, ROLE 1 the odd and the rest.

    bars: 0 queries landed, 1 + r buffer r ready for P V (zeroed past the end) and P_r + its max
    stored, 3 + r buffer r and P_r read by the other warpgroup (free), 5 + r row sums stored.
    land: r buffer r's TMA landed.
    """
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DL // 2, 16])
    Q_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=S_L, k_width=2)
    LD_C: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    ROW_S: gl.constexpr = gl.SliceLayout(1, S_L)
    ROW_O: gl.constexpr = gl.SliceLayout(1, O_L)
    HALF: gl.constexpr = DL // 2
    OTHER: gl.constexpr = 1 - ROLE

    pid_m = gl.program_id(0)
    pid_s = gl.program_id(1)
    b = gl.program_id(2)
    rows = T * H
    ctx = gl.load(ctx_ptr + b).to(gl.int32)
    start, end, prefix_end, n_blocks = key_range(pid_m, pid_s, ctx, T, S, chunk, H, BM, BN, CAUSAL)
    n_pairs = gl.cdiv(n_blocks, 2)
    base = b * S  # this sequence's first row in the flattened cache
    c_own = c_buf.index(ROLE)
    kp_own = kp_buf.index(ROLE)
    if n_blocks > 0:  # both buffers: an odd block past the end is all masked and zeroed
        issue(c_desc, kp_desc, c_own, kp_own, land.index(ROLE), base + start + ROLE * BN)

    # queries: rows past the sequence's last repeat it (computed, never stored); warpgroup 0 loads the
    # shared nope part, each warpgroup its own registers of the rope part
    if ROLE == 0:
        rq = b.to(gl.int64) * rows + gl.minimum(pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, LD_C)), rows - 1)
        cp.async_copy_global_to_shared(q_buf.index(0), qn_ptr + rq[:, None] * DL + gl.arange(0, DL, layout=gl.SliceLayout(0, LD_C))[None, :])
        cp.commit_group()
    rq2 = b.to(gl.int64) * rows + gl.minimum(pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, Q_OP)), rows - 1)
    q_r = gl.load(qr_ptr + rq2[:, None] * DR + gl.arange(0, DR, layout=gl.SliceLayout(0, Q_OP))[None, :])
    if ROLE == 0:
        cp.wait_group(0)
        _signal(bars.index(0))
    else:
        mbarrier.wait(bars.index(0), 0)

    rs = pid_m * BM + gl.arange(0, BM, layout=ROW_S)
    tok = gl.minimum(rs, rows - 1) // H
    m_i = gl.full([BM], float("-inf"), gl.float32, ROW_S)
    l_i = gl.zeros([BM], gl.float32, ROW_S)  # this warpgroup's blocks' row sums, at m_i's scale
    acc = gl.zeros([BM, HALF], gl.float32, O_L)
    for i in range(n_pairs):
        ph = i & 1
        n0 = start + (2 * i + ROLE) * BN  # this warpgroup's block (past the end in a short last pair: all masked)
        z = n0 >> 31  # 0 (n0 >= 0), unknown to the compiler: buffers indexed by it have their wgmma
        c_own = c_buf.index(ROLE + z)  # descriptors made each block, not hoisted into (spilled) registers
        kp_own = kp_buf.index(ROLE + z)
        mbarrier.wait(land.index(ROLE), ph)
        s = warpgroup_mma(q_buf.index(z), c_own.permute((1, 0)), gl.zeros([BM, BN], gl.float32, S_L), use_acc=False,
                          is_async=True)
        s = warpgroup_mma(q_r, kp_own.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(0, deps=[s]) * qk_scale
        if n0 + BN > end:  # the block holding `end`: what lies past it is not this sequence's keys
            zero_past(c_own, end - n0, BN, DL, NUM_WARPS)
        if n0 + BN > prefix_end:  # the prefix's tail block and the tree
            s = masked(s, n0, ctx, end, rs, rows, tok, mask_ptr, b, T, BN, CAUSAL)
        if ROLE == 1:  # the even block's P V first, at its max, in flight during this softmax
            mbarrier.wait(bars.index(1), ph)
            m_even = m_buf.index(0).load(ROW_S)
            alpha = gl.exp2(m_i - gl.where(m_even == float("-inf"), 0.0, m_even))
            l_i = l_i * alpha
            acc = acc * gl.convert_layout(alpha, ROW_O)[:, None]
            acc = warpgroup_mma(p_buf.index(0), c_buf.index(0).slice(HALF, HALF, dim=1), acc, is_async=True)
            m_i = m_even
        m_new = gl.maximum(m_i, gl.max(s, 1))  # the softmax: warpgroup 0's overlaps warpgroup 1's QK^T
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row may have seen no key yet
        p = gl.exp2(s - m_use[:, None])
        alpha = gl.exp2(m_i - m_use)
        m_i = m_new
        if ROLE == 1:  # buffer 0 and P_0 read: signalled before P_1, so that buffer 0 refills early
            acc = warpgroup_mma_wait(0, deps=[acc])
            _signal(bars.index(3))
        p_buf.index(ROLE).store(p.to(gl.bfloat16))
        m_buf.index(ROLE).store(m_new)
        _signal(bars.index(1 + ROLE))
        l_i = l_i * alpha + gl.sum(p, 1)
        acc = acc * gl.convert_layout(alpha, ROW_O)[:, None]
        acc = warpgroup_mma(p_buf.index(ROLE), c_own.slice(ROLE * HALF, HALF, dim=1), acc, is_async=True)
        if ROLE == 0:
            acc = warpgroup_mma_wait(0, deps=[acc])
            if i + 1 < n_pairs:  # the next even block, in flight while the odd block's softmax and P_1 V_1 run
                mbarrier.wait(bars.index(3), ph)
                issue(c_desc, kp_desc, c_own, kp_own, land.index(ROLE), base + n0 + 2 * BN)
            mbarrier.wait(bars.index(2), ph)  # then the odd block's P V, at the pair's max
            m_odd = m_buf.index(1).load(ROW_S)
            beta = gl.exp2(m_i - gl.where(m_odd == float("-inf"), 0.0, m_odd))
            l_i = l_i * beta
            acc = acc * gl.convert_layout(beta, ROW_O)[:, None]
            acc = warpgroup_mma(p_buf.index(1), c_buf.index(1).slice(0, HALF, dim=1), acc, is_async=True)
            m_i = m_odd
            acc = warpgroup_mma_wait(0, deps=[acc])
            _signal(bars.index(4))  # buffer 1 and P_1 read
        else:
            acc = warpgroup_mma_wait(0, deps=[acc])
            if i + 1 < n_pairs:
                mbarrier.wait(bars.index(4), ph)
                issue(c_desc, kp_desc, c_own, kp_own, land.index(ROLE), base + n0 + 2 * BN)

    # both halves' sums are at the final max: add them across the warpgroups
    l_buf.index(ROLE).store(l_i)
    _signal(bars.index(5 + ROLE))
    mbarrier.wait(bars.index(5 + OTHER), 0)
    l_i = l_i + l_buf.index(OTHER).load(ROW_S)
    l_safe = gl.where(l_i == 0.0, 1.0, l_i)
    out = acc / gl.convert_layout(l_safe, ROW_O)[:, None]
    ro = pid_m * BM + gl.arange(0, BM, layout=ROW_O)
    rd = ROLE * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, O_L))
    row = b.to(gl.int64) * rows + ro
    if ONE_SPLIT:
        gl.store(o_ptr + row[:, None] * DL + rd[None, :], out.to(o_ptr.dtype.element_ty), mask=(ro < rows)[:, None])
    else:
        gl.store(o_ptr + (row * n_splits + pid_s)[:, None] * DL + rd[None, :], out, mask=(ro < rows)[:, None])
        if ROLE == 0:
            lse = gl.where(l_i == 0.0, float("-inf"), m_i + gl.log2(l_safe))
            gl.store(lse_ptr + (b.to(gl.int64) * rows + rs) * n_splits + pid_s, lse, mask=rs < rows)


@gluon.jit
def mla_rows_sm90_ws(qn_ptr, qr_ptr, c_desc, kp_desc, ctx_ptr, mask_ptr, o_ptr, lse_ptr,
                     qk_scale, T, S, chunk, n_splits,
                     H: gl.constexpr, DL: gl.constexpr, DR: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                     CAUSAL: gl.constexpr, ONE_SPLIT: gl.constexpr):
    SH: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    FLAT: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    q_buf = gl.allocate_shared_memory(gl.bfloat16, [1, BM, DL], SH)
    c_buf = gl.allocate_shared_memory(gl.bfloat16, [2, BN, DL], c_desc.layout)
    kp_buf = gl.allocate_shared_memory(gl.bfloat16, [2, BN, DR], kp_desc.layout)
    p_buf = gl.allocate_shared_memory(gl.bfloat16, [2, BM, BN], SH)
    m_buf = gl.allocate_shared_memory(gl.float32, [2, BM], FLAT)
    l_buf = gl.allocate_shared_memory(gl.float32, [2, BM], FLAT)
    bars = gl.allocate_shared_memory(gl.int64, [7, 1], mbarrier.MBarrierLayout())
    land = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for k in gl.static_range(7):
        mbarrier.init(bars.index(k), count=1)
    for k in gl.static_range(2):
        mbarrier.init(land.index(k), count=1)
    fence_async_shared()  # the barriers' init, seen by TMA
    gl.warp_specialize([
        (_warpgroup, (qn_ptr, qr_ptr, c_desc, kp_desc, ctx_ptr, mask_ptr, o_ptr, lse_ptr, qk_scale, T, S, chunk, n_splits,
                      q_buf, c_buf, kp_buf, p_buf, m_buf, l_buf, bars, land, H, DL, DR, BM, BN, CAUSAL, ONE_SPLIT, 0)),
        (_warpgroup, (qn_ptr, qr_ptr, c_desc, kp_desc, ctx_ptr, mask_ptr, o_ptr, lse_ptr, qk_scale, T, S, chunk, n_splits,
                      q_buf, c_buf, kp_buf, p_buf, m_buf, l_buf, bars, land, H, DL, DR, BM, BN, CAUSAL, ONE_SPLIT, 1)),
    ], [NUM_WARPS], [WORKER_REGS])
