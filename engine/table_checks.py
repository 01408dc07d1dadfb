"""Holding a result table to the contract (engine.schema): its layout, every value, a run's agreement.

Everything a host sends is untrusted: `validate` checks a table's buffers, metadata and columns
(bringing an older version's table up to date), `check_values` every value against the bounds and
states, `check_run_tables` what a run's tables must agree on before they are stored; each raises
SchemaError naming the file, and the row and column where there is one. `loads_untrusted` reads a
host's JSON without ever raising.
"""

from __future__ import annotations

import json
import math
from typing import Any, Mapping

import pyarrow as pa
import pyarrow.compute as pc

from engine.schema import (BOUNDS, MAX_ROWS, MAX_TEXT, READABLE_VERSIONS, SCHEMAS, SCHEMA_VERSION, SOURCES, STATES,
                           SchemaError, column_defaults)

MAX_PROVENANCE_BYTES = 256 << 10


def loads_untrusted(text: str) -> Any:
    """JSON a host sent, or None where it is not JSON (or nested deep enough to exhaust the stack):
    callers check the shape they need, so a bad answer costs a message, never a crash."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _text(meta: dict[bytes, bytes], key: bytes, label: str) -> str:
    try:
        return meta.get(key, b"").decode("utf-8")
    except UnicodeDecodeError:
        raise SchemaError(f"{label}: metadata {key.decode()!r} is not UTF-8") from None


def _upgrade(table: pa.Table, name: str) -> pa.Table:
    """An older table with the columns added since at the value its version means by their absence."""
    added = column_defaults(name)
    for f in SCHEMAS[name]:
        if f.name in added and f.name not in table.schema.names:
            table = table.append_column(f, pa.array([added[f.name]] * table.num_rows, f.type))
    order = [n for n in SCHEMAS[name].names if n in table.schema.names]
    return table.select(order + [n for n in table.schema.names if n not in order])


def validate(table: pa.Table, label: str) -> pa.Table:
    """Check a table against the contract, every offset and buffer first (a bad string offset would
    otherwise be read past its data by whoever touches the column next)."""
    try:
        table.validate(full=True)
    except pa.ArrowException as e:
        raise SchemaError(f"{label}: invalid Arrow data ({str(e)[:200]})") from None
    names = table.schema.names
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise SchemaError(f"{label}: duplicate column(s) {dup}")
    meta = table.schema.metadata or {}
    version = _text(meta, b"kdbench.schema_version", label)
    if version not in READABLE_VERSIONS:
        raise SchemaError(f"{label}: schema version {version or 'missing'!r}, expected one of {READABLE_VERSIONS}")
    name = _text(meta, b"kdbench.table", label)
    if name not in SCHEMAS:
        raise SchemaError(f"{label}: unknown table {name!r}")
    raw = meta.get(b"kdbench.provenance")
    if raw is None:
        raise SchemaError(f"{label}: no provenance in the metadata")
    if len(raw) > MAX_PROVENANCE_BYTES:
        raise SchemaError(f"{label}: provenance of {len(raw)} bytes, over {MAX_PROVENANCE_BYTES}")
    prov = loads_untrusted(_text(meta, b"kdbench.provenance", label))
    if prov is None:
        raise SchemaError(f"{label}: provenance is not JSON")
    if not isinstance(prov, dict) or not isinstance(prov.get("run_id"), str):
        raise SchemaError(f"{label}: provenance is not an object with a run_id")
    if version != SCHEMA_VERSION:
        table = _upgrade(table, name)
        names = table.schema.names
    want = SCHEMAS[name]
    unknown = [n for n in names if n not in want.names]
    if unknown:  # a reader of the table (the README's one-line reads included) would take them for ours
        raise SchemaError(f"{label}: unknown column(s) {[n[:40] for n in unknown[:5]]}, not in the {name} table")
    for f in want:
        if f.name not in names:
            raise SchemaError(f"{label}: missing column {f.name!r}")
        got = table.schema.field(f.name).type
        if got != f.type:
            raise SchemaError(f"{label}: column {f.name!r} is {got}, expected {f.type}")
        if not f.nullable and table.column(f.name).null_count:
            raise SchemaError(f"{label}: column {f.name!r} has nulls")
    bad = set(table.column("source").to_pylist()) - set(SOURCES)
    if bad:
        raise SchemaError(f"{label}: column 'source' has {sorted(bad)[:5]}, expected one of {SOURCES}")
    return table


def _first(mask: pa.ChunkedArray | pa.Array) -> int | None:
    """Index of the first true value of a boolean column (nulls count as false), or None."""
    i = pc.index(pc.fill_null(mask, False), True).as_py()
    return None if i < 0 else i


def _shown(x: float) -> str:
    return str(int(x)) if math.isfinite(x) and x == int(x) and abs(x) < 1e15 else f"{x:g}"


def check_values(table: pa.Table, label: str) -> None:
    """Every value within what a real run can write: at most MAX_ROWS rows, numbers finite and within
    BOUNDS, states one of STATES, strings of at most MAX_TEXT characters. SchemaError names the first
    bad row (counted from 1) and its column."""
    name = table.schema.metadata[b"kdbench.table"].decode()
    if table.num_rows > MAX_ROWS:
        raise SchemaError(f"{label}: {table.num_rows} rows, over the {MAX_ROWS}-row bound (no full sweep writes that many)")
    bounds, states = BOUNDS.get(name, {}), STATES.get(name, {})
    for f in table.schema:
        col = table.column(f.name)
        if pa.types.is_floating(f.type) or pa.types.is_integer(f.type):
            low, high = bounds.get(f.name, (-math.inf, math.inf))
            bad = pc.or_(pc.less(col, low), pc.greater(col, high))
            why = f"must be within {_shown(low)}..{_shown(high)}"
            if pa.types.is_floating(f.type):
                bad, why = pc.or_(bad, pc.invert(pc.is_finite(col))), f"must be finite and within {_shown(low)}..{_shown(high)}"
        elif f.name in states:
            bad, why = pc.invert(pc.is_in(col, pa.array(states[f.name]))), f"must be one of {states[f.name]}"
        elif pa.types.is_string(f.type):
            bad, why = pc.greater(pc.utf8_length(col), MAX_TEXT), f"longer than {MAX_TEXT} characters"
        else:
            continue
        i = _first(bad)
        if i is not None:
            value = col[i].as_py()
            shown = f"{len(value)} characters" if isinstance(value, str) and len(value) > 40 else repr(value)
            raise SchemaError(f"{label} row {i + 1}, column {f.name!r}: {shown} {why}")


def check_run_tables(host: str, run_id: str, tables: Mapping[str, pa.Table],
                     sources: tuple[str, ...] = SOURCES) -> None:
    """What a run's tables must agree on before they are stored: each holds the table its name says,
    every value is one a run can write (`check_values`), every row belongs to `run_id` with a source in
    `sources`, and runs.arrow (when given) has rows, one source, and names `host`. Pull (per file,
    sources=measured) and ingest use this one check."""
    for name, table in tables.items():
        label = f"{name}.arrow"
        validate(table, label)
        if table.schema.metadata[b"kdbench.table"].decode() != name:
            raise SchemaError(f"{label}: holds table {table.schema.metadata[b'kdbench.table'].decode()!r}, "
                              "not what its name says")
        check_values(table, label)
        ids = set(table.column("run_id").to_pylist())
        if ids - {run_id}:
            raise SchemaError(f"{label}: run_id {sorted(ids - {run_id})[:3]}, expected {run_id!r}")
        bad = set(table.column("source").to_pylist()) - set(sources)
        if bad:
            raise SchemaError(f"{label}: rows with source {sorted(bad)}; only {', '.join(sources)} accepted here")
        if name == "runs":
            if not table.num_rows:
                raise SchemaError(f"{label}: no rows")
            if len(set(table.column("source").to_pylist())) != 1:
                raise SchemaError(f"{label}: mixed sources {sorted(set(table.column('source').to_pylist()))}")
            hosts = set(table.column("host").to_pylist())
            if hosts - {host}:
                raise SchemaError(f"{label}: names host {sorted(hosts - {host})[:3]}, expected {host!r}")
            if "projected" not in sources and "whatif" in table.column("suite").to_pylist():
                raise SchemaError(f"{label}: suite 'whatif' is the controller's own answers, never a measured run's")


