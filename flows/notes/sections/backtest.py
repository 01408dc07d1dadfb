"""The backtest table (the index's, and the cited rows on a projected page): how well each kind of
carry held up on held-out data, and how far each misses its goal."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from flows.analysis.backtest import CHANGED, BacktestRow, goal_gap
from flows.analysis.bands import MIN_GROUPS
from flows.inventory.scrub import md


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


BACKTEST_COLUMNS = ("backtest", "data", "family", "regime", "points", "median error", "median |error|",
                    "worst error", "in band", "half-width", "goal")


def backtest_cells(rows: Sequence[BacktestRow], cell: Callable[..., str] = md) -> list[list[str]]:
    """One row of BACKTEST_COLUMNS per backtest row; the goal column says how far each misses, or `met`.
    Text cells go through `cell`: markdown-escaped for a page, `scrub.plain` for a terminal."""
    out = []
    for r in rows:
        med_gap, band_gap = goal_gap(r)
        if r.skipped:
            goal = f"skipped: {r.detail}"
        elif r.kind == CHANGED:
            goal = "none: the target ran other code than the reference, so the error is not the carrier's"
        else:
            bits = []
            if med_gap is not None:
                bits.append("median met" if med_gap == 0 else f"median {med_gap:.1%} over")
            if band_gap is None:
                bits.append(f"band unknown (under {MIN_GROUPS} other configurations, pooled too)")
            else:
                bits.append("band met" if band_gap == 0 else f"band {band_gap:.0%} short")
            goal = ", ".join(bits)
        data = r.reference if r.reference == r.target else f"{r.reference} -> {r.target}"
        notes = [f"{n} {what}" for n, what in ((r.pooled, "pooled"), (r.unknown, "unknown")) if n]
        in_band = "-" if r.in_band is None else f"{r.in_band:.0%}" + (f" ({', '.join(notes)})" if notes else "")
        out.append([cell(r.kind), cell(data), cell(r.family), cell(r.regime), str(r.points), _pct(r.median_error),
                    "-" if r.median_abs_error is None else f"{r.median_abs_error:.1%}", _pct(r.worst_error), in_band, "-" if r.half_width is None else f"{r.half_width:.1%}",
                    cell(goal, cap=400)])
    return out
