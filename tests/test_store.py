"""The artifacts store: validated ingest, Hive layout readable by pyarrow.dataset, run index, URIs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow.dataset as ds
import pytest

from engine.schema import SchemaError
from flows.store import Store, StoreError
from test_projection_synth import write_run


@pytest.fixture(scope="module")
def pulled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_run(tmp_path_factory.mktemp("pulled") / "h200-1", run_id="h200-1")


@pytest.mark.parametrize("uri", ["path", "file"])
def test_ingest_and_read_back(tmp_path: Path, pulled: Path, uri: str) -> None:
    root = str(tmp_path / "art") if uri == "path" else f"file://{tmp_path / 'art'}"
    store = Store(root)
    leaf = store.ingest("h200", "h200-1", pulled)
    assert leaf == tmp_path / "art" / "runs" / "host=h200" / "run=h200-1"
    [info] = store.runs()
    assert (info.host, info.run_id, info.source, info.status) == ("h200", "h200-1", "measured", "complete")
    assert info.suites == ["comm", "e2e", "kernels"] and info.started_at == "2026-10-20T10:00:00Z"
    tables = store.load("h200", "h200-1")
    assert set(tables) == {"runs", "kernels", "e2e", "comm"}
    kern = store.dataset("kernels").to_table()
    assert set(kern.column("host").to_pylist()) == {"h200"}
    assert set(kern.column("run").to_pylist()) == {"h200-1"} == set(kern.column("run_id").to_pylist())


def test_hive_one_liner_and_two_hosts(tmp_path: Path, pulled: Path) -> None:
    store = Store(str(tmp_path / "art"))
    store.ingest("h200", "h200-1", pulled)
    other = write_run(tmp_path / "p1", host="pro6000", run_id="p-1", started_at="2026-11-02T00:00:00Z")
    store.ingest("pro6000", "p-1", other)
    # the documented one-liner finds only the result tables (index and manifests are "_"-prefixed)
    one = ds.dataset(str(tmp_path / "art" / "runs"), format="arrow", partitioning="hive")
    assert all(f.endswith(".arrow") for f in one.files) and len(one.files) == 8
    runs = store.dataset("runs").to_table()
    assert sorted(set(zip(runs.column("host").to_pylist(), runs.column("run").to_pylist()))) == \
        [("h200", "h200-1"), ("pro6000", "p-1")]
    assert [r.run_id for r in store.runs()] == ["h200-1", "p-1"]
    assert [r.run_id for r in store.runs("pro6000")] == ["p-1"]


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


def test_reference_missing_and_present(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "art"))
    with pytest.raises(StoreError, match="artifacts/reference/h200/runs.arrow"):
        store.reference("h200")
    write_run(tmp_path / "art" / "reference" / "h200")
    assert store.references() == ["h200"]
    assert store.reference("h200")["runs"].column("host")[0].as_py() == "h200"
