"""Hold-out backtests: each predicts from the calibration side only, says why when it cannot run,
measures its goals, and is stored as data the notes render."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pyarrow as pa
import pytest
from typer.testing import CliRunner

from engine.rows import KernelRow
from flows import REPO
from flows.analysis.backtest import (GOAL_IN_BAND, BacktestRow, composition, depth, goal_gap, size, tensor_parallel,
                                     trend)
from flows.analysis.backtest_store import backtests_of, refresh, stored_backtest
from flows.analysis.reference import load_reference
from flows.cli.app import app
from flows.inventory.hosts import Inventory
from flows.notes.publish import render_notes
from flows.store.store import Store


def _scaled(tables: dict, pred, factor: float) -> dict:
    """The kernels table with the points `pred` picks taking `factor` times as long."""
    rows = tables["kernels"].to_pylist()
    for r in rows:
        if pred(r):
            for k in ("time_us_p10", "time_us_p50", "time_us_p90"):
                r[k] = r[k] * factor if r[k] else r[k]
    return {**tables, "kernels": pa.Table.from_pylist(rows, schema=tables["kernels"].schema)}


def test_size_predicts_held_out_points_from_the_calibration_side_only(store: Store, inv: Inventory) -> None:
    ref = load_reference(store, inv, "h200")
    before = {r.family: r for r in size(ref)}["moe_w4a16/triton"]
    assert before.points == 2 and "M >= 256 from M < 256" in before.detail
    # the judged points taking 1.5x as long must not move the prediction: the error follows them exactly
    slower = dataclasses.replace(ref, tables=_scaled(ref.tables, lambda r: r["kernel"] == "moe_w4a16"
                                                      and r["M"] >= 256, 1.5))
    after = {r.family: r for r in size(slower)}["moe_w4a16/triton"]
    assert 1 + after.median_error == pytest.approx((1 + before.median_error) / 1.5)
    # the synthetic efficiency curve flattens at large M, so carrying M=128's efficiency lands close
    assert abs(before.median_error) < 0.10


def test_latency_bound_sizes_follow_the_calibrated_trend_by_hand() -> None:
    # 10 us at budget 64, 20 us at 256: time ~ budget^0.5, so 40 us at 1024 (the p10/p90 ride along)
    pts = [KernelRow(budget=b, time_us_p50=t, time_us_p10=t * 0.9, time_us_p90=t * 1.1)
           for b, t in ((16, 5.0), (64, 10.0), (256, 20.0))]
    assert trend(pts, KernelRow(budget=1024), "budget") == pytest.approx((40.0, 36.0, 44.0))


def test_composition_rebuilds_each_step_from_kernel_points(store: Store, inv: Inventory) -> None:
    ref = load_reference(store, inv, "h200")
    rows = {r.family: r for r in composition(ref)}
    step = rows["e2e step"]
    assert step.kind == "composition" and step.points == 3 and step.regime == "e2e" and len(step.ratios) == 3
    assert {"e2e GPU time", "e2e host time"} <= set(rows)
    # leave one configuration out: a configuration's own measured step never moves its prediction, so
    # taking 1.3x as long moves its ratio measured / predicted by exactly 1.3
    e2e = ref.tables["e2e"].to_pylist()
    for e in e2e:
        if e["concurrency"] == 4:
            e["step_ms_p50"] *= 1.3
    judged = dataclasses.replace(ref, tables={**ref.tables, "e2e": pa.Table.from_pylist(e2e, schema=ref.tables["e2e"].schema)})
    after = {r.family: r for r in composition(judged)}["e2e step"]
    at = [i for i, e in enumerate(ref.tables["e2e"].to_pylist()) if e["concurrency"] == 4]
    assert [after.ratios[i] for i in at] == pytest.approx([step.ratios[i] * 1.3 for i in at])
    # a slower MoE kernel makes the predicted step slower, never the measured one
    slower = dataclasses.replace(ref, tables=_scaled(ref.tables, lambda r: r["kernel"] == "moe_w4a16", 2.0))
    assert {r.family: r for r in composition(slower)}["e2e step"].median_error > step.median_error


def test_backtests_without_their_data_say_why(store: Store, inv: Inventory) -> None:
    ref = load_reference(store, inv, "h200")
    [d] = depth(ref)
    assert d.skipped and "layers 4" in d.detail and "61" in d.detail
    [t] = tensor_parallel(ref)
    assert t.skipped and "tp 1" in t.detail


def test_goal_gap_by_hand() -> None:
    row = BacktestRow("size", "h", "h", "moe_w4a16/triton", "memory", 4, 0.15, -0.2, 0.5)
    med, band = goal_gap(row)
    assert med == pytest.approx(0.05) and band == pytest.approx(GOAL_IN_BAND - 0.5)
    assert goal_gap(dataclasses.replace(row, regime="compute"))[0] is None      # no goal stated for compute
    assert goal_gap(dataclasses.replace(row, median_error=-0.08, in_band=1.0)) == (0.0, 0.0)
    assert goal_gap(BacktestRow("depth", "h", "h", "e2e step", "e2e", 0, detail="no rows")) == (None, None)
    # the goals are on the median |error|; issue 25's per carry: composition 5%, tp 10%, cross-host kernels 20%
    assert goal_gap(dataclasses.replace(row, median_abs_error=0.12))[0] == pytest.approx(0.02)
    comp = BacktestRow("composition", "h", "h", "e2e step", "e2e", 9, 0.01, 0.1, 1.0, median_abs_error=0.07)
    assert goal_gap(comp)[0] == pytest.approx(0.02)
    assert goal_gap(dataclasses.replace(comp, kind="tp", family="e2e TP-8 rank step"))[0] == 0.0
    assert goal_gap(dataclasses.replace(comp, kind="cross-host", family="moe/cuda vs marlin", regime="memory",
                                        median_abs_error=0.25))[0] == pytest.approx(0.05)
    assert goal_gap(dataclasses.replace(comp, in_band=None))[1] is None           # band unknown: no verdict


def test_cli_prints_and_stores_and_the_notes_render_it(store: Store, inv: Inventory, tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["backtest", "--artifacts", store.base, "--hosts", str(REPO / "hosts")],
                             env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    for kind in ("composition", "depth", "size", "tp", "cross-host"):
        assert kind in res.output
    stored = json.loads((Path(store.base) / "backtest" / "backtest.json").read_text())
    assert {r["kind"] for r in stored} == {"composition", "depth", "size", "tp", "cross-host"}
    as_json = CliRunner().invoke(app, ["backtest", "--artifacts", store.base, "--hosts", str(REPO / "hosts"),
                                       "--format", "json"])
    assert as_json.exit_code == 0 and [r["kind"] for r in json.loads(as_json.output)] == [r["kind"] for r in stored]
    assert not {"ratios", "groups", "strata"} & set(json.loads(as_json.output)[0])   # per-point evidence: stored only
    first = stored_backtest(store)[0]
    assert first == BacktestRow(**{**stored[0], "ratios": tuple(stored[0]["ratios"]), "groups": tuple(stored[0]["groups"]),
                                   "strata": tuple(stored[0]["strata"])})
    assert first.ratios and len(first.ratios) == len(first.groups) == first.points   # the evidence travels
    refresh(store, inv, "h200")
    render_notes(store, inv, tmp_path / "docs")
    notes = tmp_path / "docs" / "notes"
    index = (notes / "README.md").read_text()
    assert "## How good are the projections" in index and "| size | h200 | moe_w4a16/triton | memory | 2 |" in index
    page = (notes / "pro6000.md").read_text()
    cited = page[page.index("### Backtest error of this page's families"):]
    assert "moe_w4a16/triton" in cited and "e2e step" in cited


def test_an_outside_serving_figure_meets_the_median_acceptance_at_the_shortest_prompts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A published tokens/s states no acceptance or prompt length: the step model (faked here as
    tokens/s = 100 x accept - context / 100) answers at every acceptance the reference measured, at
    its shortest prompts, and the median stands for the figure; the fastest would flatter the model."""
    from flows.analysis import backtest as bt

    asked = []

    def fake_answer(model: object, q, config: object) -> object:
        asked.append(q)
        return dataclasses.make_dataclass("A", ["tokens_per_s"])(100 * q.accept - q.context / 100)

    monkeypatch.setattr(bt, "build", lambda *a: None)
    monkeypatch.setattr(bt, "answer", fake_answer)
    ref_rows = [{"source": "measured", "status": "ok", "step_ms_p50": 10.0, "config": "k2", "layers": 61, "tp": 8,
                 "concurrency": c, "budget": 16, "context": ctx, "accept_len_mean": acc, "tokens_per_s": 1.0}
                for c, ctx, acc in [(1, 300, 2.0), (16, 350, 3.0), (1, 32768, 4.0), (1, 300, 9.0), (16, 350, 5.0),
                                     (1, None, 6.0)]]  # a row from before the context column
    ref = bt.Dataset("h200", None, "r", {"e2e": pa.Table.from_pylist(ref_rows)})
    tgt = bt.Dataset("pub", None, "p", {"e2e": pa.Table.from_pylist(
        [{"config": "k2", "layers": 61, "tp": 8, "concurrency": 10, "tokens_per_s": 400.0}])})
    [(measured, projected, _)] = bt._e2e_pairs(ref, tgt, None, {}, relax_impl=True)
    assert measured == 400.0
    assert {q.context for q in asked} == {300} and {q.concurrency for q in asked} == {10}
    assert projected == pytest.approx(100 * 4.5 - 3.0)  # median of accepts 2, 3, 4, 5, 6, 9


def test_the_stored_backtest_is_the_same_bytes_every_time(store: Store, inv: Inventory) -> None:
    """Evidence groups name the point (its key), never an object's address, so re-running the
    backtests on the same store stores the same JSON (no churn in artifacts/backtest/)."""
    from flows.analysis.backtest_store import backtests_of

    first = backtests_of(store, inv)  # kept alive: a second run cannot reuse its rows' addresses
    second = backtests_of(store, inv)
    assert first and [dataclasses.asdict(r) for r in first] == [dataclasses.asdict(r) for r in second]


def test_a_modelled_comm_is_judged_at_the_measured_rows_own() -> None:
    """A one-GPU rank's comm is modelled by the bench, not measured: the projected tokens/s is compared at
    the row's own comm, so the carrier is judged on the step alone; a measured comm is judged as is."""
    from engine.rows import E2ERow
    from flows.analysis.backtest import _at_comm_of

    proj = E2ERow(step_ms_p50=10.0, comm_ms=0.0, tokens_per_s=120.0)
    assert _at_comm_of(proj, E2ERow(comm_source="modelled", comm_ms=2.0)) == pytest.approx(100.0)
    assert _at_comm_of(proj, E2ERow(comm_source="measured", comm_ms=2.0)) == 120.0


def test_the_cli_table_prints_cells_as_written(store: Store, inv: Inventory) -> None:
    """A terminal table is not markdown: `h200 -> h100` prints as is, with no markdown escapes, and a
    cell's text is never read as rich markup."""
    from flows.cli.emit import Format, emit
    rows = backtests_of(store, inv)
    pair = next(r for r in rows if r.reference != r.target)
    res = CliRunner().invoke(app, ["backtest", "--artifacts", store.base, "--hosts", str(REPO / "hosts")],
                             env={"COLUMNS": "300"})
    assert res.exit_code == 0, res.output
    assert f"{pair.reference} -> {pair.target}" in res.output and "\\" not in res.output
    text = emit([{"a": "[red]x[/red]"}], Format.table, cells=[["[red]x[/red]"]], header=["a"])
    assert "[red]x[/red]" in text


def test_a_target_s_acceptance_levels_are_one_piece_of_cross_host_evidence() -> None:
    """Cross-host e2e points group by configuration as composition's do: three acceptance levels of one
    (tp, C, B, context, depth) share a group, so they never count as three configurations in a band."""
    from flows.analysis import backtest as bt

    rows = [{"source": "measured", "status": "ok", "step_ms_p50": 10.0, "config": "k2", "layers": 61, "tp": 8,
             "concurrency": 1, "budget": 16, "context": 300, "synthetic_accept": a, "tokens_per_s": 100.0 + a}
            for a in (0.8, 0.85, 0.9)]
    tgt = bt.Dataset("h100", None, "t", {"e2e": pa.Table.from_pylist(rows)})
    proj = {"e2e": pa.Table.from_pylist(rows)}
    pairs = bt._e2e_pairs(tgt, tgt, None, proj, relax_impl=False)
    assert len(pairs) == 3 and len({g for _, _, g in pairs}) == 1


def test_a_thin_backtest_s_bands_pool_its_kind_and_regime_of_the_same_data_only() -> None:
    """Eight held-out points are too few for a band of their own (flows.analysis.bands.MIN_GROUPS): each
    point's band is pooled with the other families of the same kind, data and regime, counted as pooled;
    another regime's or another target's rows never join, and a row with enough points never pools."""
    from flows.analysis.backtest import judged

    def row(fam: str, n: int, spread: float, regime: str = "latency", target: str = "h200") -> BacktestRow:
        ratios = tuple(1 + spread * (2 * i / (n - 1) - 1) for i in range(n))
        return BacktestRow("cross-host", "h100", target, fam, regime, n, ratios=ratios,
                           groups=tuple(f"{fam}:{i}" for i in range(n)))

    thin, wide = row("build_tree/triton", 8, 0.02), row("tree_accept/triton", 12, 0.2)
    alone = judged([thin, row("x/y", 30, 0.2, regime="memory"), row("x/y", 30, 0.2, target="b300")])[0]
    assert alone.in_band is None and alone.unknown == 8 and alone.pooled == 0
    got, other = judged([thin, wide])
    assert got.pooled == 8 and got.unknown == 0 and got.in_band == 1.0 and got.half_width > 0.1
    assert other.pooled == 0 and other.in_band is not None


def test_a_size_row_says_how_much_of_the_time_its_compute_rate_was_fitted_on() -> None:
    """Time = 10 us + bytes / (1 GB/s) + flops / (1 TFLOP/s), bytes saturating and flops growing with M: at small M
    the flop term is a sliver of each point's time, at large M most of it. The row says both shares, so a
    reader sees when the held-out points rest on a rate the smaller sizes barely show."""
    from flows.analysis.backtest import _flop_shares
    from flows.analysis.kernelfit import fit_family

    def pt(m: int) -> KernelRow:
        nbytes, flops = 1e5 * min(m, 64), 1e6 * m
        return KernelRow(kernel="moe_w4a16", impl="triton", dtype="bfloat16", M=m, tp=1, source="measured",
                         bytes=nbytes, flops=flops, time_us_p50=10 + nbytes / 1e3 + flops / 1e6)

    calib, held = [pt(m) for m in (1, 4, 16, 64, 128)], [pt(m) for m in (1024, 4096)]
    model = fit_family("moe_w4a16", calib, 1.0, 1.0)
    share = model.flop_share((1,), 1e5 * 64, 1e6 * 4096)
    assert share == pytest.approx(4096 / (10 + 6400 + 4096), rel=1e-3)
    seen, asked = _flop_shares(model, calib, held)
    assert seen == pytest.approx(128 / (10 + 6400 + 128), rel=1e-3) and asked == pytest.approx(share, rel=1e-3)
    assert _flop_shares(None, calib, held) == (None, None)
