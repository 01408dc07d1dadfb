"""Bands from evidence (flows.analysis.bands): the finite-sample split-conformal rank of the held-out
configurations' scores, no band from one family under MIN_GROUPS configurations (pooled over its kind and
regime, labelled, or unknown), one configuration's points counted once, carries combined, and a projected
figure's band following the evidence its carries have."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from support import stepmodel as synth
from flows.analysis.backtest import BacktestRow
from flows.analysis.bands import MIN_GROUPS, combine, edges, jackknife, rank, step_band
from flows.analysis.reference import load_reference, machine_of
from flows.analysis.stepmodel import Query, answer, build
from flows.inventory.hosts import Inventory
from flows.store.store import Store


def _ratios(n: int, spread: float) -> list[float]:
    """n ratios evenly spread over +-spread (log), centred on 1."""
    return [math.exp(spread * (2 * i / (n - 1) - 1)) for i in range(n)]


def test_the_band_is_at_the_conformal_rank_and_none_below_it() -> None:
    # 90% of a new draw needs the ceil((n + 1) 0.9)-th of n scores: past n below nine, so no finite band
    assert [rank(n) for n in (8, 9, 19)] == [9, 9, 18] and MIN_GROUPS == 9
    assert edges(_ratios(8, 0.1)) is None                       # extremes of 8 hold only 8/9 of new draws
    lo, hi = edges(_ratios(9, 0.1))
    assert hi == pytest.approx(math.exp(0.1)) and lo == pytest.approx(math.exp(-0.1))
    scores = sorted(abs(math.log(r)) for r in _ratios(19, 0.1))
    assert edges(_ratios(19, 0.1))[1] == pytest.approx(math.exp(scores[17]))


def test_one_configuration_counts_once() -> None:
    # twenty points of two configurations are two pieces of evidence, not twenty
    ratios = [0.95] * 10 + [1.05] * 10
    assert edges(ratios) is not None and edges(ratios, ["a"] * 10 + ["b"] * 10) is None
    # a configuration's score is its farthest point: the band holds all of its levels
    groups = [g for g in range(9) for _ in range(2)]
    assert edges([1.0, 1.2] * 9, groups)[1] == pytest.approx(1.2)


def test_bands_hold_new_configurations() -> None:
    # nine configurations of three levels each, spread between and inside them: a new configuration's
    # levels fall inside the band at least 90% of the time (the guarantee of the conformal rank)
    rng = np.random.default_rng(7)
    trials, held = 600, 0
    for _ in range(trials):
        draw = lambda: np.exp(rng.normal(0.0, 0.05) + rng.normal(0.0, 0.03, 3))  # noqa: E731
        ratios = [x for _ in range(9) for x in draw()]
        lo, hi = edges(ratios, [g for g in range(9) for _ in range(3)])
        held += all(lo <= x <= hi for x in draw())
    assert held / trials >= 0.88   # 90% in expectation; 600 trials leave about a point of noise


def test_a_thin_family_is_pooled_with_its_kind_and_labelled() -> None:
    # eight held-out points: each one's own band would rest on seven, too few; pooled with twenty points of
    # other families of the same kind and regime it is known, wider, and says it is pooled
    mine = [(r, f"k{i}", "") for i, r in enumerate(_ratios(8, 0.02))]
    others = [(r, f"o{i}", "") for i, r in enumerate(_ratios(20, 0.2))]
    assert jackknife(mine) == [None] * 8
    bands = jackknife(mine, others)
    assert all(b is not None and b[2] and b[1] > 1.15 for b in bands)
    # enough of its own: never pooled
    own = [(r, f"k{i}", "") for i, r in enumerate(_ratios(12, 0.02))]
    assert all(b is not None and not b[2] and b[1] < 1.03 for b in jackknife(own, others))
    # a point's own configuration never counts, in any family of the pool
    same = [(r, f"k{i % 8}", "") for i, r in enumerate(_ratios(20, 0.2))]
    assert jackknife(mine, same) == [None] * 8


def test_carries_combine_and_an_unknown_one_makes_the_band_unknown() -> None:
    good = (tuple(_ratios(10, 0.1)), tuple(map(str, range(10))))
    thin = (tuple(_ratios(5, 0.1)), tuple(map(str, range(5))))
    one = combine({"composition": (good, 1.0)})
    two = combine({"composition": (good, 1.0), "tp": (good, 1.0)})
    assert one.known and two.half_width() > one.half_width()
    # a size carry acts through its family's share of the step
    part = combine({"composition": (good, 1.0), "size:moe": (good, 0.2)})
    assert one.half_width() < part.half_width() < two.half_width()
    none = combine({"composition": (good, 1.0), "cross-host": (((1.1, 1.2), ("x", "y")), 1.0)})
    assert not none.known and none.unknown == ("cross-host (2 held-out groups)",)
    assert none.of_rate(100.0) == (None, None)
    pooled = combine({"composition": (good, 1.0), "tp": (thin, 1.0, good)})
    assert pooled.known and pooled.pooled == ("tp",) and one.pooled == ()
    lo, hi = one.of_rate(100.0)
    assert lo == pytest.approx(100 / one.high) and hi == pytest.approx(100 / one.low)


def test_a_stratum_s_band_comes_from_its_own_configurations_only() -> None:
    # eleven configurations answered inside their calibration (within 1 %), two beyond it (+-20 %, three
    # levels each): a point beyond never gets a band from the close ones, pooled or not (one other
    # configuration of its kind: unknown), and the points inside never count the far configurations
    inside = [0.99, 1.0, 1.01, 1.0, 0.995, 1.005, 0.998, 1.002, 1.004, 0.996, 1.0]
    points = [*((r, f"c{i}", "") for i, r in enumerate(inside)),
              *((r, g, "beyond") for g, rs in (("x", (1.2, 1.21, 1.19)), ("y", (0.8, 0.81, 0.79))) for r in rs)]
    bands = jackknife(points, [(1.0, f"p{i}", "") for i in range(20)])
    assert all(b is None for b in bands[11:])
    assert all(b is not None and b[1] < 1.02 for b in bands[:11])
    mixed = jackknife([(r, g, "") for r, g, _ in points])   # one stratum: the far configurations widen every band
    assert all(b is not None and b[1] > 1.1 for b in mixed[:11])


def test_a_projected_answer_takes_the_evidence_of_its_carries(tmp_path: Path, inv: Inventory) -> None:
    synth.mini_run(tmp_path / "art" / "reference" / "h200")
    ref = load_reference(Store(str(tmp_path / "art")), inv, "h200")
    here = answer(build(ref.tables, ref.machine, ref.machine), Query(2, 4, 16, 256, 2.5))
    there = answer(build(ref.tables, ref.machine, machine_of(inv, "b300")), Query(2, 4, 16, 256, 2.5))

    def row(kind: str, family: str, ratios: list[float]) -> BacktestRow:
        return BacktestRow(kind, "h200", "h200", family, "e2e", len(ratios), ratios=tuple(ratios),
                           groups=tuple(map(str, range(len(ratios)))))

    narrow = [row("composition", "e2e step", _ratios(12, 0.05))]
    wide = [row("composition", "e2e step", _ratios(12, 0.2))]
    assert step_band(here, wide, 0.0).half_width() > step_band(here, narrow, 0.0).half_width()
    assert step_band(here, narrow, 0.05).half_width() > step_band(here, narrow, 0.0).half_width()
    # cross-host: with three held-out configurations the band is unknown and says why; with twelve, known and wider
    thin = step_band(there, narrow + [row("cross-host", "e2e tokens/s", [1.2, 1.1, 0.9])], 0.0)
    assert not thin.known and thin.unknown == ("cross-host (3 held-out groups)",)
    rich = step_band(there, narrow + [row("cross-host", "e2e tokens/s", _ratios(12, 0.1))], 0.0)
    assert rich.known and rich.half_width() > step_band(here, narrow, 0.0).half_width()
    assert not step_band(here, [], 0.0).known                 # no backtest stored: nothing to build a band on


def test_rate_evidence_counts_as_time_and_only_from_the_reference() -> None:
    """Cross-host e2e rows hold measured / projected tokens/s; a band is on time, so a projection that
    was too fast (ratio 0.8 in tokens/s) is a measured time 1.25x the predicted one. A carry the other
    way round (reference h100) is the same points mirrored: a projection from h200 never counts it."""
    from flows.analysis.bands import evidence_of, from_reference
    from flows.analysis.backtest import BacktestRow

    fwd = BacktestRow("cross-host", "h200", "h100", "e2e tokens/s", "e2e", 6, ratios=(0.8,) * 6)
    back = BacktestRow("cross-host", "h100", "h200", "e2e tokens/s", "e2e", 6, ratios=(1.25,) * 6)
    less = BacktestRow("cross-host", "h200", "h100", "e2e step less attention", "e2e", 2, ratios=(1.1, 1.1))
    kept = from_reference([fwd, back, less], "h200")
    assert kept == [fwd, less]
    ratios, _ = evidence_of(kept, "cross-host")
    assert ratios == pytest.approx((1.25,) * 6 + (1.1, 1.1))
