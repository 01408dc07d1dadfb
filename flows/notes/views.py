"""The notes' view of the store: a host's runs, the run each section shows, a stored projection.

Each section of a host page (kernels, e2e, comm) shows its suite's latest complete full-profile data,
whichever run that came from, and says which run that is; a smoke or partial run appears in the
page's run history and never displaces full data (`pick_source`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Sequence, overload

import pyarrow as pa

from engine.rows import CommRow, E2ERow, KernelRow, RunRow
from flows.analysis.assumptions import Assumption
from flows.analysis.backtest import BacktestRow
from flows.analysis.ceilings import rows_of
from flows.inventory.hosts import Host, Spec

SUITES = ("kernels", "e2e", "comm")


@dataclass
class Run:
    run_id: str
    tables: dict[str, pa.Table]
    _rows: dict[str, list[Any]] = field(default_factory=dict, init=False, repr=False, compare=False)

    @overload
    def rows(self, table: Literal["runs"]) -> list[RunRow]: ...
    @overload
    def rows(self, table: Literal["kernels"]) -> list[KernelRow]: ...
    @overload
    def rows(self, table: Literal["e2e"]) -> list[E2ERow]: ...
    @overload
    def rows(self, table: Literal["comm"]) -> list[CommRow]: ...
    @overload
    def rows(self, table: str) -> list[Any]: ...
    def rows(self, table: str) -> list[Any]:
        """The table's typed rows (engine.rows), made once a run: every section reads them."""
        if table not in self._rows:
            self._rows[table] = rows_of(self.tables, table)
        return self._rows[table]

    def suite_row(self, suite: str) -> RunRow | None:
        """The runs-table row of one suite of this run (None when the run did not include it)."""
        return next((r for r in self.rows("runs") if r.suite == suite), None)

    @property
    def partial(self) -> bool:
        return any(r.status == "partial" for r in self.rows("runs"))

    @property
    def runs_row(self) -> RunRow:
        rows = self.rows("runs")
        kern = [r for r in rows if r.suite == "kernels"]
        return (kern or rows)[0]


@dataclass
class Source:
    """Which run a section of a page shows, and why that one (`fallback`: empty for the latest
    complete full-profile data)."""

    suite: str
    run: Run
    profile: str
    status: str
    fallback: str = ""


@dataclass
class Projected:
    """A projection as a page shows it, whether computed now or read back from the store."""

    run: Run
    ref_host: str
    ref_run_id: str
    ref: Run | None                  # the reference's measured tables, when still at hand
    ref_spec: Spec | None
    assumptions: list[Assumption]
    references: list[str]


@dataclass
class HostView:
    """What one page shows: the host, its data (measured runs or a projection), or why there is none."""

    name: str
    host: Host | None
    spec: Spec | None
    measured: list[Run] = field(default_factory=list)      # oldest first
    projection: Projected | None = None
    missing: str = ""
    outside: list[Run] = field(default_factory=list)       # imported outside figures of this machine
    backtest: list[BacktestRow] = field(default_factory=list)
    whatif: Run | None = None                               # the stored what-if grid (flows.analysis.whatif)

    @property
    def kind(self) -> str:
        return "measured" if self.measured else "projected" if self.projection else "no data"

    @property
    def latest(self) -> Run | None:
        if self.measured:
            return self.measured[-1]
        if self.projection:
            return self.projection.run
        return None

    def source(self, suite: str) -> Source | None:
        """The run a suite's section shows: the projection, or the measured run `pick_source` chose."""
        if self.projection and not self.measured:
            run = self.projection.run
            row = run.suite_row(suite)
            return Source(suite, run, row.profile, row.status) if row and run.rows(suite) else None
        return pick_source(self.measured, suite)

    @property
    def sources(self) -> dict[str, Source]:
        return {s: src for s in SUITES if (src := self.source(s)) is not None}


def _tier(row: RunRow) -> int:
    """How well a suite's runs row stands for the host (lower is better): full and complete, full
    and skipped, any other complete or skipped profile (smoke), partial."""
    done = row.status in ("complete", "skipped")
    if row.profile == "full" and done:
        return 0 if row.status == "complete" else 1
    return 2 if done else 3


def pick_source(runs: Sequence[Run], suite: str) -> Source | None:
    """The latest run (of `runs`, oldest first) holding the suite's best data: complete full-profile
    data whenever there is any, so a later smoke or partial run never displaces it."""
    best: tuple[int, Run, RunRow] | None = None
    for run in runs:
        row = run.suite_row(suite)
        if row is None or not run.rows(suite):
            continue
        tier = _tier(row)
        if best is None or tier <= best[0]:
            best = (tier, run, row)
    if best is None:
        return None
    tier, run, row = best
    fallback = {2: f"no complete full-profile {suite} run yet", 3: f"no complete {suite} run yet"}.get(tier, "")
    return Source(suite, run, row.profile, row.status, fallback)
