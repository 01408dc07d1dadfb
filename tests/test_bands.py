"""Bands from evidence (flows.analysis.bands): conformal edges widened to a t prediction interval, unknown under
five held-out points, one configuration's points counted once, carries combined, and a projected
figure's band following the evidence its carries have."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from support import stepmodel as synth
from flows.analysis.backtest import BacktestRow
from flows.analysis.bands import MIN_POINTS, combine, edges, jackknife, step_band, t_quantile
from flows.analysis.reference import load_reference, machine_of
from flows.analysis.stepmodel import Query, answer, build
from flows.inventory.hosts import Inventory
from flows.store.store import Store


def _ratios(n: int, spread: float) -> list[float]:
    """n ratios evenly spread over +-spread (log), centred on 1."""
    return [math.exp(spread * (2 * i / (n - 1) - 1)) for i in range(n)]


def test_t_quantiles_by_hand() -> None:
    for df, t in ((1, 6.314), (3, 2.353), (4, 2.132), (9, 1.833), (30, 1.697)):
        assert t_quantile(0.95, df) == pytest.approx(t, abs=0.005)


def test_under_five_points_the_band_is_unknown_and_few_points_widen_it() -> None:
    assert edges(_ratios(MIN_POINTS - 1, 0.1)) is None
    few, many = edges(_ratios(5, 0.1)), edges(_ratios(40, 0.1))
    assert few is not None and many is not None
    assert few[0] < many[0] and few[1] > many[1]              # the same spread, less evidence: wider
    assert few[0] < 1 / math.exp(0.1) and few[1] > math.exp(0.1)   # never narrower than what was seen
    # 40 points: the conformal 5% / 95% ranks (2nd and 39th), or the t interval where that is wider
    r = sorted(_ratios(40, 0.1))
    assert many[0] <= r[1] and many[1] >= r[38]


def test_one_configuration_counts_once() -> None:
    # ten points from two configurations are two pieces of evidence, not ten
    ratios = [0.95] * 5 + [1.05] * 5
    assert edges(ratios, ["a"] * 5 + ["b"] * 5)[1] > edges(ratios)[1]
    assert edges(ratios, ["a"] * 10) is None
    # a point's band never uses its own configuration's points
    bands = jackknife([0.9, 0.9, 1.0, 1.0, 1.0, 1.1, 1.1, 1.2], list("aabbccdd"))
    assert all(b is not None for b in bands)
    assert bands[0] == edges([1.0, 1.0, 1.0, 1.1, 1.1, 1.2], list("bbccdd"))


def test_bands_hold_new_points_when_points_stray_inside_their_configuration() -> None:
    # six configurations of three acceptance levels each, no spread between configurations, 5% inside
    # each: a new point's band must count the stray with its quantile (it once added one standard
    # deviation unscaled and held 86% of new points)
    rng = np.random.default_rng(7)
    trials, held = 400, 0
    for _ in range(trials):
        ratios = list(np.exp(rng.normal(0.0, 0.05, 18)))
        lo, hi = edges(ratios, [g for g in range(6) for _ in range(3)])
        held += lo <= math.exp(rng.normal(0.0, 0.05)) <= hi
    assert held / trials >= 0.9


def test_carries_combine_and_an_unknown_one_makes_the_band_unknown() -> None:
    good = (tuple(_ratios(10, 0.1)), tuple(map(str, range(10))))
    one = combine({"composition": (good, 1.0)})
    two = combine({"composition": (good, 1.0), "tp": (good, 1.0)})
    assert one.known and two.half_width() > one.half_width()
    # a size carry acts through its family's share of the step
    part = combine({"composition": (good, 1.0), "size:moe": (good, 0.2)})
    assert one.half_width() < part.half_width() < two.half_width()
    thin = combine({"composition": (good, 1.0), "cross-host": (((1.1, 1.2), ("x", "y")), 1.0)})
    assert not thin.known and thin.unknown == ("cross-host (2 held-out points)",)
    assert thin.of_rate(100.0) == (None, None)
    lo, hi = one.of_rate(100.0)
    assert lo == pytest.approx(100 / one.high) and hi == pytest.approx(100 / one.low)


def test_a_stratum_s_band_comes_from_its_own_configurations_and_everyone_s_strays() -> None:
    # six configurations answered inside their calibration (within 1 %), two beyond it (+-20 %, three
    # levels each): a point beyond never gets a band from the close ones (one other configuration of
    # its kind: unknown), and the points inside count the far configurations' strays, not their means
    inside = [0.99, 1.0, 1.01, 1.0, 0.995, 1.005]
    ratios = [*inside, 1.2, 1.21, 1.19, 0.8, 0.81, 0.79]
    groups = [*"abcdef", "x", "x", "x", "y", "y", "y"]
    strata = [""] * 6 + ["beyond"] * 6
    bands = jackknife(ratios, groups, strata)
    assert all(b is None for b in bands[6:])
    assert all(b is not None and b[1] < 1.1 for b in bands[:6])
    pooled = jackknife(ratios, groups)                    # one stratum: the far means widen every band
    assert all(b is not None and b[1] > 1.1 for b in pooled[:6])
    strays = (tuple(ratios[6:]), tuple(groups[6:]))
    lo, hi = edges(inside, list("abcdef"), strays=strays)
    lo0, hi0 = edges(inside, list("abcdef"))
    assert hi > hi0 and lo < lo0                          # the strays' own spread counts


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
    # cross-host: with three held-out points the band is unknown and says why; with twelve, known and wider
    thin = step_band(there, narrow + [row("cross-host", "e2e tokens/s", [1.2, 1.1, 0.9])], 0.0)
    assert not thin.known and thin.unknown == ("cross-host (3 held-out points)",)
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
