"""PyTorch references for every kernel: the definition of what each Triton kernel must compute.

They are written for clarity and for checking, but vectorised enough to serve as the CPU path of
the engine (MoE loops over the experts actually touched, never over tokens).
"""

from __future__ import annotations

import heapq
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch import Tensor

from kernels.int4 import dequantize_w4


@dataclass
class Tree:
    """A DDTree draft tree. Node 0 is the root (the bonus token); nodes 1..B in best-first order.

    Parents always precede their children, so index order is a topological order.
    `draft_len` (L, the drafter's block length) fixes the width of `tree_accept`'s path without
    reading the depths back to the host.
    """

    tokens: Tensor  # [Bt, B+1] int64
    parents: Tensor  # [Bt, B+1] int64, -1 for the root
    depths: Tensor  # [Bt, B+1] int64, root 0
    scores: Tensor  # [Bt, B+1] float32, root 0.0
    mask: Tensor  # [Bt, B+1, B+1] bool, mask[b, i, j] = j is an ancestor of i or i itself
    draft_len: int | None = None


# ----------------------------------------------------------------------------- MoE W4A16


def moe_w4a16(x: Tensor, w13_q: Tensor, w13_s: Tensor, w2_q: Tensor, w2_s: Tensor,
              topk_ids: Tensor, topk_weights: Tensor) -> Tensor:
    """out[m] = sum_j w[m,j] * W2_e(silu(gate_e x[m]) * up_e x[m]), e = topk_ids[m, j]; float32 math."""
    m, h = x.shape
    inter = w13_q.shape[1] // 2
    k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    experts, counts = torch.unique_consecutive(flat_ids[order], return_counts=True)
    out = torch.zeros(m, h, dtype=torch.float32, device=x.device)
    xf = x.float()
    start = 0
    for e, c in zip(experts.tolist(), counts.tolist()):
        slots = order[start:start + c]
        start += c
        tok = slots // k
        w13 = dequantize_w4(w13_q[e:e + 1], w13_s[e:e + 1])[0]
        w2 = dequantize_w4(w2_q[e:e + 1], w2_s[e:e + 1])[0]
        gu = xf[tok] @ w13.t()
        act = F.silu(gu[:, :inter]) * gu[:, inter:]
        y = (act @ w2.t()) * topk_weights.reshape(-1)[slots].float().unsqueeze(1)
        out.index_add_(0, tok, y)
    return out.to(x.dtype)


# ----------------------------------------------------------------------------- MLA tree attention


def tree_visibility(ctx_lens: Tensor, tree_mask: Tensor, s: int) -> Tensor:
    """[Bt, T, S] bool: which cache positions each tree token sees (prefix + its tree ancestors)."""
    bt, t, _ = tree_mask.shape
    pos = torch.arange(s, device=tree_mask.device)
    rel = pos.unsqueeze(0) - ctx_lens.unsqueeze(1)  # [Bt, S]: position relative to the tree start
    prefix = rel < 0
    in_tree = (rel >= 0) & (rel < t)
    idx = rel.clamp(0, t - 1).unsqueeze(1).expand(bt, t, s)
    tree_vis = torch.gather(tree_mask, 2, idx) & in_tree.unsqueeze(1)
    return prefix.unsqueeze(1) | tree_vis


def mla_tree_attention(q_nope: Tensor, q_rope: Tensor, ckv: Tensor, kpe: Tensor, ctx_lens: Tensor,
                       tree_mask: Tensor | None, sm_scale: float, causal: bool = False,
                       compute_dtype: torch.dtype = torch.float32) -> Tensor:
    """Absorbed MLA over prefix + tree via SDPA with an explicit mask.

    causal=True is the chain tree (token t sees chunk tokens 0..t), the semantics of the kernels'
    causal mode; tree_mask is then ignored. compute_dtype float32 is the accuracy reference; the
    bench times it in the input dtype as the baseline a plain PyTorch implementation would get.
    An accuracy reference runs SDPA's math backend: on a GPU the fused float32 backends can miss
    the float64 answer by more than the bf16 kernels they judge, where few keys are visible
    (kernels/NOTES.md: the MLA check case of 9000 + 100 tokens).
    """
    bt, t, hh, dl = q_nope.shape
    s = ckv.shape[1]
    if causal:
        tree_mask = torch.ones(t, t, dtype=torch.bool, device=q_nope.device).tril().expand(bt, t, t)
    q = torch.cat([q_nope, q_rope], -1).to(compute_dtype).transpose(1, 2)  # [Bt, Hh, T, Dl+Dr]
    kk = torch.cat([ckv, kpe], -1).to(compute_dtype).unsqueeze(1).expand(bt, hh, s, -1)
    v = ckv.to(compute_dtype).unsqueeze(1).expand(bt, hh, s, dl)
    vis = tree_visibility(ctx_lens, tree_mask, s).unsqueeze(1)  # [Bt, 1, T, S]
    with sdpa_kernel(SDPBackend.MATH) if compute_dtype != q_nope.dtype else nullcontext():
        o = F.scaled_dot_product_attention(q, kk, v, attn_mask=vis, scale=sm_scale)
    return o.transpose(1, 2).to(q_nope.dtype)


# ----------------------------------------------------------------------------- DDTree build + accept


def prefix_count(length: int, k: int, cap: int) -> int:
    """Number of rank prefixes of depth 1..length (sum of k^d), stopping once it reaches cap."""
    total, level = 0, 1
    for _ in range(length):
        level *= k
        total += level
        if total >= cap:
            break
    return total


def _heap_one(lp: np.ndarray, tok: np.ndarray, budget: int) -> tuple[list[int], list[int], list[int], list[float]]:
    """The DDTree best-first heap for one sequence; returns tokens, parents, depths, scores (root first)."""
    length, k = lp.shape
    tokens, parents, depths, scores = [0], [-1], [0], [np.float32(0.0)]
    counter = 0
    # heap entry: (-score, insertion counter, depth, rank, parent node, score)
    heap = [(-float(lp[0, 0]), counter, 1, 0, 0, lp[0, 0])]
    while len(tokens) <= budget:
        _, _, d, r, par, sc = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(int(tok[d - 1, r]))
        parents.append(par)
        depths.append(d)
        scores.append(sc)
        if r + 1 < k:
            counter += 1
            s2 = np.float32(scores[par] + lp[d - 1, r + 1])
            heapq.heappush(heap, (-float(s2), counter, d, r + 1, par, s2))
        if d < length:
            counter += 1
            s2 = np.float32(sc + lp[d, 0])
            heapq.heappush(heap, (-float(s2), counter, d + 1, 0, node, s2))
    return tokens, parents, depths, [float(s) for s in scores]


def ancestor_mask(parents: Tensor) -> Tensor:
    """[Bt, N] parents (parent index < child index) -> [Bt, N, N] ancestor-or-self mask."""
    bt, n = parents.shape
    mask = torch.zeros(bt, n, n, dtype=torch.bool, device=parents.device)
    ar = torch.arange(bt, device=parents.device)
    mask[:, 0, 0] = True
    for i in range(1, n):
        mask[:, i] = mask[ar, parents[:, i]]
        mask[:, i, i] = True
    return mask


def build_tree(topk_logprobs: Tensor, topk_tokens: Tensor, root_tokens: Tensor, budget: int) -> Tree:
    """CPU heap (heapq, float32 scores, key (-score, insertion counter)) for each sequence."""
    bt, length, k = topk_logprobs.shape
    if prefix_count(length, k, budget) < budget:
        raise ValueError(f"budget {budget} exceeds the {prefix_count(length, k, budget)} prefixes of L={length}, k={k}")
    lp = topk_logprobs.detach().to("cpu", torch.float32).numpy()
    tk = topk_tokens.detach().cpu().numpy()
    rows = [_heap_one(lp[b], tk[b], budget) for b in range(bt)]
    dev = topk_logprobs.device
    tokens = torch.tensor([r[0] for r in rows], dtype=torch.int64)
    tokens[:, 0] = root_tokens.cpu()
    parents = torch.tensor([r[1] for r in rows], dtype=torch.int64)
    return Tree(
        tokens=tokens.to(dev),
        parents=parents.to(dev),
        depths=torch.tensor([r[2] for r in rows], dtype=torch.int64, device=dev),
        scores=torch.tensor([r[3] for r in rows], dtype=torch.float32, device=dev),
        mask=ancestor_mask(parents).to(dev),
        draft_len=length,
    )


def path_width(tree: Tree) -> int:
    """Width of the accept path: 1 + the deepest a path can go (draft_len, capped by the budget)."""
    n = tree.tokens.shape[1]
    depth = tree.draft_len if tree.draft_len is not None else int(tree.depths.max())
    return min(depth, n - 1) + 1


def tree_accept(tree: Tree, target_argmax: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Walk the target's argmax down the tree: (path [Bt, W] padded -1, accept_len [Bt], bonus [Bt])."""
    bt, n = tree.tokens.shape
    width = path_width(tree)
    toks = tree.tokens.tolist()
    pars = tree.parents.tolist()
    want_all = target_argmax.tolist()
    path = torch.full((bt, width), -1, dtype=torch.int64)
    acc = torch.zeros(bt, dtype=torch.int64)
    bonus = torch.zeros(bt, dtype=torch.int64)
    for b in range(bt):
        children: dict[int, list[int]] = {}
        for i in range(1, n):
            children.setdefault(pars[b][i], []).append(i)
        cur, steps = 0, [0]
        while True:
            want = want_all[b][cur]
            nxt = next((c for c in children.get(cur, []) if toks[b][c] == want), None)
            if nxt is None:
                bonus[b] = want
                break
            cur = nxt
            steps.append(cur)
        path[b, :len(steps)] = torch.tensor(steps)
        acc[b] = len(steps) - 1
    dev = tree.tokens.device
    return path.to(dev), acc.to(dev), bonus.to(dev)
