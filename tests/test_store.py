"""The artifacts store: validated ingest, a table-first Hive layout that pyarrow, DuckDB and pandas read
in one line, one manifest per complete run, migration from the old layout, and reindex."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import duckdb
import pandas as pd
import pyarrow.dataset as ds
import pytest
from typer.testing import CliRunner

from engine.schema import SchemaError
from engine.table_files import read_table
from flows import REPO
from flows.cli.app import app
from flows.store.layout import RunStatus, StoreError
from flows.store.store import Store
from support.runs import old_layout_run, write_run


@pytest.fixture(scope="module")
def pulled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_run(tmp_path_factory.mktemp("pulled") / "h200-1", run_id="h200-1")


@pytest.mark.parametrize("uri", ["path", "file"])
def test_ingest_and_read_back(tmp_path: Path, pulled: Path, uri: str) -> None:
    root = str(tmp_path / "art") if uri == "path" else f"file://{tmp_path / 'art'}"
    store = Store(root)
    info = store.ingest("h200", "h200-1", pulled)
    assert (info.host, info.run_id, info.source, info.status) == ("h200", "h200-1", "measured", "complete")
    assert info.suites == ["comm", "e2e", "kernels"] and info.started_at == "2026-10-20T10:00:00Z"
    assert store.runs() == [info] and store.run("h200", "h200-1") == info
    for table in ("runs", "kernels", "e2e", "comm"):
        assert (tmp_path / "art" / table / "host=h200" / "run=h200-1" / "part-0.parquet").is_file()
    manifest = json.loads((tmp_path / "art" / "_manifests" / "host=h200" / "run=h200-1.json").read_text())
    assert manifest["files"]["kernels"]["path"] == "kernels/host=h200/run=h200-1/part-0.parquet"
    assert info.status is RunStatus.COMPLETE and manifest["status"] == "complete"  # the enum's value, as before
    tables = store.load("h200", "h200-1")
    assert set(tables) == {"runs", "kernels", "e2e", "comm"}
    for name, table in tables.items():  # Parquet at rest gives back exactly what came over the wire
        assert table.equals(read_table(pulled / f"{name}.arrow"), check_metadata=True)
    kern = store.dataset("kernels").to_table()
    assert set(kern.column("host").to_pylist()) == {"h200"}
    assert set(kern.column("run").to_pylist()) == {"h200-1"} == set(kern.column("run_id").to_pylist())


def test_one_line_reads_with_pyarrow_duckdb_and_pandas(tmp_path: Path, pulled: Path) -> None:
    """The README's reads: one table across every run of every host, no kdbench code involved."""
    art = tmp_path / "art"
    store = Store(str(art))
    store.ingest("h200", "h200-1", pulled)
    other = write_run(tmp_path / "p1", host="pro6000", run_id="p-1", bw=1600.0, started_at="2026-11-02T00:00:00Z")
    store.ingest("pro6000", "p-1", other)
    want = store.dataset("kernels").to_table()
    assert want.num_rows == 2 * read_table(pulled / "kernels.arrow").num_rows

    one = ds.dataset(str(art / "kernels"), partitioning="hive").to_table()
    assert one.num_rows == want.num_rows and set(one.column("host").to_pylist()) == {"h200", "pro6000"}

    q = duckdb.sql(f"""
        SELECT host, run, config, concurrency, budget, tokens_per_s
        FROM read_parquet('{art}/e2e/*/*/*.parquet', hive_partitioning = true)
        WHERE source = 'measured'
        ORDER BY tokens_per_s DESC LIMIT 10""").fetchall()  # the README's query
    e2e = [r for r in store.dataset("e2e").to_table().to_pylist() if r["source"] == "measured"]
    top = sorted(e2e, key=lambda r: -r["tokens_per_s"])[:10]
    assert q == [(r["host"], r["run"], r["config"], r["concurrency"], r["budget"], r["tokens_per_s"]) for r in top]

    df = pd.read_parquet(art / "kernels")  # the README's pandas line
    assert len(df) == want.num_rows and set(df["host"]) == {"h200", "pro6000"}
    assert sorted(df["time_us_p50"]) == sorted(want.column("time_us_p50").to_pylist())
    runs = store.dataset("runs").to_table()
    assert sorted(set(zip(runs.column("host").to_pylist(), runs.column("run").to_pylist()))) == \
        [("h200", "h200-1"), ("pro6000", "p-1")]
    assert [r.run_id for r in store.runs()] == ["h200-1", "p-1"]
    assert [r.run_id for r in store.runs("pro6000")] == ["p-1"]


def test_a_run_is_visible_only_once_its_manifest_is_written(tmp_path: Path, pulled: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    store = Store(str(tmp_path / "art"))

    def crash(*_: object) -> None:
        raise OSError("controller died before the manifest")

    monkeypatch.setattr(Store, "_write_manifest", crash)
    with pytest.raises(OSError):
        store.ingest("h200", "h200-1", pulled)
    monkeypatch.undo()
    assert (tmp_path / "art" / "kernels" / "host=h200" / "run=h200-1" / "part-0.parquet").is_file()
    assert store.runs() == [] and store.dataset("kernels").count_rows() == 0
    with pytest.raises(StoreError, match="no run h200-1 of host h200"):
        store.load("h200", "h200-1")
    # every table was written (the runs table goes last), so reindex can finish the job
    report = store.reindex()
    assert report.written == ["h200/h200-1"] and not report.orphans
    assert [r.run_id for r in store.runs()] == ["h200-1"]


def test_reindex_rebuilds_manifests_and_reports_orphans(tmp_path: Path, pulled: Path) -> None:
    art = tmp_path / "art"
    store = Store(str(art))
    store.ingest("h200", "h200-1", pulled)
    manifest = art / "_manifests" / "host=h200" / "run=h200-1.json"
    good = manifest.read_bytes()
    assert store.reindex().unchanged == ["h200/h200-1"]

    manifest.write_text("{not json")
    assert store.runs() == []  # an unreadable manifest costs its own run, never every run's listing
    report = store.reindex()  # sets it aside, with the reason, and rebuilds it from the run's files
    assert report.written == ["h200/h200-1"] and list(report.set_aside) == ["_manifests/host=h200/run=h200-1.json"]
    assert (art / "quarantine" / "_manifests" / "host=h200" / "run=h200-1.json").read_text() == "{not json"
    assert "not a kdbench run manifest" in \
        (art / "quarantine" / "_manifests" / "host=h200" / "run=h200-1.json.reason").read_text()
    rebuilt, want = json.loads(manifest.read_bytes()), json.loads(good)
    assert rebuilt.pop("ingested_at") >= want.pop("ingested_at")  # the runs table's mtime: written just after
    assert rebuilt == want

    # an ingest that died before its runs table: an orphan, reported, never indexed nor deleted
    orphan = art / "kernels" / "host=h200" / "run=cut-short"
    orphan.mkdir(parents=True)
    shutil.copy(art / "kernels" / "host=h200" / "run=h200-1" / "part-0.parquet", orphan)
    # a manifest whose files are gone: removed
    gone = art / "_manifests" / "host=b300" / "run=old.json"
    gone.parent.mkdir()
    gone.write_bytes(good.replace(b"h200-1", b"old").replace(b"h200", b"b300"))
    res = CliRunner().invoke(app, ["store", "reindex", "--artifacts", str(art)])
    assert res.exit_code == 1, res.output
    assert "orphan h200/cut-short" in res.output and "1 removed" in res.output
    assert (orphan / "part-0.parquet").is_file() and not gone.exists()
    assert [r.run_id for r in store.runs()] == ["h200-1"]

    # a file changed after ingest fails its digest on the way out
    (art / "e2e" / "host=h200" / "run=h200-1" / "part-0.parquet").write_bytes(b"damaged")
    with pytest.raises(SchemaError, match="e2e/host=h200/run=h200-1"):
        store.load("h200", "h200-1")


def test_reingest_with_fewer_tables_leaves_no_stale_partition(tmp_path: Path, pulled: Path) -> None:
    art = tmp_path / "art"
    store = Store(str(art))
    store.ingest("h200", "h200-1", pulled)
    less = tmp_path / "less"
    shutil.copytree(pulled, less)
    (less / "e2e.arrow").unlink()
    store.ingest("h200", "h200-1", less)
    assert not (art / "e2e" / "host=h200" / "run=h200-1").exists()
    assert set(store.load("h200", "h200-1")) == {"runs", "kernels", "comm"}
    assert ds.dataset(str(art / "e2e"), partitioning="hive").count_rows() == 0


def test_storing_the_same_run_again_changes_no_byte(tmp_path: Path, pulled: Path) -> None:
    # `kdbench notes` re-stores every projection each time: the same tables must leave the store as it was
    art = tmp_path / "art"
    store = Store(str(art))
    first = store.ingest("h200", "h200-1", pulled)
    before = {p: p.read_bytes() for p in art.rglob("*") if p.is_file()}
    again = store.ingest("h200", "h200-1", pulled)
    assert again.ingested_at == first.ingested_at
    assert {p: p.read_bytes() for p in art.rglob("*") if p.is_file()} == before
    less = tmp_path / "less"   # different tables are a new ingest
    shutil.copytree(pulled, less)
    (less / "e2e.arrow").unlink()
    assert store.ingest("h200", "h200-1", less).ingested_at != first.ingested_at


def test_ingest_refuses_bad_files(tmp_path: Path, pulled: Path) -> None:
    store = Store(str(tmp_path / "art"))
    bad = tmp_path / "bad"
    shutil.copytree(pulled, bad)
    (bad / "kernels.arrow").write_bytes(b"not arrow")
    with pytest.raises(SchemaError, match="kernels.arrow"):
        store.ingest("h200", "h200-1", bad)
    with pytest.raises(StoreError, match="run_id"):
        store.ingest("h200", "another-id", pulled)
    with pytest.raises(StoreError, match="names host"):
        store.ingest("b300", "h200-1", pulled)
    with pytest.raises(StoreError, match="invalid host"):
        store.ingest("../x", "h200-1", pulled)
    assert store.runs() == []   # nothing half-accepted
    assert not (tmp_path / "art").exists() or not list((tmp_path / "art").rglob("*.parquet"))


def test_reference_missing_and_present(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "art"))
    with pytest.raises(StoreError, match="artifacts/reference/h200/runs.arrow"):
        store.reference("h200")
    write_run(tmp_path / "art" / "reference" / "h200")
    assert store.references() == ["h200"]
    assert store.reference("h200")["runs"].column("host")[0].as_py() == "h200"


# -- migration from layout 1 ------------------------------------------------------------------

def test_migrate_moves_an_old_store_and_loses_no_file(tmp_path: Path) -> None:
    art = tmp_path / "art"
    index: list[dict] = []
    a = write_run(tmp_path / "a", host="h200", run_id="h200-a", started_at="2026-10-01T00:00:00Z")
    b = write_run(tmp_path / "b", host="pro6000", run_id="p-b", started_at="2026-10-02T00:00:00Z", with_comm=False)
    c = write_run(tmp_path / "c", host="pro6000", run_id="p-c", started_at="2026-10-03T00:00:00Z")
    old_layout_run(art, a, "h200", "h200-a", index)
    leaf_b = old_layout_run(art, b, "pro6000", "p-b", index)
    (leaf_b / "notes.txt").write_text("an operator's file\n")
    leaf_c = old_layout_run(art, c, "pro6000", "p-c", index)
    (leaf_c / "kernels.arrow").write_bytes(b"damaged on disk")
    index[0]["ingested_at"], index[1]["ingested_at"] = "2026-10-09T00:00:00+00:00", "2026-10-05T00:00:00+00:00"
    index.append({"host": "b300", "run_id": "lost-before", "source": "measured", "status": "complete"})
    (art / "runs" / "_index.jsonl").write_text("".join(json.dumps(r) + "\n" for r in index))
    shutil.copytree(REPO / "artifacts" / "reference" / "h200", art / "reference" / "h200")  # the committed one
    write_run(art / "reference" / "synth", host="synth", run_id="synth-ref")
    ref_before = {p.name: p.read_bytes() for p in (art / "reference" / "h200").iterdir()}
    before = {str(p.relative_to(art)) for p in art.rglob("*") if p.is_file()}

    store = Store(str(art))
    with pytest.raises(StoreError, match="kdbench store migrate"):
        store.runs()
    res = CliRunner().invoke(app, ["store", "migrate", "--artifacts", str(art)])
    assert res.exit_code == 1, res.output   # something was set aside: the damaged run and the odd file
    assert "migrated 2 run(s)" in res.output and "b300/lost-before" in res.output

    # in the order the old index says they were stored
    assert [(r.host, r.run_id, r.ingested_at) for r in store.runs()] == [
        ("pro6000", "p-b", "2026-10-05T00:00:00+00:00"), ("h200", "h200-a", "2026-10-09T00:00:00+00:00")]
    for src, host, run_id in ((a, "h200", "h200-a"), (b, "pro6000", "p-b")):
        tables = store.load(host, run_id)
        assert set(tables) == {p.stem for p in src.glob("*.arrow")}
        for name, table in tables.items():
            assert table.equals(read_table(src / f"{name}.arrow"), check_metadata=True)
        m = store.manifest(host, run_id)
        assert m.migrated_from == {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in src.glob("*.arrow")}
    # nothing lost: the damaged run and the unknown file are kept aside with the reason
    aside = art / "_unmigrated"
    assert (aside / "host=pro6000" / "run=p-c" / "kernels.arrow").read_bytes() == b"damaged on disk"
    assert "sha256" in (aside / "host=pro6000" / "run=p-c" / "kernels.arrow.reason").read_text()
    for name in ("runs.arrow", "e2e.arrow", "comm.arrow", "_manifest.json"):
        assert (aside / "host=pro6000" / "run=p-c" / name).is_file()
    assert (aside / "host=pro6000" / "run=p-b" / "notes.txt").read_text() == "an operator's file\n"
    # the old files and the index are gone only because their content lives on in the new layout
    after = {str(p.relative_to(art)) for p in art.rglob("*") if p.is_file()}
    assert not [p for p in after if p.startswith("runs/") and not p.endswith("/part-0.parquet")]
    for old in (p for p in before if p.startswith("runs/host=") and p.endswith(".arrow") and "p-c" not in p):
        _, host, run, name = old.split("/")
        assert f"{name.removesuffix('.arrow')}/{host}/{run}/part-0.parquet" in after, old
    # reference datasets are untouched (the committed one byte for byte) and still read
    assert {p.name: p.read_bytes() for p in (art / "reference" / "h200").iterdir()} == ref_before
    assert store.references() == ["h200", "synth"]
    synth = store.reference("synth")
    for name, table in synth.items():
        assert table.equals(read_table(art / "reference" / "synth" / f"{name}.arrow"), check_metadata=True)
    # one-line reads work on the migrated store
    assert ds.dataset(str(art / "kernels"), partitioning="hive").count_rows() == store.dataset("kernels").count_rows()

    again = CliRunner().invoke(app, ["store", "migrate", "--artifacts", str(art)])
    assert again.exit_code == 0 and "migrated 0 run(s)" in again.output


def test_a_compressed_reference_file_is_refused_like_a_pulled_one(tmp_path: Path) -> None:
    """Reference datasets go through the same reader as pulled files: no compressed bodies."""
    import pyarrow.ipc as ipc
    ref = write_run(tmp_path / "art" / "reference" / "h200")
    table = read_table(ref / "kernels.arrow")
    with ipc.new_file(str(ref / "kernels.arrow"), table.schema,
                      options=ipc.IpcWriteOptions(compression="zstd")) as w:
        w.write_table(table)
    with pytest.raises(SchemaError, match="compressed"):
        Store(str(tmp_path / "art")).reference("h200")
