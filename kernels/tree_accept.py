"""Greedy tree accept on the GPU: one Triton program per sequence walks the target's argmax.

At each step the child of the current node whose token is the target's argmax there is accepted
(the lowest-index one, as in the reference); the walk ends at the first miss, whose argmax is the
bonus token. Outputs stay on the device, so the KV compaction can follow without a host round trip.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.reference import Tree, path_width


@triton.jit
def _accept(tok_ptr, par_ptr, am_ptr, path_ptr, alen_ptr, bonus_ptr, n1, W, NP: tl.constexpr):
    b = tl.program_id(0)
    base = b.to(tl.int64) * n1
    idx = tl.arange(0, NP)
    valid = (idx >= 1) & (idx < n1)
    par = tl.load(par_ptr + base + idx, mask=valid, other=-2)
    tok = tl.load(tok_ptr + base + idx, mask=valid, other=-1)
    zero = tl.sum(idx * 0, 0)
    cur = zero
    done = zero
    alen = zero
    bonus = tl.load(am_ptr + base).to(tl.int64) * 0
    pbase = b.to(tl.int64) * W
    tl.store(path_ptr + pbase, 0)
    for step in range(1, W):
        want = tl.load(am_ptr + base + cur)
        child = tl.min(tl.where((par == cur) & (tok == want), idx, NP), 0)
        found = (child < NP) & (done == 0)
        tl.store(path_ptr + pbase + step, tl.where(found, child, -1).to(tl.int64))
        bonus = tl.where(found | (done != 0), bonus, want)
        done = tl.where(found, done, 1)
        cur = tl.where(found, child, cur)
        alen += found.to(tl.int32)
    last = tl.load(am_ptr + base + cur)
    tl.store(bonus_ptr + b, tl.where(done != 0, bonus, last))
    tl.store(alen_ptr + b, alen.to(tl.int64))


def tree_accept(tree: Tree, target_argmax: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(path [Bt, W] node indices padded -1, accept_len [Bt], bonus [Bt]); W from the draft length."""
    bt, n1 = tree.tokens.shape
    w = path_width(tree)
    dev = tree.tokens.device
    path = torch.empty(bt, w, dtype=torch.int64, device=dev)
    alen = torch.empty(bt, dtype=torch.int64, device=dev)
    bonus = torch.empty(bt, dtype=torch.int64, device=dev)
    _accept[(bt,)](tree.tokens.contiguous(), tree.parents.contiguous(), target_argmax.to(torch.int64).contiguous(),
                   path, alen, bonus, n1, w, NP=triton.next_power_of_2(n1), num_warps=4)
    return path, alen, bonus
