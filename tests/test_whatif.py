"""`kdbench project` (grid, formats, --store, bad input) and the what-if grid on every host page:
stored where the projections are, read back by the notes, a cell that does not fit saying so."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from support import stepmodel as synth
from engine.table_checks import validate
from flows import REPO
from flows.analysis.backtest_store import refresh
from flows.analysis.whatif import GRID_CONCURRENCY, GRID_CONTEXT, SUITE, stored_whatif
from flows.cli.app import app
from flows.inventory.hosts import Inventory
from flows.notes.publish import render_notes
from flows.store.store import Store
from support.runs import FULL, model_run


@pytest.fixture()
def mini(tmp_path: Path) -> Store:
    synth.mini_run(tmp_path / "art" / "reference" / "h200")
    return Store(str(tmp_path / "art"))


def _project(store: Store, *args: str, env: dict | None = None):
    return CliRunner().invoke(app, ["project", *args, "--artifacts", store.base, "--hosts", str(REPO / "hosts")],
                              env=env or {})


def test_project_answers_a_grid_in_every_format(mini: Store) -> None:
    grid = ["b300", "--reference", "h200", "-c", "1,4", "--context", "64", "--context", "256", "-b", "4", "--accept", "2.5"]
    res = _project(mini, *grid, "--format", "json")
    assert res.exit_code == 0, res.output
    rows = json.loads(res.output)
    assert [(r["concurrency"], r["context"]) for r in rows] == [(1, 64), (1, 256), (4, 64), (4, 256)]
    for r in rows:
        assert r["tp"] == 8 and r["budget"] == 4 and r["accept"] == 2.5 and r["fits"]
        assert r["tokens_per_s"] == pytest.approx(r["concurrency"] * 3.5 / (r["step_ms"] + r["comm_ms"]) * 1e3)
        assert sum(r[f"{t}_share"] for t in ("moe", "attention", "dense", "lm_head", "tree", "gpu_other", "host",
                                              "comm")) == pytest.approx(1.0)
        assert "cross-host" in r["carries"] and r["largest"].endswith("of the step")
        # no backtest stored: no evidence, so the band is unknown and says why
        assert r["tokens_per_s_low"] is None and r["band"].startswith("unknown: composition (0 held-out groups)")
        assert "re-sharded" not in r["extrapolated"]
    assert "moe M" in rows[0]["interpolated"] or "moe M" in rows[0]["extrapolated"]
    res = _project(mini, *grid, "--format", "csv")
    assert res.exit_code == 0
    parsed = list(csv.DictReader(io.StringIO(res.output)))
    assert len(parsed) == 4 and float(parsed[0]["tokens_per_s"]) == pytest.approx(rows[0]["tokens_per_s"])
    # a table stays one line a row when piped, even where the terminal would be 80 columns wide
    res = _project(mini, *grid, env={"COLUMNS": "80"})
    assert res.exit_code == 0
    body = [ln for ln in res.output.splitlines() if ln.startswith("│")]
    assert len(body) == 4 and all("yes" in ln and "of the step" in ln for ln in body)


def test_project_store_keeps_a_projected_run_and_checks_its_input(mini: Store) -> None:
    res = _project(mini, "pro6000", "--reference", "h200", "-c", "1,4096", "--context", "256,10000000",
                   "--accept", "2.5", "--store", "--format", "json")
    assert res.exit_code == 0, res.output
    rows = json.loads(res.output)
    huge = [r for r in rows if r["concurrency"] == 4096 and r["context"] == 10_000_000]
    assert len(huge) == 1 and not huge[0]["fits"] and huge[0]["why_not"].startswith("does not fit: needs")
    [info] = [i for i in mini.runs("pro6000") if SUITE in i.suites]
    assert info.source == "projected" and info.run_id.startswith("whatif-pro6000-")
    tables = mini.load("pro6000", info.run_id)
    for name, t in tables.items():
        validate(t, name)
    e2e = tables["e2e"].to_pylist()
    assert len(e2e) == 4 and {e["source"] for e in e2e} == {"projected"}
    skipped = [e for e in e2e if e["status"] == "skipped"]
    assert len(skipped) == 1 and skipped[0]["skip_reason"].startswith("does not fit") and skipped[0]["memory_bytes"] > 0
    assert stored_whatif(mini, "pro6000", "query") is not None and stored_whatif(mini, "pro6000") is None
    # bad input is refused, naming the flag or the host
    bad = _project(mini, "pro6000", "--reference", "h200", "-c", "0")
    assert bad.exit_code == 2 and "--concurrency" in bad.output
    bad = _project(mini, "pro6000", "--reference", "h200", "--accept", "lots")
    assert bad.exit_code == 2 and "--accept" in bad.output
    bad = _project(mini, "nosuchhost")
    assert bad.exit_code == 2 and "not in the inventory" in bad.output


def test_every_page_shows_a_stored_what_if_grid(tmp_path: Path, inv: Inventory) -> None:
    model_run(tmp_path / "art" / "reference" / "h200")
    store = Store(str(tmp_path / "art"))
    refresh(store, inv, "h200")
    notes = tmp_path / "docs" / "notes"
    render_notes(store, inv, tmp_path / "docs")
    for host in ("h200", "b300", "pro6000"):            # measured and projected pages alike
        page = (notes / f"{host}.md").read_text()
        sect = page[page.index("## What if"):page.index("\n## ", page.index("## What if") + 5)]
        assert "level 0.8, 5.30 accepted draft tokens a step" in sect
        assert all(f"| C = {c} |" in sect for c in GRID_CONCURRENCY)
        assert all(f"{s // 1024}k context" in sect for s in GRID_CONTEXT)
        assert "of the step" in sect                     # each cell names its largest term
    h200 = (notes / "h200.md").read_text()
    # 64 sequences of 128k tokens: a 549 GiB latent cache on one rank of an H200
    assert "does not fit: needs" in h200 and "the GPU has 141 GiB" in h200
    grid = stored_whatif(store, "h200")
    e2e = grid["e2e"].to_pylist()
    assert len(e2e) == len(GRID_CONCURRENCY) * len(GRID_CONTEXT) and {e["tp"] for e in e2e} == {8}
    assert {e["layers"] for e in e2e} == {FULL}
    # the page's projection is still the projection, not the grid
    assert (notes / "b300.md").read_text().splitlines()[2].startswith("**Data: projected** from h200 run h200-model-1")
    # the notes render what is stored and never compute a grid: without one, no section
    for info in store.runs("h200"):
        store.fs.delete_dir(store.full("e2e", "host=h200", f"run={info.run_id}"))
        store.fs.delete_dir(store.full("runs", "host=h200", f"run={info.run_id}"))
        store.fs.delete_file(store.full("_manifests", "host=h200", f"run={info.run_id}.json"))
    render_notes(store, inv, tmp_path / "docs2")
    assert "## What if" not in (tmp_path / "docs2" / "notes" / "h200.md").read_text()


def test_a_projected_page_states_the_in_step_factors_its_reference_measured(mini: Store, inv: Inventory,
                                                                            tmp_path: Path) -> None:
    refresh(mini, inv, "h200")
    render_notes(mini, inv, tmp_path / "docs")
    page = (tmp_path / "docs" / "notes" / "b300.md").read_text()
    # the reference's rows carry the per-family split: the projection says how in-step time compared
    # with the suite's, family by family (the synthetic factors), and shows the target's step that way
    assert ("in-step/suite factor from the rows' per-family split: attention 1.30, dense 1.05, lm_head 1.00, "
            "moe 1.12, tree 1.00") in page
    assert "By kernel family:" in page and "| point | moe | attention | dense | lm_head | tree | other kernels |" in page


def test_a_grid_where_nothing_fits_says_so_once(tmp_path: Path, inv: Inventory) -> None:
    """Tables of nothing but "does not fit" (a full TP-8 rank of K2 at long contexts on an 80 GiB GPU) read as one sentence
    naming the smallest configuration and what it needs."""
    import pyarrow as pa

    from flows.notes.sections.whatif import whatif_view
    model_run(tmp_path / "art" / "reference" / "h200")
    store = Store(str(tmp_path / "art"))
    refresh(store, inv, "h200")
    grid = dict(stored_whatif(store, "h200"))
    e2e = grid["e2e"]
    n = e2e.num_rows
    reason = "does not fit: needs 94 GiB a GPU (weights 75 GiB), the GPU has 80 GiB"
    e2e = e2e.set_column(e2e.schema.get_field_index("status"), "status", pa.array(["skipped"] * n))
    grid["e2e"] = e2e.set_column(e2e.schema.get_field_index("skip_reason"), "skip_reason", pa.array([reason] * n))
    view = whatif_view(grid)
    assert view is not None and view.tables == ()
    assert f"C = {GRID_CONCURRENCY[0]} at 1k context, {reason}" in view.intro and "weight sets" in view.intro
    assert whatif_view(dict(stored_whatif(store, "h200"))).tables                # some fit: the tables stay
