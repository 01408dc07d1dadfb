"""Triton kernels against their references on the CPU, through Triton's interpreter, in fp16.

TRITON_INTERPRET must be set before Triton compiles anything, and other test modules import Triton
too, so the kernel tests run in a child pytest with the variable set; in the parent they skip and
`test_kernels_under_interpreter` carries their result. Shapes are tiny: the interpreter is slow.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
inner = pytest.mark.skipif(not INTERPRETED, reason="runs in test_kernels_under_interpreter's child")


def _numpy_scalar_index_compat() -> None:
    """Triton 3.6's interpreter calls int() on 1-element arrays, which NumPy >= 2.4 refuses."""
    import triton.runtime.interpreter as ti

    orig = ti._patch_lang_tensor

    def patched(tensor, scope) -> None:  # noqa: ANN001 - Triton's own internals
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    ti._patch_lang_tensor = patched


if INTERPRETED:
    _numpy_scalar_index_compat()


def test_kernels_under_interpreter() -> None:
    if INTERPRETED:
        pytest.skip("this is the child run")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                        "-k", "not test_kernels_under_interpreter"],
                       env=env, capture_output=True, text=True, timeout=540)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert " passed" in r.stdout and "skipped" not in r.stdout.splitlines()[-1], r.stdout[-2000:]


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "unwritten (poisoned) or non-finite output"
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def _check_moe(m: int, e: int, seed: int, configs: dict, path: str | None = None) -> None:
    """Random K2-format weights (H 256, I 128, top-3), one Triton path run with every buffer it
    allocates poisoned, its fp16 output checked against the reference."""
    from kernels import moe_gemm, reference
    from engine.gpu_check import poisoned, unpoisoned
    from kernels.int4 import quantize_w4

    g = torch.Generator().manual_seed(seed)
    h, inter, k = 256, 128, 3
    w13 = quantize_w4(torch.randn(e, 2 * inter, h, generator=g) * 0.1)
    w2 = quantize_w4(torch.randn(e, h, inter, generator=g) * 0.1)
    x = torch.randn(m, h, generator=g).half()
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(m)])
    wts = torch.rand(m, k, generator=g)
    poisoned(moe_gemm)
    try:
        out = moe_gemm.moe_w4a16(x, *w13, *w2, ids, wts, configs=configs, path=path)
    finally:
        unpoisoned(moe_gemm)
    assert out.dtype == torch.float16 and out.shape == (m, h)
    assert _rel(out, reference.moe_w4a16(x, *w13, *w2, ids, wts)) < 1e-2


@inner
@pytest.mark.parametrize("m,e,dot", [(1, 8, 0), (7, 8, 0), (5, 8, 4), (24, 4, 1)])
def test_moe_split_k_matches_reference(m: int, e: int, dot: int) -> None:
    """The decode path: per-program block finding (m=24 over 4 experts: 18 slots each, so two
    16-slot blocks per expert), two K splits in gate_up, SiLU x up (permuted for the FMA down
    pass), the split + top-k sum; FMA with and without the register double-buffer (DOT 4)."""
    cfg = (16, 32, 64, 128, 4, 1, dot)
    _check_moe(m, e, 200 + m, {"gate_up": cfg, "down": cfg}, path="split")


@inner
@pytest.mark.parametrize("m,gu,dn", [(50, (16, 32, 64, 128, 4, 1, 1), (32, 64, 64, 64, 4, 1, 1)),
                                     (19, (32, 64, 128, 256, 4, 1, 1), (1, 32, 64, 128, 4, 1, 0)),
                                     (40, (1, 32, 64, 128, 4, 1, 4), (16, 32, 32, 64, 4, 1, 1))])
def test_moe_grouped_matches_reference(m: int, gu: tuple, dn: tuple) -> None:
    """The grouped split-K path: blocks from align() (m=50: 150 slots over 8 experts, so several
    blocks an expert and unused tail blocks), plane dots (x in _plane_major's order; h written so
    by silu_mul's PLANES when down runs them) / FMA with and without the register double-buffer,
    K splits in both passes (down at m=50: KS 64 of 128), different BM per pass (two alignments)."""
    _check_moe(m, 8, 300 + m, {"gate_up": gu, "down": dn}, path="grouped")


@inner
def test_moe_refuses_unknown_dot() -> None:
    from kernels import moe_gemm_configs

    with pytest.raises(ValueError, match="DOT"):
        _check_moe(3, 8, 1, {"gate_up": (16, 32, 64, 128, 4, 1, 2), "down": (16, 32, 64, 128, 4, 1, 1)},
                   path="grouped")
    assert moe_gemm_configs.shape_class(2048) == "full" and moe_gemm_configs.shape_class(256) == "shard"


@inner
def test_moe_alignment_blocks() -> None:
    from kernels.moe_gemm import align

    ids = torch.tensor([[3, 1], [3, 0], [1, 3], [3, 2]])
    slots, seg, cnt, bexp, bms, ub = align(ids, 5, 2)
    assert cnt.tolist() == [1, 2, 1, 4, 0] and seg.tolist() == [0, 1, 3, 4, 8]
    assert slots.tolist() == [3, 1, 4, 7, 0, 2, 5, 6]  # stable: slots of expert 0, 1, 2, 3 in order
    assert ub == 4 + 5
    # blocks: e0 [0], e1 [0], e2 [0], e3 [0, 2], then unused (expert id == 5)
    assert bexp.tolist() == [0, 1, 2, 3, 3, 5, 5, 5, 5] and bms.tolist()[:5] == [0, 0, 0, 0, 2]


def _mla_inputs(bt: int, t: int, hh: int, s: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    dl, dr = 32, 16
    return (torch.randn(bt, t, hh, dl, generator=g).half(), torch.randn(bt, t, hh, dr, generator=g).half(),
            torch.randn(bt, s, dl, generator=g).half(), torch.randn(bt, s, dr, generator=g).half())


def _tree_masks(bt: int, t: int, seed: int) -> torch.Tensor:
    """Ancestor masks of real DDTrees of T nodes: sequence 0 from a peaked draft (one deep chain),
    the others from flat drafts (wide, bushy trees)."""
    from kernels import reference

    g = torch.Generator().manual_seed(seed)
    length, k = 4, 4
    lp = torch.randn(bt, length, k, generator=g)
    lp[0] *= 8
    lp = F.log_softmax(lp, -1).sort(-1, descending=True).values
    tok = torch.randint(0, 100, (bt, length, k), generator=g)
    return reference.build_tree(lp, tok, torch.zeros(bt, dtype=torch.int64), t - 1).mask


def _run_mla(args: tuple, ctx: torch.Tensor, mask: torch.Tensor | None, **kw) -> torch.Tensor:
    from kernels import mla_tree_attention
    from engine.gpu_check import poisoned, unpoisoned

    poisoned(mla_tree_attention)
    try:
        return mla_tree_attention.mla_tree_attention(*args, ctx, mask, 0.2, **kw)
    finally:
        unpoisoned(mla_tree_attention)


@inner
@pytest.mark.parametrize("t,hh,splits,cfg", [(9, 4, None, (16, 16, 4, 2)), (9, 4, 3, (16, 16, 4, 2)),
                                             (7, 3, 2, (16, 16, 4, 2)), (1, 4, None, None), (1, 4, 1, None),
                                             (13, 2, None, (32, 16, 4, 2))])
def test_mla_matches_reference(t: int, hh: int, splits: int | None, cfg: tuple | None) -> None:
    """Tokens x heads packed into row tiles: 36 rows over three 16-row tiles (the last partial),
    3 heads (tokens straddle tiles), one decode token (the small-rows config); contexts that do not
    divide the key block (9, 38), a cache longer than ctx + T; real tree masks (a deep chain and
    bushy trees) and, in the last sequence, the all-True mask; one split or several."""
    from kernels import reference
    from kernels.mla_tree_attention import Config

    bt, s = 3, 64
    args = _mla_inputs(bt, t, hh, s, 7 + t + hh)
    ctx = torch.tensor([9, s - t, 38])
    mask = _tree_masks(bt, t, t).clone()
    mask[2] = True
    out = _run_mla(args, ctx, mask, config=cfg and Config("triton", *cfg), splits=splits)
    assert _rel(out, reference.mla_tree_attention(*args, ctx, mask, 0.2)) < 1e-2


@inner
@pytest.mark.parametrize("t,hh,splits", [(12, 4, None), (12, 4, 4), (5, 2, 2)])
def test_mla_causal_is_the_chain_mask(t: int, hh: int, splits: int | None) -> None:
    """causal=True (no mask tensor; each tile stops at its last token's key) equals the reference
    with a lower-triangular tree, over prefixes that do and do not align with the key block."""
    from kernels import reference
    from kernels.mla_tree_attention import Config

    bt, s = 2, 56
    args = _mla_inputs(bt, t, hh, s, 40 + t)
    ctx = torch.tensor([16, 21])
    out = _run_mla(args, ctx, None, causal=True, config=Config("triton", 16, 16, 4, 2), splits=splits)
    want = reference.mla_tree_attention(*args, ctx, None, 0.2, causal=True)
    assert _rel(out, want) < 1e-2
    chain = torch.ones(t, t, dtype=torch.bool).tril().expand(bt, t, t)
    assert torch.equal(want, reference.mla_tree_attention(*args, ctx, chain, 0.2))


def test_mla_split_plan_fills_the_chip() -> None:
    """Splits from sizes alone: none when the row tiles fill the SMs many times over, many when
    they do not (each split a whole number of key blocks, all of them covering the cache)."""
    from kernels.mla_tree_attention import plan_splits

    assert plan_splits(16 * 257, 65793, 64, 132) == (1, 1029 * 64)
    for tiles, s, least in ((1, 4113, 64), (3, 4113, 32), (17, 65553, 7), (24, 16401, 5), (133, 65793, 2)):
        n, chunk = plan_splits(tiles, s, 64, 132)
        assert chunk % 64 == 0 and (n - 1) * chunk < s <= n * chunk
        assert n >= least, (tiles, n)



def test_mla_split_plan_for_gluon_ws_takes_whole_pairs() -> None:
    """gluon_ws takes key blocks in pairs and pays much more a wave than v5's estimate: its splits are
    whole pairs, and where tiles just overflow a wave it keeps one split rather than paying partials."""
    from kernels.mla_tree_attention import CONFIGS, PLAN_COSTS, plan_splits

    assert {c.kernel for table in CONFIGS.values() for c in table.values()} <= PLAN_COSTS.keys()
    ws = PLAN_COSTS["gluon_ws"]
    for tiles, s in ((3, 4113), (24, 16401), (136, 4113), (17, 65553), (48, 4113), (272, 16401)):
        n, chunk = plan_splits(tiles, s, 64, 132, ws)
        assert chunk % 128 == 0 and (n - 1) * chunk < s <= n * chunk, (tiles, s, n, chunk)
    assert plan_splits(136, 4113, 64, 132) == (3, 22 * 64)
    assert plan_splits(136, 4113, 64, 132, ws) == (1, 66 * 64)


@inner
def test_mla_forced_splits_run_the_planners_candidate(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forced split count runs the plan the planner weighs for that count, in whole units of the
    kernel (a sweep of counts times the planner's own choices): with a two-block unit, 3 splits of
    7 key blocks are 2 of 4, not 3 of 3 (an odd chunk, for which gluon_ws pays a masked block); with
    one-block units the chunk is what it always was; the output is still the reference's."""
    import triton

    from kernels import mla_tree_attention, reference
    from kernels.mla_tree_attention import Config, PlanCosts, split_plan

    assert split_plan(65, 2, 2) == (2, 34) and split_plan(65, 2, 1) == (2, 33) and split_plan(7, 3, 2) == (2, 4)
    for s, n in ((4113, 2), (4113, 7), (16401, 64), (100, 3), (64, 1)):
        assert split_plan(triton.cdiv(s, 64), n, 1)[1] * 64 == triton.cdiv(triton.cdiv(s, n), 64) * 64
    monkeypatch.setitem(mla_tree_attention.PLAN_COSTS, "triton", PlanCosts(2, 2.0, 1.0, 2.0, 0.0))
    combine, seen = mla_tree_attention._mla_combine, []

    class Spy:  # records the split count each combine launch merges
        def __getitem__(self, grid: tuple) -> Any:
            def launch(part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, n: int, **kw: Any) -> None:
                seen.append(n)
                combine[grid](part, lse, out, n, **kw)
            return launch

    monkeypatch.setattr(mla_tree_attention, "_mla_combine", Spy())
    bt, t, hh, s = 2, 5, 2, 7 * 16
    args = _mla_inputs(bt, t, hh, s, 11)
    ctx = torch.tensor([s - t, 50])
    mask = _tree_masks(bt, t, 3)
    out = _run_mla(args, ctx, mask, config=Config("triton", 16, 16, 4, 2), splits=3)
    assert seen == [2]
    assert _rel(out, reference.mla_tree_attention(*args, ctx, mask, 0.2)) < 1e-2

def _draft(bt: int, length: int, k: int, seed: int, ties: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lp = F.log_softmax(torch.randn(bt, length, 40, generator=g) * 2, -1).topk(k, -1).values
    if ties:
        lp = ((lp * 2).round() / 2).sort(-1, descending=True).values
    return lp.contiguous(), torch.randint(0, 5000, (bt, length, k), generator=g)


@inner
@pytest.mark.parametrize("length,k,budget,ties", [(4, 3, 20, False), (6, 4, 60, True), (3, 2, 14, False),
                                                  (3, 3, 30, None)])
def test_tree_build_is_the_cpu_heap(length: int, k: int, budget: int, ties: bool | None) -> None:
    """The GPU builder against the CPU heap: random log-probs, a coarse grid (many equal scores,
    the insertion counters break them), all equal (ties: None; the counters decide everything)."""
    from kernels import build_tree, reference
    from engine.gpu_check import poisoned, unpoisoned

    lp, tok = _draft(3, length, k, budget, bool(ties))
    if ties is None:
        lp.zero_()
    root = torch.tensor([11, 12, 13])
    want = reference.build_tree(lp, tok, root, budget)
    poisoned(build_tree)
    try:
        got = build_tree.build_tree(lp, tok, root, budget)
    finally:
        unpoisoned(build_tree)
    for field in ("tokens", "parents", "depths", "scores", "mask"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    assert got.draft_len == want.draft_len == length


@inner
def test_tree_build_refuses_what_it_cannot_build() -> None:
    from kernels import build_tree

    lp, tok = _draft(1, 2, 2, 0, False)
    with pytest.raises(ValueError, match="budget"):
        build_tree.build_tree(lp, tok, torch.tensor([0]), 7)
    with pytest.raises(ValueError, match="63-bit"):
        build_tree.key_bits(4096, 64, 64)


@inner
def test_tree_accept_matches_walk() -> None:
    from kernels import reference, tree_accept
    from engine.gpu_check import poisoned, unpoisoned

    lp, tok = _draft(4, 5, 3, 3, False)
    tree = reference.build_tree(lp, tok, torch.zeros(4, dtype=torch.int64), 30)
    g = torch.Generator().manual_seed(5)
    am = torch.randint(0, 5000, (4, 31), generator=g)
    steps = []
    for b in range(4):  # follow the best child for b + 1 steps, then miss for sure (no token is < 0)
        cur, n = 0, 0
        for _ in range(b + 1):
            kids = (tree.parents[b] == cur).nonzero().flatten()
            if kids.numel() == 0:
                break
            am[b, cur] = tree.tokens[b, kids[0]]
            cur, n = int(kids[0]), n + 1
        am[b, cur] = -5
        steps.append(n)
    poisoned(tree_accept)
    try:
        got = tree_accept.tree_accept(tree, am)
    finally:
        unpoisoned(tree_accept)
    want = reference.tree_accept(tree, am)
    for a, w in zip(got, want):
        assert torch.equal(a, w)
    assert want[1].tolist() == steps and want[2].tolist() == [-5] * 4


def test_auto_dispatch_is_the_reference_on_cpu() -> None:
    from kernels import ops

    x = torch.zeros(1, 8)
    assert ops.kernel_impl("auto", "moe_gemm", x) == "torch"
    assert ops.kernel_impl("torch", "moe_gemm", x) == "torch"
    assert ops.kernel_impl("triton", "mla_tree_attention", x) == "triton"
    with pytest.raises(ValueError):
        ops.kernel_impl("cuda", "moe_gemm", x)  # type: ignore[arg-type]


def test_mla_impl_names_the_kernel_the_dispatch_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The impl column of an MLA point names the Gluon kernel where the launch runs it: ops.mla_impl
    reads the tile config the launch reads (on an sm_90 device with bf16 queries over 16 rows: v5's
    "gluon" up to SHORT_WORK tiles x key blocks a launch, "gluon_ws" above), and "triton" where that
    config is the tl.dot kernel's (16 rows or fewer, fp16, another GPU)."""
    from kernels import mla_tree_attention, ops

    q = torch.zeros(1, 5, 4, 64, dtype=torch.bfloat16)  # 20 query rows: the "rows" class
    assert ops.mla_impl(q, 64) == "torch"  # CPU tensors: the reference
    assert ops.mla_impl(q, 64, "torch") == "torch"
    assert ops.mla_impl(q, 64, "triton") == "triton"  # the interpreter: the default table
    monkeypatch.setattr(mla_tree_attention, "capability", lambda device: (9, 0))
    assert ops.mla_impl(q, 64 * 1025, "triton") == "gluon_ws"  # 1 x 1 x 1025: over SHORT_WORK
    assert ops.mla_impl(q, 64, "triton") == "gluon"  # a small launch: the short config
    assert ops.mla_impl(q[:, :4], 64, "triton") == "triton"  # 16 rows: the small-row config
    assert ops.mla_impl(q.half(), 64, "triton") == "triton"  # Gluon takes bf16 only
    monkeypatch.setattr(mla_tree_attention, "capability", lambda device: (12, 0))
    assert ops.mla_impl(q, 64, "triton") == "triton"
    monkeypatch.setattr(mla_tree_attention, "capability", lambda device: (9, 0))
    monkeypatch.setitem(mla_tree_attention.SHORT_WORK, (9, 0), 4)  # work: batch x row tiles x key blocks
    assert ops.mla_impl(q, 4 * 64, "triton") == "gluon"  # 1 x 1 x 4: the short config
    assert ops.mla_impl(q, 4 * 64 + 1, "triton") == "gluon_ws"  # 1 x 1 x 5
    assert ops.mla_impl(q.expand(2, -1, -1, -1), 2 * 64, "triton") == "gluon"  # 2 x 1 x 2
    assert ops.mla_impl(q.expand(2, -1, -1, -1), 3 * 64, "triton") == "gluon_ws"  # 2 x 1 x 3
    wide = torch.zeros(1, 5, 16, 64, dtype=torch.bfloat16)  # 80 rows: 2 row tiles
    assert ops.mla_impl(wide, 2 * 64, "triton") == "gluon"  # 1 x 2 x 2
    assert ops.mla_impl(wide, 3 * 64, "triton") == "gluon_ws"  # 1 x 2 x 3
    monkeypatch.setattr(mla_tree_attention, "mla_gluon", None)  # a Triton without Gluon
    monkeypatch.setattr(mla_tree_attention, "capability", lambda device: (9, 0))
    assert ops.mla_impl(q, 64, "triton") == "triton"
