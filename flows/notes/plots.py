"""PNG plots for the notes, byte-identical for identical inputs.

A section returns its charts as data (`Lines`, `Roofline`, `Amdahl`: a file name under the page's
plot folder and what to draw); rendering draws them (`Chart.draw`) beside the page.

Figures are built on matplotlib's object API with the Agg canvas (no pyplot global state), under
matplotlib's default rcParams plus a few fixed ones (so a user's matplotlibrc cannot change the
bytes), and saved without the Software/date metadata that would differ between runs. Every label
is shown as written (`_literal`): hosts name the kernels, and a `$...$` in a name would otherwise be
parsed as mathtext (and may fail to parse). Tick labels keep their mathtext exponents.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence, Union

import matplotlib
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from engine.rows import COLUMNS

RC = {k: v for k, v in matplotlib.rcParamsDefault.items() if k not in ("backend", "backend_fallback")}
RC.update({"font.family": "DejaVu Sans", "font.size": 9, "figure.dpi": 100, "savefig.dpi": 100,
           "axes.grid": True, "grid.alpha": 0.3, "path.simplify": False, "svg.hashsalt": "kdbench"})
SIZE = (6.4, 3.8)
TERM_COLORS = {COLUMNS.draft_ms: "#4C72B0", COLUMNS.tree_build_ms: "#55A868", COLUMNS.verify_ms: "#C44E52",
               COLUMNS.accept_ms: "#8172B2", COLUMNS.other_ms: "#937860", COLUMNS.comm_ms: "#DA8BC3",
               # the per-family split of a step (flows.analysis.stepmodel's terms)
               COLUMNS.moe_ms: "#C44E52", COLUMNS.attention_ms: "#4C72B0", COLUMNS.dense_ms: "#CCB974",
               COLUMNS.lm_head_ms: "#64B5CD", COLUMNS.tree_ms: "#55A868", COLUMNS.gpu_other_ms: "#937860",
               COLUMNS.outside_ms: "#8C8C8C"}


def _literal(text: str) -> str:
    """text with its dollar signs escaped, so matplotlib draws it as text, never as mathtext."""
    return text.replace("$", r"\$")


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(path, format="png", metadata={"Software": None})
    return path


def _figure() -> Figure:
    with matplotlib.rc_context(RC):
        return Figure(figsize=SIZE, layout="constrained")


Band = tuple[Sequence[float], Sequence[float]] | None          # y low, y high


def _positive(values: Iterable[float]) -> bool:
    return any(math.isfinite(v) and v > 0 for v in values)


@dataclass(frozen=True)
class Lines:
    """One line per series on a log-M axis, with a shaded band where the series has one."""

    file: str
    series: Sequence[tuple[str, Sequence[float], Sequence[float], Band]]
    title: str
    xlabel: str
    ylabel: str
    logx: bool = True
    logy: bool = False

    def draw(self, out_dir: Path) -> Path:
        with matplotlib.rc_context(RC):
            fig = _figure()
            ax = fig.add_subplot()
            for label, x, y, band in self.series:
                line, = ax.plot(x, y, marker="o", ms=3, label=_literal(label))
                if band:
                    ax.fill_between(x, band[0], band[1], color=line.get_color(), alpha=0.2, lw=0)
            ax.set(title=_literal(self.title), xlabel=_literal(self.xlabel), ylabel=_literal(self.ylabel))
            # a log axis needs a positive value to show (a store may hold none: all of it is drawn as NaN)
            if self.logx and _positive(v for _, x, _, _ in self.series for v in x):
                ax.set_xscale("log", base=2)
            if self.logy and _positive(v for _, _, y, _ in self.series for v in y):
                ax.set_yscale("log")
            if self.series:
                ax.legend(loc="best")
            return _save(fig, out_dir / self.file)


@dataclass(frozen=True)
class Roofline:
    """Achieved TFLOP/s against arithmetic intensity (flop/byte) under each (label, GB/s, TFLOP/s) roof."""

    file: str
    points: Sequence[tuple[str, Sequence[float], Sequence[float]]]
    ceilings: Sequence[tuple[str, float, float]]
    title: str

    def draw(self, out_dir: Path) -> Path:
        xs = [x for _, xx, _ in self.points for x in xx if x > 0]
        lo, hi = (min(xs) / 4, max(xs) * 4) if xs else (0.1, 1e4)
        with matplotlib.rc_context(RC):
            fig = _figure()
            ax = fig.add_subplot()
            for label, bw, tf in self.ceilings:
                ridge = tf * 1e3 / bw
                grid = sorted({lo, hi, min(max(ridge, lo), hi)})
                ax.plot(grid, [min(bw * g / 1e3, tf) for g in grid], lw=1.5, ls="--",
                        label=_literal(f"{label} roof"))
            for label, x, y in self.points:
                keep = [(a, b) for a, b in zip(x, y) if a > 0 and b > 0]
                if keep:
                    ax.scatter([a for a, _ in keep], [b for _, b in keep], s=12, label=_literal(label))
            ax.set(title=_literal(self.title), xlabel="arithmetic intensity (flop / byte)", ylabel="TFLOP/s")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.legend(loc="lower right", fontsize=7)
            return _save(fig, out_dir / self.file)


@dataclass(frozen=True)
class Amdahl:
    """Stacked shares (%) of each step term, one bar per (label, {term: ms})."""

    file: str
    bars: Sequence[tuple[str, dict[str, float]]]
    title: str

    def draw(self, out_dir: Path) -> Path:
        bars = self.bars
        with matplotlib.rc_context(RC):
            fig = _figure()
            ax = fig.add_subplot()
            labels = [_literal(b[0]) for b in bars]
            bottoms = [0.0] * len(bars)
            for term, color in ((t, c) for t, c in TERM_COLORS.items() if any(t in b for _, b in bars)):
                shares = [100 * t.get(term, 0.0) / (sum(t.values()) or 1.0) for _, t in bars]
                ax.bar(range(len(bars)), shares, bottom=bottoms, color=color, label=term.removesuffix("_ms"))
                bottoms = [b + s for b, s in zip(bottoms, shares)]
            ax.set_xticks(range(len(bars)), labels, fontsize=7, rotation=30, ha="right")
            ax.set(title=_literal(self.title), ylabel="share of the step (%)", ylim=(0, 100))
            ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
            return _save(fig, out_dir / self.file)


Chart = Union[Lines, Roofline, Amdahl]
