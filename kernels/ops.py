"""The one entry point the engine calls: dispatch each op to its Triton kernel or its reference.

impl="auto" runs the fastest kernel this host has for the inputs: on a CUDA device the MoE's CUDA C++
kernel where nvcc built it (kernels/moe_cuda.py), else Triton where the kernel's module imports;
the PyTorch reference otherwise. "cuda", "triton" and "torch" force one (tests use "triton" under
TRITON_INTERPRET=1 on the CPU).
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

__all__ = ["Tree", "Impl", "moe_impl", "moe_w4a16", "mla_tree_attention", "build_tree", "tree_accept", "triton_module"]


@cache
def triton_module(name: str) -> ModuleType | None:
    """kernels.<name> if it imports here (Triton present and the module written), else None; the
    CUDA C++ MoE's module too (it shares moe_gemm's shape classes, so it needs Triton to import)."""
    try:
        return importlib.import_module(f"kernels.{name}")
    except ImportError:
        return None


def _pick(impl: Impl, module: str, like: Tensor) -> ModuleType | None:
    """The Triton module to run, or None for the reference."""
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"impl must be auto, triton or torch here, got {impl!r}")
    if impl == "torch":
        return None
    mod = triton_module(module)
    if impl == "triton":
        if mod is None:
            raise RuntimeError(f"Triton kernel kernels.{module} is not available here")
        return mod
    return mod if (like.is_cuda and mod is not None) else None


def moe_impl(x: Tensor, w13_q: Tensor, w2_q: Tensor, impl: Impl = "auto") -> str:
    """The MoE kernel `impl` runs on these inputs: "cuda", "triton" or "torch" (the impl column)."""
    if impl == "cuda":
        return impl
    if impl == "auto" and x.is_cuda:
        cuda = triton_module("moe_cuda")
        if cuda is not None and cuda.supports(x, w13_q, w2_q):
            return "cuda"
    return "triton" if _pick(impl, "moe_gemm", x) else "torch"


def moe_w4a16(x: Tensor, w13_q: Tensor, w13_s: Tensor, w2_q: Tensor, w2_s: Tensor,
              topk_ids: Tensor, topk_weights: Tensor, impl: Impl = "auto") -> Tensor:
    """Routed-expert MoE with K2 INT4 weights: [M, H] -> [M, H] in x's dtype."""
    which = moe_impl(x, w13_q, w2_q, impl)
    fn = reference.moe_w4a16 if which == "torch" else triton_module(
        "moe_cuda" if which == "cuda" else "moe_gemm").moe_w4a16
    return fn(x, w13_q, w13_s, w2_q, w2_s, topk_ids, topk_weights)


def mla_tree_attention(q_nope: Tensor, q_rope: Tensor, ckv: Tensor, kpe: Tensor, ctx_lens: Tensor,
                       tree_mask: Tensor, sm_scale: float, impl: Impl = "auto") -> Tensor:
    """Absorbed MLA for T tree tokens over each sequence's prefix plus their tree ancestors."""
    mod = _pick(impl, "mla_verify", q_nope)
    fn = mod.mla_tree_attention if mod else reference.mla_tree_attention
    return fn(q_nope, q_rope, ckv, kpe, ctx_lens, tree_mask, sm_scale)


def build_tree(topk_logprobs: Tensor, topk_tokens: Tensor, root_tokens: Tensor, budget: int,
               impl: Impl = "auto") -> Tree:
    """DDTree best-first tree of `budget` nodes (+ root) per sequence; same tree on every impl."""
    mod = _pick(impl, "tree_build", topk_logprobs)
    fn = mod.build_tree if mod else reference.build_tree
    return fn(topk_logprobs, topk_tokens, root_tokens, budget)


def tree_accept(tree: Tree, target_argmax: Tensor, impl: Impl = "auto") -> tuple[Tensor, Tensor, Tensor]:
    """Greedy accept: (path [Bt, L+1] node indices padded -1, accept_len [Bt], bonus [Bt])."""
    mod = _pick(impl, "tree_accept", tree.tokens)
    fn = mod.tree_accept if mod else reference.tree_accept
    return fn(tree, target_argmax)
