"""MLA tree-verify attention, absorbed form: tokens x heads packed into the MMA's rows.

A sequence's T query tokens x H heads are R = T * H rows (row r = token r // H, head r % H, the
layout q already has). One program = (tile of BM rows, one split of the key range, sequence b):
every latent block it loads serves all BM rows, so the cache is read ceil(R / BM) times a sequence
(at H = 8, BM = 64: once per 8 tokens), not once per token. QK^T runs over 512 + 64, PV over the
same latent tile. Keys below the tree (the prefix) are visible to every row and go through a loop
with no mask and no bounds; only the blocks from the last whole prefix block on see the tree mask
(key ctx_b + u is visible to token t iff tree_mask[b, t, u]) or, with causal=True, u <= t, where a
tile stops at its last token's own key. Splits of the key range are planned on the host from sizes
alone (no sync) to fill the chip; a combine kernel merges them by log-sum-exp in a fixed order, so
results do not depend on scheduling. T = 1 with mask [[True]] is plain decode through the same path.
Three kernels compute this: `_mla_rows` here (tl.dot; every GPU and the CPU interpreter) and, on
sm_90, mla_gluon.py's (the same programs with the MMA layouts written out, key blocks by TMA) and
mla_gluon_ws.py's (the same programs, two warpgroups out of phase, FlashMLA's schedule);
`CONFIGS` picks.
"""

from __future__ import annotations

from functools import cache
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

try:  # Gluon (triton.experimental) ships with Triton 3.6; without it the tl.dot kernel runs everywhere
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from kernels import mla_gluon, mla_gluon_ws
except ImportError:
    mla_gluon = mla_gluon_ws = None

LOG2E = 1.4426950408889634  # scores go through exp2


class Config(NamedTuple):
    """A tile config: which kernel ("triton": tl.dot, any backend and the interpreter; "gluon": the
    sm_90 kernel of mla_gluon.py, bf16, BM = BN = 64, 8 warps; "gluon_ws": mla_gluon_ws.py's, bf16,
    BM = BN = 64, 4 warps a warpgroup), its row and key tiles, warps, stages."""

    kernel: str
    bm: int
    bn: int
    warps: int
    stages: int


# Configs keyed by CUDA capability; None is the default (other GPUs and the CPU interpreter). Each
# entry maps a row class to its Config: "small" when a sequence has at most 16 query rows (decode
# at TP-8), "short" when it has more but the launch's work is at most SHORT_WORK[capability] (a
# capability without that entry has no short class), "rows" otherwise. On sm_90 gluon_ws is the
# fastest kernel where the work is larger and v5's lockstep kernel ("gluon") below: gluon_ws's
# two-warpgroup pipeline costs a few microseconds more a launch (kernels/NOTES.md section 2, v9);
# the "small" configs are checked on the GPU but not yet timed.
CONFIGS: dict[tuple[int, int] | None, dict[str, Config]] = {
    (9, 0): {"rows": Config("gluon_ws", 64, 64, 4, 1), "short": Config("gluon", 64, 64, 8, 1),
             "small": Config("triton", 16, 64, 4, 3)},
    None: {"rows": Config("triton", 64, 64, 8, 2), "small": Config("triton", 16, 64, 4, 2)},
}
# A launch's work in 64-row tiles x 64-key blocks: batch x tiles a sequence x blocks of the cache's
# capacity (the host knows it without a sync; each sequence's context is on the GPU). Up to this
# much, a capability runs its "short" config.
SHORT_WORK: dict[tuple[int, int], int] = {(9, 0): 1024}
WORK_TILE = 64


class PlanCosts(NamedTuple):
    """The split planner's cost model for one row kernel, in units of one key block's time for one
    row tile: the key blocks a program takes at a time (a split is a whole number of them), a
    program's fixed cost (load its queries, start its pipeline, write its rows), the extra of
    writing fp32 partials, the combine's launch, and its read of one (tile, split)'s partials."""

    unit: int
    fixed: float
    partial: float
    combine: float
    per_part: float


# Costs by row kernel. tl.dot's and v5's are estimates, not fits. gluon_ws takes its blocks in pairs
# (one a warpgroup); its costs are a least-squares fit of its H200 times over FlashMLA's grid under
# the estimated costs' plans (kernels/NOTES.md section 2, v7): the programs of a wave start and end
# in step, so their queries, first loads and partials' writes are long next to a block.
_V5_COSTS = PlanCosts(1, 2.0, 1.0, 2.0, 0.02)
PLAN_COSTS: dict[str, PlanCosts] = {"triton": _V5_COSTS, "gluon": _V5_COSTS,
                                    "gluon_ws": PlanCosts(2, 6.1, 7.7, 3.6, 0.0)}
MAX_SPLITS = 128
SPLIT_GAIN = 0.03  # splitting costs partials' memory: it must save this fraction of the time


@triton.jit
def _attend(acc, m_i, l_i, qn, qr, c, kp, vis, qk_scale, MASKED: tl.constexpr):
    """One key block of online softmax: scores, running max / sum, accumulator update."""
    s = (tl.dot(qn, tl.trans(c)) + tl.dot(qr, tl.trans(kp))) * qk_scale
    if MASKED:
        s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASKED:  # a row may have seen no key yet: keep exp2 away from -inf - -inf
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c)
    return acc, m_new, l_i


@triton.jit
def _mla_rows(qn_ptr, qr_ptr, ckv_ptr, kpe_ptr, ctx_ptr, mask_ptr, o_ptr, lse_ptr,
              qk_scale, T, S, chunk, n_splits,
              H: tl.constexpr, DL: tl.constexpr, DR: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
              CAUSAL: tl.constexpr, ONE_SPLIT: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = tl.program_id(2)
    rows = T * H
    ctx = tl.load(ctx_ptr + b).to(tl.int32)
    rm = pid_m * BM + tl.arange(0, BM)
    rval = rm < rows
    tok = rm // H
    row = b.to(tl.int64) * rows + rm
    rdl = tl.arange(0, DL)
    rdr = tl.arange(0, DR)
    qn = tl.load(qn_ptr + row[:, None] * DL + rdl[None, :], mask=rval[:, None], other=0.0)
    qr = tl.load(qr_ptr + row[:, None] * DR + rdr[None, :], mask=rval[:, None], other=0.0)
    start = pid_s * chunk
    end = tl.minimum(tl.minimum(start + chunk, ctx + T), S)  # the tree sits inside the cache
    if CAUSAL:  # no row of this tile sees past its last token's own key
        end = tl.minimum(end, ctx + tl.minimum((pid_m * BM + BM - 1) // H, T - 1) + 1)
    prefix_end = start + tl.maximum(tl.minimum(end, ctx) - start, 0) // BN * BN
    m_i = tl.full((BM,), float("-inf"), tl.float32)
    l_i = tl.zeros((BM,), tl.float32)
    acc = tl.zeros((BM, DL), tl.float32)
    kv = ckv_ptr + b.to(tl.int64) * S * DL
    kr = kpe_ptr + b.to(tl.int64) * S * DR
    for n0 in range(start, prefix_end, BN):  # whole prefix blocks: every key visible to every row
        rn = n0 + tl.arange(0, BN)
        c = tl.load(kv + rn[:, None] * DL + rdl[None, :])
        kp = tl.load(kr + rn[:, None] * DR + rdr[None, :])
        acc, m_i, l_i = _attend(acc, m_i, l_i, qn, qr, c, kp, None, qk_scale, MASKED=False)
    mrow = mask_ptr + (b.to(tl.int64) * T + tok) * T
    for n0 in range(prefix_end, end, BN):  # the prefix's tail block and the tree
        rn = n0 + tl.arange(0, BN)
        kval = rn < end
        c = tl.load(kv + rn[:, None] * DL + rdl[None, :], mask=kval[:, None], other=0.0)
        kp = tl.load(kr + rn[:, None] * DR + rdr[None, :], mask=kval[:, None], other=0.0)
        rel = rn - ctx
        if CAUSAL:
            seen = rel[None, :] <= tok[:, None]
        else:
            in_tree = rval[:, None] & (kval & (rel >= 0))[None, :]
            seen = tl.load(mrow[:, None] + rel[None, :], mask=in_tree, other=0).to(tl.int1)
        vis = kval[None, :] & ((rel < 0)[None, :] | seen)
        acc, m_i, l_i = _attend(acc, m_i, l_i, qn, qr, c, kp, vis, qk_scale, MASKED=True)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    if ONE_SPLIT:
        tl.store(o_ptr + row[:, None] * DL + rdl[None, :], out.to(o_ptr.dtype.element_ty), mask=rval[:, None])
    else:
        prow = row * n_splits + pid_s
        tl.store(o_ptr + prow[:, None] * DL + rdl[None, :], out, mask=rval[:, None])
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(lse_ptr + prow, lse, mask=rval)


@triton.jit
def _mla_combine(part_ptr, lse_ptr, o_ptr, n_splits, DL: tl.constexpr, BD: tl.constexpr, NSP: tl.constexpr):
    """o[row, d-chunk] = sum_s 2^(lse_s - max) o_s / sum_s 2^(lse_s - max), splits in a fixed order."""
    row = tl.program_id(0).to(tl.int64)
    rs = tl.arange(0, NSP)
    smask = rs < n_splits
    prow = row * n_splits + rs
    lse = tl.load(lse_ptr + prow, mask=smask, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    w = w / tl.sum(w, 0)
    rd = tl.program_id(1) * BD + tl.arange(0, BD)
    o = tl.load(part_ptr + prow[:, None] * DL + rd[None, :], mask=smask[:, None], other=0.0)
    tl.store(o_ptr + row * DL + rd, tl.sum(o * w[:, None], 0).to(o_ptr.dtype.element_ty))


@cache
def sm_count(device: torch.device) -> int:
    """The device's SMs, for the split plan; an H200's 132 off the GPU (the interpreter's tests)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def capability(device: torch.device) -> tuple[int, int] | None:
    """The CUDA capability `CONFIGS` is keyed by; None off CUDA (the CPU interpreter)."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def pick_config(cap: tuple[int, int] | None, dtype: torch.dtype, batch: int, rows: int, cache_rows: int) -> Config:
    """The Config for `batch` sequences of `rows` query rows over caches of `cache_rows` rows on a
    device of capability `cap` (the default where a table entry's kernel cannot run these inputs):
    the one choice both the launch and the kernels table's impl column (kernels.ops.mla_impl) read."""
    if rows <= 16:
        cls = "small"
    elif cap in SHORT_WORK and batch * triton.cdiv(rows, WORK_TILE) * triton.cdiv(cache_rows, WORK_TILE) <= SHORT_WORK[cap]:
        cls = "short"
    else:
        cls = "rows"
    cfg = CONFIGS.get(cap, CONFIGS[None])[cls]
    if cfg.kernel == "triton" or gluon_runs(cap, dtype):
        return cfg
    return CONFIGS[None]["small" if cls == "small" else "rows"]


def gluon_runs(cap: tuple[int, int] | None, dtype: torch.dtype) -> bool:
    """Whether the sm_90 Gluon kernels can run here: Gluon imported, a Hopper GPU, bf16 inputs."""
    return mla_gluon is not None and cap == (9, 0) and dtype == torch.bfloat16


def rows_kernel(cfg: Config, cap: tuple[int, int] | None, dtype: torch.dtype) -> Any:
    """The row kernel `cfg` names, after checking it can run these inputs with these tiles."""
    if cfg.kernel == "triton":
        return _mla_rows
    if cfg.kernel not in ("gluon", "gluon_ws"):
        raise ValueError(f"mla_tree_attention: unknown kernel {cfg.kernel!r} (triton, gluon, gluon_ws)")
    gluon = mla_gluon if cfg.kernel == "gluon" else mla_gluon_ws
    if not (gluon_runs(cap, dtype) and (cfg.bm, cfg.bn, cfg.warps) == (64, 64, gluon.NUM_WARPS.value)):
        warps = "8 warps" if cfg.kernel == "gluon" else "4 warps a warpgroup"
        raise ValueError(f"mla_tree_attention: {cfg} needs Gluon, an sm_90 GPU, bf16 and BM = BN = 64, {warps}")
    return gluon.mla_rows_sm90 if cfg.kernel == "gluon" else gluon.mla_rows_sm90_ws


def key_args(cfg: Config, ckv: Tensor, kpe: Tensor) -> tuple[Any, Any]:
    """The cache as the row kernel takes it: tensors, or for the Gluon kernels TMA descriptors of key
    blocks over the flattened [batch * S, D] cache."""
    if cfg.kernel == "triton":
        return ckv, kpe
    return tuple(TensorDescriptor.from_tensor(x.view(-1, x.shape[-1]), [cfg.bn, x.shape[-1]], mla_gluon.KEY_LAYOUT)
                 for x in (ckv, kpe))


def split_plan(blocks: int, want: int, unit: int) -> tuple[int, int]:
    """(splits, key blocks a split) for `want` splits of `blocks` blocks, each a whole number of the
    kernel's units: the planner's candidate for that count, and what a forced count runs, so that a
    sweep of counts times the plans the planner chooses between. Fewer splits where rounding up
    covers the cache sooner."""
    per = triton.cdiv(triton.cdiv(blocks, want), unit) * unit
    return triton.cdiv(blocks, per), per


def plan_splits(tiles: int, s: int, bn: int, sms: int, costs: PlanCosts = _V5_COSTS) -> tuple[int, int]:
    """(splits, keys per split) for `tiles` row tiles over an `s`-key cache, from host-known sizes.

    Cost in key blocks: waves of one program per SM (a tile's latent and query tiles fill its
    shared memory) times the blocks of a split (whole units) plus a program's fixed cost and, when
    split, its partials' write; plus, when split, the combine pass. Ties go to fewer splits.
    """
    blocks = triton.cdiv(s, bn)
    best = (float("inf"), 1, blocks)
    for want in range(1, min(blocks, MAX_SPLITS) + 1):  # a split must save SPLIT_GAIN over one pass
        n, per = split_plan(blocks, want, costs.unit)
        if n != want:
            continue
        split = n > 1
        cost = triton.cdiv(tiles * n, sms) * (per + costs.fixed + costs.partial * split)
        cost += split * (costs.combine + costs.per_part * tiles * n)
        if cost < best[0] * (1.0 - SPLIT_GAIN * (split and best[1] == 1)):
            best = (cost, n, per)
    return best[1], best[2] * bn


def mla_tree_attention(q_nope: Tensor, q_rope: Tensor, ckv: Tensor, kpe: Tensor, ctx_lens: Tensor,
                       tree_mask: Tensor | None, sm_scale: float, causal: bool = False,
                       config: Config | None = None, splits: int | None = None) -> Tensor:
    """MLA tree verify (or, with causal=True, a chunk of prompt tokens over the prefix and causally
    among themselves; tree_mask is then ignored and may be None). `config` and `splits` override
    the table and the planner for the tuning sweep; a forced count runs the planner's candidate for
    it (`split_plan`: whole units of the kernel)."""
    bt, t, hh, dl = q_nope.shape
    dr = q_rope.shape[-1]
    s = ckv.shape[1]
    if dl & (dl - 1) or dr & (dr - 1):
        raise ValueError(f"mla_tree_attention: latent {dl} and rope {dr} must be powers of two")
    if not causal and tree_mask is None:
        raise ValueError("mla_tree_attention: a tree mask is needed unless causal=True")
    rows, cap = t * hh, capability(q_nope.device)
    cfg = config or pick_config(cap, q_nope.dtype, bt, rows, s)
    kernel = rows_kernel(cfg, cap, q_nope.dtype)
    tiles = triton.cdiv(rows, cfg.bm)
    if splits is None:
        n_splits, chunk = plan_splits(bt * tiles, s, cfg.bn, sm_count(q_nope.device), PLAN_COSTS[cfg.kernel])
    else:
        n_splits, per = split_plan(triton.cdiv(s, cfg.bn), splits, PLAN_COSTS[cfg.kernel].unit)
        chunk = per * cfg.bn
    qn, qr = q_nope.contiguous(), q_rope.contiguous()
    ckv, kpe = ckv.contiguous(), kpe.contiguous()
    mask = ctx_lens if causal else tree_mask.to(torch.int8).contiguous()  # causal: never read
    out = torch.empty_like(qn)
    one = n_splits == 1
    if one:
        part, lse = out, out
    else:
        part = torch.empty(bt * rows, n_splits, dl, dtype=torch.float32, device=qn.device)
        lse = torch.empty(bt * rows, n_splits, dtype=torch.float32, device=qn.device)
    kernel[(tiles, n_splits, bt)](qn, qr, *key_args(cfg, ckv, kpe), ctx_lens, mask, part, lse,
                                  sm_scale * LOG2E, t, s, chunk, n_splits,
                                  H=hh, DL=dl, DR=dr, BM=cfg.bm, BN=cfg.bn, CAUSAL=causal, ONE_SPLIT=one,
                                  num_warps=cfg.warps, num_stages=cfg.stages)
    if not one:
        bd = min(dl, 128)
        _mla_combine[(bt * rows, dl // bd)](part, lse, out, n_splits, DL=dl, BD=bd,
                                            NSP=triton.next_power_of_2(n_splits), num_warps=4)
    return out


def flops(bt: int, t: int, hh: int, ctx: int, dl: int, dr: int) -> float:
    """Matmul flops of one verify step: QK^T over dl+dr plus PV over dl, per query row and key."""
    return 2.0 * bt * t * hh * (ctx + t) * (dl + dr + dl)
