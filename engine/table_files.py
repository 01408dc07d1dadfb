"""Result files: a table built from rows, written as one Arrow IPC file beside its manifest, read back checked.

A file carries its table's name, the schema version and the run's provenance in its metadata
(engine.schema); every read goes through engine.table_checks.validate, so no caller sees a table
that does not hold to the contract.
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

import pyarrow as pa
import pyarrow.ipc as ipc

from engine.files import atomic_write_bytes, sha256_file
from engine.ipcfooter import IpcRefused, refuse_compressed
from engine.schema import SCHEMAS, SCHEMA_VERSION, SchemaError, column_defaults
from engine.table_checks import validate

MANIFEST = "manifest.json"
# A result file is read whole into memory (never memory-mapped: a file truncated under a map
# raises SIGBUS), so it must fit; a sweep's largest table is a few MB.
MAX_FILE_BYTES = 256 << 20


def to_table(name: str, rows: Iterable[Any], provenance: Any) -> pa.Table:
    """Build a table of `name` from rows: engine.rows' typed rows, or dicts (a column a dict leaves out
    takes its `defaults` value, null where it has none). `provenance`: an engine.rows.Provenance (a key
    it leaves None is not written) or a dict."""
    schema = SCHEMAS[name]
    rows = [asdict(r) if is_dataclass(r) else r for r in rows]
    unknown = {k for r in rows for k in r} - set(schema.names)
    if unknown:
        raise SchemaError(f"{name}: unknown columns {sorted(unknown)}")
    defaults = column_defaults(name)
    cols = {f.name: [r.get(f.name, defaults.get(f.name)) for r in rows] for f in schema}
    meta = {"kdbench.schema_version": SCHEMA_VERSION, "kdbench.table": name,
            "kdbench.provenance": json.dumps(_provenance_keys(provenance), sort_keys=True)}
    return pa.Table.from_pydict(cols, schema=schema.with_metadata(meta))


def _provenance_keys(provenance: Any) -> dict[str, Any]:
    if is_dataclass(provenance) and not isinstance(provenance, type):
        return {k: v for k, v in asdict(provenance).items() if v is not None}
    return dict(provenance)


def table_bytes(table: pa.Table) -> bytes:
    """One Arrow IPC file (uncompressed, as `parse_table` accepts) holding `table`."""
    sink = pa.BufferOutputStream()
    with ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def write_table(out_dir: Path, table: pa.Table) -> Path:
    """Write `table` as `<name>.arrow` atomically and refresh the manifest, so a reader never sees half a file."""
    name = table.schema.metadata[b"kdbench.table"].decode()
    path = Path(out_dir) / f"{name}.arrow"
    atomic_write_bytes(path, table_bytes(table))
    write_manifest(Path(out_dir))
    return path


def manifest_bytes(files: Mapping[str, str]) -> bytes:
    """The manifest.json of a result folder: {file name: sha256}."""
    return json.dumps({"schema_version": SCHEMA_VERSION, "files": dict(files)}, indent=1, sort_keys=True).encode()


def write_manifest(out_dir: Path) -> None:
    atomic_write_bytes(out_dir / MANIFEST, manifest_bytes({p.name: sha256_file(p) for p in sorted(out_dir.glob("*.arrow"))}))


def read_table(path: Path) -> pa.Table:
    """Open and fully check one result file; raises SchemaError naming the file and what is wrong."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise SchemaError(f"{path.name}: {size} bytes, over the {MAX_FILE_BYTES}-byte limit")
        data = path.read_bytes()
    except OSError as e:
        raise SchemaError(f"{path.name}: not a readable Arrow IPC file (OSError: {str(e)[:200]})") from None
    return parse_table(data, path.name)


def parse_table(data: bytes, label: str) -> pa.Table:
    """Fully check one result file's bytes (a local file or a store object); SchemaError names `label`.

    Every record batch is checked to be uncompressed before pyarrow decodes anything (a compressed
    body says its own unpacked size, so a small file could claim gigabytes); then `validate` checks
    every offset and the contract."""
    if len(data) > MAX_FILE_BYTES:
        raise SchemaError(f"{label}: {len(data)} bytes, over the {MAX_FILE_BYTES}-byte limit")
    try:
        refuse_compressed(data)
        table = ipc.open_file(pa.BufferReader(data)).read_all()
    except IpcRefused as e:
        raise SchemaError(f"{label}: {e}") from None
    except (pa.ArrowException, ValueError, struct.error) as e:
        why = f"{type(e).__name__}: {str(e)[:200]}"
        raise SchemaError(f"{label}: not a readable Arrow IPC file ({why})") from None
    return validate(table, label)


def provenance(table: pa.Table) -> dict[str, Any]:
    return json.loads(table.schema.metadata[b"kdbench.provenance"])
