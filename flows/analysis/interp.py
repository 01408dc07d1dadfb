"""Piecewise-linear interpolation over measured samples in log axes, saying where it leaves their range.

A measured sweep is a scattered set of shapes (M; batch x budget x context; tp x tokens), not always a
full grid. `interpolate` walks the axes in order: on the first axis it takes the two measured values
that bracket the query (log scale) and recurses on the samples at each; the two answers are blended
linearly in log axis. Outside the measured values of an axis the edge value is held (or, with
`beyond="slope"`, the edge segment's log-log slope is extended, clipped), and the axis is named in
`extrapolated`: a figure built on it is an extrapolation, and says so. `interpolate_borrowing` fills
such an edge from another level of the first axis where one spans the query (a trend borrowed, still
labelled extrapolated).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Mapping, Sequence

Sample = tuple[Mapping[str, float], float]     # shape (axis -> value), measured value
Beyond = Literal["hold", "slope"]
SLOPE_RANGE = (0.0, 1.0)   # an extended trend may neither fall nor grow faster than linearly


@dataclass(frozen=True)
class Estimate:
    value: float
    extrapolated: tuple[str, ...] = ()     # axes on which the query lies outside the samples
    interpolated: tuple[str, ...] = ()     # axes on which it lies between two measured values

    def scaled(self, factor: float) -> "Estimate":
        return Estimate(self.value * factor, self.extrapolated, self.interpolated)


def _x(v: float) -> float:
    return math.log(max(float(v), 1.0))


def _merge(*names: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(n for group in names for n in group))


def interpolate(samples: Sequence[Sample], query: Mapping[str, float], axes: Sequence[str],
                log_value: bool = True, beyond: Beyond = "hold") -> Estimate:
    """The value at `query` from `samples` (at least one), piecewise linear in log of each axis.

    `log_value`: blend log(value) (positive quantities: times, ratios) instead of the value itself.
    Samples with the same shape are averaged. Raises ValueError on no samples."""
    if not samples:
        raise ValueError("interpolate: no samples")
    if not axes:
        vals = [v for _, v in samples]
        if log_value:
            return Estimate(math.exp(sum(math.log(v) for v in vals) / len(vals)))
        return Estimate(sum(vals) / len(vals))
    axis, rest = axes[0], axes[1:]
    q = _x(query[axis])
    levels = sorted({_x(s[axis]) for s, _ in samples})

    def at(level: float) -> Estimate:
        return interpolate([s for s in samples if _x(s[0][axis]) == level], query, rest, log_value, beyond)

    if q in levels:
        return at(q)
    if q < levels[0] or q > levels[-1]:
        edge = levels[0] if q < levels[0] else levels[-1]
        e = at(edge)
        value = e.value
        if beyond == "slope" and len(levels) > 1:
            inner = levels[1] if q < levels[0] else levels[-2]
            f = at(inner)
            if e.value > 0 and f.value > 0:
                slope = math.log(e.value / f.value) / (edge - inner)
                slope = min(max(slope, SLOPE_RANGE[0]), SLOPE_RANGE[1])
                value = e.value * math.exp(slope * (q - edge))
        return Estimate(value, _merge((axis,), e.extrapolated), e.interpolated)
    hi = next(v for v in levels if v > q)
    lo = max(v for v in levels if v < q)
    a, b = at(lo), at(hi)
    w = (q - lo) / (hi - lo)
    if log_value:
        value = math.exp((1 - w) * math.log(a.value) + w * math.log(b.value))
    else:
        value = (1 - w) * a.value + w * b.value
    return Estimate(value, _merge(a.extrapolated, b.extrapolated), _merge((axis,), a.interpolated, b.interpolated))


def interpolate_borrowing(samples: Sequence[Sample], query: Mapping[str, float], axes: Sequence[str]) -> Estimate:
    """`interpolate` over `axes`, except that at each level of the first axis whose samples do not reach
    the query along the second, the edge value takes the trend of the nearest level that spans the
    query there (its value at the query over its value at the edge); then linear in log of the first
    axis between levels. The borrowed axis stays labelled extrapolated: it was not measured there."""
    level, trend, rest = axes[0], axes[1], tuple(axes[1:])
    levels = sorted({float(s[level]) for s, _ in samples})
    by = {lv: [(s, v) for s, v in samples if float(s[level]) == lv] for lv in levels}
    spans = {lv: sorted({float(s[trend]) for s, _ in by[lv]}) for lv in levels}
    t = float(query[trend])
    per_level = []
    for lv in levels:
        est = interpolate(by[lv], query, rest)
        donors = [d for d in levels if d != lv and len(spans[d]) > 1 and spans[d][0] <= t <= spans[d][-1]]
        if trend in est.extrapolated and donors:
            donor = min(donors, key=lambda d: (abs(math.log(d / lv)), d))
            edge = min(spans[lv], key=lambda x: abs(math.log(x / t)))
            est = est.scaled(interpolate(by[donor], query, rest).value
                             / interpolate(by[donor], {**query, trend: edge}, rest).value)
        per_level.append((lv, est))
    blend = interpolate([({level: lv}, e.value) for lv, e in per_level], query, (level,))
    used = [e for lv, e in per_level if lv in _bracket(levels, float(query[level]))]
    return Estimate(blend.value, _merge(blend.extrapolated, *(e.extrapolated for e in used)),
                    _merge(blend.interpolated, *(e.interpolated for e in used)))


def _bracket(levels: Sequence[float], x: float) -> set[float]:
    """The levels an interpolation at x reads: x itself, or the two around it, or the nearest edge."""
    if x in levels:
        return {x}
    below, above = [v for v in levels if v < x], [v for v in levels if v > x]
    return {v for v in (max(below, default=None), min(above, default=None)) if v is not None}
