"""Model-level projection (issue 11 item 6) on synthetic schema-3 tables: per-rank terms, the target's
own links, full-model headlines; and schema-2 files still read."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pyarrow as pa
import pytest

from engine.rows import table_rows
from engine.table_files import read_table, to_table
from flows import REPO
from flows.analysis.backtest import cross_host, depth, judged, tensor_parallel
from flows.analysis.backtest_store import refresh
from flows.analysis.projection import ALLREDUCES_PER_LAYER, Machine, allreduce_us, assumptions, project
from flows.analysis.reference import is_outside, load_reference, machine_of
from flows.analysis.stepmodel import answer, build, query_of
from flows.inventory.hosts import Inventory
from flows.analysis.assumptions import Comm, TensorParallel
from flows.notes.gather import gather
from flows.notes.points import moe_points
from flows.notes.publish import render_notes
from flows.notes.summary import headline
from flows.store.store import Store
from support.runs import FULL, evidence


def _e2e(tables: dict, **want: object) -> list[dict]:
    return [e for e in tables["e2e"].to_pylist() if all(e[k] == v for k, v in want.items())]


def test_same_tp_over_each_targets_own_links(model_store: Store, inv: Inventory) -> None:
    ref = load_reference(model_store, inv, "h200")
    pro = project(ref.tables, ref.machine, machine_of(inv, "pro6000"), evidence=evidence(0.1))
    b300 = project(ref.tables, ref.machine, machine_of(inv, "b300"), evidence=evidence(0.1))
    for tables, link in ((pro, "pcie"), (b300, "nvlink")):
        rows = tables["e2e"].to_pylist()
        assert rows and {e["tp"] for e in rows} == {8} and {e["comm_source"] for e in rows} == {"modelled"}
        tp = {type(a): a for a in assumptions(tables)}[TensorParallel]
        assert [r.how for r in tp.rows] == ["same"]       # the reference measured TP-8 ranks
        assert {type(a): a for a in assumptions(tables)}[Comm].interconnect == link
    # comm = 2 all-reduces a layer x 61 layers of tokens x 7168 x 2 bytes over the target's link
    [p] = _e2e(pro, layers=FULL, concurrency=16)
    comm = {type(a): a for a in assumptions(pro)}[Comm]
    nbytes = 16 * 16 * 7168 * 2
    want = ALLREDUCES_PER_LAYER * FULL * allreduce_us(nbytes, 8, comm.alpha_us, 64 * comm.efficiency) / 1e3
    assert p["comm_ms"] == pytest.approx(want)
    [b] = _e2e(b300, layers=FULL, concurrency=16)
    assert b["comm_ms"] < p["comm_ms"] and b["tokens_per_s"] > p["tokens_per_s"]    # NVLink 5 against PCIe
    assert p["tokens_per_s_low"] < p["tokens_per_s"] < p["tokens_per_s_high"]


def test_resharded_when_the_target_has_another_gpu_count(model_store: Store, inv: Inventory) -> None:
    ref = load_reference(model_store, inv, "h200")
    two = project(ref.tables, ref.machine, Machine("h200x2", inv.specs["h200-sxm"], 2, "nvlink"))
    tp = {type(a): a for a in assumptions(two)}[TensorParallel]
    # the TP-1 rows are the nearest degree: re-sharded by the step model
    assert tp.target_tp == 2 and [r.how for r in tp.rows] == ["model"]
    meas = {(e["layers"], e["concurrency"], e["tp"]): e for e in ref.tables["e2e"].to_pylist()}
    for e in two["e2e"].to_pylist():
        assert e["tp"] == 2
        # a TP-2 rank's MoE lies between the measured TP-1 and TP-8 ranks' steps' worth of experts
        lo, hi = meas[(e["layers"], e["concurrency"], 8)], meas[(e["layers"], e["concurrency"], 1)]
        assert lo["step_ms_p50"] - lo["comm_ms"] < e["step_ms_p50"] < hi["step_ms_p50"]


def test_headlines_show_full_model_tokens_per_s(model_store: Store, inv: Inventory, tmp_path: Path) -> None:
    refresh(model_store, inv, "h200")
    views = {v.name: v for v in gather(model_store, inv)}
    h200, pro = headline(views["h200"]), headline(views["pro6000"])
    ms = [k.M for k in moe_points(views["h200"].latest)]
    assert ms == sorted(set(ms))                      # the MoE table shows full shapes, not the TP-8 shards too
    assert h200.startswith(f"full model {FULL} layers TP-8: ") and "at C=1 (B=15, accept 5.30)" in h200
    assert "at C=16" in h200 and "no full-depth" not in h200
    assert pro.startswith(f"full model {FULL} layers TP-8: ") and ") at C=1" in pro     # with its band
    render_notes(model_store, inv, tmp_path / "docs")
    index = (tmp_path / "docs" / "notes" / "README.md").read_text()
    assert f"full model {FULL} layers TP-8" in index
    page = (tmp_path / "docs" / "notes" / "b300.md").read_text()
    assert page.splitlines()[4].startswith(f"**Headline:** full model {FULL} layers TP-8: ")


def test_depth_and_tp_backtests_run_when_the_rows_exist(model_store: Store, inv: Inventory) -> None:
    ref = load_reference(model_store, inv, "h200")
    [d] = judged(depth(ref))
    # the synthetic step is linear in depth, so the line through 2, 6, 10 layers lands on 61
    assert d.points == 4 and abs(d.median_error) < 1e-6
    # four points: each one's band would rest on the other three, under nine, so it is unknown
    assert d.in_band is None and d.unknown == 4
    rows = {r.family: r for r in tensor_parallel(ref)}
    assert rows["moe_w4a16/triton"].points == 10                      # shard points from full ones
    rank = rows["e2e TP-8 rank step"]
    assert rank.points == 8 and rank.median_error is not None


def test_schema_2_files_read_with_tp_1(tmp_path: Path) -> None:
    rows = [{"run_id": "r", "config": "k2", "layers": 2, "device": "cuda", "concurrency": 1, "budget": 16,
             "source": "measured"}]
    table = to_table("e2e", rows, {"run_id": "r"})
    old = table.drop_columns(["tp", "weight_sets", "vocab", "comm_source"])
    old = old.replace_schema_metadata({**old.schema.metadata, b"kdbench.schema_version": b"2"})
    path = tmp_path / "e2e.arrow"
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_file(f, old.schema) as w:
        w.write_table(old)
    [row] = read_table(path).to_pylist()
    assert (row["tp"], row["weight_sets"], row["vocab"], row["comm_source"]) == (1, 1, None, None)


def test_full_model_projection_meets_the_published_serving_figures(model_store: Store, inv: Inventory,
                                                                     tmp_path: Path) -> None:
    import shutil
    shutil.copytree(REPO / "artifacts" / "reference" / "pro6000-published",
                    Path(model_store.base) / "reference" / "pro6000-published")
    ref, pub = load_reference(model_store, inv, "h200"), load_reference(model_store, inv, "pro6000-published")
    assert is_outside(pub.tables) and not is_outside(ref.tables)
    rows = {r.family: r for r in cross_host([ref], [pub])}
    e2e = rows["e2e tokens/s"]
    # both published rows (61 layers, TP-8, C = 1 and 10) meet the step model at their configuration
    assert e2e.points == 2 and "the step model at its configuration" in e2e.detail
    model = build(ref.tables, ref.machine, dataclasses.replace(machine_of(inv, "pro6000"), gpus=8))
    full = [e for e in table_rows(ref.tables["e2e"], "e2e") if e.layers == FULL]
    best = max(answer(model, dataclasses.replace(query_of(e), tp=8, concurrency=10)).tokens_per_s for e in full)
    assert e2e.ratios[1] == pytest.approx(517.0 / best)
