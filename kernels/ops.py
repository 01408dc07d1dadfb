"""The one entry point the engine calls: dispatch each op to its kernel or its reference.

impl="auto" runs the fastest kernel this host has for the inputs: on a CUDA device the MoE's CUDA C++
kernel where nvcc built it (kernels/moe_cuda.py), the MLA's Gluon kernel where its module picks it
(kernels/mla_tree_attention.py: sm_90, bf16), else Triton where the kernel's module imports; the
PyTorch reference otherwise. "cuda", "triton" and "torch" force one (tests use "triton" under
TRITON_INTERPRET=1 on the CPU). The `*_impl` functions name the kernel a call runs ("cuda", "gluon_ws",
"gluon", "triton" or "torch": the kernels table's impl column); each op dispatches through its own (the MoE's
CUDA fast path through the rules its `moe_impl` asks), so the column and the dispatch cannot disagree.
"""

from __future__ import annotations

import importlib
from functools import cache
from types import ModuleType
from typing import Literal

from torch import Tensor

from kernels import reference
from kernels.reference import Tree

Impl = Literal["auto", "cuda", "triton", "torch"]

__all__ = ["Tree", "Impl", "moe_impl", "moe_w4a16", "mla_impl", "mla_tree_attention", "build_tree",
           "tree_accept", "kernel_impl", "kernel_module"]


@cache
def kernel_module(name: str) -> ModuleType | None:
    """kernels.<name> if it imports here, else None. Every kernel module imports Triton (the CUDA C++
    MoE's too), so on a host without Triton all are None."""
    try:
        return importlib.import_module(f"kernels.{name}")
    except ImportError:
        return None


def kernel_impl(impl: Impl, module: str, like: Tensor) -> str:
    """"triton" where kernels.<module> runs for inputs like `like` under `impl`, else "torch"."""
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"impl must be auto, triton or torch here, got {impl!r}")
    if impl == "torch":
        return "torch"
    mod = kernel_module(module)
    if impl == "triton":
        if mod is None:
            raise RuntimeError(f"Triton kernel kernels.{module} is not available here")
        return "triton"
    return "triton" if (like.is_cuda and mod is not None) else "torch"


def moe_impl(x: Tensor, w13_q: Tensor, w2_q: Tensor, impl: Impl = "auto") -> str:
    """The MoE kernel `impl` runs on these inputs: "cuda", "triton" or "torch" (the impl column)."""
    if impl == "cuda":
        return impl
    if impl == "auto" and x.is_cuda:
        cuda = kernel_module("moe_cuda")
        if cuda is not None and cuda.supports(x, w13_q, w2_q):
            return "cuda"
    return kernel_impl(impl, "moe_gemm", x)


def moe_w4a16(x: Tensor, w13_q: Tensor, w13_s: Tensor, w2_q: Tensor, w2_s: Tensor,
              topk_ids: Tensor, topk_weights: Tensor, impl: Impl = "auto") -> Tensor:
    """Routed-expert MoE with K2 INT4 weights: [M, H] -> [M, H] in x's dtype. Under "auto" on a CUDA
    device one lookup finds the CUDA kernel's set-up call, or None where `moe_impl` would not name it
    (both ask moe_cuda's same rules), so a call does not work out its shape twice."""
    if impl == "auto" and x.is_cuda:
        cuda = kernel_module("moe_cuda")
        call = None if cuda is None else cuda.prepared(x, w13_q, w2_q, topk_ids, topk_weights)
        if call is not None:
            return call.run(x, w13_q, w13_s, w2_q, w2_s, topk_ids, topk_weights)
    which = moe_impl(x, w13_q, w2_q, impl)
    fn = reference.moe_w4a16 if which == "torch" else kernel_module(
        "moe_cuda" if which == "cuda" else "moe_gemm").moe_w4a16
    return fn(x, w13_q, w13_s, w2_q, w2_s, topk_ids, topk_weights)


def mla_impl(q_nope: Tensor, cache_rows: int, impl: Impl = "auto") -> str:
    """The MLA kernel `impl` runs on these queries [Bt, T, H, DL] over a cache of `cache_rows` rows a
    sequence: "gluon_ws", "gluon" or "triton" (the tile config kernels.mla_tree_attention picks for
    T x H rows on this device), or "torch"."""
    if kernel_impl(impl, "mla_tree_attention", q_nope) == "torch":
        return "torch"
    mod = kernel_module("mla_tree_attention")
    bt, t, hh, _ = q_nope.shape
    return mod.pick_config(mod.capability(q_nope.device), q_nope.dtype, bt, t * hh, cache_rows).kernel


def mla_tree_attention(q_nope: Tensor, q_rope: Tensor, ckv: Tensor, kpe: Tensor, ctx_lens: Tensor,
                       tree_mask: Tensor | None, sm_scale: float, impl: Impl = "auto",
                       causal: bool = False) -> Tensor:
    """Absorbed MLA for T tree tokens over each sequence's prefix plus their tree ancestors; with
    causal=True the T tokens are a chunk of prompt (token t sees the prefix and chunk tokens <= t)
    and tree_mask may be None."""
    fn = reference.mla_tree_attention if kernel_impl(impl, "mla_tree_attention", q_nope) == "torch" else \
        kernel_module("mla_tree_attention").mla_tree_attention
    return fn(q_nope, q_rope, ckv, kpe, ctx_lens, tree_mask, sm_scale, causal=causal)


def build_tree(topk_logprobs: Tensor, topk_tokens: Tensor, root_tokens: Tensor, budget: int,
               impl: Impl = "auto") -> Tree:
    """DDTree best-first tree of `budget` nodes (+ root) per sequence; same tree on every impl."""
    fn = reference.build_tree if kernel_impl(impl, "build_tree", topk_logprobs) == "torch" else \
        kernel_module("build_tree").build_tree
    return fn(topk_logprobs, topk_tokens, root_tokens, budget)


def tree_accept(tree: Tree, target_argmax: Tensor, impl: Impl = "auto") -> tuple[Tensor, Tensor, Tensor]:
    """Greedy accept: (path [Bt, L+1] node indices padded -1, accept_len [Bt], bonus [Bt])."""
    fn = reference.tree_accept if kernel_impl(impl, "tree_accept", tree.tokens) == "torch" else \
        kernel_module("tree_accept").tree_accept
    return fn(tree, target_argmax)
