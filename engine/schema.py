"""Arrow schemas of the result tables: the contract between the host payload and the controller.

Every table is written by `engine.bench` on a GPU host, checked by the controller when pulled,
and extended (never redefined) by the projection, which fills the nullable projection columns and
sets `source` to "projected". The schema version travels in each file's metadata, so a reader can
refuse files it does not understand instead of misreading them.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import asdict, is_dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Iterable, Mapping

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc

from engine.files import atomic_write_bytes, sha256_file
from engine.ipcfooter import IpcRefused, refuse_compressed

SCHEMA_VERSION = "4"
READABLE_VERSIONS = ("2", "3", "4")   # older files read with the later columns at their defaults (_ADDED)
TABLES = ("runs", "kernels", "e2e", "comm")
SOURCES = ("measured", "projected")
MANIFEST = "manifest.json"
# A result file is read whole into memory (never memory-mapped: a file truncated under a map
# raises SIGBUS), so it must fit; a sweep's largest table is a few MB.
MAX_FILE_BYTES = 256 << 20
MAX_PROVENANCE_BYTES = 256 << 10

_f = pa.field
_s, _i, _d = pa.string(), pa.int64(), pa.float64()

# Provenance: the same keys in the runs table and in every file's metadata.
PROVENANCE_KEYS = (
    "run_id", "host", "gpu_name", "gpu_count", "driver", "cuda", "torch", "triton",
    "python", "payload_hash", "arch", "device", "started_at", "ended_at",
)
# Keys the controller adds to the provenance of the files it writes: a projection's or what-if grid's
# reference (and the projection's target spec figures and assumptions, the grid's question and answers);
# an import's origin, the outside machine, date, source, implementation, notes, spec sheet and link.
ADDED_PROVENANCE_KEYS = (
    "reference_run_id", "reference_host", "references", "spec", "assumptions", "what", "answers",
    "origin", "machine", "date", "source", "impl", "notes", "interconnect",
)

SCHEMAS: dict[str, pa.Schema] = {
    "runs": pa.schema([
        _f("run_id", _s, False), _f("host", _s, False), _f("suite", _s, False),
        _f("profile", _s, False), _f("status", _s, False),  # RunStatus
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
        _f("op", _s),  # dense_gemm: which op of a step it times (engine.costs.dense_ops); null elsewhere
        _f("M", _i), _f("N", _i), _f("K", _i), _f("E", _i), _f("top_k", _i),
        _f("tp", _i),  # 1 for full shapes, N for the shapes one rank of a TP-N deployment runs
        _f("unique_experts", _i), _f("expected_experts", _d),
        _f("budget", _i), _f("context", _i), _f("batch", _i),
        _f("time_us_p10", _d), _f("time_us_p50", _d, False), _f("time_us_p90", _d),
        _f("host_us", _d),  # host time of one eager call, called back to back (null where not measured)
        _f("repeats", _i), _f("bytes", _d, False), _f("flops", _d, False),
        _f("achieved_gbps", _d), _f("achieved_tflops", _d),
        _f("source", _s, False),
        # projection only (null when measured)
        _f("reference_run_id", _s), _f("regime", _s), _f("reference_regime", _s),
        _f("time_us_low", _d), _f("time_us_high", _d),
    ]),
    "e2e": pa.schema([
        _f("run_id", _s, False), _f("config", _s, False), _f("layers", _i),
        _f("tp", _i), _f("weight_sets", _i), _f("vocab", _i),
        _f("comm_source", _s),  # CommSource: where comm_ms came from
        _f("device", _s, False), _f("concurrency", _i, False), _f("budget", _i, False),
        _f("context", _i),  # prompt tokens a sequence holds in its cache when decoding starts (mean)
        _f("synthetic_accept", _d),  # the drafter's steering level: acceptance is synthetic
        # PointStatus; a skipped point keeps its key, the reason and the device bytes it needed
        _f("status", _s, False), _f("skip_reason", _s), _f("memory_bytes", _d),
        _f("accept_len_mean", _d), _f("tokens_per_s", _d), _f("steps", _i),
        _f("step_ms_p50", _d), _f("step_ms_p99", _d), _f("ttft_ms", _d),
        _f("itl_ms_p50", _d), _f("itl_ms_p99", _d),
        # the measured step split, and comm_ms: the step's collectives (see comm_source; 0 at tp 1);
        # tokens_per_s and itl include comm_ms, step_ms_* and the stages do not
        _f("draft_ms", _d), _f("tree_build_ms", _d), _f("verify_ms", _d),
        _f("accept_ms", _d), _f("other_ms", _d), _f("comm_ms", _d),
        # per step, from a profiled decode of the same point (CUDA only): GPU busy, and the rest
        _f("kernel_ms", _d), _f("outside_ms", _d),
        # kernel_ms by family (they sum to it): routed MoE, attention, dense bf16 GEMMs of the layers,
        # the lm-head, tree build + accept, and every other kernel
        _f("moe_ms", _d), _f("attention_ms", _d), _f("dense_ms", _d), _f("lm_head_ms", _d),
        _f("tree_ms", _d), _f("gpu_other_ms", _d),
        _f("source", _s, False),
        _f("reference_run_id", _s), _f("tokens_per_s_low", _d), _f("tokens_per_s_high", _d),
    ]),
    "comm": pa.schema([
        _f("run_id", _s, False), _f("op", _s, False), _f("world_size", _i, False),
        _f("bytes", _i, False), _f("time_us_p50", _d), _f("algbw_gbps", _d),
        _f("busbw_gbps", _d), _f("status", _s, False),  # PointStatus
        _f("skip_reason", _s), _f("source", _s, False),
    ]),
}


# Bounds of one result table, from what a full sweep can write: the full profiles write under a hundred
# points per table, and the axes still growing (the MoE sweep to M = 4096, an e2e context axis) multiply
# that by a few; MAX_ROWS leaves tenfold room beyond. A table over it is refused whole, before any use.
MAX_ROWS = 5_000
MAX_TEXT = 4096        # characters of one string cell (a run's note is the longest a host writes)
_AXIS = (1, 1 << 20)   # a shape or count axis: tokens, experts, heads, batch, concurrency
_T_US = (1e-3, 1e10)   # a time in us: 1 ns to about three hours
_T_MS = (1e-6, 1e7)    # a time in ms that cannot be zero (a step, a latency, a GPU-busy total)
_PART_MS = (0.0, 1e7)  # a share of a step, which can be (comm_ms is 0 at tp 1)
_RATE = (0.0, 1e12)    # an achieved rate (GB/s, TFLOP/s, tokens/s band)
# What a number may be: every float finite, and within [low, high] where listed (a null passes: the
# nullable columns say "not measured"). Anything else is refused naming its row and column, at pull,
# at ingest and at import (`check_values`), so the notes never divide by a host's zero or NaN.
# flops may be 0 (a kernel that only moves and compares data); bytes may not (every kernel reads).
BOUNDS: dict[str, dict[str, tuple[float, float]]] = {
    "runs": {"gpu_count": (0, 1 << 12), "copy_gbps": (1e-6, 1e9), "matmul_tflops": (1e-9, 1e9),
             "points": (0, MAX_ROWS)},
    "kernels": {"M": _AXIS, "N": _AXIS, "K": _AXIS, "E": _AXIS, "top_k": _AXIS, "tp": (1, 1 << 12),
                "unique_experts": (0, 1 << 20), "expected_experts": (0, 1 << 20), "budget": (0, 1 << 20),
                "context": (0, 1 << 24), "batch": _AXIS, "time_us_p10": _T_US, "time_us_p50": _T_US,
                "time_us_p90": _T_US, "host_us": _T_US, "repeats": (1, 1 << 30), "bytes": (1.0, 1e18),
                "flops": (0.0, 1e21), "achieved_gbps": _RATE, "achieved_tflops": _RATE,
                "time_us_low": _T_US, "time_us_high": _T_US},
    "e2e": {"layers": (1, 1 << 12), "tp": (1, 1 << 12), "weight_sets": (1, 1 << 12), "vocab": (1, 1 << 24),
            "concurrency": _AXIS, "budget": (0, 1 << 20), "context": (0, 1 << 24), "synthetic_accept": (0.0, 1.0),
            "memory_bytes": (0.0, 1e18), "accept_len_mean": (0.0, 1 << 20), "tokens_per_s": (1e-9, 1e12),
            "steps": (0, 1 << 40), "step_ms_p50": _T_MS, "step_ms_p99": _T_MS, "ttft_ms": _T_MS,
            "itl_ms_p50": _T_MS, "itl_ms_p99": _T_MS, "draft_ms": _PART_MS, "tree_build_ms": _PART_MS,
            "verify_ms": _PART_MS, "accept_ms": _PART_MS, "other_ms": _PART_MS, "comm_ms": _PART_MS,
            "kernel_ms": _T_MS, "outside_ms": _PART_MS, "moe_ms": _PART_MS, "attention_ms": _PART_MS,
            "dense_ms": _PART_MS, "lm_head_ms": _PART_MS, "tree_ms": _PART_MS, "gpu_other_ms": _PART_MS,
            "tokens_per_s_low": (1e-9, 1e12), "tokens_per_s_high": (1e-9, 1e12)},
    # a skipped collective keeps world_size 0 and bytes 0 (the device had none to run)
    "comm": {"world_size": (0, 1 << 12), "bytes": (0, 1 << 50), "time_us_p50": _T_US, "algbw_gbps": _RATE,
             "busbw_gbps": _RATE},
}


class RunStatus(StrEnum):
    """A suite's state in the runs table: all its points, some (interrupted, or points failed), none."""

    COMPLETE = "complete"
    PARTIAL = "partial"
    SKIPPED = "skipped"


class PointStatus(StrEnum):
    """An e2e or comm point's state: measured, or skipped (its key and the reason kept)."""

    OK = "ok"
    SKIPPED = "skipped"


class CommSource(StrEnum):
    """Where an e2e row's comm_ms comes from: the row's own N-GPU run (its whole step, collectives
    included), the alpha-beta model beside one rank timed on one GPU, or none (tp 1: no collectives)."""

    MEASURED = "measured"
    MODELLED = "modelled"
    NONE = "none"


# The columns that name a state: one of these values (suite "whatif": the controller's stored what-if
# answers, projected only; a host's runs name the three suites engine.bench runs).
STATES: dict[str, dict[str, tuple[str, ...]]] = {
    "runs": {"suite": ("kernels", "e2e", "comm", "whatif"), "status": tuple(s.value for s in RunStatus)},
    "e2e": {"status": tuple(s.value for s in PointStatus)},
    "comm": {"status": tuple(s.value for s in PointStatus)},
}


class SchemaError(ValueError):
    """A result file that does not match the contract; the message names the file and field."""


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


def loads_untrusted(text: str) -> Any:
    """JSON a host sent, or None where it is not JSON (or nested deep enough to exhaust the stack):
    callers check the shape they need, so a bad answer costs a message, never a crash."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


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


def _text(meta: dict[bytes, bytes], key: bytes, label: str) -> str:
    try:
        return meta.get(key, b"").decode("utf-8")
    except UnicodeDecodeError:
        raise SchemaError(f"{label}: metadata {key.decode()!r} is not UTF-8") from None


# Columns added after version 2, per table, and the value an older file means by leaving them out
# (version 3: tp, weight_sets, vocab, comm_source; version 4: kernels' op and host_us, e2e's context,
# status, skip_reason, memory_bytes and the per-family split of kernel_ms). A row built without them gets the same value.
_ADDED: dict[str, dict[str, Any]] = {
    "kernels": {"tp": 1, "host_us": None, "op": None},
    "e2e": {"tp": 1, "weight_sets": 1, "vocab": None, "comm_source": None, "context": None, "status": "ok",
            "skip_reason": None, "memory_bytes": None, "moe_ms": None, "attention_ms": None, "dense_ms": None,
            "lm_head_ms": None, "tree_ms": None, "gpu_other_ms": None},
}


def column_defaults(name: str) -> dict[str, Any]:
    """The columns of table `name` added since version 2, and the value a row or file without them means."""
    return dict(_ADDED.get(name, {}))


def _upgrade(table: pa.Table, name: str) -> pa.Table:
    """An older table with the columns added since at the value its version means by their absence."""
    added = _ADDED.get(name, {})
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


def provenance(table: pa.Table) -> dict[str, Any]:
    return json.loads(table.schema.metadata[b"kdbench.provenance"])
