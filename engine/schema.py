"""Arrow schemas of the result tables: the contract between the host payload and the controller.

Every table is written by `engine.bench` on a GPU host, checked by the controller when pulled,
and extended (never redefined) by the projection, which fills the nullable projection columns and
sets `source` to "projected". The schema version travels in each file's metadata, so a reader can
refuse files it does not understand instead of misreading them.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

import pyarrow as pa
import pyarrow.ipc as ipc

SCHEMA_VERSION = "2"
TABLES = ("runs", "kernels", "e2e", "comm")
SOURCES = ("measured", "projected")
MANIFEST = "manifest.json"

_f = pa.field
_s, _i, _d = pa.string(), pa.int64(), pa.float64()

# Provenance: the same keys in the runs table and in every file's metadata.
PROVENANCE_KEYS = (
    "run_id", "host", "gpu_name", "gpu_count", "driver", "cuda", "torch", "triton",
    "python", "payload_hash", "arch", "device", "started_at", "ended_at",
)

SCHEMAS: dict[str, pa.Schema] = {
    "runs": pa.schema([
        _f("run_id", _s, False), _f("host", _s, False), _f("suite", _s, False),
        _f("profile", _s, False), _f("status", _s, False),  # complete | partial | skipped
        _f("gpu_name", _s), _f("gpu_count", _i), _f("driver", _s), _f("cuda", _s),
        _f("torch", _s), _f("triton", _s), _f("python", _s), _f("payload_hash", _s),
        _f("arch", _s), _f("device", _s),  # device: cuda | cpu
        _f("started_at", _s), _f("ended_at", _s),
        _f("copy_gbps", _d), _f("matmul_tflops", _d),  # this device's own ceilings
        _f("points", _i), _f("note", _s), _f("source", _s, False),
    ]),
    "kernels": pa.schema([
        _f("run_id", _s, False), _f("kernel", _s, False), _f("impl", _s, False),
        _f("dtype", _s, False), _f("device", _s, False),
        _f("M", _i), _f("N", _i), _f("K", _i), _f("E", _i), _f("top_k", _i),
        _f("tp", _i),  # MoE rows: 1 for full shapes, N for one rank's TP-N shard shapes
        _f("unique_experts", _i), _f("expected_experts", _d),
        _f("budget", _i), _f("context", _i), _f("batch", _i),
        _f("time_us_p10", _d), _f("time_us_p50", _d, False), _f("time_us_p90", _d),
        _f("repeats", _i), _f("bytes", _d, False), _f("flops", _d, False),
        _f("achieved_gbps", _d), _f("achieved_tflops", _d),
        _f("source", _s, False),
        # projection only (null when measured)
        _f("reference_run_id", _s), _f("regime", _s), _f("reference_regime", _s),
        _f("time_us_low", _d), _f("time_us_high", _d),
    ]),
    "e2e": pa.schema([
        _f("run_id", _s, False), _f("config", _s, False), _f("layers", _i),
        _f("device", _s, False), _f("concurrency", _i, False), _f("budget", _i, False),
        _f("synthetic_accept", _d),  # the drafter's steering level: acceptance is synthetic
        _f("accept_len_mean", _d), _f("tokens_per_s", _d), _f("steps", _i),
        _f("step_ms_p50", _d), _f("step_ms_p99", _d), _f("ttft_ms", _d),
        _f("itl_ms_p50", _d), _f("itl_ms_p99", _d),
        # the step split; comm_ms is zero on one GPU and filled by the projection for n GPUs
        _f("draft_ms", _d), _f("tree_build_ms", _d), _f("verify_ms", _d),
        _f("accept_ms", _d), _f("other_ms", _d), _f("comm_ms", _d),
        # per step, from a profiled decode of the same point (CUDA only): GPU busy, and the rest
        _f("kernel_ms", _d), _f("outside_ms", _d),
        _f("source", _s, False),
        _f("reference_run_id", _s), _f("tokens_per_s_low", _d), _f("tokens_per_s_high", _d),
    ]),
    "comm": pa.schema([
        _f("run_id", _s, False), _f("op", _s, False), _f("world_size", _i, False),
        _f("bytes", _i, False), _f("time_us_p50", _d), _f("algbw_gbps", _d),
        _f("busbw_gbps", _d), _f("status", _s, False),  # ok | skipped
        _f("skip_reason", _s), _f("source", _s, False),
    ]),
}


class SchemaError(ValueError):
    """A result file that does not match the contract; the message names the file and field."""


def to_table(name: str, rows: Iterable[Mapping[str, Any]], provenance: Mapping[str, Any]) -> pa.Table:
    """Build a table of `name` from row dicts (missing nullable columns become null)."""
    schema = SCHEMAS[name]
    unknown = {k for r in rows for k in r} - set(schema.names)
    if unknown:
        raise SchemaError(f"{name}: unknown columns {sorted(unknown)}")
    rows = list(rows)
    cols = {f.name: [r.get(f.name) for r in rows] for f in schema}
    meta = {"kdbench.schema_version": SCHEMA_VERSION, "kdbench.table": name,
            "kdbench.provenance": json.dumps(dict(provenance), sort_keys=True)}
    return pa.Table.from_pydict(cols, schema=schema.with_metadata(meta))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary sibling, then rename: a reader sees the old file or the new one, never half."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_table(out_dir: Path, table: pa.Table) -> Path:
    """Write `table` as `<name>.arrow` atomically and refresh the manifest, so a reader never sees half a file."""
    name = table.schema.metadata[b"kdbench.table"].decode()
    path = Path(out_dir) / f"{name}.arrow"
    sink = pa.BufferOutputStream()
    with ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    atomic_write_bytes(path, sink.getvalue().to_pybytes())
    write_manifest(Path(out_dir))
    return path


def write_manifest(out_dir: Path) -> None:
    files = {p.name: sha256_file(p) for p in sorted(out_dir.glob("*.arrow"))}
    body = json.dumps({"schema_version": SCHEMA_VERSION, "files": files}, indent=1, sort_keys=True)
    atomic_write_bytes(out_dir / MANIFEST, body.encode())


def read_table(path: Path) -> pa.Table:
    """Open and check one result file; raises SchemaError naming the file and what is wrong."""
    path = Path(path)
    try:
        with pa.memory_map(str(path)) as src:
            table = ipc.open_file(src).read_all()
    except (pa.ArrowInvalid, OSError) as e:
        raise SchemaError(f"{path.name}: not a readable Arrow IPC file ({e})") from None
    return validate(table, path.name)


def validate(table: pa.Table, label: str) -> pa.Table:
    meta = table.schema.metadata or {}
    version = meta.get(b"kdbench.schema_version", b"").decode()
    if version != SCHEMA_VERSION:
        raise SchemaError(f"{label}: schema version {version or 'missing'!r}, expected {SCHEMA_VERSION!r}")
    name = meta.get(b"kdbench.table", b"").decode()
    if name not in SCHEMAS:
        raise SchemaError(f"{label}: unknown table {name!r}")
    want = SCHEMAS[name]
    for f in want:
        if f.name not in table.schema.names:
            raise SchemaError(f"{label}: missing column {f.name!r}")
        got = table.schema.field(f.name).type
        if got != f.type:
            raise SchemaError(f"{label}: column {f.name!r} is {got}, expected {f.type}")
        if not f.nullable and table.column(f.name).null_count:
            raise SchemaError(f"{label}: column {f.name!r} has nulls")
    bad = set(table.column("source").to_pylist()) - set(SOURCES)
    if bad:
        raise SchemaError(f"{label}: column 'source' has {sorted(bad)}, expected one of {SOURCES}")
    return table


def provenance(table: pa.Table) -> dict[str, Any]:
    return json.loads(table.schema.metadata[b"kdbench.provenance"])
