"""`kdbench import` against hostile files and names: one line naming the row and the column, never a
traceback; no absurd value stored; no name kdbench's own data goes by taken without --replace."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from engine.table_files import read_table
from flows import REPO
from flows.analysis.importer import ImportFileError, import_file
from flows.analysis.reference import is_outside
from flows.cli.app import app
from flows.inventory.hosts import Inventory
from flows.store.store import Store
from support.runs import write_run

PROV = {"machine": "1x test GPU", "date": "2026-11-01", "source": "a test", "host": "pro6000"}
SERVING = [{"concurrency": 1, "tokens_per_s": 10.0}]
MOE = {"kernel": "moe_w4a16", "M": 1, "time_us": 150}


def _doc(**doc: object) -> str:
    return json.dumps({"provenance": PROV, **doc})


# (file name, its text, words of the one-line error)
BAD: dict[str, tuple[str, str, str]] = {
    "deep-json": ("in.json", '{"provenance": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
    "huge-int-literal": ("in.json", _doc(kernels=[MOE]).replace('"M": 1', '"M": 1' + "0" * 5000), "not JSON kdbench reads"),
    "huge-int": ("in.json", _doc(kernels=[MOE]).replace('"M": 1', '"M": 1' + "0" * 400),
                 "kernels row 1, column 'M'"),
    "huge-csv-field": ("in.csv", "# machine: m\n# date: d\n# source: s\n# host: pro6000\nkernel,M,time_us\n"
                       f"moe_w4a16,1,\"{'9' * 200_000}\"\n", "not CSV kdbench reads"),
    "csv-extra-fields": ("in.csv", "# machine: m\n# date: d\n# source: s\n# host: pro6000\nkernel,M,time_us\n"
                         "moe_w4a16,1,150,oops\n", "row 1 has more fields than the header"),
    "list-for-spec": ("in.json", json.dumps({"provenance": {**PROV, "host": "elsewhere", "spec": ["h200-sxm"]},
                                            "serving": SERVING}), "column 'spec'"),
    "list-for-interconnect": ("in.json", json.dumps({"provenance": {**PROV, "interconnect": ["pcie"]},
                                                    "serving": SERVING}), "column 'interconnect'"),
    "list-for-kernel": ("in.json", _doc(kernels=[{**MOE, "kernel": ["moe_w4a16"]}]), "kernels row 1, column 'kernel'"),
    "tiny-time": ("in.json", _doc(kernels=[{**MOE, "time_us": 1e-300}]), "kernels row 1, column 'time_us_p50'"),
    "negative-flops": ("in.json", _doc(kernels=[{"kernel": "rmsnorm", "time_us": 5, "bytes": 1e6, "flops": -5}]),
                       "kernels row 1, column 'flops'"),
    "formula": ("in.json", json.dumps({"provenance": {**PROV, "machine": '=HYPERLINK("https://x.test","GPU")'},
                                       "serving": SERVING}), "column 'machine': text may not start with"),
    "homoglyph-kernel": ("in.json", _doc(kernels=[{**MOE, "kernel": "m\u043ee_w4a16"}]),
                         "kernels row 1, column 'kernel': 'm\u043ee_w4a16' must be ASCII"),
    "readme-host": ("in.json", json.dumps({"provenance": {**PROV, "host": "README", "spec": "h200-sxm"},
                                           "serving": SERVING}), "column 'host': 'README' is the name of a page"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_hostile_file_gets_one_line_naming_row_and_column(tmp_path: Path, inv: Inventory, case: str) -> None:
    """N12 (N15 for the README host): tracebacks for deep JSON, huge ints, long CSV fields and lists
    where text belongs; and absurd values (1e-300 us, negative flops, formulas, look-alike names) stored."""
    name, text, words = BAD[case]
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ImportFileError, match=words.replace("(", r"\(")) as e:
        import_file(path, "bad", tmp_path / "art", inv)
    assert "\n" not in str(e.value) and len(str(e.value)) < 400
    res = CliRunner().invoke(app, ["import", str(path), "--name", "bad", "--artifacts", str(tmp_path / "art")])
    assert res.exit_code == 2 and words in res.output and "Traceback" not in res.output, res.output[-500:]
    assert not (tmp_path / "art" / "reference" / "bad").exists()


def test_a_whole_number_written_as_text_is_taken(tmp_path: Path, inv: Inventory) -> None:
    """N12: `tp` = "2.0" ended the import in a traceback; it is the whole number 2."""
    path = tmp_path / "in.json"
    path.write_text(json.dumps({"provenance": PROV, "serving": [{**SERVING[0], "tp": "2.0"}]}))
    [row] = read_table(Path(import_file(path, "two", tmp_path / "art", inv)) / "e2e.arrow").to_pylist()
    assert (row["tp"], row["comm_source"]) == (2, "measured")


def test_an_import_cannot_take_a_measured_reference_name(tmp_path: Path, inv: Inventory) -> None:
    """N9: `kdbench import ... --name h200` replaced kdbench's own measured reference: every projection
    then carried from outside figures, and the h200 page said "projected"."""
    art = tmp_path / "art"
    shutil.copytree(REPO / "artifacts" / "reference" / "h200", art / "reference" / "h200")
    before = {p.name: p.read_bytes() for p in (art / "reference" / "h200").iterdir()}
    path = tmp_path / "in.json"
    path.write_text(json.dumps({"provenance": {**PROV, "host": "h200"}, "serving": SERVING}))
    res = CliRunner().invoke(app, ["import", str(path), "--name", "h200", "--artifacts", str(art)])
    assert res.exit_code == 2 and "kdbench's own measured reference" in res.output and "--replace" in res.output
    assert {p.name: p.read_bytes() for p in (art / "reference" / "h200").iterdir()} == before
    # a host with measured runs in the store: `--reference NAME` would come to mean the import
    store = Store(str(art))
    store.ingest("pro6000", "p-1", write_run(tmp_path / "p-1", host="pro6000", run_id="p-1"))
    with pytest.raises(ImportFileError, match="host pro6000 has measured runs"):
        import_file(path, "pro6000", art, inv)
    # an earlier import of the same name is replaced without asking; --replace takes a taken name
    import_file(path, "sweep", art, inv)
    import_file(path, "sweep", art, inv)
    res = CliRunner().invoke(app, ["import", str(path), "--name", "h200", "--artifacts", str(art), "--replace"])
    assert res.exit_code == 0, res.output
    assert is_outside(store.reference("h200")) and (art / "reference" / "h200" / "README.md").read_bytes() == \
        before["README.md"]  # what the import does not write is left alone
