"""The artifacts store: validated Arrow runs, one Hive partition per host and run, plus a run index.

Layout under the root (a local path or any pyarrow filesystem URI such as s3://bucket/prefix):

    runs/host=<host>/run=<run_id>/<table>.arrow     one file per result table of that run
    runs/host=<host>/run=<run_id>/_manifest.json    sha256 per file ("_": dataset discovery skips it)
    runs/_index.jsonl                               one line per run, sorted ("_" for the same reason)
    backtest/backtest.json                          the latest backtest results (flows.backtest)
    reference/<name>/<table>.arrow                  committed reference datasets

The partition key is `run`, not `run_id`, because every table already carries a `run_id` column;
`host` is only a column in the runs table, where ingest checks it equals the partition value.
Nothing is accepted without passing engine.schema.read_table, so a reader never meets a bad file.

On an object store (s3://) each file is written by one PUT, which S3 makes atomic: a reader sees the
whole old or the whole new object. There is no lock there, so the index update is a plain
read-modify-write: two controllers ingesting at the same moment can lose one index line. That run's
files stay under runs/ (dataset() still finds them) and ingesting it again restores the line.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.ipc as ipc
from filelock import FileLock
from pydantic import BaseModel

from engine.schema import SCHEMAS, TABLES, SchemaError, check_run_tables, read_table, validate

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
INDEX = "runs/_index.jsonl"
MANIFEST = "_manifest.json"


class StoreError(Exception):
    """A store operation that cannot proceed; the message names the host, run or file."""


class RunInfo(BaseModel):
    host: str
    run_id: str
    source: str                      # measured | projected
    status: str                      # complete | partial
    started_at: str | None = None   # the host's clock: shown, never used to order runs
    ingested_at: str | None = None  # the controller's clock when stored: what orders runs
    suites: list[str] = []
    reference_run_id: str | None = None


def default_root() -> str:
    return str(Path(__file__).resolve().parent.parent / "artifacts")


def check_name(kind: str, value: str) -> str:
    """Host names and run ids become path segments: refuse anything that could escape the tree."""
    if not _NAME.match(value or "") or value in (".", ".."):
        raise StoreError(f"invalid {kind} {value!r}: use letters, digits, '.', '_' and '-'")
    return value


def run_info(host: str, run_id: str, tables: dict[str, pa.Table]) -> RunInfo:
    """Summarise a run from its runs table (checked by check_run_tables): complete only when every
    suite finished or was skipped."""
    rows = tables["runs"].to_pylist()
    sources = {r["source"] for r in rows}
    done = all(r["status"] in ("complete", "skipped") for r in rows)
    started = sorted(r["started_at"] for r in rows if r["started_at"])
    refs = {r for t in tables.values() if "reference_run_id" in t.schema.names
            for r in t.column("reference_run_id").to_pylist() if r}
    return RunInfo(host=host, run_id=run_id, source=sources.pop(),
                   status="complete" if done else "partial",
                   started_at=started[0] if started else None,
                   suites=sorted({r["suite"] for r in rows}),
                   reference_run_id=min(refs) if refs else None)


def table_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


class Store:
    """Results on any pyarrow filesystem; local roots get a file lock around index updates (none on S3)."""

    def __init__(self, root: str | None = None):
        root = root or default_root()
        if "://" in root:
            self.fs, base = pafs.FileSystem.from_uri(root)
        else:
            self.fs, base = pafs.LocalFileSystem(), str(Path(root).resolve())
        self.base = base.rstrip("/")
        self.local = isinstance(self.fs, pafs.LocalFileSystem)

    def _p(self, *parts: str) -> str:
        return "/".join([self.base, *parts])

    def _exists(self, path: str) -> bool:
        return self.fs.get_file_info(path).type != pafs.FileType.NotFound

    def _write(self, path: str, data: bytes) -> None:
        """Write whole files through a temporary name where the filesystem can rename atomically."""
        self.fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
        if self.local:
            tmp = f"{path}.tmp"
            with self.fs.open_output_stream(tmp) as f:
                f.write(data)
            self.fs.move(tmp, path)
        else:
            with self.fs.open_output_stream(path) as f:
                f.write(data)

    def _read_arrow(self, path: str) -> pa.Table:
        with self.fs.open_input_file(path) as f:
            try:
                table = ipc.open_file(f).read_all()
            except (pa.ArrowInvalid, OSError) as e:
                raise SchemaError(f"{path.rsplit('/', 1)[-1]}: not a readable Arrow IPC file ({e})") from None
        return validate(table, path[len(self.base) + 1:])

    def _lock(self) -> FileLock | _NoLock:
        if not self.local:
            return _NoLock()
        Path(self._p("runs")).mkdir(parents=True, exist_ok=True)
        return FileLock(self._p("runs", ".index.lock"))

    # -- writing ---------------------------------------------------------------------------

    def ingest(self, host: str, run_id: str, src_dir: Path) -> Path:
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
        self.put_tables(host, run_id, tables)
        return Path(self._p("runs", f"host={host}", f"run={run_id}"))

    def put_tables(self, host: str, run_id: str, tables: dict[str, pa.Table]) -> None:
        """Store one run's tables (measured or projected) and record it in the index."""
        check_name("host", host), check_name("run id", run_id)
        if "runs" not in tables:
            raise StoreError(f"run {run_id} of {host}: no runs.arrow")
        try:
            check_run_tables(host, run_id, tables)
        except SchemaError as e:
            raise StoreError(f"run {run_id} of {host}: {e}") from None
        info = run_info(host, run_id, tables)
        info.ingested_at = datetime.now(timezone.utc).isoformat(timespec="microseconds")
        leaf = self._p("runs", f"host={host}", f"run={run_id}")
        sums = {}
        for name in sorted(tables):
            data = table_bytes(tables[name])
            self._write(f"{leaf}/{name}.arrow", data)
            sums[f"{name}.arrow"] = hashlib.sha256(data).hexdigest()
        self._write(f"{leaf}/{MANIFEST}", json.dumps({"files": sums}, indent=1, sort_keys=True).encode())
        with self._lock():
            index = {(r.host, r.run_id): r for r in self._read_index()}
            index[(host, run_id)] = info
            body = "".join(json.dumps(r.model_dump(), sort_keys=True) + "\n"
                           for _, r in sorted(index.items()))
            self._write(self._p(INDEX), body.encode())

    def put_json(self, rel: str, obj: object) -> None:
        """A derived document under the root (e.g. backtest results), written whole."""
        self._write(self._p(rel), json.dumps(obj, indent=1, sort_keys=True).encode())

    # -- reading ---------------------------------------------------------------------------

    def get_json(self, rel: str) -> object | None:
        path = self._p(rel)
        if not self._exists(path):
            return None
        with self.fs.open_input_stream(path) as f:
            return json.loads(f.read().decode())

    def _read_index(self) -> list[RunInfo]:
        path = self._p(INDEX)
        if not self._exists(path):
            return []
        with self.fs.open_input_stream(path) as f:
            text = f.read().decode()
        return [RunInfo.model_validate_json(line) for line in io.StringIO(text) if line.strip()]

    def runs(self, host: str | None = None) -> list[RunInfo]:
        """Runs in the index in the order the controller stored them (runs indexed before that was
        recorded first, by run id), optionally of one host. A host's own started_at never decides
        which run is latest."""
        rows = [r for r in self._read_index() if host is None or r.host == host]
        return sorted(rows, key=lambda r: (r.ingested_at or "", r.run_id))

    def load(self, host: str, run_id: str) -> dict[str, pa.Table]:
        check_name("host", host), check_name("run id", run_id)
        leaf = self._p("runs", f"host={host}", f"run={run_id}")
        if not self._exists(leaf):
            raise StoreError(f"no run {run_id} of host {host} in the store")
        return {t: self._read_arrow(f"{leaf}/{t}.arrow") for t in TABLES
                if self._exists(f"{leaf}/{t}.arrow")}

    def reference(self, name: str) -> dict[str, pa.Table]:
        """A committed reference dataset (artifacts/reference/<name>/), validated like any run."""
        check_name("reference", name)
        leaf = self._p("reference", name)
        tables = {t: self._read_arrow(f"{leaf}/{t}.arrow") for t in TABLES
                  if self._exists(f"{leaf}/{t}.arrow")}
        if "runs" not in tables:
            raise StoreError(f"reference dataset {name!r} is missing: expected artifacts/reference/{name}/runs.arrow "
                             f"(record it with `python -m engine.bench` on the {name} host)")
        return tables

    def references(self) -> list[str]:
        sel = pafs.FileSelector(self._p("reference"), allow_not_found=True)
        return sorted(i.base_name for i in self.fs.get_file_info(sel)
                      if i.type == pafs.FileType.Directory and self._exists(f"{i.path}/runs.arrow"))

    def dataset(self, table: str) -> ds.Dataset:
        """One table across all runs, with `host` and `run` from the Hive partition directories."""
        if table not in TABLES:
            raise StoreError(f"unknown table {table!r}; tables are {', '.join(TABLES)}")
        root = self._p("runs")
        sel = pafs.FileSelector(root, recursive=True, allow_not_found=True)
        files = sorted(i.path for i in self.fs.get_file_info(sel) if i.base_name == f"{table}.arrow")
        return ds.dataset(files, schema=_dataset_schema(table), filesystem=self.fs, format="arrow",
                          partitioning=ds.partitioning(flavor="hive"), partition_base_dir=root)


def _dataset_schema(table: str) -> pa.Schema:
    schema = SCHEMAS[table]
    extra = [pa.field(k, pa.string()) for k in ("host", "run") if k not in schema.names]
    return pa.schema(list(schema) + extra)


class _NoLock:
    def __enter__(self) -> None: ...
    def __exit__(self, *exc: object) -> None: ...
