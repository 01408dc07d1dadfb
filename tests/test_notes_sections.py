"""The sections return their charts as data and draw nothing; rendering draws exactly the charts a page links.
A kernel point's GB/s is the bandwidth its row carries."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

from engine.table_files import provenance, read_table, to_table, write_table
from flows.inventory.hosts import Inventory
from flows.notes.gather import gather
from flows.notes.publish import render_notes
from flows.notes.render import render_host
from flows.notes.sections.page import page_view
from flows.store.store import Store
from support.runs import model_run, write_run


def test_a_page_draws_exactly_the_charts_its_sections_returned(tmp_path: Path, inv: Inventory) -> None:
    store = Store(str(tmp_path / "art"))
    store.ingest("h200", "full-1", write_run(tmp_path / "p1", run_id="full-1"))
    store.ingest("h200", "model-2", model_run(tmp_path / "p2", run_id="model-2"))
    [view] = [v for v in gather(store, inv) if v.name == "h200"]
    notes = tmp_path / "notes"
    _, charts = page_view(view)
    assert not notes.exists()                                       # building a page writes nothing
    files = [c.file for c in charts]
    assert sorted(files) == sorted(set(files)) and {"moe_us_per_token.png", "roofline.png", "amdahl.png",
                                                    "tokens_vs_accept.png"} <= set(files)
    text = render_host(view, notes)
    linked = set(re.findall(r"\]\(h200/([^)]+\.png)\)", text))
    assert linked == set(files)
    assert {p.name for p in (notes / "h200").iterdir()} == set(files)


def _column(page: str, title: str, header: str) -> list[str]:
    """The cells under `header` in the first table of the `## title` section."""
    lines = page[page.index(f"## {title}\n"):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = [[c.strip() for c in line.strip().strip("|").split(" | ")]
             for line in itertools.takewhile(lambda line: line.startswith("|"), lines[start:])]
    at = table[0].index(header)
    return [row[at] for row in table[2:]]


def test_gb_per_s_is_the_bandwidth_the_row_carries(tmp_path: Path, inv: Inventory) -> None:
    run = write_run(tmp_path / "p1", run_id="full-1")
    t = read_table(run / "kernels.arrow")
    rows = [{**r, "achieved_gbps": 1111.0 if r["kernel"] == "moe_w4a16" else None} for r in t.to_pylist()]
    write_table(run, to_table("kernels", rows, provenance(t)))
    store = Store(str(tmp_path / "art"))
    store.ingest("h200", "full-1", run)
    render_notes(store, inv, tmp_path / "docs")
    page = (tmp_path / "docs" / "notes" / "h200.md").read_text()
    assert set(_column(page, "MoE W4A16 GEMM", "GB/s")) == {"1111"}
    assert set(_column(page, "Attention and tree kernels", "GB/s")) == {"-"}          # a row without one shows none
