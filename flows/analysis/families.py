"""Kernel families and point keys: one definition for the projection, the backtests and the notes.

A family is a kernel name (as engine.bench writes it) and an implementation. These rules say
which points run on the host whatever the GPU (CPU kernels, the Python tree references), which
resource bounds a point (its regime), which kernel shape each e2e step term is made of, and how
points and e2e rows are keyed when two tables are matched.
"""

from __future__ import annotations

from engine.config import ModelConfig
from engine.rows import COLUMNS, AcceptShape, DenseShape, E2ERow, KernelRow, MlaShape, MoeShape, Shape, TreeShape

MEMORY, COMPUTE, HOST, LATENCY = "memory", "compute", "host", "latency"
# A GPU point reaching under this share of both ceilings is bound by latency (serial steps, launches):
# its time follows neither bandwidth nor flops.
LATENCY_SHARE = 0.05
# The dense GEMMs of a step (engine.costs.dense_ops), one point per op, M and TP degree.
DENSE = "dense_gemm"
# The torch references of the tree kernels are Python loops on the host: GPU speed does not move them.
HOST_SIDE = {("build_tree", "torch"), ("tree_accept", "torch")}
C = COLUMNS
POINT_KEY = (C.kernel, C.impl, C.dtype, C.M, C.N, C.K, C.E, C.top_k, C.budget, C.context, C.batch, C.tp, C.op)
E2E_KEY = (C.config, C.layers, C.tp, C.concurrency, C.budget, C.context, C.synthetic_accept)
# Term of the e2e step -> kernel families whose time makes it up (verify: per layer).
TERM_FAMILIES = {C.verify_ms: ("moe_w4a16", "mla_tree_attention"), C.tree_build_ms: ("build_tree",),
                 C.accept_ms: ("tree_accept",)}
# Each family's shape record (engine.rows): the names of its axes, and the kernels columns they are stored in.
SHAPES: dict[str, type[Shape]] = {"moe_w4a16": MoeShape, "mla_tree_attention": MlaShape, "build_tree": TreeShape,
                                  "tree_accept": AcceptShape, DENSE: DenseShape}
# The size axis of each family: what the size backtest holds out.
SIZE_AXIS = {"moe_w4a16": C.M, "mla_tree_attention": C.context, "build_tree": C.budget, "tree_accept": C.budget,
             "dense_gemm": C.M}
E2E_CONTEXT = 512   # context of a short-prompt e2e step (prompts of 256-512 tokens plus the new ones)



def label(row: KernelRow) -> str:
    """`kernel/impl`, the name a family goes by in tables and notes."""
    return f"{row.kernel}/{row.impl}"


def tp_of(row: KernelRow | E2ERow) -> int:
    """Tensor-parallel degree of a point or e2e row (1 where the file predates the column)."""
    return int(row.tp or 1)


def host_side(row: KernelRow) -> bool:
    """Points that run on the host whatever the GPU: CPU kernels and the Python tree references."""
    return row.impl == "cpu" or (row.kernel, row.impl) in HOST_SIDE


def bound(t_bytes: float, t_flops: float) -> str:
    return MEMORY if t_bytes >= t_flops else COMPUTE


def regime(row: KernelRow, gbps: float | None, tflops: float | None) -> str:
    """host, latency, memory or compute: what bounds a measured point on a device of these ceilings."""
    if host_side(row):
        return HOST
    if not gbps or not tflops:
        return "-"
    t_bytes, t_flops = row.bytes / (gbps * 1e3), row.flops / (tflops * 1e6)
    if max(t_bytes, t_flops) < LATENCY_SHARE * row.time_us_p50:
        return LATENCY
    return bound(t_bytes, t_flops)


def point_key(row: KernelRow) -> tuple:
    return tuple(tp_of(row) if k == "tp" else getattr(row, k) for k in POINT_KEY)


def e2e_key(row: E2ERow, without: tuple[str, ...] = ()) -> tuple:
    return tuple(tp_of(row) if k == "tp" else getattr(row, k) for k in E2E_KEY if k not in without)


def shape_of(row: KernelRow) -> Shape:
    """The shape a point of a family kdbench models ran at, as that family's shape record."""
    return SHAPES[row.kernel].of(row)


def shape_at(family: str, cfg: ModelConfig, tp: int, tokens: int = 0, batch: int = 0, budget: int = 0,
             context: int = 0) -> Shape:
    """The shape one rank of a TP-`tp` deployment of `cfg` runs a family's kernel at, for a step of
    `tokens` tokens (the MoE) or `batch` sequences of `budget` tree nodes over `context` cached rows."""
    if family == "moe_w4a16":
        return MoeShape(tokens, 2 * (cfg.moe_inter // tp), cfg.hidden, cfg.experts, cfg.top_k)
    if family == "mla_tree_attention":
        return MlaShape(batch, budget, context, cfg.heads // tp, cfg.kv_lora + cfg.rope_dim)
    if family == "build_tree":
        return TreeShape(batch, budget, cfg.draft_len, cfg.draft_topk)
    return AcceptShape(batch, budget)


def preferred(rows: list[KernelRow]) -> list[KernelRow]:
    """The implementation a step runs: the engine's own kernels where the family has them (CUDA or
    Triton, whichever the host ran at each shape), else what there is (the torch reference)."""
    return [r for r in rows if r.impl != "torch"] or rows
