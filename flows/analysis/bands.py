"""Bands from evidence: split-conformal edges of the held-out errors of each carry a figure uses.

Every backtest (flows.analysis.backtest) keeps, per kind of carry and family, the ratios measured / predicted
of the points it held out. The rule, fixed before looking at which points it moves (issue 25):

- Points of one group (one configuration's acceptance levels) are one piece of evidence. A group's score is
  the largest |log ratio| of its points, so a band that holds a new group's score holds every point of it.
- With n groups the band at 90% coverage is exp(+-q), q the ceil((n + 1) 0.9)-th smallest score: the
  finite-sample split-conformal rank, which holds a new exchangeable group with probability at least 90%.
  Below MIN_GROUPS (9) groups that rank exceeds n: no finite band has the guarantee, so none is drawn
  from the family alone (neither its extremes nor a t interval: those assume what few points cannot show).
- Where a family (or a stratum of it) has too few groups, its band is pooled: the groups of every family
  of the same backtest kind and regime (and stratum) together, a wider evidence base labelled as pooled;
  a configuration measured in several families stays one group there. Too few even so: the band is
  unknown and says which carry lacks evidence, never a narrow band from thin evidence.

The reported coverage of a backtest (`jackknife`) is computed the same way: each point's band from the
other groups only (its own configuration never counts, in any family of the pool). A figure built with
several carries adds their log-centres and log-half-widths in quadrature, with the measurement spread as
one more term; kernel-level carries (a family's size) act on the step through that family's share of it.

Where the memory-bound carrier's form is uncertain (flows.analysis.carrier.others), a figure's band also holds
what each other candidate carrier gives for it: no held-out evidence settles the form for the target.

Cross-host evidence is the carries from the projection's own reference (the carry the other way is the
same points mirrored, not more evidence), and a rate's held-out ratios (tokens/s) count inverted, as time.

Evidence is split by stratum where an answer can lie beyond what its calibration measured in a way the
other answers do not (a composed step whose in-step terms leave the tokens its TP degree's rows
measured: flows.analysis.stepmodel.Step.stratum): such an answer's errors are of another kind, so its band
comes from its own stratum only (pooled across families of that stratum; too few groups: unknown).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

COVERAGE = 0.90


def rank(n: int, coverage: float = COVERAGE) -> int:
    """The split-conformal rank of n scores at `coverage`: ceil((n + 1) coverage)."""
    return math.ceil(round((n + 1) * coverage, 9))


MIN_GROUPS = next(n for n in range(1, 1000) if rank(n) <= n)   # 9 at 90%: fewer, and no finite band holds
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
    unknown: tuple[str, ...] = ()  # the carries without enough evidence, "name (n groups)"
    pooled: tuple[str, ...] = ()   # the carries whose band is pooled over their kind and regime (module doc)

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


def edges(ratios: Sequence[float], groups: Sequence[object] | None = None,
          coverage: float = COVERAGE) -> tuple[float, float] | None:
    """(low, high) edges of measured/predicted ratios (module doc): exp(-+q), q the conformal rank of the
    groups' scores (a group's largest |log ratio|); None under MIN_GROUPS groups."""
    groups = list(groups) if groups is not None else list(range(len(ratios)))
    score: dict[object, float] = {}
    for r, g in zip(ratios, groups):
        score[g] = max(score.get(g, 0.0), abs(math.log(r)))
    k = rank(len(score), coverage)
    if k > len(score):
        return None
    q = sorted(score.values())[k - 1]
    return math.exp(-q), math.exp(q)


def pooled_edges(own: Evidence, pool: Evidence) -> tuple[tuple[float, float], bool] | None:
    """The edges of `own` evidence, else (too few groups) of `own` and `pool` together, said pooled (True);
    None where even the pool is too thin."""
    mine = edges(*own)
    if mine is not None:
        return mine, False
    both = edges((*own[0], *pool[0]), (*own[1], *pool[1]))
    return None if both is None else (both, True)


def groups_in(ev: Evidence) -> int:
    """How many pieces of evidence (configurations) the held-out points are."""
    return len(set(ev[1]))


def evidence_of(rows: Sequence[object], carry: str, stratum: str = "", pool: bool = False) -> Evidence:
    """The held-out ratios of time (and their groups) of a carry in one stratum, pooled over the stored
    backtest rows it rests on; `pool`: those of every other family of the same backtest kind and regime
    (what the carry's band is pooled with where its own evidence is too thin)."""
    kind, prefixes = EVIDENCE[carry]
    mine = [r for r in rows if getattr(r, "kind") == kind and str(getattr(r, "family")).startswith(prefixes)]
    regimes = {getattr(r, "regime") for r in mine}
    return evidence_in([r for r in rows if getattr(r, "kind") == kind and getattr(r, "regime") in regimes
                        and not str(getattr(r, "family")).startswith(prefixes)] if pool else mine, stratum)


def evidence_in(rows: Sequence[object], stratum: str = "") -> Evidence:
    """The held-out ratios of time of stored backtest rows in one stratum, with the group of each (a row
    without groups: each point its own)."""
    ratios: list[float] = []
    groups: list[str] = []
    for r in rows:
        got = tuple(getattr(r, "ratios", ()) or ())
        if str(getattr(r, "family")).startswith(RATES):
            got = tuple(1 / x for x in got)
        names = getattr(r, "groups", ()) or [f"{getattr(r, 'family')}:{i}" for i in range(len(got))]
        strata = getattr(r, "strata", ()) or ("",) * len(got)
        keep = [(x, str(g)) for x, g, s in zip(got, names, strata) if s == stratum]
        ratios += [x for x, _ in keep]
        groups += [g for _, g in keep]
    return tuple(ratios), tuple(groups)


def combine(parts: Mapping[str, tuple[Evidence, float] | tuple[Evidence, float, Evidence]],
            spread: float = 0.0) -> Band:
    """The band of a figure made with each carry in `parts` (its evidence, the share of the figure it
    acts on, and optionally what its band is pooled with where that evidence is too thin), plus a relative
    measurement spread."""
    centre, var, unknown, pooled = 0.0, math.log1p(spread) ** 2, [], []
    for name, (own, share, *pool) in parts.items():
        got = pooled_edges(own, pool[0] if pool else ((), ()))
        if got is None:
            n = groups_in(own)
            unknown.append(f"{name} ({n} held-out group{'s' if n != 1 else ''})")
            continue
        if got[1]:
            pooled.append(name)
        lo, hi = (math.log(1 + share * (x - 1)) for x in got[0])
        centre += (lo + hi) / 2
        var += ((hi - lo) / 2) ** 2
    if unknown:
        return Band(None, None, tuple(unknown))
    h = math.sqrt(var)
    return Band(min(math.exp(centre - h), 1.0), max(math.exp(centre + h), 1.0), pooled=tuple(pooled))


def holding(band: Band, ratios: Sequence[float]) -> Band:
    """The band widened to hold each of `ratios` (another candidate's time over the figure's: what the other
    carriers would give where the carrier's form is uncertain, flows.analysis.carrier.others); an unknown
    band stays unknown."""
    if not band.known or not ratios:
        return band
    return Band(min(band.low, *ratios), max(band.high, *ratios), pooled=band.pooled)  # type: ignore[type-var]


Point = tuple[float, str, str]   # a held-out ratio, its group, its stratum


def jackknife(points: Sequence[Point], pool: Sequence[Point] = ()) -> list[tuple[float, float, bool] | None]:
    """For each held-out point, its band (low, high, pooled) by `pooled_edges` from the other groups of its
    stratum: its own family's `points` first, pooled with `pool` (the points of the other families of the
    same backtest kind and regime) where those are too few. Its own group never counts, in any family."""
    out: list[tuple[float, float, bool] | None] = []
    for _, mine, kind in points:
        own = [(r, g) for r, g, s in points if s == kind and g != mine]
        more = [(r, g) for r, g, s in pool if s == kind and g != mine]
        got = pooled_edges((tuple(r for r, _ in own), tuple(g for _, g in own)),
                           (tuple(r for r, _ in more), tuple(g for _, g in more)))
        out.append(None if got is None else (*got[0], got[1]))
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
                                              evidence_of(evidence, carry, stratum, pool=True))
    whole = step.step_ms + step.ms["comm"]
    return holding(combine(parts, spread), [(o.step_ms + o.ms["comm"]) / whole for o in others])
