"""Notes keep the full picture: per suite the latest complete full-profile data, the run history,
both MoE shapes side by side, and tokens/s against accepted length at full depth.

Every run here is stored through `Store.ingest` (real Parquet files and manifests) and rendered
through the real templates.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine.table_files import provenance, read_table, to_table, write_table
from flows import REPO
from flows.inventory.hosts import Inventory
from flows.notes.gather import gather
from flows.notes.publish import render_notes
from flows.notes.summary import headline
from flows.store.store import Store
from support import sections
from support.runs import FULL, model_run, rewrite_table, write_run


def _only(run_dir: Path, suites: set[str], profile: str = "full", status: str = "complete") -> Path:
    """Keep only some suites of a written run, under another profile or status."""
    for name in ("kernels", "e2e", "comm"):
        if name not in suites:
            (run_dir / f"{name}.arrow").unlink(missing_ok=True)
    rewrite_table(run_dir, "runs", lambda rows: [{**r, "profile": profile, "status": status} for r in rows
                                            if r["suite"] in suites])
    return run_dir


def _render(store: Store, inv: Inventory, docs: Path) -> Path:
    render_notes(store, inv, docs)
    return docs / "notes"


def test_a_kernels_only_smoke_run_after_a_full_run_keeps_the_e2e_section_and_sweep(tmp_path: Path,
                                                                                     inv: Inventory) -> None:
    store = Store(str(tmp_path / "art"))
    store.ingest("h200", "full-1", write_run(tmp_path / "p1", run_id="full-1"))
    [before] = [headline(v) for v in gather(store, inv) if v.name == "h200"]
    smoke = _only(write_run(tmp_path / "p2", run_id="smoke-2", bw=3000.0, started_at="2026-10-21T10:00:00Z"),
                  {"kernels"}, profile="smoke")
    rewrite_table(smoke, "kernels", lambda rows: [r for r in rows if r["kernel"] == "moe_w4a16" and r["M"] <= 4])
    store.ingest("h200", "smoke-2", smoke)
    assert [r.run_id for r in store.runs("h200")] == ["full-1", "smoke-2"]
    notes = _render(store, inv, tmp_path / "docs")
    page = (notes / "h200.md").read_text()
    assert "**Data: measured.** Latest run smoke-2;" in page
    # the full sweep and e2e stay, each saying where it comes from
    moe = sections.section(page, "MoE W4A16 GEMM")
    assert "From run full-1 (full profile, complete" in moe
    assert [r[0] for r in sections.table_rows(moe)] == ["1", "2", "4", "8", "16", "32", "64", "128", "256", "512"]
    assert "No TP-8 shard-shape points in this run" in moe          # write_run has full shapes only
    e2e = sections.section(page, "End to end")
    assert "From run full-1 (full profile, complete" in e2e and len(sections.table_rows(e2e)) == 3
    assert "## Step breakdown" in page and "## Time outside kernels" in page
    assert (notes / "h200" / "amdahl.png").is_file()
    # the smoke run is in the history, feeding no section
    runs = {r[0]: r for r in sections.table_rows(sections.section(page, "Runs"))}
    assert runs["smoke-2"][1:] == ["2026-10-21T10:00:00Z", "smoke", "kernels", "ab12cd34", "complete", "-"]
    assert runs["full-1"][1:] == ["2026-10-20T10:00:00Z", "full", "kernels, e2e, comm (skipped)", "ab12cd34",
                                  "complete", "kernels, e2e, comm"]
    assert list(runs) == ["smoke-2", "full-1"]                                    # newest first
    # the headline still comes from the full data; a smoke run is compared with smoke runs only
    assert [headline(v) for v in gather(store, inv) if v.name == "h200"] == [before]
    assert "First measured smoke-profile run of this host" in sections.section(page, "Against the previous run")


def test_each_section_comes_from_its_own_latest_complete_full_run(tmp_path: Path, inv: Inventory) -> None:
    store = Store(str(tmp_path / "art"))
    store.ingest("h200", "all-1", write_run(tmp_path / "p1", run_id="all-1"))
    store.ingest("h200", "kern-2", _only(write_run(tmp_path / "p2", run_id="kern-2", bw=3900.0,
                                                   started_at="2026-10-21T10:00:00Z"), {"kernels"}))
    # a later full run whose e2e suite did not finish: its kernels are newer, its e2e is not used
    late = _only(write_run(tmp_path / "p3", run_id="late-3", bw=4100.0, started_at="2026-10-22T10:00:00Z"),
                 {"e2e"}, status="partial")
    store.ingest("h200", "late-3", late)
    notes = _render(store, inv, tmp_path / "docs")
    page = (notes / "h200.md").read_text()
    assert "From run kern-2 (full profile, complete" in sections.section(page, "MoE W4A16 GEMM")
    assert "From run kern-2 (full profile, complete" in sections.section(page, "Attention and tree kernels")
    assert "From run all-1 (full profile, complete" in sections.section(page, "End to end")
    assert "From run all-1 (full profile, skipped" in sections.section(page, "All-reduce")
    # % of copy bandwidth uses the kernels run's own measured ceiling (3900 GB/s), not another run's
    env = sections.section(page, "Environment")
    assert env.splitlines()[2] == "|  | e2e, comm | kernels |"
    assert "| measured copy bandwidth | 4300 GB/s | 3900 GB/s |" in env
    runs = {r[0]: r for r in sections.table_rows(sections.section(page, "Runs"))}
    assert runs["late-3"][3:] == ["e2e (partial)", "ab12cd34", "partial", "-"]
    assert "(partial: some suites did not finish)" in page.splitlines()[2]


def test_smoke_data_is_shown_only_while_there_is_no_full_data(tmp_path: Path, inv: Inventory) -> None:
    store = Store(str(tmp_path / "art"))
    store.ingest("h200", "smoke-1", _only(write_run(tmp_path / "p1", run_id="smoke-1"), {"kernels", "e2e"},
                                          profile="smoke"))
    page = (_render(store, inv, tmp_path / "docs") / "h200.md").read_text()
    e2e = sections.section(page, "End to end")
    assert "From run smoke-1 (smoke profile, complete" in e2e
    assert "There is no complete full-profile e2e run yet: these are the latest figures there are." in e2e


def _shard_rows(page: str) -> tuple[list[list[str]], list[list[str]]]:
    moe = sections.section(page, "MoE W4A16 GEMM")
    full = moe[moe.index("### Full shapes"):moe.index("### TP-8 shard shapes")]
    shard = moe[moe.index("### TP-8 shard shapes"):]
    return sections.table_rows(full), sections.table_rows(shard)


def test_the_moe_section_shows_full_and_tp8_shard_shapes_in_two_tables(tmp_path: Path, inv: Inventory) -> None:
    ref = model_run(tmp_path / "ref")
    store = Store(str(tmp_path / "art"))
    store.ingest("h200", "h200-model-1", ref)
    page = (_render(store, inv, tmp_path / "docs") / "h200.md").read_text()
    full, shard = _shard_rows(page)
    kern = [k for k in read_table(ref / "kernels.arrow").to_pylist() if k["kernel"] == "moe_w4a16"]
    for rows, tp in ((full, 1), (shard, 8)):
        want = sorted((k for k in kern if k["tp"] == tp), key=lambda k: k["M"])
        assert [r[0] for r in rows] == [str(k["M"]) for k in want]             # one row per M: never mixed
        assert [r[1] for r in rows] == [k["impl"] for k in want]
        assert [r[2] for r in rows] == [f"{k['time_us_p50']:,.1f}" for k in want]
        assert [r[5] for r in rows] == [f"{k['bytes'] / 1e6:,.1f}" for k in want]
        assert [r[7] for r in rows] == [f"{100 * k['bytes'] / (k['time_us_p50'] * 1e3) / 4300.0:,.1f}" for k in want]
        assert [r[10] for r in rows] == [f"{k['unique_experts']} ({k['expected_experts']:,.1f})" for k in want]
    moe = sections.section(page, "MoE W4A16 GEMM")
    assert "expert intermediate 256 (gate_up N = 512, down K = 256)" in moe
    assert "expert intermediate 2048 (gate_up N = 4096, down K = 2048)" in moe
    assert "No TP-8 shard-shape points" not in moe
    # the projected page keeps them apart as well (the projection carries the shard points)
    from flows.analysis.backtest_store import refresh
    refresh(store, inv, "h200")
    b300 = (_render(store, inv, tmp_path / "docs") / "b300.md").read_text()
    pfull, pshard = _shard_rows(b300)
    assert [r[0] for r in pfull] == [r[0] for r in full] and [r[0] for r in pshard] == [r[0] for r in shard]


LEVELS = ((0.6, 3.1), (0.8, 5.3), (0.9, 6.4))   # synthetic level -> measured accepted tokens per step


def _accept_sweep(run_dir: Path) -> None:
    """Each e2e row at three acceptance levels, its tokens/s following (accept + 1) / step."""
    def sweep(rows: list[dict]) -> list[dict]:
        out = []
        for r in rows:
            for level, acc in LEVELS:
                out.append({**r, "synthetic_accept": level, "accept_len_mean": acc,
                            "tokens_per_s": r["tokens_per_s"] * (acc + 1) / (r["accept_len_mean"] + 1)})
        return out
    rewrite_table(run_dir, "e2e", sweep)


def test_tokens_per_s_against_accepted_length_at_full_depth(tmp_path: Path, inv: Inventory) -> None:
    ref = model_run(tmp_path / "ref")
    _accept_sweep(ref)
    store = Store(str(tmp_path / "art"))
    store.ingest("h200", "h200-model-1", ref)
    from flows.analysis.backtest_store import refresh
    refresh(store, inv, "h200")           # what `kdbench notes` stores first (the what-if grid among it)
    notes = _render(store, inv, tmp_path / "docs")
    page = (notes / "h200.md").read_text()
    sect = sections.section(page, "Tokens/s against accepted length")
    assert "![tokens/s against accepted length](h200/tokens_vs_accept.png)" in sect
    assert (notes / "h200" / "tokens_vs_accept.png").is_file()
    rows = sections.table_rows(sect)
    e2e = read_table(ref / "e2e.arrow").to_pylist()
    # one row per (tp, concurrency, level), all at the full 61 layers; within a line tokens/s rises with acceptance
    assert {(r[0], r[1], r[2], r[3]) for r in rows} == {(str(tp), str(FULL), str(c), f"{lv:g}")
                                                        for tp in (1, 8) for c in (1, 16) for lv, _ in LEVELS}
    assert len(rows) == 12
    for tp in ("1", "8"):
        for c in ("1", "16"):
            line = [r for r in rows if r[0] == tp and r[2] == c]
            assert [r[4] for r in line] == [f"{a:.2f}" for _, a in LEVELS]
            tps = [float(r[6].replace(",", "")) for r in line]
            assert tps == sorted(tps)
            want = [e for e in e2e if e["layers"] == FULL and e["tp"] == int(tp) and e["concurrency"] == int(c)
                    and e["synthetic_accept"] == 0.9]
            assert line[-1][6] == f"{max(e['tokens_per_s'] for e in want):,.0f}"
    # the new tables and plot (and the what-if grid, stored again) are byte-identical when another process
    # refreshes and renders them
    cli = subprocess.run([sys.executable, "-c", "from flows.cli.app import app; app()", "notes", "--artifacts", store.base,
                          "--hosts", str(inv.dir), "--docs", str(tmp_path / "cli")],
                         env={**os.environ, "PYTHONHASHSEED": "999"}, capture_output=True, text=True, timeout=120,
                         cwd=REPO)
    assert cli.returncode == 0, cli.stderr
    for rel in ("h200.md", "h200/tokens_vs_accept.png", "h200/moe_pct_peak_bw.png"):
        assert (tmp_path / "cli" / "notes" / rel).read_bytes() == (notes / rel).read_bytes(), rel


def test_no_accept_plot_without_full_depth_rows(tmp_path: Path, inv: Inventory) -> None:
    store = Store(str(tmp_path / "art"))
    store.ingest("h200", "two-layers", write_run(tmp_path / "p1", run_id="two-layers"))
    notes = _render(store, inv, tmp_path / "docs")
    sect = sections.section((notes / "h200.md").read_text(), "Tokens/s against accepted length")
    assert sect.startswith("## Tokens/s against accepted length\n\nNo plot: no full-depth e2e rows yet (the e2e "
                           "rows here have 4 layers")
    assert "|" not in sect and not (notes / "h200" / "tokens_vs_accept.png").exists()


def test_pages_come_from_the_shipped_templates() -> None:
    from importlib.resources import files
    names = {p.name for p in files("flows.notes").joinpath("templates").iterdir()}
    assert {"host.md.j2", "index.md.j2", "_macros.md.j2"} <= names
    # layout only: no template formats a number or escapes a string itself
    for name in names:
        text = files("flows.notes").joinpath("templates", name).read_text()
        assert not re.search(r"\|\s*(format|round|e|escape|safe)\b", text), name


@pytest.mark.parametrize("suite, section, note, shown", [
    ("e2e", "End to end", "e2e k2: synthetic_accept=0.8 | eager step included <b>",
     r"e2e k2: synthetic_accept=0.8 \| eager step included \<b\>"),
    ("kernels", "MoE W4A16 GEMM", "kernels at k2 shapes | each after a read of 256 MB <i>",
     r"kernels at k2 shapes \| each after a read of 256 MB \<i\>"),
])
def test_a_section_quotes_how_its_run_made_the_figures(tmp_path: Path, inv: Inventory, suite: str, section: str,
                                                       note: str, shown: str) -> None:
    """A suite's own note (e2e: synthetic acceptance, modelled comm; kernels: the L2 flush and replay
    method) travels with its figures, escaped."""
    run = write_run(tmp_path / "p1", run_id="full-1")
    rewrite_table(run, "runs", lambda rows: [{**r, "note": note} if r["suite"] == suite else r for r in rows])
    store = Store(str(tmp_path / "art"))
    store.ingest("h200", "full-1", run)
    text = sections.section((_render(store, inv, tmp_path / "docs") / "h200.md").read_text(), section)
    assert "How the run made them, in its own words: " + shown in text


def test_the_moe_table_shows_the_kernel_that_runs_at_each_m(tmp_path: Path, inv: Inventory) -> None:
    """The engine picks CUDA or Triton per M: each row names its own; a torch baseline at the same M never shows."""
    ref = model_run(tmp_path / "ref")
    table = read_table(ref / "kernels.arrow")
    rows = table.to_pylist()
    moe = [k for k in rows if k["kernel"] == "moe_w4a16" and k["tp"] == 1]
    cuda_m = sorted({k["M"] for k in moe})[1:3]
    for k in moe:
        if k["M"] in cuda_m:
            k["impl"] = "cuda"
    rows += [dict(k, impl="torch", time_us_p50=k["time_us_p50"] * 50) for k in moe if k["M"] == cuda_m[0]]
    write_table(ref, to_table("kernels", rows, provenance(table)))
    store = Store(str(tmp_path / "art"))
    store.ingest("h200", "h200-model-1", ref)
    page = (_render(store, inv, tmp_path / "docs") / "h200.md").read_text()
    full, _ = _shard_rows(page)
    assert [r[0] for r in full] == [str(m) for m in sorted({k["M"] for k in moe})]
    assert [r[1] for r in full] == ["cuda" if int(r[0]) in cuda_m else "triton" for r in full]
    assert "triton, cuda" in sections.section(page, "MoE W4A16 GEMM")


def test_the_moe_table_shows_host_time_and_percent_of_the_roofline(tmp_path: Path, inv: Inventory) -> None:
    """host us beside the GPU time, and roofline %: max(bytes / copy, flops / matmul) at the run's own
    ceilings over the time; at a compute-bound point the flops term is the floor."""
    ref = model_run(tmp_path / "ref")
    table = read_table(ref / "kernels.arrow")
    runs = read_table(ref / "runs.arrow").to_pylist()
    copy = next(r["copy_gbps"] for r in runs if r["suite"] == "kernels")
    mm = next(r["matmul_tflops"] for r in runs if r["suite"] == "kernels")
    rows = table.to_pylist()
    full = sorted((k for k in rows if k["kernel"] == "moe_w4a16" and k["tp"] == 1), key=lambda k: k["M"])
    full[0]["host_us"] = 23.456
    last = full[-1]
    last["flops"] = 4 * last["bytes"] / (copy * 1e3) * mm * 1e6  # floor: 4x the byte time, in flops
    write_table(ref, to_table("kernels", rows, provenance(table)))
    store = Store(str(tmp_path / "art"))
    store.ingest("h200", "h200-model-1", ref)
    page = (_render(store, inv, tmp_path / "docs") / "h200.md").read_text()
    moe = sections.section(page, "MoE W4A16 GEMM")
    head = next(line for line in moe.splitlines() if line.startswith("| M |"))
    cols = [c.strip() for c in head.strip("|").split("|")]
    body, _ = _shard_rows(page)
    host, roof = cols.index("host us"), cols.index("roofline %")
    assert body[0][host] == "23.5" and body[1][host] == "-", "host time where measured, '-' elsewhere"
    byte_floor = 100 * full[0]["bytes"] / (copy * 1e3) / full[0]["time_us_p50"]
    assert body[0][roof] == f"{byte_floor:,.1f}" == body[0][cols.index("% of copy BW")], "byte-bound: % of copy"
    assert body[-1][roof] == f"{400 * last['bytes'] / (copy * 1e3) / last['time_us_p50']:,.1f}"
