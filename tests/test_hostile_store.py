"""A tampered store, or one cut short: real files on disk, real Parquet, the real migrate and reindex.

A store is trusted no more than a host: a manifest names only its own run's partitions, a part is
read size-bounded and digest-checked with its footer checked before decoding, one unusable manifest
costs its own run only, and neither a killed migration nor a reindex racing an ingest loses a run.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engine.schema import MAX_ROWS, SchemaError
from engine.table_files import read_table
from flows import REPO
from flows.store import store as store_mod
from flows.store.layout import MANIFESTS, StoreError, parquet_bytes
from flows.store.migrate import migrate
from flows.store.store import Store
from support.runs import old_layout_run, write_run


# -- migrate, killed at any point ---------------------------------------------------------------

class Killed(BaseException):
    """A kill -9 at one point of the migration: nothing after it runs, no except clause sees it."""


class _Killing:
    """The store's filesystem, raising Killed at its `at`-th change (write, move, delete); `changes`
    counts them, so a run without a kill says how many points there are to kill at."""

    MUTATIONS = ("delete_file", "delete_dir", "move", "open_output_stream", "create_dir")

    def __init__(self, fs: Any, at: int | None):
        self._fs, self.at, self.changes = fs, at, 0

    def tick(self) -> None:
        if self.changes == self.at:
            raise Killed(self.at)
        self.changes += 1

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._fs, name)
        if name not in self.MUTATIONS:
            return real

        def changed(*args: Any, **kwargs: Any) -> Any:
            self.tick()
            return real(*args, **kwargs)
        return changed


def _killable(store: Store, at: int | None) -> _Killing:
    killing = _Killing(store.fs, at)
    write = store.write_bytes

    def write_bytes(rel: str, data: bytes) -> None:
        killing.tick()
        write(rel, data)
    store.fs, store.write_bytes = killing, write_bytes  # type: ignore[method-assign]
    return killing


@pytest.fixture(scope="module")
def old_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[tuple[str, str], Path]]:
    """A layout-1 store of two runs (one with an operator's stray file), and each run's source files."""
    tmp = tmp_path_factory.mktemp("old")
    art, index = tmp / "art", []
    runs = {("h200", "h200-a"): write_run(tmp / "a", host="h200", run_id="h200-a"),
            ("pro6000", "p-b"): write_run(tmp / "b", host="pro6000", run_id="p-b", with_comm=False)}
    for (host, run_id), src in runs.items():
        leaf = old_layout_run(art, src, host, run_id, index)
    (leaf / "notes.txt").write_text("an operator's file\n")
    (art / "runs" / "_index.jsonl").write_text("".join(json.dumps(r) + "\n" for r in index))
    return art, runs


def _assert_nothing_lost(art: Path, runs: dict[tuple[str, str], Path]) -> None:
    store = Store(str(art))
    assert sorted((r.host, r.run_id) for r in store.runs()) == sorted(runs)
    for (host, run_id), src in runs.items():
        tables = store.load(host, run_id)
        assert set(tables) == {p.stem for p in src.glob("*.arrow")}, (host, run_id)
        for name, table in tables.items():
            assert table.equals(read_table(src / f"{name}.arrow"), check_metadata=True)
    assert (art / "_unmigrated" / "host=pro6000" / "run=p-b" / "notes.txt").read_text() == "an operator's file\n"
    left = [p for p in (art / "runs").rglob("*") if p.is_file() and p.name != "part-0.parquet"]
    assert left == [], left


def test_a_migration_killed_at_any_point_and_run_again_loses_nothing(
        old_store: tuple[Path, dict], tmp_path: Path) -> None:
    """N2: a migration cut short after it deleted some of a run's old files used to rewrite the run from
    the files left, and the rewrite deleted the tables the first run had moved: only `runs` survived."""
    src, runs = old_store
    art = tmp_path / "count"
    shutil.copytree(src, art)
    points = _killable(store := Store(str(art)), None)
    migrate(store)
    assert points.changes > 20
    for at in range(points.changes):
        art = tmp_path / f"kill-{at}"
        shutil.copytree(src, art)
        store = Store(str(art))
        _killable(store, at)
        with pytest.raises(Killed):
            migrate(store)
        report = migrate(Store(str(art)))
        assert set(report.set_aside) <= {"_unmigrated/host=pro6000/run=p-b/notes.txt"}, (at, report.set_aside)
        _assert_nothing_lost(art, runs)


def test_a_second_migration_is_refused_while_one_runs(old_store: tuple[Path, dict], tmp_path: Path) -> None:
    """N2: two migrations at once did the same damage; the second is refused while the first holds the lock."""
    src, runs = old_store
    art = tmp_path / "art"
    shutil.copytree(src, art)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from flows.store.store import Store; from flows.store.migrate import exclusive\n"
                               f"with exclusive(Store({str(art)!r})):\n    print('held', flush=True); sys.stdin.read()"],
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(StoreError, match="another `kdbench store migrate` is running"):
            migrate(Store(str(art)))
        assert (art / "runs" / "_index.jsonl").is_file() and Store(str(art)).exists(str(art / "runs" / "host=h200"))
    finally:
        holder.communicate("", timeout=30)
    migrate(Store(str(art)))  # the lock went with the process
    _assert_nothing_lost(art, runs)


# -- crafted manifests and parts ----------------------------------------------------------------

@pytest.fixture
def stored(tmp_path: Path) -> tuple[Store, Path]:
    art = tmp_path / "art"
    store = Store(str(art))
    for host, run_id in (("h200", "h200-1"), ("pro6000", "p-1")):
        store.ingest(host, run_id, write_run(tmp_path / run_id, host=host, run_id=run_id))
    return store, art


def _manifest(art: Path, host: str, run_id: str) -> Path:
    return art / MANIFESTS / f"host={host}" / f"run={run_id}.json"


def _edit(path: Path, change: Callable[[dict], None]) -> None:
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


def test_a_manifest_cannot_read_outside_its_run(stored: tuple[Store, Path], tmp_path: Path) -> None:
    """N7: a manifest's paths were read relative to the store root, so `../` read outside it."""
    store, art = stored
    outside = tmp_path / "outside.parquet"
    outside.write_bytes((art / "kernels" / "host=h200" / "run=h200-1" / "part-0.parquet").read_bytes())
    digest = hashlib.sha256(outside.read_bytes()).hexdigest()

    def point_outside(doc: dict) -> None:
        doc["files"]["kernels"].update(path="../outside.parquet", sha256=digest)
    _edit(_manifest(art, "h200", "h200-1"), point_outside)
    with pytest.raises(StoreError, match="not the run's own partition path"):
        store.load("h200", "h200-1")
    assert [r.run_id for r in store.runs()] == ["p-1"]  # skipped, and the other run still listed
    # another run's part, though inside the store, is not this run's either
    _edit(_manifest(art, "pro6000", "p-1"),
          lambda doc: doc["files"]["kernels"].update(path="kernels/host=h200/run=h200-1/part-0.parquet"))
    assert store.runs() == []
    report = store.reindex()  # both set aside with the reason, and rebuilt from the runs' own files
    assert sorted(report.set_aside) == ["_manifests/host=h200/run=h200-1.json", "_manifests/host=pro6000/run=p-1.json"]
    assert report.written == ["h200/h200-1", "pro6000/p-1"]
    assert store.manifest("h200", "h200-1").files["kernels"].path == "kernels/host=h200/run=h200-1/part-0.parquet"
    reason = art / "quarantine" / "_manifests" / "host=h200" / "run=h200-1.json.reason"
    assert "../outside.parquet" in reason.read_text()


def test_an_unreadable_manifest_under_any_name_costs_only_itself(stored: tuple[Store, Path]) -> None:
    """N7: a bad manifest under a non-Hive name made every `runs()` fail, and reindex never repaired it."""
    store, art = stored
    junk = art / MANIFESTS / "junk.json"
    junk.write_text('{"host": [')
    assert [r.run_id for r in store.runs()] == ["h200-1", "p-1"]
    report = store.reindex()
    assert list(report.set_aside) == ["_manifests/junk.json"] and not junk.exists()
    assert (art / "quarantine" / "_manifests" / "junk.json").read_text() == '{"host": ['
    assert [r.run_id for r in store.runs()] == ["h200-1", "p-1"]


def _retouched(art: Path, table: str, change: Callable[[pa.Table], pa.Table]) -> Path:
    """Rewrite a stored part with changed content (a tampered store), its manifest left as it was."""
    part = art / table / "host=h200" / "run=h200-1" / "part-0.parquet"
    part.write_bytes(parquet_bytes(change(pq.read_table(part))))
    return part


def test_dataset_reads_are_digest_checked(stored: tuple[Store, Path]) -> None:
    """N7: `dataset()` read every part named by a manifest without checking the recorded sha256."""
    store, art = stored
    rows = store.dataset("kernels").count_rows()
    _retouched(art, "kernels", lambda t: t.set_column(t.schema.get_field_index("time_us_p50"), "time_us_p50",
                                                         pa.array([1.0] * t.num_rows)))
    with pytest.raises(SchemaError, match="kernels/host=h200/run=h200-1/part-0.parquet: sha256 differs"):
        store.dataset("kernels")
    assert store.dataset("e2e").count_rows() > 0 and rows > 0


def test_parts_are_read_size_bounded(stored: tuple[Store, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """N7: parts were read whole, however large; they are bounded like every other file kdbench reads."""
    store, art = stored
    size = (art / "kernels" / "host=h200" / "run=h200-1" / "part-0.parquet").stat().st_size
    monkeypatch.setattr(store_mod, "MAX_FILE_BYTES", size - 1)
    with pytest.raises(SchemaError, match=f"larger than {size - 1} bytes"):
        store.load("h200", "h200-1")
    assert store.reindex().bad["h200/h200-1"].endswith(f"larger than {size - 1} bytes")


def test_a_parquet_bomb_is_refused_by_its_footer_before_decoding(stored: tuple[Store, Path]) -> None:
    """N11: a small part of very many rows (a constant row compresses to almost nothing) made `store
    reindex` decode all of them; its footer's row count now refuses it first."""
    store, art = stored
    rows = 40 * MAX_ROWS
    part = _retouched(art, "kernels", lambda t: pa.concat_tables([t.slice(0, 1)] * rows).combine_chunks())
    assert part.stat().st_size < 1 << 20 and pq.ParquetFile(part).metadata.num_rows == rows
    report = store.reindex()
    assert "h200/h200-1" in report.bad and "p-1" not in " ".join(report.bad)
    assert f"footer says {rows} rows, not the {MAX_ROWS}-row bound; not decoded" in report.bad["h200/h200-1"]
    with pytest.raises(SchemaError, match="sha256 differs"):
        store.load("h200", "h200-1")  # read through its manifest, the digest refuses it first


def test_a_footer_that_disagrees_with_the_manifest_is_refused(stored: tuple[Store, Path]) -> None:
    store, art = stored
    part = _retouched(art, "kernels", lambda t: t.slice(0, 3))
    digest = hashlib.sha256(part.read_bytes()).hexdigest()
    _edit(_manifest(art, "h200", "h200-1"), lambda doc: doc["files"]["kernels"].update(sha256=digest))
    with pytest.raises(SchemaError, match="footer says 3 rows, not its manifest's"):
        store.load("h200", "h200-1")


# -- reindex racing an ingest -------------------------------------------------------------------

@pytest.mark.parametrize("when", ["before", "after"])
def test_reindex_racing_an_ingest_keeps_the_run(stored: tuple[Store, Path], tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch, when: str) -> None:
    """N8: reindex listed the tables before the manifests, so a run ingested in between had a manifest
    and no files seen: reindex removed the manifest and the run disappeared. The ingest lands just
    before or just after the manifests are listed, whichever order reindex lists in."""
    store, art = stored
    late = write_run(tmp_path / "late", host="h200", run_id="h200-late")
    listing = store.files_under
    landed = []

    def files_under(folder: str) -> list:
        if folder == MANIFESTS and when == "before" and not landed:
            landed.append(store.ingest("h200", "h200-late", late))
        out = listing(folder)
        if folder == MANIFESTS and when == "after" and not landed:
            landed.append(store.ingest("h200", "h200-late", late))
        return out
    monkeypatch.setattr(store, "files_under", files_under)
    report = store.reindex()
    assert landed and not report.removed, report
    assert "h200-late" in [r.run_id for r in Store(str(art)).runs()]
    assert Store(str(art)).run("h200", "h200-late").ingested_at == landed[0].ingested_at
