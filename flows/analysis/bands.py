"""Bands from evidence: split-conformal edges of the held-out errors of each carry a figure uses.

Every backtest (flows.analysis.backtest) keeps, per kind of carry and family, the ratios measured / predicted
of the points it held out. A figure built with a carry gets that carry's band: its edges at the
conformal order statistics of those ratios (for 90% coverage, the ceil((n + 1) 0.95)-th from each
end: the extremes while n < 19), widened where that is narrower to the normal prediction interval
of the log ratios (mean +- t(0.95, n - 1) sd sqrt(1 + 1/n)): with a handful of points the extremes of
n cover only (n - 1) / (n + 1) of new ones, so few points give a wider band, never a narrower one. A figure built with several carries adds their log-centres and
their log-half-widths in quadrature, with the measurement spread as one more term. A carry with
fewer than MIN_POINTS held-out points has no band: the figure's band is unknown and says which
carry lacks evidence, never a narrow band. Kernel-level carries (a family's size) act on the step
through that family's share of it.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

MIN_POINTS = 5
COVERAGE = 0.90
# carry -> (backtest kind, family prefix) of the evidence it rests on
EVIDENCE = {"composition": ("composition", "e2e step"), "tp": ("tp", "e2e TP-"),
            "size:moe": ("size", "moe_w4a16/"), "size:attention": ("size", "mla_tree_attention/"),
            "cross-host": ("cross-host", "e2e tokens/s")}


@dataclass(frozen=True)
class Band:
    low: float | None             # multiplier of the predicted time (None: unknown)
    high: float | None
    unknown: tuple[str, ...] = ()  # the carries without enough evidence, "name (n points)"

    @property
    def known(self) -> bool:
        return self.low is not None

    def of_rate(self, value: float) -> tuple[float | None, float | None]:
        """(low, high) of a rate (tokens/s) whose time the band is on."""
        if not self.known:
            return None, None
        return value / self.high, value / self.low  # type: ignore[operator]

    def half_width(self) -> float | None:
        return None if not self.known else (self.high - self.low) / 2  # type: ignore[operator]


T95_SMALL = {1: 6.314, 2: 2.920, 3: 2.353}   # t(0.95, df) where the expansion below is poor


def t_quantile(p: float, df: int) -> float:
    """Student's t quantile (Cornish-Fisher expansion around the normal one; within 0.5% for df >= 4)."""
    if p == 0.95 and df in T95_SMALL:
        return T95_SMALL[df]
    z = statistics.NormalDist().inv_cdf(p)
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2) \
        + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * df ** 3)


def edges(ratios: Sequence[float], groups: Sequence[object] | None = None,
          coverage: float = COVERAGE) -> tuple[float, float] | None:
    """(low, high) edges of measured/predicted ratios (module doc); None under MIN_POINTS points or
    under two groups. Points of one group (the acceptance levels of one configuration) are one piece
    of evidence: the edges are taken over the groups' mean log ratios, their spread inside a group
    added in quadrature."""
    if len(ratios) < MIN_POINTS:
        return None
    groups = list(groups) if groups is not None else list(range(len(ratios)))
    by: dict[object, list[float]] = {}
    for r, g in zip(ratios, groups):
        by.setdefault(g, []).append(math.log(r))
    means = sorted(statistics.mean(v) for v in by.values())
    n = len(means)
    if n < 2:
        return None
    inside = [x - statistics.mean(v) for v in by.values() for x in v]
    within = statistics.pstdev(inside) if len(inside) > n else 0.0
    k = math.ceil((n + 1) * (1 + coverage) / 2)      # rank from each end
    lo, hi = (means[0], means[-1]) if k > n else (means[n - k], means[k - 1])
    half = math.hypot(t_quantile((1 + coverage) / 2, n - 1) * statistics.stdev(means) * math.sqrt(1 + 1 / n), within)
    mid = statistics.mean(means)
    return min(math.exp(lo - within), math.exp(mid - half), 1.0), max(math.exp(hi + within), math.exp(mid + half), 1.0)


Evidence = tuple[tuple[float, ...], tuple[str, ...]]   # held-out ratios, the group of each


def evidence_of(rows: Sequence[object], carry: str) -> Evidence:
    """The held-out ratios (and their groups) of a carry, pooled over the stored backtest rows it rests on."""
    kind, prefix = EVIDENCE[carry]
    ratios: list[float] = []
    groups: list[str] = []
    for r in rows:
        if getattr(r, "kind") == kind and str(getattr(r, "family")).startswith(prefix):
            got = tuple(getattr(r, "ratios", ()) or ())
            ratios += got
            groups += [f"{getattr(r, 'family')}:{g}" for g in (getattr(r, "groups", ()) or range(len(got)))]
    return tuple(ratios), tuple(groups)


def combine(parts: Mapping[str, tuple[Evidence, float]], spread: float = 0.0) -> Band:
    """The band of a figure made with each carry in `parts` (its evidence, the share of the figure it
    acts on), plus a relative measurement spread."""
    centre, var, unknown = 0.0, math.log1p(spread) ** 2, []
    for name, ((ratios, groups), share) in parts.items():
        e = edges(ratios, groups)
        if e is None:
            unknown.append(f"{name} ({len(ratios)} held-out point{'s' if len(ratios) != 1 else ''})")
            continue
        lo, hi = (math.log(1 + share * (x - 1)) for x in e)
        centre += (lo + hi) / 2
        var += ((hi - lo) / 2) ** 2
    if unknown:
        return Band(None, None, tuple(unknown))
    h = math.sqrt(var)
    return Band(min(math.exp(centre - h), 1.0), max(math.exp(centre + h), 1.0))


def jackknife(ratios: Sequence[float], groups: Sequence[object]) -> list[tuple[float, float] | None]:
    """For each held-out point, the edges from the other groups' ratios only (its own never counts)."""
    out = []
    for mine in groups:
        keep = [(r, g) for r, g in zip(ratios, groups) if g != mine]
        out.append(edges([r for r, _ in keep], [g for _, g in keep]))
    return out


def step_band(step: Any, evidence: Sequence[object], spread: float) -> Band:
    """The band of a step model answer: each carry it used, with the evidence the backtests stored."""
    parts = {}
    for carry in step.carries:
        share = step.share(carry.split(":")[1]) if carry.startswith("size:") else 1.0
        parts[carry] = (evidence_of(evidence, carry), share)
    return combine(parts, spread)
