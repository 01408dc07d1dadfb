"""Where a run's files live in the store and what its manifest says: names, paths, the manifest model.

See flows.store.store for the layout as a whole; this module is its vocabulary (paths, Hive keys, the
manifest and run summary models, Parquet bytes), shared by the store and its layout migration.
"""

from __future__ import annotations

import re
from enum import StrEnum

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ValidationError

from engine.rows import COLUMNS, table_rows
from engine.schema import MAX_ROWS, TABLES
from flows import REPO

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
MANIFESTS = "_manifests"
PART = "part-0.parquet"
LAYOUT = 2  # 1: runs/host=<h>/run=<id>/<table>.arrow with runs/_index.jsonl (flows.store.migrate reads it)
OLD_INDEX = "runs/_index.jsonl"
SET_ASIDE = "quarantine/_manifests"
MAX_MANIFEST = 1 << 20


class StoreError(Exception):
    """A store operation that cannot proceed; the message names the host, run or file."""


class RunStatus(StrEnum):
    """A stored run: complete when every suite finished or was skipped, else partial (manifests hold the value)."""

    COMPLETE = "complete"
    PARTIAL = "partial"


class RunInfo(BaseModel):
    host: str
    run_id: str
    source: str                      # measured | projected
    status: RunStatus
    started_at: str | None = None   # the host's clock: shown, never used to order runs
    ingested_at: str | None = None  # the controller's clock when stored: what orders runs
    suites: list[str] = []
    reference_run_id: str | None = None


class StoredFile(BaseModel):
    path: str                        # relative to the store root
    sha256: str
    rows: int


class Manifest(RunInfo):
    """What `_manifests/host=<h>/run=<id>.json` holds: the run's summary and every file it owns."""

    layout: int = LAYOUT
    files: dict[str, StoredFile]     # table -> file
    migrated_from: dict[str, str] = {}  # layout-1 file name -> its sha256, for runs moved by `store migrate`

    def info(self) -> RunInfo:
        return RunInfo.model_validate(self.model_dump(include=set(RunInfo.model_fields)))


class Reindexed(BaseModel):
    """What `Store.reindex` did; `orphans` and `bad` were left untouched for a person to look at."""

    written: list[str] = []          # host/run whose manifest was (re)written
    unchanged: list[str] = []
    removed: list[str] = []          # manifests of runs with no files left
    set_aside: dict[str, str] = {}   # manifest path -> why it could not be used (moved under quarantine/_manifests/)
    orphans: list[str] = []          # partitions without a runs table: an ingest that never finished
    bad: dict[str, str] = {}         # host/run -> why its files did not validate


def default_root() -> str:
    return str(REPO / "artifacts")


def check_name(kind: str, value: str) -> str:
    """Host names and run ids become path segments: refuse anything that could escape the tree."""
    if not _NAME.match(value or "") or value in (".", ".."):
        raise StoreError(f"invalid {kind} {value!r}: use letters, digits, '.', '_' and '-'")
    return value


def run_info(host: str, run_id: str, tables: dict[str, pa.Table]) -> RunInfo:
    """Summarise a run from its tables (checked by check_run_tables, the runs table included):
    complete only when every suite finished or was skipped."""
    rows = table_rows(tables["runs"], "runs")
    sources = {r.source for r in rows}
    done = all(r.status in ("complete", "skipped") for r in rows)
    started = sorted(r.started_at for r in rows if r.started_at)
    ref = COLUMNS.reference_run_id
    refs = {r for t in tables.values() if ref in t.schema.names for r in t.column(ref).to_pylist() if r}
    return RunInfo(host=host, run_id=run_id, source=sources.pop(),
                   status=RunStatus.COMPLETE if done else RunStatus.PARTIAL,
                   started_at=started[0] if started else None,
                   suites=sorted({r.suite for r in rows}),
                   reference_run_id=min(refs) if refs else None)


def parquet_bytes(table: pa.Table) -> bytes:
    """One Parquet file (zstd, one row group); the schema with its kdbench metadata travels inside."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue().to_pybytes()


def part_path(table: str, host: str, run_id: str) -> str:
    return f"{table}/host={host}/run={run_id}/{PART}"


def manifest_path(host: str, run_id: str) -> str:
    return f"{MANIFESTS}/host={host}/run={run_id}.json"


def parse_manifest(rel: str, data: bytes) -> Manifest:
    """A stored manifest, trusted only as far as it names its own run: its Hive key, and for each
    table that run's own partition path (never `../` or another run's file), within the row bound.
    StoreError says what is wrong."""
    try:
        m = Manifest.model_validate_json(data)
    except ValidationError as e:
        raise StoreError(f"{rel}: not a kdbench run manifest ({str(e.errors()[0]['msg'])[:200]})") from None
    if hive_key(rel) != (m.host, m.run_id):
        raise StoreError(f"{rel}: names run {m.run_id[:80]!r} of {m.host[:80]!r}, not the run its path names")
    for table, f in m.files.items():
        if table not in TABLES or f.path != part_path(table, m.host, m.run_id):
            raise StoreError(f"{rel}: table {table[:40]!r} at {f.path[:120]!r}, not the run's own partition path")
        if not 0 <= f.rows <= MAX_ROWS:
            raise StoreError(f"{rel}: table {table} of {f.rows} rows, over the {MAX_ROWS}-row bound")
    return m


def hive_key(path: str) -> tuple[str, str] | None:
    """(host, run) of a file `.../host=<h>/run=<id>/<name>` or a manifest `.../host=<h>/run=<id>.json`."""
    m = re.search(r"host=([^/]+)/run=([^/]+)/[^/]+$", path) or re.search(r"host=([^/]+)/run=([^/]+)\.json$", path)
    return (m.group(1), m.group(2)) if m else None
