"""The artifacts store: validated runs in a table-first Hive layout, one manifest per complete run.

Layout under the root (a local path or any pyarrow filesystem URI such as s3://bucket/prefix):

    <table>/host=<host>/run=<run_id>/part-0.parquet   one file per result table of a run (runs, kernels, e2e, comm)
    _manifests/host=<host>/run=<run_id>.json          written last: the run is complete; its summary and sha256s
    quarantine/host=<host>/run=<run_id>/...           rejected files and why (flows.transport.pull)
    quarantine/_manifests/...                         manifests `reindex` set aside (unreadable, or naming files
                                                      that are not their run's own), each with a `.reason`
    backtest/backtest.json                            the latest backtest results (flows.analysis.backtest_store)
    reference/<name>/<table>.arrow                    committed reference datasets, as engine.bench wrote them

So one line reads one table across every run: `pyarrow.dataset.dataset("<root>/kernels", partitioning="hive")`,
DuckDB's `read_parquet('<root>/kernels/*/*/*.parquet', hive_partitioning = true)` or polars'
`scan_parquet`. Parquet at rest, Arrow IPC on the wire: docs/store.md says why.

A run is visible to kdbench (runs, load, dataset, notes, projection) only once its manifest exists,
and ingest writes it after every table file, the runs table last of those. There is no shared index:
each run owns its objects, so concurrent ingests on S3 (one atomic PUT per object, no lock) cannot
lose each other's runs. The partition key is `run`, not `run_id`, because every table already carries
a `run_id` column; `host` is also a column of the runs table, where ingest checks it equals the
partition value. Nothing is stored without passing engine.table_checks.check_run_tables (the contract and
every value), and nothing is read back without engine.table_checks.validate either: a part is read only
through its run's manifest, which must name the run's own partition paths; it is size-bounded,
digest-checked, and its Parquet footer's row count and decoded size are checked before it is decoded.
A manifest that cannot be read is skipped by readers (logged) and set aside by `reindex`.
"""

from __future__ import annotations

import hashlib
import json
import logging
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

if TYPE_CHECKING:
    import pyarrow.dataset as ds

from engine.files import atomic_write_bytes
from engine.schema import MAX_ROWS, SCHEMAS, TABLES, SchemaError
from engine.table_checks import check_run_tables, validate
from engine.table_files import MAX_FILE_BYTES, parse_table, read_table
from flows.store.layout import (MANIFESTS, MAX_MANIFEST, OLD_INDEX, PART, SET_ASIDE, Manifest, Reindexed, RunInfo,
                                StoredFile, StoreError, check_name, default_root, hive_key, manifest_path,
                                parquet_bytes, parse_manifest, part_path, run_info)

log = logging.getLogger(__name__)


class Store:
    """Results on any pyarrow filesystem; a local root writes every file atomically (temp + rename)."""

    def __init__(self, root: str | None = None):
        root = root or default_root()
        if "://" in root:
            self.fs, base = pafs.FileSystem.from_uri(root)
        else:
            self.fs, base = pafs.LocalFileSystem(), str(Path(root).resolve())
        self.base = base.rstrip("/")
        self.local = isinstance(self.fs, pafs.LocalFileSystem)

    def full(self, *parts: str) -> str:
        """The filesystem path of a store-relative path."""
        return "/".join([self.base, *parts])

    def exists(self, path: str) -> bool:
        """Whether a full path (see `full`) exists, file or folder."""
        return self.fs.get_file_info(path).type != pafs.FileType.NotFound

    def files_under(self, folder: str) -> list[pafs.FileInfo]:
        """Every file below a store-relative folder (none when it does not exist)."""
        sel = pafs.FileSelector(self.full(folder), recursive=True, allow_not_found=True)
        return [i for i in self.fs.get_file_info(sel) if i.type == pafs.FileType.File]

    def write_bytes(self, rel: str, data: bytes) -> None:
        """A whole file under the root: atomic rename locally, one PUT (atomic too) on an object store."""
        path = self.full(rel)
        if self.local:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(Path(path), data)
        else:
            with self.fs.open_output_stream(path) as f:
                f.write(data)

    def read_bytes(self, rel: str, limit: int | None = None) -> bytes:
        """A whole file; StoreError past `limit` bytes (manifests and old indexes are bounded)."""
        with self.fs.open_input_stream(self.full(rel)) as f:
            data = f.read(limit + 1) if limit else f.read()
        if limit and len(data) > limit:
            raise StoreError(f"{rel}: larger than {limit} bytes")
        return data

    def _read_part(self, f: StoredFile) -> pa.Table:
        """A stored Parquet file, size-bounded, checked against the digest and row count its manifest
        recorded, then against the schema."""
        try:
            data = self.read_bytes(f.path, MAX_FILE_BYTES)
        except StoreError as e:
            raise SchemaError(str(e)) from None
        if hashlib.sha256(data).hexdigest() != f.sha256:
            raise SchemaError(f"{f.path}: sha256 differs from the run's manifest (changed after ingest)")
        return _parse_part(f.path, data, f.rows)

    def read_arrow(self, rel: str) -> pa.Table:
        """An Arrow IPC file under the root (reference datasets, layout-1 runs), checked as a pulled file is."""
        return parse_table(self.read_bytes(rel, MAX_FILE_BYTES), rel)

    def _check_old_layout(self) -> None:
        if self.exists(self.full(OLD_INDEX)):
            raise StoreError(f"{self.full(OLD_INDEX)}: this store is in the old layout "
                             "(runs/host=<h>/run=<id>/<table>.arrow); run `kdbench store migrate` once")

    # -- writing ---------------------------------------------------------------------------

    def ingest(self, host: str, run_id: str, src_dir: Path) -> RunInfo:
        """Copy a pulled run into the store, refusing it whole if any file fails validation."""
        check_name("host", host), check_name("run id", run_id)
        files = sorted(Path(src_dir).glob("*.arrow"))
        if not files:
            raise StoreError(f"run {run_id} of {host}: no .arrow files in the pulled results")
        tables = {}
        for f in files:
            if f.stem not in TABLES:
                raise StoreError(f"run {run_id} of {host}: unexpected file {f.name}")
            tables[f.stem] = read_table(f)
        return self.put_tables(host, run_id, tables)

    def put_tables(self, host: str, run_id: str, tables: dict[str, pa.Table],
                   migrated_from: dict[str, str] | None = None, ingested_at: str | None = None) -> RunInfo:
        """Store one run's tables (measured or projected); the run appears when its manifest does.

        `ingested_at` orders runs: now by default; `store migrate` keeps a run's original one ("" when
        its old index never recorded one: such runs sort first, by run id)."""
        check_name("host", host), check_name("run id", run_id)
        unknown = sorted(set(tables) - set(TABLES))
        if unknown:
            raise StoreError(f"run {run_id} of {host}: unknown table {unknown[0]!r}")
        if "runs" not in tables:
            raise StoreError(f"run {run_id} of {host}: no runs table")
        try:
            check_run_tables(host, run_id, tables)
        except SchemaError as e:
            raise StoreError(f"run {run_id} of {host}: {e}") from None
        info = run_info(host, run_id, tables)
        parts = {name: parquet_bytes(tables[name]) for name in tables}
        digests = {name: hashlib.sha256(data).hexdigest() for name, data in parts.items()}
        same = self._same_run(host, run_id, digests) if ingested_at is None else None
        if same is not None:   # nothing new arrived: the stored run stays, byte for byte
            return same.info()
        info.ingested_at = datetime.now(timezone.utc).isoformat(timespec="microseconds") \
            if ingested_at is None else ingested_at
        files = {}
        for name in sorted(tables, key=lambda t: (t == "runs", t)):  # the runs table last: reindex relies on it
            rel = part_path(name, host, run_id)
            self.write_bytes(rel, parts[name])
            files[name] = StoredFile(path=rel, sha256=digests[name], rows=tables[name].num_rows)
        manifest = Manifest(**info.model_dump(), files=files, migrated_from=migrated_from or {})
        self._write_manifest(manifest)
        for name in set(TABLES) - set(tables):  # a re-ingest with fewer tables leaves no stale partition
            leaf = self.full(name, f"host={host}", f"run={run_id}")
            if self.exists(leaf):
                self.fs.delete_dir(leaf)
        return info

    def _same_run(self, host: str, run_id: str, digests: dict[str, str]) -> Manifest | None:
        """The stored manifest of this run when it holds exactly the table files of these sha256 digests, else None."""
        try:
            m = self.manifest(host, run_id)
        except StoreError:
            return None
        return m if {name: f.sha256 for name, f in m.files.items()} == digests else None

    def _write_manifest(self, m: Manifest) -> None:
        body = json.dumps(m.model_dump(mode="json"), indent=1, sort_keys=True) + "\n"
        self.write_bytes(manifest_path(m.host, m.run_id), body.encode())

    def put_json(self, rel: str, obj: object) -> None:
        """A derived document under the root (e.g. backtest results), written whole."""
        self.write_bytes(rel, json.dumps(obj, indent=1, sort_keys=True).encode())

    # -- reading ---------------------------------------------------------------------------

    def get_json(self, rel: str) -> object | None:
        """A derived document written by `put_json`, or None when there is none yet."""
        if not self.exists(self.full(rel)):
            return None
        return json.loads(self.read_bytes(rel).decode())

    def manifests(self, host: str | None = None) -> list[Manifest]:
        """Every complete run's manifest (of one host) in the order the controller stored them (runs
        stored before that was recorded first, by run id). A host's own started_at never decides
        which run is latest."""
        self._check_old_layout()
        folder = f"{MANIFESTS}/host={check_name('host', host)}" if host else MANIFESTS
        good, _ = self._manifests_under(folder)
        return sorted(good.values(), key=lambda m: (m.ingested_at or "", m.run_id))

    def _manifests_under(self, folder: str) -> tuple[dict[str, Manifest], dict[str, str]]:
        """(path -> manifest, path -> why unusable) of every .json file below `folder`. One bad
        manifest costs its own run only: readers skip it (logged), `reindex` sets it aside."""
        good, bad = {}, {}
        for i in self.files_under(folder):
            if not i.base_name.endswith(".json"):
                continue
            rel = i.path[len(self.base) + 1:]
            try:
                good[rel] = parse_manifest(rel, self.read_bytes(rel, MAX_MANIFEST))
            except StoreError as e:
                bad[rel] = str(e)
                log.warning("%s; skipped (`kdbench store reindex` sets it aside and rebuilds the run's manifest)", e)
        return good, bad

    def runs(self, host: str | None = None) -> list[RunInfo]:
        """Complete (manifested) runs in the order they were stored (see `manifests`), optionally of one host."""
        return [m.info() for m in self.manifests(host)]

    def manifest(self, host: str, run_id: str) -> Manifest:
        check_name("host", host), check_name("run id", run_id)
        rel = manifest_path(host, run_id)
        if not self.exists(self.full(rel)):
            self._check_old_layout()
            raise StoreError(f"no run {run_id} of host {host} in the store")
        return parse_manifest(rel, self.read_bytes(rel, MAX_MANIFEST))

    def run(self, host: str, run_id: str) -> RunInfo:
        """One run's summary; StoreError when the store has no complete run of that id."""
        return self.manifest(host, run_id).info()

    def load(self, host: str, run_id: str) -> dict[str, pa.Table]:
        return {t: self._read_part(f) for t, f in self.manifest(host, run_id).files.items()}

    def reference(self, name: str) -> dict[str, pa.Table]:
        """A committed reference dataset (artifacts/reference/<name>/), validated like any run."""
        check_name("reference", name)
        tables = {t: self.read_arrow(f"reference/{name}/{t}.arrow") for t in TABLES
                  if self.exists(self.full("reference", name, f"{t}.arrow"))}
        if "runs" not in tables:
            raise StoreError(f"reference dataset {name!r} is missing: expected artifacts/reference/{name}/runs.arrow "
                             f"(record it with `python -m engine.bench` on the {name} host)")
        return tables

    def references(self) -> list[str]:
        sel = pafs.FileSelector(self.full("reference"), allow_not_found=True)
        return sorted(i.base_name for i in self.fs.get_file_info(sel)
                      if i.type == pafs.FileType.Directory and self.exists(f"{i.path}/runs.arrow"))

    def dataset(self, table: str) -> ds.Dataset:
        """One table across all complete runs, with `host` and `run` as the Hive partition folders name them.

        Only files a manifest names are read, each as `load` reads it (size-bounded, digest-checked,
        validated): a run still being ingested, or one whose ingest was cut short, never shows up here
        (a raw glob over <table>/ may see it).
        """
        import pyarrow.dataset as ds   # pulls in pandas: loaded by the one method that needs it
        if table not in TABLES:
            raise StoreError(f"unknown table {table!r}; tables are {', '.join(TABLES)}")
        schema = _dataset_schema(table)
        parts = []
        for m in sorted(self.manifests(), key=lambda m: m.files[table].path if table in m.files else ""):
            if table in m.files:
                t = self._read_part(m.files[table])
                keys = {"host": m.host, "run": m.run_id}
                cols = [t.column(f.name) if f.name in t.schema.names else pa.array([keys[f.name]] * t.num_rows, f.type)
                        for f in schema]
                parts.append(pa.Table.from_arrays(cols, schema=schema))
        return ds.dataset(parts, schema=schema)

    # -- derived state ---------------------------------------------------------------------

    def reindex(self) -> Reindexed:
        """Rebuild every manifest from the run folders: the summary and sha256s come from the files,
        the time it was stored from the old manifest, else from the runs table's modification time.

        A run whose runs table is there has all its files (ingest writes that table last), so it is
        (re)indexed; partitions without one are orphans of an ingest that never finished and are
        only reported, like runs whose files do not validate. A manifest that cannot be used (not
        parseable, naming another run or files outside its run's partitions) is set aside under
        quarantine/_manifests/ with a `.reason`, and rebuilt from the run's files when they are there.

        Manifests are listed before the table folders: a manifest is written after all its run's
        files, so an ingest landing between the two listings has its files seen too. A manifest is
        removed only when, checked again just before, none of its run's files exist. Nothing under
        a table folder is ever deleted.
        """
        self._check_old_layout()
        good, bad = self._manifests_under(MANIFESTS)
        report = Reindexed()
        for rel, why in sorted(bad.items()):
            self._set_aside_manifest(rel, why)
            report.set_aside[rel] = why
        existing = {(m.host, m.run_id): m for m in good.values()}
        found: dict[tuple[str, str], dict[str, str]] = {}
        stored: dict[tuple[str, str], str] = {}  # when each runs table was written (just before its manifest)
        for table in TABLES:
            for i in self.files_under(table):
                key = hive_key(i.path)
                if key and i.base_name == PART:
                    found.setdefault(key, {})[table] = i.path[len(self.base) + 1:]
                    if table == "runs" and i.mtime is not None:
                        stored[key] = i.mtime.astimezone(timezone.utc).isoformat(timespec="microseconds")
        for key in sorted(set(existing) - set(found)):
            if not any(self.exists(self.full(part_path(t, *key))) for t in TABLES):
                self.fs.delete_file(self.full(manifest_path(*key)))
                report.removed.append("/".join(key))
        for (host, run_id), parts in sorted(found.items()):
            label = f"{host}/{run_id}"
            if "runs" not in parts:
                report.orphans.append(label)
                continue
            try:
                check_name("host", host), check_name("run id", run_id)
                datas = {t: self.read_bytes(rel, MAX_FILE_BYTES) for t, rel in parts.items()}
                tables = {t: _parse_part(rel, datas[t]) for t, rel in parts.items()}
                check_run_tables(host, run_id, tables)
                info = run_info(host, run_id, tables)
            except (SchemaError, StoreError) as e:
                report.bad[label] = str(e)
                continue
            old = existing.get((host, run_id)) or self._landed(host, run_id)
            files = {t: StoredFile(path=parts[t], sha256=hashlib.sha256(datas[t]).hexdigest(),
                                   rows=tables[t].num_rows) for t in sorted(parts)}
            info.ingested_at = old.ingested_at if old else stored.get((host, run_id))
            new = Manifest(**info.model_dump(), files=files, migrated_from=old.migrated_from if old else {})
            if old == new:
                report.unchanged.append(label)
            else:
                self._write_manifest(new)
                report.written.append(label)
        return report

    def _landed(self, host: str, run_id: str) -> Manifest | None:
        """The manifest an ingest wrote after reindex listed the manifests, if one did (its time is kept)."""
        try:
            return self.manifest(host, run_id)
        except StoreError:
            return None

    def _set_aside_manifest(self, rel: str, why: str) -> None:
        """Move an unusable manifest out of _manifests/ (readers then stop tripping on it), its reason beside it."""
        dest = f"{SET_ASIDE}/{rel[len(MANIFESTS) + 1:]}"
        self.write_bytes(f"{dest}.reason", (why + "\n").encode())
        self.fs.create_dir(self.full(dest.rsplit("/", 1)[0]), recursive=True)
        self.fs.move(self.full(rel), self.full(dest))


def _parse_part(rel: str, data: bytes, rows: int | None = None) -> pa.Table:
    """One Parquet part, its footer checked before anything is decoded: at most MAX_ROWS rows (and the
    `rows` its manifest recorded), at most MAX_FILE_BYTES decoded, so a small file cannot claim
    gigabytes; then every offset and the contract."""
    try:
        pf = pq.ParquetFile(pa.BufferReader(data))
        meta = pf.metadata
        decoded = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
        if meta.num_rows > MAX_ROWS or (rows is not None and meta.num_rows != rows):
            want = f"its manifest's {rows}" if rows is not None and meta.num_rows <= MAX_ROWS else f"the {MAX_ROWS}-row bound"
            raise SchemaError(f"{rel}: its footer says {meta.num_rows} rows, not {want}; not decoded")
        if meta.num_columns > max(len(schema) for schema in SCHEMAS.values()):
            raise SchemaError(f"{rel}: its footer says {meta.num_columns} columns, more than any table has; not decoded")
        if decoded > MAX_FILE_BYTES:
            raise SchemaError(f"{rel}: its footer says {decoded} bytes decoded, over the {MAX_FILE_BYTES}-byte "
                              "bound; not decoded")
        table = pf.read()
        table.validate(full=True)
    except (pa.ArrowInvalid, OSError) as e:
        raise SchemaError(f"{rel}: not a readable Parquet file ({str(e)[:200]})") from None
    return validate(table, rel)


def _dataset_schema(table: str) -> pa.Schema:
    schema = SCHEMAS[table]
    extra = [pa.field(k, pa.string()) for k in ("host", "run") if k not in schema.names]
    return pa.schema(list(schema) + extra)
