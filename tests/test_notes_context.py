"""The notes' context section on a synthetic store: tokens/s against context per (tp, C), where
attention overtakes the MoE (from the rows' own per-family split), and skipped points shown as
skipped, on a measured page and on the page projected from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import K2
from engine.costs import prefill_flops
from engine.rows import E2ERow
from flows.analysis.backtest_store import refresh
from flows.inventory.hosts import Inventory
from flows.notes.publish import render_notes
from flows.notes.sections.context import crossover
from flows.store.store import Store
from support import sections
from support.runs import FULL, model_run, rewrite_table

MOE_MS = {1: 12.0, 16: 30.0}            # the MoE's time a step does not grow with the context
ATT_MS_PER_1K = {1: 0.5, 16: 4.0}       # attention's does
SKIPPED = {(1, 131072): ("needs 150.2 GB: weights 77.1 + latent cache 9.2 (1 x 131186 rows) + working set 2.1; "
                         "61.0 GB free beside the weights", 150.2e9),
           (16, 32768): ("predicted to take 210 s (from this run's 4 measured context points), past the 95 s left "
                         "of the context axis's 180 s", 115.3e9)}


def _with_context_axis(rows: list[dict]) -> list[dict]:
    """The full-depth TP-8 rows at a 400-token prompt, plus the context axis: the step grows by
    attention's time, two points skipped (memory, time)."""
    out = []
    for r in rows:
        if r["layers"] != FULL or r["tp"] != 8:
            out.append(r)
            continue
        c = r["concurrency"]
        lengths = (400, 1024, 8192, 32768) if c == 1 else (400, 1024, 8192)
        for n in lengths:
            att = ATT_MS_PER_1K[c] * n / 1024
            step = r["step_ms_p50"] + att
            out.append({**r, "context": n, "moe_ms": MOE_MS[c], "attention_ms": att, "step_ms_p50": step,
                        "verify_ms": r["verify_ms"] + att, "ttft_ms": 0.05 * c * n,
                        "tokens_per_s": (r["accept_len_mean"] + 1) * c / step * 1e3})
    for (c, n), (why, nbytes) in SKIPPED.items():
        out.append({"run_id": rows[0]["run_id"], "config": "k2", "layers": FULL, "tp": 8, "device": "cuda",
                    "concurrency": c, "budget": 15, "context": n, "synthetic_accept": 0.8, "status": "skipped",
                    "skip_reason": why, "memory_bytes": nbytes, "source": "measured"})
    return out


@pytest.fixture(scope="module")
def pages(tmp_path_factory: pytest.TempPathFactory, inv: Inventory) -> tuple[Path, dict[str, str]]:
    tmp = tmp_path_factory.mktemp("ctx")
    ref = model_run(tmp / "ref")
    rewrite_table(ref, "e2e", _with_context_axis)
    store = Store(str(tmp / "art"))
    store.ingest("h200", "h200-model-1", ref)
    refresh(store, inv, "h200")
    render_notes(store, inv, tmp / "docs")
    notes = tmp / "docs" / "notes"
    return notes, {h: (notes / f"{h}.md").read_text() for h in ("h200", "b300")}


def test_tokens_per_s_against_context_per_tp_and_concurrency(pages: tuple[Path, dict[str, str]]) -> None:
    notes, text = pages
    sect = sections.section(text["h200"], "Tokens/s against context")
    assert "![tokens/s against context](h200/tokens_vs_context.png)" in sect
    assert (notes / "h200" / "tokens_vs_context.png").stat().st_size > 1000
    rows = sections.table_rows(sect)
    assert [(r[0], r[1], r[4]) for r in rows] == [("8", "1", n) for n in ("400", "1,024", "8,192", "32,768")] + \
        [("8", "16", n) for n in ("400", "1,024", "8,192")]
    for line in ([r for r in rows if r[1] == c] for c in ("1", "16")):
        tps = [float(r[5].replace(",", "")) for r in line]
        assert tps == sorted(tps, reverse=True)   # longer prompts, slower steps
    assert rows[3][10:] == ["16.00", "12.00", "1.33"]   # attention ms, MoE ms and their ratio at 32k, C = 1
    # TTFT against its compute floor: the prompts' flops at the run's matmul rate (720 TFLOP/s here)
    for r in rows:
        c, n = int(r[1]), int(r[4].replace(",", ""))
        floor = c * prefill_flops(K2, n, FULL, tp=8) / 720e9
        assert r[7] == f"{floor:,.1f}" and r[8] == f"{0.05 * c * n / floor:,.1f}"
    assert float(rows[3][7].replace(",", "")) > 4 * float(rows[2][7].replace(",", ""))  # attention: superlinear
    # where attention overtakes the MoE, from the rows' own split
    assert "- TP-8 C=1 (level 0.8, B=15): attention overtakes the MoE between 8,192 and 32,768 tokens " \
           "(4.00 vs 12.00 ms a step at 8,192 tokens; 16.00 vs 12.00 ms a step at 32,768 tokens)." in sect
    assert "- TP-8 C=16 (level 0.8, B=15): attention overtakes the MoE between 1,024 and 8,192 tokens" in sect


def test_skipped_points_are_shown_as_skipped_with_reason_and_bytes(pages: tuple[Path, dict[str, str]]) -> None:
    _, text = pages
    sect = sections.section(text["h200"], "Tokens/s against context")
    assert "- TP-8 C=1 B=15 context 131,072, 150.2 GB needed: skipped: needs 150.2 GB: weights 77.1" in sect
    assert "- TP-8 C=16 B=15 context 32,768, 115.3 GB needed: skipped: predicted to take 210 s" in sect
    main = sections.table_rows(sections.section(text["h200"], "End to end"))
    skipped = [r for r in main if r[6] in ("131,072", "32,768") and r[8] == "skipped"]
    assert {(r[5], r[6]) for r in skipped} == {("1", "131,072"), ("16", "32,768")}
    assert all(r[7] == "-" and r[9] == "-" for r in skipped)   # no figure stands for them
    # the headline and the acceptance table keep to the short prompts
    assert "full model 61 layers TP-8:" in text["h200"]
    accept = sections.table_rows(sections.section(text["h200"], "Tokens/s against accepted length"))
    assert len([r for r in accept if r[0] == "8"]) == 2
    split = sections.section(text["h200"], "Step breakdown")
    assert "ctx=32768" in split and "ctx=131072" not in split


def test_the_projected_page_ignores_skipped_points_and_says_which(pages: tuple[Path, dict[str, str]]) -> None:
    notes, text = pages
    b300 = text["b300"]
    sect = sections.section(b300, "Tokens/s against context")
    rows = sections.table_rows(sect)
    assert "band (tokens/s)" in sect and (notes / "b300" / "tokens_vs_context.png").is_file()
    assert {r[4] for r in rows} == {"400", "1,024", "8,192", "32,768"} and len(rows) == 7
    # each row has a low-high band, or says it is unknown (no cross-host evidence stored in this fixture)
    assert all(r[6] == "unknown" or r[6].count("-") == 1 for r in rows)
    # the projection's rows carry the step model's per-family split, so the page says where attention
    # overtakes the MoE on the target, from it
    assert "where attention overtakes the MoE is not known" not in sect and "attention stays below the MoE" in sect
    assert "Skipped points" not in sect and "skipped" not in sections.section(b300, "End to end")
    assert "2 e2e point(s) the reference skipped (not measured there), so not projected: TP-8 C=1 B=15 context " \
           "131,072: needs 150.2 GB" in b300


def test_crossover_in_words() -> None:
    def row(n: int, att: float | None, moe: float | None) -> E2ERow:
        return E2ERow(context=n, attention_ms=att, moe_ms=moe)

    assert crossover("s", [row(1024, 1.0, 5.0), row(8192, 4.0, 5.0)]) == \
        "s: attention stays below the MoE up to 8,192 tokens (4.00 vs 5.00 ms a step at 8,192 tokens)."
    assert crossover("s", [row(1024, 6.0, 5.0), row(8192, 9.0, 5.0)]).startswith(
        "s: attention already takes longer than the MoE at the shortest prompt (6.00 vs 5.00")
    assert "(of the 2 prompt lengths with a per-family split)" in \
        crossover("s", [row(400, None, None), row(1024, 1.0, 5.0), row(8192, 6.0, 5.0)])
    assert crossover("s", [row(400, None, None), row(1024, None, None)]).endswith("is not known.")
