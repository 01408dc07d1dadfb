"""What a projected figure's band rests on: the cross-host carries of its own reference only, the figures the
other candidate carriers give where the carrier's form is uncertain, and, on the page, words when the target is
faster than every machine that evidence came from."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from engine.rows import table_rows
from flows.analysis.assumptions import BandEvidence, KernelModels
from flows.analysis.backtest import BacktestRow
from flows.analysis.backtest_store import store_backtest
from flows.analysis.bands import Band, holding, step_band
from flows.analysis.carrier import HARMONIC, LITTLE, SHARE
from flows.analysis.ceilings import peak_tflops
from flows.analysis.families import label, point_key, preferred, shape_of
from flows.analysis.kernelfit import class_key
from flows.analysis.projection import Machine, assumptions, project
from flows.analysis.reference import load_reference, project_host
from flows.analysis.stepmodel import answer, build, calibration_rows, config_of, query_of
from flows.analysis.whatif import answers
from flows.inventory.hosts import Inventory
from flows.notes.gather import gather
from flows.notes.sections.projected import assumption_text, band_caveat, projection_view
from flows.store.store import Store
from support.runs import evidence, write_run

N = 12   # held-out points of each carry: above bands.MIN_GROUPS, so each band is its own


def _cross(reference: str, target: str, family: str, regime: str, spread: float,
           gbps: float | None = None) -> BacktestRow:
    ratios = tuple(1 + spread * (2 * i / (N - 1) - 1) for i in range(N))
    return BacktestRow("cross-host", reference, target, family, regime, N, ratios=ratios,
                       groups=tuple(map(str, range(N))), target_gbps=gbps)


def _own(spread: float = 0.004) -> list[BacktestRow]:
    """The reference's own evidence: every in-host carry, and its cross-host carries to an H100, each
    missing by up to +-spread (narrower than the candidate carriers differ on a step)."""
    return [dataclasses.replace(r, median_error=0.0, median_abs_error=spread / 2) for r in [*evidence(spread, carries=(("composition", "e2e step"), ("size", "moe_w4a16/triton"),
                                     ("size", "mla_tree_attention/triton"), ("tp", "e2e TP-8 rank step"))),
            *(_cross("h200", "h100", f, r, spread, 3350.0) for f, r in
              (("moe_w4a16/triton", "memory"), ("moe_w4a16/triton", "compute"), ("e2e tokens/s", "e2e")))]]


def _reverse() -> list[BacktestRow]:
    """The same carries the other way round, missing wildly: another reference's evidence, never this one's."""
    return [dataclasses.replace(r, reference="h100", target="h200", ratios=tuple(x ** 12 for x in r.ratios),
                                target_gbps=4800.0) for r in _own(0.3) if r.kind == "cross-host"]


@pytest.fixture()
def store(tmp_path: Path) -> Store:
    write_run(tmp_path / "art" / "reference" / "h200", spread=0.002)
    return Store(str(tmp_path / "art"))


def _queries(ref) -> list:
    """A few queries at the reference's measured configurations, on one rank of TP-8."""
    rows = calibration_rows(table_rows(ref.tables["e2e"], "e2e"))
    return [(dataclasses.replace(query_of(r), tp=8), None) for r in rows[:4]]


def _bands(t: dict) -> tuple[list, list]:
    return ([(k["time_us_low"], k["time_us_high"]) for k in t["kernels"].to_pylist()],
            [(e["tokens_per_s_low"], e["tokens_per_s_high"]) for e in t["e2e"].to_pylist()])


def test_a_projection_s_bands_and_page_rest_on_its_own_reference_s_cross_host_rows_only(
        store: Store, inv: Inventory) -> None:
    ref = load_reference(store, inv, "h200")
    b300 = Machine("b300", inv.specs["b300-sxm"], 8, "nvlink")
    own, both = _own(), _own() + _reverse()
    alone = _bands(project(ref.tables, ref.machine, b300, evidence=own))
    assert any(lo is not None for lo, _ in alone[0]) and all(lo is not None for lo, _ in alone[1])
    assert _bands(project(ref.tables, ref.machine, b300, evidence=both)) == alone
    model = build(ref.tables, ref.machine, b300)
    queries = _queries(ref)
    assert queries
    assert [a.band for a in answers(model, queries, both, 0.03)] == [a.band for a in answers(model, queries, own, 0.03)]
    # the page cites its reference's carries and not the reverse ones, though both are stored
    store_backtest(store, both)
    project_host(store, inv, "b300", evidence=both)
    [view] = [v for v in gather(store, inv) if v.name == "b300"]
    cited = projection_view(view).cited
    data = [row[cited.header.index("data")] for row in cited.rows if row[0] == "cross-host"]
    assert data and all(d.startswith("h200 ") for d in data)


def test_a_band_holds_what_the_other_carriers_give_where_no_latency_settles_the_form(
        store: Store, inv: Inventory) -> None:
    """No spec sheet states a DRAM latency, so Little's law, the harmonic carrier and a share of copy are
    all guesses for a B300 (more bandwidth than any measured machine): a figure's band holds all three."""
    ref = load_reference(store, inv, "h200")
    b300 = Machine("b300", inv.specs["b300-sxm"], 8, "nvlink")
    t = project(ref.tables, ref.machine, b300, evidence=_own())
    model = build(ref.tables, ref.machine, b300)
    assert model.form is None and [m.form for m in model.others()] == [LITTLE, SHARE]
    recs = {type(a): a for a in assumptions(t)}
    assert (recs[KernelModels].carrier, recs[KernelModels].others) == (HARMONIC, [LITTLE, SHARE])
    kern = {point_key(k): k for k in table_rows(t["kernels"], "kernels")}
    moved = 0
    for r in preferred([k for k in table_rows(ref.tables["kernels"], "kernels") if k.kernel == "moe_w4a16"]):
        p = kern[point_key(r)]
        if p.time_us_low is None:
            continue
        fam = model.fams["moe_w4a16"]
        for m in model.others():
            alt = fam.time_us(class_key(r), shape_of(r), r.bytes, r.flops, m.carry)[0].value
            assert p.time_us_low * (1 - 1e-9) <= alt <= p.time_us_high * (1 + 1e-9), (label(r), r.M, m.form)
            moved += abs(alt / p.time_us_p50 - 1) > 0.1
    assert moved   # the candidates differ by more than the evidence's spread: the band had to widen
    for e in table_rows(t["e2e"], "e2e"):
        [r] = [x for x in table_rows(ref.tables["e2e"], "e2e") if (x.concurrency, x.budget, x.layers, x.synthetic_accept)
               == (e.concurrency, e.budget, e.layers, e.synthetic_accept) and x.tp == 1 and x.context == e.context]
        q = dataclasses.replace(query_of(r), tp=8)
        mine = answer(model, q, config_of(r))
        for m in model.others():
            alt = e.tokens_per_s * (mine.step_ms + mine.ms["comm"]) / (lambda s: s.step_ms + s.ms["comm"])(
                answer(m, q, config_of(r)))
            assert e.tokens_per_s_low * (1 - 1e-9) <= alt <= e.tokens_per_s_high * (1 + 1e-9)
    for a in answers(model, _queries(ref), _own(), 0.002):   # and a what-if answer's band
        q, whole = a.step.query, a.step.step_ms + a.step.ms["comm"]
        for m in model.others():
            s = answer(m, q)
            assert a.band.low * (1 - 1e-9) <= (s.step_ms + s.ms["comm"]) / whole <= a.band.high * (1 + 1e-9)


def test_holding_widens_a_known_band_and_leaves_an_unknown_one() -> None:
    assert holding(Band(0.9, 1.1), [0.7, 1.05, 1.3]) == Band(0.7, 1.3)
    assert holding(Band(0.9, 1.1), []) == Band(0.9, 1.1)
    unknown = Band(None, None, ("cross-host (2 held-out groups)",))
    assert holding(unknown, [0.5]) == unknown


def test_step_band_holds_each_other_answer(store: Store, inv: Inventory) -> None:
    ref = load_reference(store, inv, "h200")
    model = build(ref.tables, ref.machine, Machine("b300", inv.specs["b300-sxm"], 8, "nvlink"))
    q = _queries(ref)[0][0]
    s, alts = answer(model, q), [answer(m, q) for m in model.others()]
    plain, held = step_band(s, _own(), 0.002), step_band(s, _own(), 0.002, alts)
    whole = s.step_ms + s.ms["comm"]
    ratios = [(a.step_ms + a.ms["comm"]) / whole for a in alts]
    assert not all(plain.low <= x <= plain.high for x in ratios)   # the evidence alone would not hold them
    assert held.low == pytest.approx(min(plain.low, *ratios)) and held.high == pytest.approx(max(plain.high, *ratios))


def test_a_page_says_when_its_target_is_faster_than_every_machine_its_bands_came_from(
        store: Store, inv: Inventory) -> None:
    ref = load_reference(store, inv, "h200")
    t = project(ref.tables, ref.machine, Machine("b300", inv.specs["b300-sxm"], 8, "nvlink"),
                evidence=_own() + _reverse())
    recs = {type(a): a for a in assumptions(t)}
    assert recs[BandEvidence].evidence_gbps == {"h200": 4800.0, "h100": 3350.0}   # the reverse carry is not its evidence
    assert recs[BandEvidence].target_gbps == 8000.0
    words = band_caveat(assumptions(t), "b300")
    assert words and words.startswith("this page's bands rest on carries to slower machines")
    assert "h200 4800 GB/s" in words and "b300's 8000 GB/s" in words
    slower = project(ref.tables, ref.machine, Machine("pro6000", inv.specs["rtx-pro-6000-server"], 8, "pcie"),
                     evidence=_own())
    assert band_caveat(assumptions(slower), "pro6000") is None
    assert band_caveat([], "b300") is None


def test_no_band_edge_beats_the_target_s_spec_roofline(store: Store, inv: Inventory) -> None:
    """Wide evidence (a carry that once missed by 60 %) would put a memory-bound point's fast edge past the
    target's spec bandwidth: the edge stops at the spec roofline, which no kernel beats."""
    ref = load_reference(store, inv, "h200")
    spec = inv.specs["b300-sxm"]
    t = project(ref.tables, ref.machine, Machine("b300", spec, 8, "nvlink"), evidence=_own(0.6))
    floors = [(k.time_us_low, max(k.bytes / (spec.mem_bw_gbps * 1e3), k.flops / (peak_tflops(spec, k.dtype) * 1e6)))
              for k in table_rows(t["kernels"], "kernels") if k.time_us_low is not None]
    assert floors and all(low >= floor * (1 - 1e-9) for low, floor in floors)
    assert any(low == pytest.approx(floor) for low, floor in floors)   # some edge did stop there


def test_the_projection_names_its_carrier_and_the_others_its_bands_hold() -> None:
    text = assumption_text(KernelModels(["moe_w4a16"], [132, 160], [None, None], HARMONIC, [LITTLE, SHARE]))
    assert "by the harmonic carrier" in text and "from 132 SMs on the reference to 160" in text
    assert text.endswith("each band also holds what Little's law (the in-flight rate, capped at the copy ceiling) "
                         "and a fixed share of the copy ceiling give")
    older = assumption_text(KernelModels(["moe_w4a16"], [132, 160]))   # a record stored before the form was
    assert "by Little's law" in older and "also holds" not in older


def test_a_thin_kernel_carry_is_pooled_with_its_regime_and_the_page_says_so(store: Store, inv: Inventory) -> None:
    """Three held-out MoE memory-bound points are too few for a band of their own: with another family's
    memory-bound carries from the same reference beside them the MoE's bands are pooled, known and named in
    the projection's band record; with nothing beside them they are unknown."""
    ref = load_reference(store, inv, "h200")
    b300 = Machine("b300", inv.specs["b300-sxm"], 8, "nvlink")
    thin = [dataclasses.replace(r, ratios=r.ratios[:3], groups=r.groups[:3], points=3)
            if (r.kind, r.family, r.regime) == ("cross-host", "moe_w4a16/triton", "memory") else r for r in _own()]
    moe = lambda t: [k for k in table_rows(t["kernels"], "kernels")  # noqa: E731
                     if k.kernel == "moe_w4a16" and k.impl == "triton" and k.regime == "memory"]
    alone = project(ref.tables, ref.machine, b300, evidence=thin)
    assert moe(alone) and all(k.time_us_low is None for k in moe(alone))
    rich = project(ref.tables, ref.machine, b300, evidence=thin + [_cross("h200", "h100", "dense_gemm/torch", "memory",
                                                                          0.004, 3350.0)])
    assert all(k.time_us_low is not None for k in moe(rich))
    [band] = [a for a in assumptions(rich) if isinstance(a, BandEvidence)]
    assert "cross-host moe_w4a16/triton memory" in band.pooled
    words = assumption_text(band)
    assert "pooled here: " in words and "cross-host moe_w4a16/triton memory" in words.split("pooled here: ")[1]
