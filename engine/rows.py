"""Typed rows of the result tables, generated from engine.schema's columns, and the kernel shapes.

Why generated: the column spec in engine.schema is the one definition; a row class copied by hand
would drift from it. `ROWS[table]` is a frozen dataclass with one keyword field a column, each
defaulting to what a file that leaves the column out means (null, or `schema.column_defaults`): a
misspelt or unknown column is a TypeError where the row is made, not a wrong file later.
`schema.to_table` takes these rows.

The kernels table keeps its generic shape columns (M, N, K, E, top_k, batch, budget, context, op:
schema v4), which mean different things in different families. Each family's shape record below
names its own axes and maps them onto those columns in one place (`columns`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, make_dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, ClassVar

import pyarrow as pa

from engine import schema

if TYPE_CHECKING:   # the controller reads rows without torch, which engine.timing imports
    from engine.timing import Timing

_PY = {pa.string(): str, pa.int64(): int, pa.float64(): float}


_NAMES = {"runs": "RunRow", "kernels": "KernelRow", "e2e": "E2ERow", "comm": "CommRow"}


def _row_type(table: str) -> type:
    defaults = schema.column_defaults(table)
    spec = [(f.name, _PY[f.type] | None, field(default=defaults.get(f.name))) for f in schema.SCHEMAS[table]]
    # named and placed as this module's attributes, so a row pickles (the comm suite's ranks send theirs)
    return make_dataclass(_NAMES[table], spec, frozen=True, kw_only=True,
                          namespace={"__module__": __name__,
                                     "__doc__": f"One row of the {table} table (engine.schema's columns)."})


ROWS: dict[str, type] = {t: _row_type(t) for t in schema.TABLES}
Row = Any   # an instance of one of ROWS' classes (made at import, so a type checker sees Any)
RunRow, KernelRow, E2ERow, CommRow = (ROWS[t] for t in schema.TABLES)
# Every column's name as an attribute (COLUMNS.reference_run_id == "reference_run_id"), for the few
# places that must name a column as a string (an Arrow column read): a misspelt one is an
# AttributeError where it is named, not a column silently missing.
COLUMNS = SimpleNamespace(**{n: n for t in schema.TABLES for n in schema.SCHEMAS[t].names})


def table_rows(table: pa.Table, name: str) -> list[Any]:
    """The rows of a checked table of `name` as that table's typed rows (a column the table does not
    hold takes the row's default; one the row does not know is a TypeError)."""
    return [ROWS[name](**r) for r in table.to_pylist()]


def set_columns(row: Any) -> dict[str, Any]:
    """Column -> value of the columns a row sets (not null): what a progress line carries."""
    return {f.name: getattr(row, f.name) for f in fields(row) if getattr(row, f.name) is not None}


def _timing_columns(t: Timing, nbytes: float, flops: float) -> dict[str, Any]:
    """The timing columns of a kernel point, and the rates its bytes and flops reach in that time."""
    s = t.p50_us * 1e-6
    return {"time_us_p10": t.p10_us, "time_us_p50": t.p50_us, "time_us_p90": t.p90_us,
            "repeats": t.repeats, "bytes": float(nbytes), "flops": float(flops),
            "achieved_gbps": nbytes / s / 1e9, "achieved_tflops": flops / s / 1e12}


class _Shape:
    """A family's shape: its own names (the fields) and the kernels columns they are stored in."""

    COLUMNS: ClassVar[dict[str, str]]  # field -> column

    def columns(self) -> dict[str, Any]:
        return {col: getattr(self, name) for name, col in self.COLUMNS.items()}

    @classmethod
    def of(cls, row: Any) -> Any:
        """The shape a kernels row of this family stores (the inverse of `columns`): read by its names."""
        return cls(**{name: getattr(row, col) for name, col in cls.COLUMNS.items()})


@dataclass(frozen=True)
class MoeShape(_Shape):
    """Routed experts: M tokens through E experts of [gate_up_rows, hidden] (gate_up_rows = 2 x the
    intermediate of one TP rank), each token to top_k of them."""

    tokens: int
    gate_up_rows: int
    hidden: int
    experts: int
    top_k: int
    COLUMNS: ClassVar[dict[str, str]] = {"tokens": "M", "gate_up_rows": "N", "hidden": "K", "experts": "E",
                                         "top_k": "top_k"}


@dataclass(frozen=True)
class MlaShape(_Shape):
    """Tree-verify attention: `batch` sequences of budget + 1 tree tokens over `context` cached rows,
    `heads` query heads (one TP rank's) of `head_dim` (latent + rope)."""

    batch: int
    budget: int
    context: int
    heads: int
    head_dim: int
    COLUMNS: ClassVar[dict[str, str]] = {"batch": "batch", "budget": "budget", "context": "context",
                                         "heads": "N", "head_dim": "K"}


@dataclass(frozen=True)
class TreeShape(_Shape):
    """Tree build: `budget` nodes a sequence from draft_len positions of draft_topk candidates."""

    batch: int
    budget: int
    draft_len: int
    draft_topk: int
    COLUMNS: ClassVar[dict[str, str]] = {"batch": "batch", "budget": "budget", "draft_len": "N", "draft_topk": "K"}


@dataclass(frozen=True)
class AcceptShape(_Shape):
    """Tree accept: the target's argmax walked down trees of `budget` nodes."""

    batch: int
    budget: int
    COLUMNS: ClassVar[dict[str, str]] = {"batch": "batch", "budget": "budget"}


@dataclass(frozen=True)
class DenseShape(_Shape):
    """A dense GEMM of a step (engine.costs.dense_ops): M tokens x [out_features, in_features], `heads`
    of them side by side for the absorbed MLA einsums (1 for a plain linear)."""

    op: str
    tokens: int
    out_features: int
    in_features: int
    heads: int
    COLUMNS: ClassVar[dict[str, str]] = {"op": "op", "tokens": "M", "out_features": "N", "in_features": "K",
                                         "heads": "batch"}


def kernel_row(kernel: str, impl: str, dtype: str, device: str, shape: _Shape, t: Timing, nbytes: float,
               flops: float, **more: Any) -> Any:
    """A kernels row: the point's shape in its family's columns, its timing, and `more` columns."""
    return KernelRow(kernel=kernel, impl=impl, dtype=dtype, device=device, **shape.columns(),
                     **_timing_columns(t, nbytes, flops), **more)
