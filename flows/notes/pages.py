"""What the page templates lay out (flows/notes/templates/): one frozen view per section, a Page, the index.

Every string a view holds is page text already: host strings went through `md` when the sections
built the view, so the templates only arrange them and never escape. A plot is named here by its
path relative to the page; the section that built the view also returned the chart that draws it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Table:
    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]

    @staticmethod
    def of(header: Sequence[str], rows: Sequence[Sequence[str]]) -> "Table":
        return Table(tuple(header), tuple(tuple(r) for r in rows))


@dataclass(frozen=True)
class SourceLine:
    """Where a section's figures come from, as the page says it."""

    run_id: str
    profile: str
    status: str
    started: str
    fallback: str


@dataclass(frozen=True)
class MoeTable:
    title: str
    shape: str
    impl: str
    plateau: int | None
    table: Table


@dataclass(frozen=True)
class MoeView:
    source: SourceLine | None
    tables: tuple[MoeTable, ...]
    plots: tuple[tuple[str, str], ...]            # (alt text, relative path)
    missing_shard: int | None = None              # the shard degree an 8-GPU box runs, when not measured
    method: str | None = None                     # the kernel suite's own note in that run: how it timed


@dataclass(frozen=True)
class KernelsView:
    source: SourceLine | None
    table: Table | None
    roofline: str | None
    dense: Table | None = None


@dataclass(frozen=True)
class AcceptView:
    table: Table | None
    plot: str | None
    why_not: str                                  # when there is no full-depth row to plot


@dataclass(frozen=True)
class ContextView:
    table: Table | None
    plot: str | None
    crossover: tuple[str, ...]                    # per series: where attention overtakes the MoE, or why unknown
    skipped: tuple[str, ...]                      # every skipped e2e point: reason and bytes
    why_not: str                                  # when there is no series to plot


@dataclass(frozen=True)
class E2EView:
    source: SourceLine
    method: str | None  # the e2e suite's own note in that run: how its figures were made
    projected: bool
    levels: str
    table: Table
    accept: AcceptView
    context: ContextView
    split: Table
    amdahl: str
    busy: Table | None
    largest: str
    families: Table | None = None   # the step by kernel family, where the rows have that split


@dataclass(frozen=True)
class CommView:
    source: SourceLine
    table: Table


@dataclass(frozen=True)
class Comparison:
    first: bool
    sentence: str
    table: Table | None


@dataclass(frozen=True)
class ProjectionView:
    ref_line: str
    assumptions: tuple[str, ...]
    cited: Table | None


@dataclass(frozen=True)
class OutsideEntry:
    line: str
    e2e: Table | None
    kernels: Table | None
    notes: tuple[str, ...]


@dataclass(frozen=True)
class LevelTable:
    title: str
    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class WhatIfView:
    intro: str
    tables: tuple[LevelTable, ...]
    notes: tuple[str, ...]


@dataclass(frozen=True)
class Page:
    name: str
    gpu: str
    kind: str
    data_line: str
    headline: str | None
    environment: Table | None
    history: Table | None
    moe: MoeView | None
    kernels: KernelsView | None
    e2e: E2EView | None
    comm: CommView | None
    comparison: Comparison | None
    projection: ProjectionView | None
    outside: tuple[OutsideEntry, ...]
    whatif: WhatIfView | None = None
    band_note: str | None = None        # what the bands rest on, where the page must say so next to them


@dataclass(frozen=True)
class IndexView:
    hosts: Table
    backtest: Table | None
    backtest_details: tuple[str, ...]
