"""The sections return their charts as data and draw nothing; rendering draws exactly the charts a page links."""

from __future__ import annotations

import re
from pathlib import Path

from flows.inventory import Inventory
from flows.notes.gather import gather
from flows.notes.render import render_host
from flows.notes.sections.page import page_view
from flows.store import Store
from test_projection_synth import model_run, write_run


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
