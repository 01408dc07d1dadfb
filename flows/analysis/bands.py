"""Bands from evidence: split-conformal edges of the held-out errors of each carry a figure uses.

Every backtest (flows.analysis.backtest) keeps, per kind of carry and family, the ratios measured / predicted
of the points it held out. A figure built with a carry gets that carry's band: its edges at the
conformal order statistics of those ratios (for 90% coverage, the ceil((n + 1) 0.95)-th from each
end: the extremes while n < 19), widened where that is narrower to the normal prediction interval
of the log ratios (mean +- t(0.95, n - 1) sd sqrt(1 + 1/n)): with a handful of points the extremes of
n cover only (n - 1) / (n + 1) of new ones, so few points give a wider band, never a narrower one.
Points of one group (one configuration's acceptance levels) are one piece of evidence for where a
configuration lands; how far a point strays from its configuration is a second term with its own
edges (the same rule over the pooled deviations, their spread counted with the groups' degrees of
freedom), and a new point has both: the two independent terms add in quadrature. A figure built with several carries adds their log-centres and
their log-half-widths in quadrature, with the measurement spread as one more term. A carry with
fewer than MIN_POINTS held-out points has no band: the figure's band is unknown and says which
carry lacks evidence, never a narrow band. Kernel-level carries (a family's size) act on the step
through that family's share of it.

Where the memory-bound carrier's form is uncertain (flows.analysis.carrier.others), a figure's band also holds
what each other candidate carrier gives for it: no held-out evidence settles the form for the target.

Cross-host evidence is the carries from the projection's own reference (the carry the other way is the
same points mirrored, not more evidence), and a rate's held-out ratios (tokens/s) count inverted, as time.

Evidence is split by stratum where an answer can lie beyond what its calibration measured in a way the
other answers do not (a composed step whose in-step terms leave the tokens its TP degree's rows
measured: flows.analysis.stepmodel.Step.stratum): such an answer's errors are of another kind, so the
configurations' term of a figure's band comes from its own stratum only (too few points there: unknown),
while the stray term pools every stratum's deviations (how one configuration's levels spread is not
what the stratum parts).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

MIN_POINTS = 5
COVERAGE = 0.90
# carry -> (backtest kind, family prefixes) of the evidence it rests on
EVIDENCE = {"composition": ("composition", ("e2e step",)), "tp": ("tp", ("e2e TP-",)),
            "size:moe": ("size", ("moe_w4a16/",)), "size:attention": ("size", ("mla_tree_attention/",)),
            "cross-host": ("cross-host", ("e2e tokens/s", "e2e step less attention"))}
# Families whose held-out ratios are of a rate (measured / predicted tokens/s): a band is on the predicted
# time, so their evidence counts inverted (a projection too fast reads as a measured time above 1).
RATES = ("e2e tokens/s",)


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


Evidence = tuple[tuple[float, ...], tuple[str, ...]]   # held-out ratios, the group of each
T95_SMALL = {1: 6.314, 2: 2.920, 3: 2.353}   # t(0.95, df) where the expansion below is poor


def t_quantile(p: float, df: int) -> float:
    """Student's t quantile (Cornish-Fisher expansion around the normal one; within 0.5% for df >= 4)."""
    if p == 0.95 and df in T95_SMALL:
        return T95_SMALL[df]
    z = statistics.NormalDist().inv_cdf(p)
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2) \
        + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * df ** 3)


def edges(ratios: Sequence[float], groups: Sequence[object] | None = None,
          coverage: float = COVERAGE, strays: Evidence = ((), ())) -> tuple[float, float] | None:
    """(low, high) edges of measured/predicted ratios (module doc); None under MIN_POINTS points or
    under two groups. Points of one group (the acceptance levels of one configuration) are one piece
    of evidence: the edges of the groups' mean log ratios, combined in quadrature with the edges of
    the points' deviations from their group's mean. `strays`: points of other strata, whose deviations
    inside their groups count too (how a configuration's levels spread is not what a stratum parts)."""
    if len(ratios) < MIN_POINTS:
        return None
    groups = list(groups) if groups is not None else list(range(len(ratios)))
    by = _by_group(ratios, groups)
    means = [statistics.mean(v) for v in by.values()]
    if len(means) < 2:
        return None
    lo, hi = _interval(means, len(means) - 1, coverage)
    spread = [*by.values(), *_by_group(*strays).values()]
    free = sum(map(len, spread)) - len(spread)   # the deviations' degrees of freedom: none when every group is one point
    if free:   # the two terms are independent: their edges add in quadrature around the groups' centre
        d_lo, d_hi = _interval([x - statistics.mean(v) for v in spread for x in v], free, coverage, centred=True)
        mid = statistics.mean(means)
        lo, hi = mid - math.hypot(mid - lo, d_lo), mid + math.hypot(hi - mid, d_hi)
    return min(math.exp(lo), 1.0), max(math.exp(hi), 1.0)


def _by_group(ratios: Sequence[float], groups: Sequence[object]) -> dict[object, list[float]]:
    """Log ratios by group."""
    by: dict[object, list[float]] = {}
    for r, g in zip(ratios, groups):
        by.setdefault(g, []).append(math.log(r))
    return by


def _interval(xs: Sequence[float], df: int, coverage: float, centred: bool = False) -> tuple[float, float]:
    """Log edges holding `coverage` of new draws like `xs`: the conformal ranks of xs (its extremes while
    they are too few), widened to the t prediction interval with `df` degrees of freedom; `centred`:
    deviations from their groups' means (mean zero by construction, spread over `df`)."""
    xs = sorted(xs)
    n = len(xs)
    k = math.ceil((n + 1) * (1 + coverage) / 2)      # rank from each end
    lo, hi = (xs[0], xs[-1]) if k > n else (xs[n - k], xs[k - 1])
    t = t_quantile((1 + coverage) / 2, df)
    if centred:
        mid, half = 0.0, t * math.sqrt(sum(x * x for x in xs) / df)
    else:
        mid, half = statistics.mean(xs), t * statistics.stdev(xs) * math.sqrt(1 + 1 / n)
    return min(lo, mid - half), max(hi, mid + half)


def evidence_of(rows: Sequence[object], carry: str, stratum: str = "", others: bool = False) -> Evidence:
    """The held-out ratios of time (and their groups) of a carry in one stratum (`others`: in every other
    one), pooled over the stored backtest rows it rests on."""
    kind, prefixes = EVIDENCE[carry]
    ratios: list[float] = []
    groups: list[str] = []
    for r in rows:
        family = str(getattr(r, "family"))
        if getattr(r, "kind") == kind and family.startswith(prefixes):
            got = tuple(getattr(r, "ratios", ()) or ())
            if family.startswith(RATES):
                got = tuple(1 / x for x in got)
            names = getattr(r, "groups", ()) or range(len(got))
            strata = getattr(r, "strata", ()) or ("",) * len(got)
            keep = [(x, g) for x, g, s in zip(got, names, strata) if (s == stratum) != others]
            ratios += [x for x, _ in keep]
            groups += [f"{getattr(r, 'family')}:{g}" for _, g in keep]
    return tuple(ratios), tuple(groups)


def combine(parts: Mapping[str, tuple[Evidence, float] | tuple[Evidence, float, Evidence]],
            spread: float = 0.0) -> Band:
    """The band of a figure made with each carry in `parts` (its evidence, the share of the figure it
    acts on, and optionally the carry's points of other strata for the stray term), plus a relative
    measurement spread."""
    centre, var, unknown = 0.0, math.log1p(spread) ** 2, []
    for name, ((ratios, groups), share, *strays) in parts.items():
        e = edges(ratios, groups, strays=strays[0] if strays else ((), ()))
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


def holding(band: Band, ratios: Sequence[float]) -> Band:
    """The band widened to hold each of `ratios` (another candidate's time over the figure's: what the other
    carriers would give where the carrier's form is uncertain, flows.analysis.carrier.others); an unknown
    band stays unknown."""
    if not band.known or not ratios:
        return band
    return Band(min(band.low, *ratios), max(band.high, *ratios))  # type: ignore[type-var]


def jackknife(ratios: Sequence[float], groups: Sequence[object],
              strata: Sequence[str] = ()) -> list[tuple[float, float] | None]:
    """For each held-out point, the edges from the other groups' ratios of its stratum only (its own
    group never counts; no strata: one)."""
    strata = list(strata) or [""] * len(ratios)
    out = []
    for mine, kind in zip(groups, strata):
        keep = [(r, g, s == kind) for r, g, s in zip(ratios, groups, strata) if g != mine]
        strays = tuple(r for r, _, same in keep if not same), tuple(g for _, g, same in keep if not same)
        out.append(edges([r for r, _, same in keep if same], [g for _, g, same in keep if same], strays=strays))
    return out


def from_reference(evidence: Sequence[object], reference: str) -> list[object]:
    """The evidence a projection from `reference` rests on: its cross-host rows are the carries from that
    reference only (a carry the other way is the same points mirrored, not more evidence)."""
    return [e for e in evidence if getattr(e, "kind") != "cross-host" or getattr(e, "reference") == reference]


def reached(evidence: Sequence[object], reference: str, ref_gbps: float) -> dict[str, float]:
    """The machines a projection's band evidence came from, by spec copy bandwidth (GB/s): its reference
    and the targets of the reference's cross-host carries."""
    out = {reference: ref_gbps}
    for e in from_reference(evidence, reference):
        if getattr(e, "kind") == "cross-host" and getattr(e, "target_gbps", None):
            out[str(getattr(e, "target"))] = float(getattr(e, "target_gbps"))
    return out


def step_band(step: Any, evidence: Sequence[object], spread: float, others: Sequence[Any] = ()) -> Band:
    """The band of a step model answer: each carry it used, with the evidence the backtests stored, holding
    the same answer under each other candidate carrier (`others`: those answers)."""
    parts = {}
    for carry in step.carries:
        share = step.share(carry.split(":")[1]) if carry.startswith("size:") else 1.0
        stratum = step.stratum if carry == "composition" else ""
        parts[f"{carry} {stratum}".strip()] = (evidence_of(evidence, carry, stratum), share,
                                              evidence_of(evidence, carry, stratum, others=True))
    whole = step.step_ms + step.ms["comm"]
    return holding(combine(parts, spread), [(o.step_ms + o.ms["comm"]) / whole for o in others])
