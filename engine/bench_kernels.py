"""The kernels suite: MoE W4A16 GEMM, tree-verify MLA attention, tree build, tree accept, and the
dense GEMMs of a step (engine.costs.dense_ops: attention projections, absorbed MLA einsums, router
gate, shared expert, dense layer, lm-head, drafter), at full shapes and one TP rank's shards.

CUDA runs K2 shapes with impl "auto" (the MoE's CUDA C++ kernel where it built and its M bucket
fits this device, else Triton; the MLA's Gluon kernel where kernels.mla_tree_attention picks it for
the shape and device, else Triton; Triton for tree build and accept; the dense ops as the model runs
them, in PyTorch), plus the torch reference at a few points so the speedup shows; the CPU runs
k2-mini shapes on the references. Every point carries the bytes it must move and the flops it must
do, so it reads against the run's ceilings; the MoE points on CUDA also carry host_us, the host's
time of one eager call.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from engine.config import K2, K2_MINI, SHARD_TP, ModelConfig
from engine.costs import (DenseOp, build_tree_cost, dense_op_cost, dense_ops, expected_experts, mla_cost, moe_cost,
                          tree_accept_cost)
from engine.model import Init
from engine.rows import AcceptShape, DenseShape, KernelRow, MlaShape, MoeShape, TreeShape, kernel_row
from engine.timing import host_us, time_op
from kernels import ops, reference



@dataclass(frozen=True)
class KernelProfile:
    cfg: ModelConfig
    moe_m: tuple[int, ...]
    moe_torch_m: tuple[int, ...]  # where the torch reference is timed too
    moe_tp_m: tuple[int, ...]  # M of the shard sweep (each expert's intermediate / SHARD_TP): rows with that tp
    attn: tuple[tuple[int, int, int], ...]  # (batch, budget, context), all heads
    attn_torch: tuple[tuple[int, int, int], ...]
    attn_tp: tuple[tuple[int, int, int], ...]  # the same at one rank of TP-SHARD_TP (its heads): rows with that tp
    tree: tuple[tuple[int, int], ...]  # (batch, budget)
    dense_m: tuple[int, ...]  # M of every dense op (engine.costs.dense_ops) ...
    dense_tp: tuple[int, ...]  # ... at these TP degrees (a replicated op's shape is timed once, at the lowest)
    repeats: int
    torch_repeats: int


def _attn_sweep(batch_1024: tuple[int, ...]) -> tuple[tuple[int, int, int], ...]:
    """(batch, budget, context) of the MLA sweep: FlashMLA's comparison grid (batch 1 / 8 / 16, budget
    16 / 64 / 256, context 4k-64k) plus short contexts, budget 1024 and 128k context at the extremes. The
    shortest context is the e2e suite's shortest prompt: a step's attention at its prompts (256-512
    tokens) lies inside the sweep, so its in-step factor compares like with like, not with a fit
    extended below the sweep (where the kernel's fixed costs, not its key stream, set the time)."""
    grid = [(b, n, c) for b in (1, 8, 16) for n in (16, 64, 256) for c in (256, 1024, 4096, 16384, 32768, 65536)]
    return tuple(grid + [(b, 1024, c) for b in batch_1024 for c in (4096, 32768)]
                 + [(b, n, 131072) for b in (1, 16) for n in (16, 256)])


PROFILES: dict[tuple[str, str], KernelProfile] = {
    ("cuda", "full"): KernelProfile(
        K2, (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096), (1, 32),
        (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096),
        _attn_sweep((1, 8)), ((1, 64, 8192), (8, 64, 8192), (1, 256, 8192)), _attn_sweep((1, 16)),
        tuple((b, n) for b in (1, 16) for n in (16, 64, 256, 1024)), (1, 16, 64, 256, 1024, 4096), (1, 8),
        repeats=50, torch_repeats=5),
    ("cuda", "smoke"): KernelProfile(
        K2, (1, 16, 128), (16,), (1, 128), ((1, 16, 4096), (1, 256, 4096)), ((1, 64, 4096),), ((16, 64, 32768),),
        ((1, 64), (16, 256)), (1, 256), (1, 8), repeats=10, torch_repeats=3),
    ("cpu", "full"): KernelProfile(
        K2_MINI, (1, 2, 4, 8, 16, 32, 64, 128), (), (),
        tuple((b, n, c) for b in (1, 4) for n in (16, 64, 256) for c in (256, 1024)), (), (),
        tuple((b, n) for b in (1, 8) for n in (16, 64, 256)), (1, 16, 64), (1, 2), repeats=10, torch_repeats=3),
    ("cpu", "smoke"): KernelProfile(
        K2_MINI, (1, 8, 32), (), (), ((1, 16, 128), (2, 64, 256)), (), (), ((1, 16), (4, 64)), (1, 16), (1, 2),
        repeats=5, torch_repeats=3),
}
POINT_S = 0.25  # a point's timed repeats stop near this many seconds (never under MIN_REPEATS)
MIN_REPEATS = 5


class KernelBench:
    """Builds each point's inputs on the device and times one op on them."""

    def __init__(self, prof: KernelProfile, device: torch.device, seed: int = 0):
        self.p, self.dev, self.seed = prof, device, seed
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.ini = Init(seed, device, self.dtype)
        self.gen = torch.Generator(device=device).manual_seed(seed + 1)
        self._moe: tuple[int, tuple[torch.Tensor, ...]] | None = None

    def reseed(self) -> None:
        """Restart the input generators, so two impls can be given identical inputs."""
        self.moe_weights()
        self.ini.gen.manual_seed(self.seed)
        self.gen.manual_seed(self.seed + 1)

    def points(self) -> list[tuple[str, Callable[[], KernelRow]]]:
        p = self.p
        pts: list[tuple[str, Callable[[], KernelRow]]] = []
        for m in p.moe_m:
            pts.append((f"moe_w4a16 M={m}", lambda m=m: self.moe(m, "auto")))
            if m in p.moe_torch_m:
                pts.append((f"moe_w4a16 M={m} torch", lambda m=m: self.moe(m, "torch")))
        for m in p.moe_tp_m:
            pts.append((f"moe_w4a16 M={m} tp={SHARD_TP}", lambda m=m: self.moe(m, "auto", tp=SHARD_TP)))
        for b, n, c in p.attn:
            pts.append((f"mla_tree_attention Bt={b} B={n} ctx={c}",
                        lambda b=b, n=n, c=c: self.attention(b, n, c, "auto")))
        for b, n, c in p.attn_torch:
            pts.append((f"mla_tree_attention Bt={b} B={n} ctx={c} torch",
                        lambda b=b, n=n, c=c: self.attention(b, n, c, "torch")))
        for b, n, c in p.attn_tp:
            pts.append((f"mla_tree_attention Bt={b} B={n} ctx={c} tp={SHARD_TP}",
                        lambda b=b, n=n, c=c: self.attention(b, n, c, "auto", tp=SHARD_TP)))
        for b, n in p.tree:
            pts.append((f"build_tree Bt={b} B={n}", lambda b=b, n=n: self.build_tree(b, n)))
        for b, n in p.tree:
            pts.append((f"tree_accept Bt={b} B={n}", lambda b=b, n=n: self.tree_accept(b, n)))
        for tp, op in self.dense_shapes():
            pts += [(f"dense_gemm {op.name} M={m} tp={tp}", lambda tp=tp, op=op, m=m: self.dense(op, m, tp))
                    for m in p.dense_m]
        return pts

    # ------------------------------------------------------------------ dense GEMMs
    def dense_shapes(self) -> list[tuple[int, DenseOp]]:
        """(tp, op) for every distinct dense op of the profile's TP degrees: a replicated op (the same
        shape at every degree) is timed once, at the lowest degree."""
        seen, out = set(), []
        for tp in self.p.dense_tp:
            for op in dense_ops(self.p.cfg, tp):
                if op not in seen:
                    seen.add(op)
                    out.append((tp, op))
        return out

    def dense(self, op: DenseOp, m: int, tp: int) -> KernelRow:
        """One op as the model runs it: F.linear, or the absorbed MLA einsum a head at a time."""
        dtype = torch.float32 if op.dtype == "float32" else self.dtype
        if op.heads > 1:  # w_uk: [h, k, n] as engine.model keeps it; w_uv: [h, n, k]
            w = self.ini.normal(op.heads, *((op.k, op.n) if op.name == "w_uk" else (op.n, op.k)), std=op.k ** -0.5)
            x = self.ini.normal(m, op.heads, op.k, std=1.0)
            spec = "thd,hdc->thc" if op.name == "w_uk" else "thc,hvc->thv"
            fn = lambda: torch.einsum(spec, x, w)  # noqa: E731
        else:
            w = self.ini.linear(op.n, op.k).to(dtype)
            x = self.ini.normal(m, op.k, std=1.0).to(dtype)
            fn = lambda: torch.nn.functional.linear(x, w)  # noqa: E731
        t = time_op(fn, self.dev, budgeted_repeats(fn, self.dev, self.p.repeats))
        return kernel_row("dense_gemm", "torch", str(dtype).removeprefix("torch."), self.dev.type,
                          DenseShape(op.name, m, op.n, op.k, op.heads), t, *dense_op_cost(op, m, x.element_size()),
                          tp=tp)

    # ------------------------------------------------------------------ MoE
    def moe_weights(self, tp: int = 1) -> tuple[torch.Tensor, ...]:
        """The routed experts at full shape (tp 1), or one rank's shard of them (intermediate / tp);
        one weight set at a time is kept (the shard sweep runs after the full one)."""
        if self._moe is None or self._moe[0] != tp:
            c = self.p.cfg
            self._moe = None
            w13 = self.ini.int4(c.experts, 2 * c.moe_inter // tp, c.hidden)
            w2 = self.ini.int4(c.experts, c.hidden, c.moe_inter // tp)
            self._moe = (tp, (*w13, *w2))
        return self._moe[1]

    def moe_inputs(self, m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [M, H] and a random top-k routing (ids, weights) over all experts."""
        c = self.p.cfg
        x = self.ini.normal(m, c.hidden, std=1.0)
        scores = torch.rand(m, c.experts, generator=self.gen, device=self.dev)
        tw, ids = scores.topk(c.top_k, dim=-1)
        return x, ids, (tw / tw.sum(-1, keepdim=True)).float()

    def moe(self, m: int, impl: str, tp: int = 1) -> KernelRow:
        c = self.p.cfg
        w = self.moe_weights(tp)
        x, ids, tw = self.moe_inputs(m)
        reps = self.p.repeats if impl == "auto" else self.p.torch_repeats
        call = lambda: ops.moe_w4a16(x, *w, ids, tw, impl=impl)  # noqa: E731
        t = time_op(call, self.dev, reps)
        host = host_us(call, self.dev) if self.dev.type == "cuda" and impl == "auto" else None
        h, i, e, k = c.hidden, c.moe_inter // tp, c.experts, c.top_k
        unique = int(ids.unique().numel())
        nbytes, flops = moe_cost(c, m, unique, x.element_size(), tp)
        return kernel_row("moe_w4a16", ops.moe_impl(x, w[0], w[2], impl), str(self.dtype).removeprefix("torch."),
                          self.dev.type, MoeShape(m, 2 * i, h, e, k), t, nbytes, flops, tp=tp,
                          unique_experts=unique, expected_experts=expected_experts(e, k, m), host_us=host)

    # ------------------------------------------------------------------ trees
    def draft(self, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Drafter-like inputs: sorted top-k log-probs and tokens per position, root tokens."""
        c = self.p.cfg
        raw = torch.randn(batch, c.draft_len, c.draft_topk, generator=self.gen, device=self.dev)
        lp = torch.log_softmax(raw * 2, -1).sort(-1, descending=True).values
        tok = torch.randint(0, c.vocab, (batch, c.draft_len, c.draft_topk), generator=self.gen, device=self.dev)
        root = torch.randint(0, c.vocab, (batch,), generator=self.gen, device=self.dev)
        return lp, tok, root

    def tree(self, batch: int, budget: int) -> ops.Tree:
        lp, tok, root = self.draft(batch)
        return reference.build_tree(lp, tok, root, budget)

    def build_tree(self, batch: int, budget: int) -> KernelRow:
        lp, tok, root = self.draft(batch)
        c = self.p.cfg
        t = time_op(lambda: ops.build_tree(lp, tok, root, budget), self.dev, self.p.repeats)
        return kernel_row("build_tree", ops.kernel_impl("auto", "build_tree", lp), "float32", self.dev.type,
                          TreeShape(batch, budget, c.draft_len, c.draft_topk), t,
                          *build_tree_cost(c, batch, budget))  # flops: one score add per node

    def accept_inputs(self, batch: int, budget: int) -> tuple[ops.Tree, torch.Tensor]:
        """A real tree and a target argmax that agrees with each node's first child (a deep walk)."""
        tree = self.tree(batch, budget)
        n = budget + 1
        first = torch.full((batch, n), n, dtype=torch.int64, device=self.dev)
        idx = torch.arange(1, n, device=self.dev).expand(batch, -1)
        first.scatter_reduce_(1, tree.parents[:, 1:], idx, reduce="amin")
        rand = torch.randint(0, self.p.cfg.vocab, (batch, n), generator=self.gen, device=self.dev)
        return tree, torch.where(first < n, tree.tokens.gather(1, first.clamp(max=n - 1)), rand)

    def tree_accept(self, batch: int, budget: int) -> KernelRow:
        tree, want = self.accept_inputs(batch, budget)
        t = time_op(lambda: ops.tree_accept(tree, want), self.dev, self.p.repeats)
        return kernel_row("tree_accept", ops.kernel_impl("auto", "tree_accept", tree.tokens), "int64", self.dev.type,
                          AcceptShape(batch, budget), t,
                          *tree_accept_cost(self.p.cfg, batch, budget))  # flops: one compare per node

    # ------------------------------------------------------------------ attention
    def attention_inputs(self, batch: int, budget: int, context: int, tp: int = 1) -> tuple:
        """Latent queries for B+1 tree tokens over a context-row prefix, with a real DDTree mask;
        heads / tp of them (one rank of TP-tp: the latent cache is whole on every rank)."""
        c = self.p.cfg
        n = budget + 1
        hh, dl, dr = c.heads // tp, c.kv_lora, c.rope_dim
        q_nope = self.ini.normal(batch, n, hh, dl, std=1.0)
        q_rope = self.ini.normal(batch, n, hh, dr, std=1.0)
        ckv = self.ini.normal(batch, context + n, dl, std=1.0)
        kpe = self.ini.normal(batch, context + n, dr, std=1.0)
        lens = torch.full((batch,), context, dtype=torch.int64, device=self.dev)
        return q_nope, q_rope, ckv, kpe, lens, self.tree(batch, budget).mask, 1.0 / (c.qk_dim ** 0.5)

    def attention(self, batch: int, budget: int, context: int, impl: str, tp: int = 1) -> KernelRow:
        c = self.p.cfg
        q_nope, q_rope, ckv, kpe, lens, mask, scale = self.attention_inputs(batch, budget, context, tp)
        if impl == "torch":  # the plain-PyTorch baseline, in the input dtype
            fn = lambda: reference.mla_tree_attention(q_nope, q_rope, ckv, kpe, lens, mask, scale,  # noqa: E731
                                                      compute_dtype=self.dtype)
            reps = self.p.torch_repeats
        else:
            fn = lambda: ops.mla_tree_attention(q_nope, q_rope, ckv, kpe, lens, mask, scale)  # noqa: E731
            reps = budgeted_repeats(fn, self.dev, self.p.repeats)
        t = time_op(fn, self.dev, reps)
        nbytes, flops = mla_cost(c, batch, budget, context, q_nope.element_size(), tp)
        return kernel_row("mla_tree_attention", ops.mla_impl(q_nope, ckv.shape[1], impl), str(self.dtype).removeprefix("torch."),
                          self.dev.type, MlaShape(batch, budget, context, q_nope.shape[2], c.kv_lora + c.rope_dim),
                          t, nbytes, flops, tp=tp)


def budgeted_repeats(fn: Callable[[], object], device: torch.device, repeats: int) -> int:
    """Repeats that keep a long point near POINT_S seconds of timed calls (one untimed call measures it;
    it also compiles), at least MIN_REPEATS; short points keep the profile's repeats."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return max(MIN_REPEATS, min(repeats, int(POINT_S / max(time.perf_counter() - t0, 1e-9))))
