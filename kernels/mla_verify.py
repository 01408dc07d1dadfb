"""MLA tree-verify attention, absorbed form, split-KV (flash-decoding) in Triton.

One program = (sequence b, tree token t, one split of the key range [0, ctx_b + T)); its rows are
all Hh heads of that token, so every latent row it loads serves all heads at once. Prefix keys are
visible to every tree token; a key at ctx_b + u is visible iff tree_mask[b, t, u]. Each program
keeps a running max / sum / [Hh, 512] accumulator; a combine kernel merges the splits by
log-sum-exp. T = 1 with mask [[True]] is plain decode through the same path.

At B = 64 with 64 heads the work is 4160 query rows per latent row: the kernel is bound by matmul
rate, not by the cache bytes (NOTES.md has the roofline).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

LOG2E = 1.4426950408889634  # scores go through exp2
CONFIG = {"BN": 64, "num_warps": 8, "num_stages": 2}
TARGET_PROGRAMS = 264  # ~2 waves on a 132-SM H200


@triton.jit
def _mla_split(qn_ptr, qr_ptr, ckv_ptr, kpe_ptr, ctx_ptr, mask_ptr, o_ptr, lse_ptr,
               qk_scale, T, Hh, S, chunk, n_splits,
               DL: tl.constexpr, DR: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr,
               ONE_SPLIT: tl.constexpr):
    pid_bt = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = pid_bt // T
    t = pid_bt % T
    ctx = tl.load(ctx_ptr + b).to(tl.int32)
    start = pid_s * chunk
    end = tl.minimum(tl.minimum(start + chunk, ctx + T), S)  # the tree sits inside the cache
    rh = tl.arange(0, BH)
    hmask = rh < Hh
    rdl = tl.arange(0, DL)
    rdr = tl.arange(0, DR)
    qrow = pid_bt.to(tl.int64) * Hh + rh
    qn = tl.load(qn_ptr + qrow[:, None] * DL + rdl[None, :], mask=hmask[:, None], other=0.0)
    qr = tl.load(qr_ptr + qrow[:, None] * DR + rdr[None, :], mask=hmask[:, None], other=0.0)
    m_i = tl.full((BH,), float("-inf"), tl.float32)
    l_i = tl.zeros((BH,), tl.float32)
    acc = tl.zeros((BH, DL), tl.float32)
    kv_base = b.to(tl.int64) * S
    mrow = mask_ptr + (b.to(tl.int64) * T + t) * T
    for n0 in range(start, end, BN):
        rn = n0 + tl.arange(0, BN)
        kval = rn < end
        c = tl.load(ckv_ptr + (kv_base + rn)[:, None] * DL + rdl[None, :], mask=kval[:, None], other=0.0)
        kp = tl.load(kpe_ptr + (kv_base + rn)[:, None] * DR + rdr[None, :], mask=kval[:, None], other=0.0)
        s = tl.dot(qn, tl.trans(c)) + tl.dot(qr, tl.trans(kp))
        rel = rn - ctx
        in_tree = kval & (rel >= 0)
        tm = tl.load(mrow + rel, mask=in_tree, other=0).to(tl.int1)
        vis = kval & ((rel < 0) | tm)
        s = tl.where(vis[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c)
        m_i = m_new
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    if ONE_SPLIT:
        tl.store(o_ptr + qrow[:, None] * DL + rdl[None, :], out.to(o_ptr.dtype.element_ty), mask=hmask[:, None])
    else:
        prow = (pid_bt.to(tl.int64) * n_splits + pid_s) * Hh + rh
        tl.store(o_ptr + prow[:, None] * DL + rdl[None, :], out, mask=hmask[:, None])
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(lse_ptr + prow, lse, mask=hmask)


@triton.jit
def _mla_combine(part_ptr, lse_ptr, o_ptr, Hh, n_splits, DL: tl.constexpr, BD: tl.constexpr, NSP: tl.constexpr):
    """o[bt, h, d-chunk] = sum_s 2^(lse_s - max) o_s / sum_s 2^(lse_s - max); one program per chunk."""
    pid = tl.program_id(0)
    bt = pid // Hh
    h = pid % Hh
    rs = tl.arange(0, NSP)
    smask = rs < n_splits
    rows = (bt.to(tl.int64) * n_splits + rs) * Hh + h
    lse = tl.load(lse_ptr + rows, mask=smask, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    w = w / tl.sum(w, 0)
    rd = tl.program_id(1) * BD + tl.arange(0, BD)
    o = tl.load(part_ptr + rows[:, None] * DL + rd[None, :], mask=smask[:, None], other=0.0)
    tl.store(o_ptr + pid.to(tl.int64) * DL + rd, tl.sum(o * w[:, None], 0).to(o_ptr.dtype.element_ty))


def plan_splits(programs: int, s: int, bn: int, target: int = TARGET_PROGRAMS) -> tuple[int, int]:
    """(splits, keys per split) from host-known sizes: enough programs to fill the chip."""
    splits = max(1, min(triton.cdiv(target, programs), triton.cdiv(s, 4 * bn)))
    chunk = triton.cdiv(triton.cdiv(s, splits), bn) * bn
    return triton.cdiv(s, chunk), chunk


def mla_tree_attention(q_nope: Tensor, q_rope: Tensor, ckv: Tensor, kpe: Tensor, ctx_lens: Tensor,
                       tree_mask: Tensor, sm_scale: float, config: dict | None = None,
                       splits: int | None = None) -> Tensor:
    """Triton MLA tree verify; `config` / `splits` override the defaults for the tuning sweep."""
    cfg = {**CONFIG, **(config or {})}
    bt, t, hh, dl = q_nope.shape
    dr = q_rope.shape[-1]
    s = ckv.shape[1]
    if dl & (dl - 1) or dr & (dr - 1):
        raise ValueError(f"mla_tree_attention: latent {dl} and rope {dr} must be powers of two")
    bn = cfg["BN"]
    if splits is None:
        n_splits, chunk = plan_splits(bt * t, s, bn)
    else:
        chunk = triton.cdiv(triton.cdiv(s, splits), bn) * bn
        n_splits = triton.cdiv(s, chunk)
    qn, qr = q_nope.contiguous(), q_rope.contiguous()
    ckv, kpe = ckv.contiguous(), kpe.contiguous()
    mask = tree_mask.to(torch.int8).contiguous()
    out = torch.empty_like(qn)
    bh = max(16, triton.next_power_of_2(hh))
    one = n_splits == 1
    if one:
        part, lse = out, out
    else:
        part = torch.empty(bt * t, n_splits, hh, dl, dtype=torch.float32, device=qn.device)
        lse = torch.empty(bt * t, n_splits, hh, dtype=torch.float32, device=qn.device)
    _mla_split[(bt * t, n_splits)](qn, qr, ckv, kpe, ctx_lens, mask, part, lse,
                                   sm_scale * LOG2E, t, hh, s, chunk, n_splits,
                                   DL=dl, DR=dr, BH=bh, BN=bn, ONE_SPLIT=one,
                                   num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if not one:
        bd = min(dl, 128)
        _mla_combine[(bt * t * hh, dl // bd)](part, lse, out, hh, n_splits, DL=dl, BD=bd,
                                              NSP=triton.next_power_of_2(n_splits), num_warps=4)
    return out


def flops(bt: int, t: int, hh: int, ctx: int, dl: int, dr: int) -> float:
    """Matmul flops of one verify step: QK^T over dl+dr plus PV over dl, per query row and key."""
    return 2.0 * bt * t * hh * (ctx + t) * (dl + dr + dl)

