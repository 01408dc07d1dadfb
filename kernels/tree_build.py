"""GPU DDTree builder: the CPU heap's exact tree, one Triton program per sequence.

The heap becomes a register frontier of <= B+2 candidates, each one int64 key
  [ 31 bits: order of -score | CBITS: ~insertion counter | PBITS: parent | GBITS: (depth-1)*k + rank ]
so one max-reduction pops the candidate the CPU heap pops (smallest -score, then earliest
insertion; counters are unique, so the low fields never decide) and carries its fields with it.
Scores are <= 0 (sums of log-probs), so -score >= 0 and its float bits order like the value.
A second kernel writes the ancestor-or-self mask by walking each row's parent chain.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.reference import Tree, prefix_count

NUM_WARPS = 4


@triton.jit
def _key(score, counter, parent, g, CBITS: tl.constexpr, PBITS: tl.constexpr, GBITS: tl.constexpr):
    neg = -score + 0.0  # -0.0 -> +0.0 so that 0.0 and -0.0 tie, as they do in the CPU heap
    order = 0x7FFFFFFF - neg.to(tl.int32, bitcast=True)
    cmax = (1 << CBITS) - 1
    return ((order.to(tl.int64) << (CBITS + PBITS + GBITS))
            | ((cmax - counter).to(tl.int64) << (PBITS + GBITS))
            | (parent.to(tl.int64) << GBITS) | g.to(tl.int64))


@triton.jit
def _tree_heap(lp_ptr, tok_ptr, root_ptr, otok_ptr, opar_ptr, odep_ptr, osc_ptr, L, K, n1,
               CAP: tl.constexpr, CBITS: tl.constexpr, PBITS: tl.constexpr, GBITS: tl.constexpr):
    b = tl.program_id(0)
    lp_b = lp_ptr + b * L * K
    tok_b = tok_ptr + b * L * K
    ob = b.to(tl.int64) * n1
    idx = tl.arange(0, CAP)
    zero = tl.sum(idx * 0, 0)  # scalar int32 0 that the compiler treats as a loop-carried tensor
    s0 = tl.load(lp_b)
    keys = tl.where(idx == 0, _key(s0, zero, zero, zero, CBITS, PBITS, GBITS), -1)
    psc = tl.zeros((CAP,), tl.float32)
    tl.store(otok_ptr + ob, tl.load(root_ptr + b))
    tl.store(opar_ptr + ob, -1)
    tl.store(odep_ptr + ob, 0)
    tl.store(osc_ptr + ob, 0.0)
    counter = zero + 1
    nslots = zero + 1
    gmask = (1 << GBITS) - 1
    pmask = (1 << PBITS) - 1
    for node in range(1, n1):
        best = tl.max(keys, 0)
        sel = keys == best
        pscore = tl.sum(tl.where(sel, psc, 0.0), 0)
        g = (best & gmask).to(tl.int32)
        par = ((best >> GBITS) & pmask).to(tl.int32)
        d = g // K + 1
        r = g % K
        score = pscore + tl.load(lp_b + g)
        tl.store(otok_ptr + ob + node, tl.load(tok_b + g))
        tl.store(opar_ptr + ob + node, par.to(tl.int64))
        tl.store(odep_ptr + ob + node, d.to(tl.int64))
        tl.store(osc_ptr + ob + node, score)
        has_sib = r + 1 < K
        s_sib = pscore + tl.load(lp_b + g + 1, mask=has_sib, other=0.0)
        k_sib = _key(s_sib, counter, par, g + 1, CBITS, PBITS, GBITS)
        counter += has_sib.to(tl.int32)
        has_child = d < L
        s_ch = score + tl.load(lp_b + d * K, mask=has_child, other=0.0)
        k_ch = _key(s_ch, counter, zero + node, d * K, CBITS, PBITS, GBITS)
        counter += has_child.to(tl.int32)
        keys = tl.where(sel, tl.where(has_sib, k_sib, -1), keys)
        put = (idx == nslots) & has_child
        keys = tl.where(put, k_ch, keys)
        psc = tl.where(put, score, psc)
        nslots += has_child.to(tl.int32)


@triton.jit
def _tree_mask(par_ptr, mask_ptr, n1, L, BR: tl.constexpr, NP: tl.constexpr):
    """Rows BR*pid..: mask[i, j] = j on the parent chain of i (i included); depth <= L steps."""
    b = tl.program_id(0)
    rows = tl.program_id(1) * BR + tl.arange(0, BR)
    rvalid = rows < n1
    cols = tl.arange(0, NP)
    par_b = par_ptr + b.to(tl.int64) * n1
    cur = rows
    m = cols[None, :] == cur[:, None]
    for _ in range(0, L):
        cur = tl.load(par_b + cur, mask=rvalid & (cur > 0), other=0).to(tl.int32)
        m = m | (cols[None, :] == cur[:, None])
    out = mask_ptr + (b.to(tl.int64) * n1 + rows)[:, None] * n1 + cols[None, :]
    tl.store(out, m.to(tl.int8), mask=rvalid[:, None] & (cols[None, :] < n1))


def key_bits(budget: int, length: int, k: int) -> tuple[int, int, int]:
    """Field widths of the heap key; they must fit in 63 bits beside the 31-bit score order."""
    cbits = (2 * budget + 1).bit_length()
    pbits = max(1, budget.bit_length())
    gbits = max(1, (length * k - 1).bit_length())
    if 31 + cbits + pbits + gbits > 63:
        raise ValueError(f"build_tree: budget {budget} with L*k = {length * k} does not fit the 63-bit heap key")
    return cbits, pbits, gbits


def build_tree(topk_logprobs: Tensor, topk_tokens: Tensor, root_tokens: Tensor, budget: int,
               num_warps: int = NUM_WARPS) -> Tree:
    """Same tree as kernels.reference.build_tree (nodes, order, parents, scores), built on the device."""
    bt, length, k = topk_logprobs.shape
    cbits, pbits, gbits = key_bits(budget, length, k)
    if prefix_count(length, k, budget) < budget:
        raise ValueError(f"budget {budget} exceeds the prefixes of L={length}, k={k}")
    n1 = budget + 1
    dev = topk_logprobs.device
    lp = topk_logprobs.float().contiguous()
    tk = topk_tokens.to(torch.int64).contiguous()
    tokens = torch.empty(bt, n1, dtype=torch.int64, device=dev)
    parents = torch.empty(bt, n1, dtype=torch.int64, device=dev)
    depths = torch.empty(bt, n1, dtype=torch.int64, device=dev)
    scores = torch.empty(bt, n1, dtype=torch.float32, device=dev)
    _tree_heap[(bt,)](lp, tk, root_tokens.to(torch.int64).contiguous(), tokens, parents, depths, scores,
                      length, k, n1, CAP=triton.next_power_of_2(budget + 2),
                      CBITS=cbits, PBITS=pbits, GBITS=gbits, num_warps=num_warps)
    mask = torch.empty(bt, n1, n1, dtype=torch.bool, device=dev)
    br = 16
    _tree_mask[(bt, triton.cdiv(n1, br))](parents, mask.view(torch.int8), n1, length, BR=br,
                                          NP=triton.next_power_of_2(n1), num_warps=4)
    return Tree(tokens=tokens, parents=parents, depths=depths, scores=scores, mask=mask, draft_len=length)
