"""Typed rows of the result tables, one class a table, written out from engine.schema's columns; a file's
provenance record; and the kernel shapes.

Why written out: a type checker sees each row's attributes, so a misspelt one is caught before a run;
tests/test_engine_units.py checks that every row class has exactly its table's columns, in order, of the
column's type, each defaulting to what a file that leaves the column out means (null, or
`schema.column_defaults`), and that `Provenance` has the schema's provenance keys. A row is a frozen
dataclass of keyword fields: an unknown column is a TypeError where the row is made, not a wrong file
later. `table_files.to_table` takes these rows.

The kernels table keeps its generic shape columns (M, N, K, E, top_k, batch, budget, context, op:
schema v4), which mean different things in different families. Each family's shape record below
names its own axes and maps them onto those columns in one place (`columns`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar, overload

import pyarrow as pa

from engine import schema, table_files

if TYPE_CHECKING:   # the controller reads rows without torch, which engine.timing imports
    from engine.timing import Timing

@dataclass(frozen=True, kw_only=True)
class RunRow:
    """One row of the runs table."""

    run_id: str | None = None
    host: str | None = None
    suite: str | None = None
    profile: str | None = None
    status: str | None = None
    gpu_name: str | None = None
    gpu_count: int | None = None
    driver: str | None = None
    cuda: str | None = None
    torch: str | None = None
    triton: str | None = None
    python: str | None = None
    payload_hash: str | None = None
    arch: str | None = None
    device: str | None = None
    started_at: str | None = None
    ended_at: str | None = None
    copy_gbps: float | None = None
    matmul_tflops: float | None = None
    points: int | None = None
    note: str | None = None
    source: str | None = None


@dataclass(frozen=True, kw_only=True)
class KernelRow:
    """One row of the kernels table."""

    run_id: str | None = None
    kernel: str | None = None
    impl: str | None = None
    dtype: str | None = None
    device: str | None = None
    op: str | None = None
    M: int | None = None
    N: int | None = None
    K: int | None = None
    E: int | None = None
    top_k: int | None = None
    tp: int | None = 1
    unique_experts: int | None = None
    expected_experts: float | None = None
    budget: int | None = None
    context: int | None = None
    batch: int | None = None
    time_us_p10: float | None = None
    time_us_p50: float | None = None
    time_us_p90: float | None = None
    host_us: float | None = None
    repeats: int | None = None
    bytes: float | None = None
    flops: float | None = None
    achieved_gbps: float | None = None
    achieved_tflops: float | None = None
    source: str | None = None
    reference_run_id: str | None = None
    regime: str | None = None
    reference_regime: str | None = None
    time_us_low: float | None = None
    time_us_high: float | None = None


@dataclass(frozen=True, kw_only=True)
class E2ERow:
    """One row of the e2e table."""

    run_id: str | None = None
    config: str | None = None
    layers: int | None = None
    tp: int | None = 1
    weight_sets: int | None = 1
    vocab: int | None = None
    comm_source: str | None = None
    device: str | None = None
    concurrency: int | None = None
    budget: int | None = None
    context: int | None = None
    synthetic_accept: float | None = None
    status: str | None = "ok"
    skip_reason: str | None = None
    memory_bytes: float | None = None
    accept_len_mean: float | None = None
    tokens_per_s: float | None = None
    steps: int | None = None
    step_ms_p50: float | None = None
    step_ms_p99: float | None = None
    ttft_ms: float | None = None
    itl_ms_p50: float | None = None
    itl_ms_p99: float | None = None
    draft_ms: float | None = None
    tree_build_ms: float | None = None
    verify_ms: float | None = None
    accept_ms: float | None = None
    other_ms: float | None = None
    comm_ms: float | None = None
    kernel_ms: float | None = None
    outside_ms: float | None = None
    moe_ms: float | None = None
    attention_ms: float | None = None
    dense_ms: float | None = None
    lm_head_ms: float | None = None
    tree_ms: float | None = None
    gpu_other_ms: float | None = None
    source: str | None = None
    reference_run_id: str | None = None
    tokens_per_s_low: float | None = None
    tokens_per_s_high: float | None = None


@dataclass(frozen=True, kw_only=True)
class CommRow:
    """One row of the comm table."""

    run_id: str | None = None
    op: str | None = None
    world_size: int | None = None
    bytes: int | None = None
    time_us_p50: float | None = None
    algbw_gbps: float | None = None
    busbw_gbps: float | None = None
    status: str | None = None
    skip_reason: str | None = None
    source: str | None = None


@dataclass(frozen=True, kw_only=True)
class Provenance:
    """A result file's provenance (its metadata JSON): engine.schema.PROVENANCE_KEYS, where the run ran,
    then the controller's ADDED_PROVENANCE_KEYS. Read with `of`, which ignores keys it does not know; a
    key left None is not written (`table_files.to_table`)."""

    run_id: str
    host: str | None = None
    gpu_name: str | None = None
    gpu_count: int | None = None
    driver: str | None = None
    cuda: str | None = None
    torch: str | None = None
    triton: str | None = None
    python: str | None = None
    payload_hash: str | None = None
    arch: str | None = None
    device: str | None = None
    started_at: str | None = None
    ended_at: str | None = None
    reference_run_id: str | None = None
    reference_host: str | None = None
    references: list[str] | None = None
    spec: str | dict[str, Any] | None = None   # an import's spec sheet name; a projection's target spec figures
    assumptions: list[dict[str, Any]] | None = None
    what: str | None = None
    answers: list[dict[str, Any]] | None = None
    origin: str | None = None
    machine: str | None = None
    date: str | None = None
    source: str | None = None
    impl: str | None = None
    notes: list[str] | None = None
    interconnect: str | None = None

    @classmethod
    def of(cls, table: pa.Table) -> Provenance:
        """The provenance of a checked table (its run_id a string: `table_checks.validate`)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in table_files.provenance(table).items() if k in known})


Row = RunRow | KernelRow | E2ERow | CommRow
ROWS: dict[str, type[Row]] = {"runs": RunRow, "kernels": KernelRow, "e2e": E2ERow, "comm": CommRow}
# Every column's name as an attribute (COLUMNS.reference_run_id == "reference_run_id"), for the few
# places that must name a column as a string (an Arrow column read): a misspelt one is an
# AttributeError where it is named, not a column silently missing.
S = TypeVar("S", bound="Shape")
COLUMNS = SimpleNamespace(**{n: n for t in schema.TABLES for n in schema.SCHEMAS[t].names})


@overload
def table_rows(table: pa.Table, name: Literal["runs"]) -> list[RunRow]: ...
@overload
def table_rows(table: pa.Table, name: Literal["kernels"]) -> list[KernelRow]: ...
@overload
def table_rows(table: pa.Table, name: Literal["e2e"]) -> list[E2ERow]: ...
@overload
def table_rows(table: pa.Table, name: Literal["comm"]) -> list[CommRow]: ...
@overload
def table_rows(table: pa.Table, name: str) -> list[Any]: ...
def table_rows(table: pa.Table, name: str) -> list[Any]:
    """The rows of a checked table of `name` as that table's typed rows (a column the table does not
    hold takes the row's default; one the row does not know is a TypeError)."""
    return [ROWS[name](**r) for r in table.to_pylist()]


def set_columns(row: Row) -> dict[str, Any]:
    """Column -> value of the columns a row sets (not null): what a progress line carries."""
    return {f.name: getattr(row, f.name) for f in fields(row) if getattr(row, f.name) is not None}


def _timing_columns(t: Timing, nbytes: float, flops: float) -> dict[str, Any]:
    """The timing columns of a kernel point, and the rates its bytes and flops reach in that time."""
    s = t.p50_us * 1e-6
    return {"time_us_p10": t.p10_us, "time_us_p50": t.p50_us, "time_us_p90": t.p90_us,
            "repeats": t.repeats, "bytes": float(nbytes), "flops": float(flops),
            "achieved_gbps": nbytes / s / 1e9, "achieved_tflops": flops / s / 1e12}


class Shape:
    """A family's shape: its own names (the fields), the kernels columns they are stored in, and the axes
    a sweep varies (`SWEPT`: the rest follow from the model config, the TP degree and, for dense GEMMs, the op)."""

    COLUMNS: ClassVar[dict[str, str]]  # field -> column
    SWEPT: ClassVar[tuple[str, ...]]

    def columns(self) -> dict[str, Any]:
        return {col: getattr(self, name) for name, col in self.COLUMNS.items()}

    @classmethod
    def of(cls: type[S], row: Any) -> S:
        """The shape a kernels row of this family stores (the inverse of `columns`): read by its names."""
        return cls(**{name: getattr(row, col) for name, col in cls.COLUMNS.items()})


@dataclass(frozen=True)
class MoeShape(Shape):
    """Routed experts: M tokens through E experts of [gate_up_rows, hidden] (gate_up_rows = 2 x the
    intermediate of one TP rank), each token to top_k of them."""

    tokens: int
    gate_up_rows: int
    hidden: int
    experts: int
    top_k: int
    COLUMNS: ClassVar[dict[str, str]] = {"tokens": "M", "gate_up_rows": "N", "hidden": "K", "experts": "E",
                                         "top_k": "top_k"}
    SWEPT: ClassVar[tuple[str, ...]] = ("tokens",)


@dataclass(frozen=True)
class MlaShape(Shape):
    """Tree-verify attention: `batch` sequences of budget + 1 tree tokens over `context` cached rows,
    `heads` query heads (one TP rank's) of `head_dim` (latent + rope)."""

    batch: int
    budget: int
    context: int
    heads: int
    head_dim: int
    COLUMNS: ClassVar[dict[str, str]] = {"batch": "batch", "budget": "budget", "context": "context",
                                         "heads": "N", "head_dim": "K"}
    SWEPT: ClassVar[tuple[str, ...]] = ("batch", "budget", "context")


@dataclass(frozen=True)
class TreeShape(Shape):
    """Tree build: `budget` nodes a sequence from draft_len positions of draft_topk candidates."""

    batch: int
    budget: int
    draft_len: int
    draft_topk: int
    COLUMNS: ClassVar[dict[str, str]] = {"batch": "batch", "budget": "budget", "draft_len": "N", "draft_topk": "K"}
    SWEPT: ClassVar[tuple[str, ...]] = ("batch", "budget")


@dataclass(frozen=True)
class AcceptShape(Shape):
    """Tree accept: the target's argmax walked down trees of `budget` nodes."""

    batch: int
    budget: int
    COLUMNS: ClassVar[dict[str, str]] = {"batch": "batch", "budget": "budget"}
    SWEPT: ClassVar[tuple[str, ...]] = ("batch", "budget")


@dataclass(frozen=True)
class DenseShape(Shape):
    """A dense GEMM of a step (engine.costs.dense_ops): M tokens x [out_features, in_features], `heads`
    of them side by side for the absorbed MLA einsums (1 for a plain linear)."""

    op: str
    tokens: int
    out_features: int
    in_features: int
    heads: int
    COLUMNS: ClassVar[dict[str, str]] = {"op": "op", "tokens": "M", "out_features": "N", "in_features": "K",
                                         "heads": "batch"}
    SWEPT: ClassVar[tuple[str, ...]] = ("tokens",)


def kernel_row(kernel: str, impl: str, dtype: str, device: str, shape: Shape, t: Timing, nbytes: float,
               flops: float, **more: Any) -> KernelRow:
    """A kernels row: the point's shape in its family's columns, its timing, and `more` columns."""
    return KernelRow(kernel=kernel, impl=impl, dtype=dtype, device=device, **shape.columns(),
                     **_timing_columns(t, nbytes, flops), **more)
