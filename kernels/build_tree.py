"""GPU DDTree builder: the CPU heap's exact tree, one Triton program per sequence.

Every heap item is one int64 key
  [ 31 bits: order of -score | CBITS: ~insertion counter | PBITS: parent | GBITS: (depth-1)*k + rank ]
so the largest key is the item the CPU heap pops (smallest -score, then earliest insertion;
counters are unique, so the low fields never decide) and carries its fields with it. Scores are
<= 0 (sums of log-probs), so -score >= 0 and its float bits order like the value.
The heap itself becomes L*k FIFO queues, one per (depth, rank) (see _tree_fifo): a pop is one
reduction over L*k queue heads instead of over the whole frontier.
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
def _take_max(k1, a1, k2, a2):
    """Combine for tl.reduce: the larger key and what rides with it (keys of live heads are unique)."""
    take = k1 > k2
    return tl.where(take, k1, k2), tl.where(take, a1, a2)


@triton.jit
def _tree_fifo(lp_ptr, tok_ptr, root_ptr, otok_ptr, opar_ptr, odep_ptr, osc_ptr, qk_ptr, qs_ptr, n1,
               L: tl.constexpr, K: tl.constexpr, QP: tl.constexpr, QCAP: tl.constexpr,
               CBITS: tl.constexpr, PBITS: tl.constexpr, GBITS: tl.constexpr):
    """The heap as L*K FIFO queues, one per (depth d, rank r): queue g = (d-1)*K + r holds the pending
    items (parent p, rank r) for the parents p of depth d-1 in pop order, so its keys increase from
    head to tail and the heap's next pop is the largest head key. The k-th item ever to enter queue g
    has the k-th parent of depth d-1 (items leave queue g in that order into queue g + 1, and queue
    d*K takes each depth-d node as it pops), so an item's position is its queue's count of entries.
    Lane g of the program owns queue g: its head and second item in registers, later items in
    qk/qs[g, position], written and read back by lane g's own thread only; the third item is fetched
    one pop ahead. One tuple max-reduction over the heads a pop; the rest is lane-wise."""
    b = tl.program_id(0)
    ob = b.to(tl.int64) * n1
    lane = tl.arange(0, QP)
    live = lane < L * K
    lq = tl.load(lp_ptr + b * L * K + lane, mask=live, other=0.0)  # log-prob of queue g's rank at its depth
    lt = tl.load(tok_ptr + b * L * K + lane, mask=live, other=0)
    qk_l = qk_ptr + b.to(tl.int64) * QP * QCAP + lane * QCAP
    qs_l = qs_ptr + b.to(tl.int64) * QP * QCAP + lane * QCAP
    zero = tl.sum(lane * 0, 0)
    tl.store(otok_ptr + ob, tl.load(root_ptr + b))
    tl.store(opar_ptr + ob, -1)
    tl.store(odep_ptr + ob, 0)
    tl.store(osc_ptr + ob, 0.0)
    first = lane == 0
    hkey = tl.where(first, _key(lq, zero, zero, lane, CBITS, PBITS, GBITS), -1)
    hpsc = tl.zeros((QP,), tl.float32)  # the head item's parent score
    nkey = tl.full((QP,), -1, tl.int64)
    npsc = tl.zeros((QP,), tl.float32)
    qlen = first.to(tl.int32)
    hpos = tl.zeros((QP,), tl.int32)  # the head's position; hpos + qlen = entries so far
    pend = lane < 0  # lanes whose second slot takes the item loaded last step
    pkey = nkey
    ppsc = npsc
    counter = zero + 1
    gmask = (1 << GBITS) - 1
    pmask = (1 << PBITS) - 1
    for node in range(1, n1):
        best, pscore = tl.reduce((hkey, hpsc), 0, _take_max)
        nkey = tl.where(pend, pkey, nkey)  # last step's refill lands after this step's pop was chosen
        npsc = tl.where(pend, ppsc, npsc)
        g = (best & gmask).to(tl.int32)
        par = ((best >> GBITS) & pmask).to(tl.int32)
        # the popped item's score, exactly, from its key (scores are <= 0 and never -0.0)
        neg = (0x7FFFFFFF - (best >> (CBITS + PBITS + GBITS))).to(tl.int32).to(tl.float32, bitcast=True)
        score = 0.0 - neg
        d = g // K + 1
        pop = lane == g
        tl.store(otok_ptr + ob + node + lane * 0, lt, mask=pop)
        tl.store(opar_ptr + ob + node, par.to(tl.int64))
        tl.store(odep_ptr + ob + node, d.to(tl.int64))
        tl.store(osc_ptr + ob + node, score)
        # the sibling (queue g + 1, same parent) and the first child (queue d*K, parent = this node)
        has_sib = g % K + 1 < K
        sib = (lane == g + 1) & has_sib
        k_sib = _key(pscore + lq, counter, par, lane, CBITS, PBITS, GBITS)
        counter += has_sib.to(tl.int32)
        ch = (lane == d * K) & (d < L)
        k_ch = _key(score + lq, counter, zero + node, lane, CBITS, PBITS, GBITS)
        counter += (d < L).to(tl.int32)
        # the popped queue: its second item moves up, its third (if any) is fetched for the next step
        pend = pop & (qlen >= 3)
        pkey = tl.load(qk_l + hpos + 2, mask=pend, other=-1)
        ppsc = tl.load(qs_l + hpos + 2, mask=pend, other=0.0)
        hkey = tl.where(pop, nkey, hkey)
        hpsc = tl.where(pop, npsc, hpsc)
        nkey = tl.where(pop, -1, nkey)
        hpos += pop.to(tl.int32)
        qlen -= pop.to(tl.int32)
        # appends: to memory at the queue's next position; into the head slot of an empty queue,
        # the second slot of a one-item queue
        new = sib | ch
        newkey = tl.where(sib, k_sib, k_ch)
        newpsc = tl.where(sib, pscore, score)
        tl.store(qk_l + hpos + qlen, newkey, mask=new)
        tl.store(qs_l + hpos + qlen, newpsc, mask=new)
        hkey = tl.where(new & (qlen == 0), newkey, hkey)
        hpsc = tl.where(new & (qlen == 0), newpsc, hpsc)
        nkey = tl.where(new & (qlen == 1), newkey, nkey)
        npsc = tl.where(new & (qlen == 1), newpsc, npsc)
        qlen += new.to(tl.int32)


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
    qp, qcap = triton.next_power_of_2(length * k), n1 + 2
    tokens = torch.empty(bt, n1, dtype=torch.int64, device=dev)
    parents = torch.empty(bt, n1, dtype=torch.int64, device=dev)
    depths = torch.empty(bt, n1, dtype=torch.int64, device=dev)
    scores = torch.empty(bt, n1, dtype=torch.float32, device=dev)
    qk = torch.empty(bt, qp, qcap, dtype=torch.int64, device=dev)
    qs = torch.empty(bt, qp, qcap, dtype=torch.float32, device=dev)
    _tree_fifo[(bt,)](topk_logprobs.float().contiguous(), topk_tokens.to(torch.int64).contiguous(),
                      root_tokens.to(torch.int64).contiguous(), tokens, parents, depths, scores, qk, qs,
                      n1, L=length, K=k, QP=qp, QCAP=qcap, CBITS=cbits, PBITS=pbits, GBITS=gbits, num_warps=num_warps)
    mask = torch.empty(bt, n1, n1, dtype=torch.bool, device=dev)
    br = 16
    _tree_mask[(bt, triton.cdiv(n1, br))](parents, mask.view(torch.int8), n1, length, BR=br,
                                          NP=triton.next_power_of_2(n1), num_warps=4)
    return Tree(tokens=tokens, parents=parents, depths=depths, scores=scores, mask=mask, draft_len=length)
