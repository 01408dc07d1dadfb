"""`kdbench import`: outside figures become a reference set in the kdbench schema, labelled as outside,
usable as --reference, shown beside kdbench's own figures; bad files get one error naming row and column."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from engine.config import K2
from engine.costs import expected_experts, int4_expert_bytes
from engine.table_files import provenance, read_table
from flows import REPO
from flows.analysis.backtest_store import refresh
from flows.analysis.importer import ImportFileError, import_file
from flows.analysis.projection import assumptions, project
from flows.analysis.reference import load_reference, machine_of, measured_datasets
from flows.cli.app import app
from flows.inventory.hosts import Inventory
from flows.analysis.assumptions import E2eWithoutSplit
from flows.notes.gather import gather
from flows.notes.publish import render_notes
from flows.store.store import Store
from support.runs import write_run

SHIPPED = REPO / "artifacts" / "reference" / "pro6000-published" / "source.json"
PROV = {"machine": "1x test GPU", "date": "2026-11-01", "source": "a test", "host": "pro6000"}


def _json(tmp: Path, **doc: object) -> Path:
    path = tmp / "in.json"
    path.write_text(json.dumps({"provenance": PROV, **doc}))
    return path


def test_the_shipped_published_figures(tmp_path: Path, inv: Inventory) -> None:
    out = Path(import_file(SHIPPED, "pro6000-published", tmp_path, inv))
    kern = read_table(out / "kernels.arrow").to_pylist()
    e2e = read_table(out / "e2e.arrow").to_pylist()
    prov = provenance(read_table(out / "runs.arrow"))
    assert (prov["origin"], prov["host"], prov["impl"]) == ("published", "pro6000", "sglang-ddtree")
    assert {k["impl"] for k in kern} == {"marlin"} and {k["source"] for k in kern} == {"measured"}
    # bytes from K2 shapes: 8 experts at M=1, so 150 us is 73% of the source's 1.8 TB/s
    m1 = next(k for k in kern if k["M"] == 1)
    assert m1["bytes"] == pytest.approx(expected_experts(384, 8, 1) * int4_expert_bytes(K2) + 2 * 7168 * 2 + 8 * 12)
    assert m1["achieved_gbps"] / 1800 == pytest.approx(0.734, abs=0.005)
    assert [(e["concurrency"], e["tokens_per_s"], e["layers"], e["tp"]) for e in e2e] == [(1, 138.7, 61, 8),
                                                                                         (10, 517.0, 61, 8)]
    # the committed copy is exactly what the import writes
    for name in ("kernels", "e2e", "runs"):
        assert read_table(out / f"{name}.arrow").equals(read_table(SHIPPED.parent / f"{name}.arrow"))


def test_csv_kernel_points_and_serving_benchmark_keys(tmp_path: Path, inv: Inventory) -> None:
    kern = tmp_path / "sweep.csv"
    kern.write_text("# machine: 1x PRO 6000\n# date: 2026-10-01\n# source: my sweep\n# host: pro6000\n"
                    "# impl: marlin\nkernel,M,time_us\nmoe_w4a16,1,150\nmoe_w4a16,16,1100\n")
    out = Path(import_file(kern, "sweep", tmp_path, inv))
    assert [k["M"] for k in read_table(out / "kernels.arrow").to_pylist()] == [1, 16]
    serving = _json(tmp_path, serving=[{"max_concurrency": 4, "output_throughput": 300.5, "median_ttft_ms": 90.0,
                                        "median_itl_ms": 12.5, "tp": 8}])
    [row] = read_table(Path(import_file(serving, "bench", tmp_path, inv)) / "e2e.arrow").to_pylist()
    assert (row["concurrency"], row["tokens_per_s"], row["ttft_ms"], row["itl_ms_p50"], row["layers"]) == \
        (4, 300.5, 90.0, 12.5, 61)
    assert row["comm_source"] == "measured"          # a real 8-GPU run paid its own all-reduces


@pytest.mark.parametrize("doc, message", [
    ({"kernels": [{"kernel": "moe_w4a16", "M": 1, "time_us": 150}, {"kernel": "moe_w4a16", "M": 2}]},
     "in.json: kernels row 2, column 'time_us'"),
    ({"kernels": [{"kernel": "moe_w4a16", "M": "one", "time_us": 150}]}, "kernels row 1, column 'M': 'one' is not a number"),
    ({"kernels": [{"kernel": "mla_tree_attention", "batch": 1, "budget": 16, "time_us": 50}]},
     "kernels row 1, column 'context': missing"),
    ({"kernels": [{"kernel": "rmsnorm", "time_us": 5}]}, "kernels row 1, column 'bytes': kdbench does not know"),
    ({"serving": [{"concurrency": 1, "tokens_per_s": -3}]}, "serving row 1, column 'tokens_per_s'"),
])
def test_bad_rows_name_the_row_and_the_column(tmp_path: Path, inv: Inventory, doc: dict, message: str) -> None:
    with pytest.raises(ImportFileError, match=message.replace("(", r"\(")):
        import_file(_json(tmp_path, **doc), "bad", tmp_path, inv)


def test_bad_provenance_and_the_cli_error(tmp_path: Path, inv: Inventory) -> None:
    path = tmp_path / "in.json"
    path.write_text(json.dumps({"provenance": {**PROV, "date": ""}, "kernels": []}))
    with pytest.raises(ImportFileError, match="provenance, column 'date'"):
        import_file(path, "bad", tmp_path, inv)
    path.write_text(json.dumps({"provenance": {**PROV, "host": "elsewhere"}, "serving": [{"concurrency": 1,
                                                                                          "tokens_per_s": 1}]}))
    with pytest.raises(ImportFileError, match="column 'spec'"):
        import_file(path, "bad", tmp_path, inv)
    path.write_text(json.dumps({"provenance": {**PROV, "source": "scp me@10.1.2.3:/home/me/run.json"},
                                "serving": [{"concurrency": 1, "tokens_per_s": 1}]}))
    with pytest.raises(ImportFileError, match="column 'source': looks like .*an IPv4 address"):
        import_file(path, "bad", tmp_path, inv)
    path.write_text(json.dumps({"provenance": {**PROV, "machine": "8x | GPU\n# injected"},
                                "serving": [{"concurrency": 1, "tokens_per_s": 1}]}))
    with pytest.raises(ImportFileError, match="column 'machine': control characters"):
        import_file(path, "bad", tmp_path, inv)
    res = CliRunner().invoke(app, ["import", str(path), "--name", "bad", "--artifacts", str(tmp_path)])
    assert res.exit_code == 2 and "column 'machine'" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "reference" / "bad").exists()


def test_outside_data_as_reference_and_beside_kdbench_figures(tmp_path: Path, inv: Inventory) -> None:
    art = tmp_path / "art"
    write_run(art / "reference" / "h200")
    shutil.copytree(SHIPPED.parent, art / "reference" / "pro6000-published")
    store = Store(str(art))
    # never counted as a kdbench measurement of pro6000
    assert [d.name for d in measured_datasets(store, inv)] == ["h200"]
    ref = load_reference(store, inv, "pro6000-published")
    proj = project(ref.tables, ref.machine, machine_of(inv, "b300"))
    assert {k["impl"] for k in proj["kernels"].to_pylist()} == {"marlin"}
    assert proj["e2e"].num_rows == 0
    assert E2eWithoutSplit(rows=2) in assumptions(proj)
    refresh(store, inv, "h200")
    views = {v.name: v for v in gather(store, inv)}
    assert views["pro6000"].kind == "projected" and len(views["pro6000"].outside) == 1
    render_notes(store, inv, tmp_path / "docs")
    page = (tmp_path / "docs" / "notes" / "pro6000.md").read_text()
    outside = page[page.index("## Outside measurements"):]
    assert "kdbench did not run them" in outside and "(published)" in outside
    assert "| sglang-ddtree | k2 | 61 | 8 | 1 | 138.7 |" in outside
    assert page.splitlines()[0].endswith(": projected")
