"""The notes against a store holding values no pull accepts today (a store from an older kdbench, or
one tampered with): real Parquet parts whose manifests vouch for them, the real render and CLI.

Whatever one host's stored data holds, every other page is written, and that host's page either
shows its figures with the bad ones as "-" or says, in one line, why it could not be rendered.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pytest
from typer.testing import CliRunner

from flows import REPO
from flows.notes import publish
from flows.notes.publish import render_notes
from flows.notes.views import HostView
from flows.cli.app import app
from flows.inventory.files import load_inventory
from flows.inventory.hosts import Inventory
from flows.store.layout import MANIFESTS, parquet_bytes
from flows.store.store import Store
from support.runs import model_run, write_run


def _tamper(art: Path, host: str, run_id: str, table: str, change: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """Rewrite a stored part, each row through change(row), and its manifest's digest to match: what a
    store written before values were checked at the door may hold."""
    store = Store(str(art))
    t = store.load(host, run_id)[table]
    new = pa.Table.from_pylist([change(dict(r)) for r in t.to_pylist()], schema=t.schema)
    data = parquet_bytes(new)
    rel = f"{table}/host={host}/run={run_id}/part-0.parquet"
    (art / rel).write_bytes(data)
    manifest = art / MANIFESTS / f"host={host}" / f"run={run_id}.json"
    doc = json.loads(manifest.read_text())
    doc["files"][table].update(sha256=hashlib.sha256(data).hexdigest(), rows=new.num_rows)
    manifest.write_text(json.dumps(doc))


def _first(value: Any, column: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """Set `column` to `value` in every row."""
    return lambda r: {**r, column: value}


# (table, change) a store may hold for one host
STORED: dict[str, tuple[str, Callable[[dict], dict]]] = {
    "zero-time": ("kernels", _first(0.0, "time_us_p50")),
    "nan-time": ("kernels", _first(float("nan"), "time_us_p50")),
    "zero-bytes": ("kernels", _first(0.0, "bytes")),
    "zero-kernel-ms": ("e2e", lambda r: {**r, "kernel_ms": 0.0, "outside_ms": 0.0}),
    "zero-step": ("e2e", lambda r: {**r, **{t: 0.0 for t in ("draft_ms", "tree_build_ms", "verify_ms", "accept_ms",
                                                               "other_ms", "comm_ms", "step_ms_p50")}}),
    "zero-ceilings": ("runs", lambda r: {**r, "copy_gbps": 0.0, "matmul_tflops": float("nan")}),
}


@pytest.fixture
def fleet(tmp_path: Path) -> tuple[Path, Inventory]:
    """Two measured hosts in the store (h200 with full-depth e2e rows, pro6000) and the shipped inventory."""
    hosts = tmp_path / "hosts"
    shutil.copytree(REPO / "hosts", hosts, ignore=shutil.ignore_patterns(".locks"))
    art = tmp_path / "art"
    store = Store(str(art))
    store.ingest("h200", "h200-1", model_run(tmp_path / "h200-1", run_id="h200-1"))
    store.ingest("pro6000", "p-1", write_run(tmp_path / "p-1", host="pro6000", run_id="p-1", bw=1600.0))
    return art, load_inventory(hosts)


def _notes(art: Path, inv: Inventory, docs: Path) -> str:
    """`kdbench notes` as a user runs it (projections and backtests refreshed, then every page); its output."""
    res = CliRunner().invoke(app, ["notes", "--artifacts", str(art), "--hosts", str(inv.dir), "--docs", str(docs),
                                   "--no-commit"])
    assert res.exit_code == 0, res.output[-2000:]
    return res.output


def test_no_stored_value_blocks_the_notes(fleet: tuple[Path, Inventory], tmp_path: Path) -> None:
    """N1: a kernel time of 0 or NaN, or an e2e row whose kernel_ms is 0, made render_notes raise
    (ZeroDivisionError, StopIteration): no page of any host was written, and `kdbench notes` exited 1.
    One host per stored case, all in one store: each gets its page, and so does everyone else."""
    art, inv = fleet
    store = Store(str(art))
    for case, (table, change) in STORED.items():
        run_dir = write_run(tmp_path / case, host=case, run_id=f"{case}-1", bw=1600.0)
        store.ingest(case, f"{case}-1", run_dir)
        _tamper(art, case, f"{case}-1", table, change)
    notes = tmp_path / "docs" / "notes"
    _notes(art, inv, tmp_path / "docs")
    assert (notes / "h200.md").read_text().splitlines()[0].endswith(": measured")
    index = (notes / "README.md").read_text()
    for case in STORED:
        page = (notes / f"{case}.md").read_text()
        assert page.splitlines()[0] == f"# {case}: measured", (case, page[:300])  # rendered, the bad figures as "-"
        assert f"[{case}]({case}.md)" in index


def test_a_page_that_fails_costs_that_page_only(fleet: tuple[Path, Inventory], tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """One host's page failing (here: its stored part no longer reads) costs that page, not the fleet's."""
    art, inv = fleet
    (art / "kernels" / "host=pro6000" / "run=p-1" / "part-0.parquet").write_bytes(b"damaged")
    docs = tmp_path / "docs"
    out = _notes(art, inv, docs)
    assert "pro6000: no data (its stored data could not be read" in out
    page = (docs / "notes" / "pro6000.md").read_text()
    assert "could not be read" in page and "sha256 differs" in page and len(page) < 2000
    assert (docs / "notes" / "h200.md").read_text().splitlines()[0].endswith(": measured")
    # a page that raises while it is laid out gets a page saying so; the index still lists every host
    real = publish.render_host

    def render_host(view: HostView, docs_dir: Path) -> str:
        if view.name == "h200":
            raise ZeroDivisionError("float division by zero")
        return real(view, docs_dir)
    monkeypatch.setattr(publish, "render_host", render_host)
    render_notes(Store(str(art)), inv, docs)
    page = (docs / "notes" / "h200.md").read_text()
    assert "could not be rendered" in page and "ZeroDivisionError" in page
    index = (docs / "notes" / "README.md").read_text()
    assert "[h200](h200.md)" in index and "[pro6000](pro6000.md)" in index


def test_a_page_over_the_size_bound_is_replaced_by_one_saying_so(fleet: tuple[Path, Inventory], tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """N4 (volume): a page is bounded too; a page over the bound is not written as it is."""
    art, inv = fleet
    monkeypatch.setattr(publish, "MAX_PAGE_BYTES", 4096)
    render_notes(Store(str(art)), inv, tmp_path / "docs")
    page = (tmp_path / "docs" / "notes" / "h200.md").read_text()
    assert len(page.encode()) < 4096 and "over the 4096-byte bound" in page


def test_a_host_named_like_the_index_gets_no_page_and_the_index_stays(fleet: tuple[Path, Inventory],
                                                                      tmp_path: Path) -> None:
    """N15: an import whose host was README got no page: the fleet index overwrote docs/notes/README.md
    (here a reference set made before imports refused the name)."""
    art, inv = fleet
    write_run(art / "reference" / "readme-ref", host="README", run_id="readme-1")
    render_notes(Store(str(art)), inv, tmp_path / "docs")
    index = (tmp_path / "docs" / "notes" / "README.md").read_text()
    assert index.startswith("# kdbench fleet") and "[README](README.md)" not in index
