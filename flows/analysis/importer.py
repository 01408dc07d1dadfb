"""`kdbench import FILE --name NAME`: outside figures (kernel points, serving results) as a reference set.

The file is JSON ({"provenance": {...}, "kernels": [...], "serving": [...]}) or CSV (`# key: value`
provenance lines, then a header row and one point per row; a `kernel` column makes it kernel
points, a `concurrency` column serving results). The provenance names the machine, the date and
the source; `origin` is `published` or `outside` (the default). Serving records may use the keys an
SGLang or vLLM serving benchmark prints (max_concurrency, output_throughput, median_ttft_ms,
median_itl_ms). Bytes and flops of a kernel kdbench knows are computed from its shape (engine.costs).

The result is reference/NAME/ in the artifacts store (a folder or a pyarrow filesystem URI such as
s3://bucket/prefix, like every other command's `--artifacts`), in the kdbench schema: `source` =
measured (somebody measured them), `impl` naming the outside kernel, the provenance's `origin` marking
them as not kdbench's own, so the notes show them beside kdbench's figures and never as a kdbench
measurement.

Everything in the file is untrusted: a bad value is refused with one line naming the row and the
column, by the checks pull applies to a host's tables (engine.table_checks.check_values) plus the import's
own (names are plain ASCII identifiers, so a look-alike cannot pose as a kernel kdbench knows; text
cannot start like a spreadsheet formula). A name already taken is refused without --replace: a
reference dataset of kdbench's own measurements, or a host with measured runs (`--reference NAME`
would then mean the import).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import re
from pathlib import Path
from typing import Any, get_args

import pyarrow as pa

from engine.config import CONFIGS
from engine.costs import expected_experts
from engine.rows import MoeShape, Provenance
from engine.schema import MAX_ROWS, CommSource, SchemaError
from engine.table_checks import check_values
from engine.table_files import MANIFEST, manifest_bytes, table_bytes, to_table
from flows.analysis.families import shape_at
from flows.analysis.kernelfit import cost_of
from flows.analysis.reference import OUTSIDE_ORIGINS, is_outside
from flows.inventory.hosts import INDEX_PAGE, Interconnect, Inventory, is_page_name
from flows.inventory.scrub import leaks
from flows.store.layout import StoreError, check_name
from flows.store.store import Store

MAX_BYTES = 4 << 20
MAX_INT = 1 << 53       # a count beyond this is no count (and would not survive a float)
_IDENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*\Z")  # kernel, impl, dtype, config: ASCII only
_FORMULA = ("=", "+", "-", "@")   # what a spreadsheet opening the notes or a CSV export would run
REQUIRED = ("machine", "date", "source")
KNOWN = ("moe_w4a16", "mla_tree_attention", "build_tree", "tree_accept")
SHAPE = {"moe_w4a16": ("M",), "mla_tree_attention": ("batch", "budget", "context"),
         "build_tree": ("batch", "budget"), "tree_accept": ("batch", "budget")}
# serving-benchmark spellings (SGLang bench_serving, vLLM benchmark_serving) -> kdbench's
SERVING_ALIASES = {"max_concurrency": "concurrency", "output_throughput": "tokens_per_s",
                   "median_ttft_ms": "ttft_ms", "mean_ttft_ms": "ttft_ms", "median_itl_ms": "itl_ms",
                   "mean_itl_ms": "itl_ms", "accept_length": "accept_len_mean"}
KERNEL_ALIASES = {"time_us_p50": "time_us"}


class ImportFileError(ValueError):
    """A file `kdbench import` cannot take; the message names the file, the row and the column."""


def _num(where: str, col: str, value: Any, integer: bool = False, positive: bool = True) -> float | int:
    if isinstance(value, bool):
        raise ImportFileError(f"{where}, column {col!r}: {value!r} is not a number")
    try:
        x = float(value)
    except (TypeError, ValueError, OverflowError):
        raise ImportFileError(f"{where}, column {col!r}: {str(value)[:40]!r} is not a number") from None
    if not math.isfinite(x) or (positive and x <= 0):
        raise ImportFileError(f"{where}, column {col!r}: {x:g} must be a finite number above 0")
    if integer:
        if x != int(x) or abs(x) > MAX_INT:
            raise ImportFileError(f"{where}, column {col!r}: {x:g} must be a whole number of at most {MAX_INT}")
        return int(x)
    return x


def _text(where: str, col: str, value: Any, limit: int = 200) -> str:
    """Text that reaches the notes: bounded, printable, no table separators, nothing shaped like an
    address, login or key path (the notes' leak check would refuse every page)."""
    if not isinstance(value, str) or not value.strip() or len(value) > limit:
        raise ImportFileError(f"{where}, column {col!r}: must be text of 1-{limit} characters")
    if not value.isprintable() or "|" in value or "`" in value:
        raise ImportFileError(f"{where}, column {col!r}: control characters, '|' and '`' are not accepted")
    if value.strip().startswith(_FORMULA):
        raise ImportFileError(f"{where}, column {col!r}: text may not start with {' '.join(_FORMULA)} "
                              "(a spreadsheet would run it as a formula)")
    found = leaks(value)
    if found:
        raise ImportFileError(f"{where}, column {col!r}: looks like {', '.join(found)}; leave it out")
    return value.strip()


def _ident(where: str, col: str, value: Any, limit: int = 64) -> str:
    """A name kdbench matches on (kernel, impl, dtype, config): ASCII letters, digits, '_.+-'."""
    text = _text(where, col, value, limit)
    if not _IDENT.match(text):
        raise ImportFileError(f"{where}, column {col!r}: {text[:40]!r} must be ASCII letters, digits and '_.+-', "
                              "starting with a letter or digit")
    return text


def read_file(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    """(provenance, kernel records, serving records) of a JSON or CSV file."""
    if not path.is_file():
        raise ImportFileError(f"{path.name}: no such file")
    if path.stat().st_size > MAX_BYTES:
        raise ImportFileError(f"{path.name}: larger than {MAX_BYTES >> 20} MiB")
    text = path.read_text(errors="replace")
    if path.suffix.lower() == ".json":
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise ImportFileError(f"{path.name}: not JSON ({e.msg} at line {e.lineno})") from None
        except (ValueError, RecursionError) as e:  # a number of thousands of digits; nesting past the stack
            why = "nested too deeply" if isinstance(e, RecursionError) else str(e)[:80]
            raise ImportFileError(f"{path.name}: not JSON kdbench reads ({why})") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("provenance"), dict):
            raise ImportFileError(f"{path.name}: expected an object with a 'provenance' object and "
                                  "'kernels' and/or 'serving' lists")
        kern, serv = doc.get("kernels", []), doc.get("serving", [])
        if not isinstance(kern, list) or not isinstance(serv, list) or not all(
                isinstance(r, dict) for r in [*kern, *serv]):
            raise ImportFileError(f"{path.name}: 'kernels' and 'serving' must be lists of objects")
        return doc["provenance"], kern, serv
    if path.suffix.lower() != ".csv":
        raise ImportFileError(f"{path.name}: expected a .json or .csv file")
    prov: dict[str, Any] = {}
    body = []
    for line in text.splitlines():
        if line.startswith("#"):
            key, _, value = line[1:].partition(":")
            if key.strip():
                prov.setdefault(key.strip(), value.strip())
        elif line.strip():
            body.append(line)
    try:
        rows = list(csv.DictReader(io.StringIO("\n".join(body))))
    except csv.Error as e:  # a field over the csv module's limit (128 KiB), a stray quote
        raise ImportFileError(f"{path.name}: not CSV kdbench reads ({str(e)[:80]})") from None
    for i, row in enumerate(rows, 1):
        if None in row:
            raise ImportFileError(f"{path.name}: row {i} has more fields than the header")
    cols = set(rows[0]) if rows else set()
    if "kernel" in cols:
        return prov, rows, []
    if cols & {"concurrency", "max_concurrency"}:
        return prov, [], rows
    raise ImportFileError(f"{path.name}: the header needs a 'kernel' column (kernel points) or a "
                          "'concurrency' column (serving results)")


def check_provenance(label: str, prov: dict[str, Any], inv: Inventory, name: str) -> Provenance:
    """The file's provenance as an import stores it (run `<origin>-<name>`, the GPU of its spec sheet, started
    at its date), each key checked."""
    where = f"{label}: provenance"
    machine, date, source = (_text(where, k, prov.get(k)) for k in REQUIRED)
    origin = prov.get("origin", "outside")
    if not isinstance(origin, str) or origin not in OUTSIDE_ORIGINS:
        raise ImportFileError(f"{where}, column 'origin': {str(origin)[:40]!r}, expected one of {OUTSIDE_ORIGINS}")
    try:
        host = check_name("host", _text(where, "host", prov.get("host", name), 128))
    except StoreError as e:
        raise ImportFileError(f"{where}, column 'host': {e}") from None
    if is_page_name(host):
        raise ImportFileError(f"{where}, column 'host': {host!r} is the name of a page the notes index writes "
                              f"(docs/notes/{INDEX_PAGE}.md): its page would be lost")
    spec = prov.get("spec") or (inv.hosts[host].spec if host in inv.hosts else None)
    if not isinstance(spec, str) or spec not in inv.specs:
        raise ImportFileError(f"{where}, column 'spec': {str(spec)[:60]!r} is not a spec sheet in hosts/specs/ "
                              f"(host {host!r} is not in the inventory, so the file must name one)")
    gpus = _num(where, "gpus", prov.get("gpus", inv.hosts[host].gpus if host in inv.hosts else 1), integer=True)
    link = prov.get("interconnect") or (inv.hosts[host].interconnect if host in inv.hosts else "none")
    if link not in get_args(Interconnect):
        raise ImportFileError(f"{where}, column 'interconnect': {str(link)[:40]!r}, expected one of "
                              f"{get_args(Interconnect)}")
    notes = prov.get("notes", [])
    if isinstance(notes, str):
        notes = [notes]
    if not isinstance(notes, list):
        raise ImportFileError(f"{where}, column 'notes': must be text or a list of texts")
    sheet = inv.specs[spec]
    return Provenance(run_id=f"{origin}-{name}"[:128], machine=machine, date=date, source=source, origin=origin,
                      host=host, spec=spec, gpu_name=sheet.gpu, gpu_count=int(gpus), arch=sheet.arch, device="cuda",
                      started_at=date, interconnect=link,
                      impl=_ident(where, "impl", prov.get("impl", "outside")),
                      notes=[_text(where, "notes", n, 400) for n in notes])


def kernel_rows(label: str, records: list[dict[str, Any]], run_id: str, impl: str) -> list[dict[str, Any]]:
    out = []
    for i, raw in enumerate(records, 1):
        where = f"{label}: kernels row {i}"
        r = {KERNEL_ALIASES.get(k, k): v for k, v in raw.items() if v not in (None, "")}
        kernel = _ident(where, "kernel", r.get("kernel"))
        t = _num(where, "time_us", r.get("time_us"))
        config = _ident(where, "config", r.get("config", "k2"), 32)
        if config not in CONFIGS:
            raise ImportFileError(f"{where}, column 'config': {config!r}, expected one of {sorted(CONFIGS)}")
        cfg = CONFIGS[config]
        tp = _num(where, "tp", r.get("tp", 1), integer=True)
        row: dict[str, Any] = {"run_id": run_id, "kernel": kernel, "impl": _ident(where, "impl", r.get("impl", impl)),
                               "dtype": _ident(where, "dtype", r.get("dtype", "bfloat16"), 32), "device": "cuda",
                               "tp": tp, "time_us_p50": t, "source": "measured"}
        for col in ("M", "batch", "budget", "context"):
            if col in r:
                row[col] = _num(where, col, r[col], integer=True)
        if kernel in KNOWN:
            for col in SHAPE[kernel]:
                if col not in row:
                    raise ImportFileError(f"{where}, column {col!r}: missing ({kernel} needs {', '.join(SHAPE[kernel])})")
            shape = shape_at(kernel, cfg, int(tp), tokens=row.get("M", 0), batch=row.get("batch", 0),
                             budget=row.get("budget", 0), context=row.get("context", 0))
            nbytes, flops = cost_of(cfg, shape, int(tp))
            if isinstance(shape, MoeShape):   # its whole shape, from the config; the others keep the columns given
                row.update(shape.columns(), expected_experts=expected_experts(cfg.experts, cfg.top_k, shape.tokens))
        else:
            if "bytes" not in r or "flops" not in r:
                raise ImportFileError(f"{where}, column {'bytes' if 'bytes' not in r else 'flops'!r}: kdbench does "
                                      f"not know kernel {kernel!r}, so the file must give bytes and flops")
            nbytes, flops = _num(where, "bytes", r["bytes"]), _num(where, "flops", r["flops"], positive=False)
        row.update(bytes=float(nbytes), flops=float(flops), achieved_gbps=nbytes / (t * 1e3),
                   achieved_tflops=flops / (t * 1e6))
        out.append(row)
    return out


def serving_rows(label: str, records: list[dict[str, Any]], run_id: str, gpus: int) -> list[dict[str, Any]]:
    out = []
    for i, raw in enumerate(records, 1):
        where = f"{label}: serving row {i}"
        r = {SERVING_ALIASES.get(k, k): v for k, v in raw.items() if v not in (None, "")}
        config = _ident(where, "config", r.get("config", "k2"), 32)
        if config not in CONFIGS:
            raise ImportFileError(f"{where}, column 'config': {config!r}, expected one of {sorted(CONFIGS)}")
        tp = _num(where, "tp", r.get("tp", gpus), integer=True)
        row = {"run_id": run_id, "config": config, "device": "cuda", "source": "measured",
               "concurrency": _num(where, "concurrency", r.get("concurrency"), integer=True),
               "tokens_per_s": _num(where, "tokens_per_s", r.get("tokens_per_s")),
               "layers": _num(where, "layers", r.get("layers", CONFIGS[config].layers), integer=True),
               "tp": tp, "budget": _num(where, "budget", r.get("budget", 0), integer=True, positive=False),
               "comm_source": CommSource.MEASURED if tp > 1 else CommSource.NONE}
        for col, dst in (("ttft_ms", "ttft_ms"), ("itl_ms", "itl_ms_p50"), ("accept_len_mean", "accept_len_mean")):
            if col in r:
                row[dst] = _num(where, col, r[col])
        out.append(row)
    return out


def _taken(store: Store, name: str) -> str | None:
    """Why an import may not take `name` without --replace, or None (an earlier import of it is replaced)."""
    if name in store.references():
        try:
            tables = store.reference(name)
        except (StoreError, SchemaError) as e:
            return f"reference/{name}/ holds a dataset that does not read ({e})"
        if not is_outside(tables):
            return f"reference/{name}/ is kdbench's own measured reference"
    elif any(r.source == "measured" for r in store.runs(name)):
        return f"host {name} has measured runs in the store (`--reference {name}` would then mean this import)"
    return None


def _checked(label: str, table: pa.Table) -> pa.Table:
    """The table, refused with its row and column where a value is out of what a run can write."""
    try:
        check_values(table, label)
    except SchemaError as e:
        raise ImportFileError(str(e)) from None
    return table


def import_file(path: Path, name: str, root: str | Path, inv: Inventory, replace: bool = False) -> str:
    """Validate `path` and write reference/<name>/ into the artifacts store at `root` (a folder or a
    pyarrow filesystem URI); returns where. An earlier import of that name is replaced; a name already
    taken otherwise (see `_taken`) only with `replace`."""
    check_name("dataset name", name)
    store = Store(str(root))
    prov_in, kern_in, serv_in = read_file(path)
    prov = check_provenance(path.name, prov_in, inv, name)
    if len(kern_in) > MAX_ROWS or len(serv_in) > MAX_ROWS:
        raise ImportFileError(f"{path.name}: more than {MAX_ROWS} kernel points or serving results")
    if not kern_in and not serv_in:
        raise ImportFileError(f"{path.name}: no kernel points and no serving results")
    taken = None if replace else _taken(store, name)
    if taken:
        raise ImportFileError(f"--name {name}: {taken}; choose another --name, or pass --replace to replace it")
    run_id = prov.run_id
    kern = kernel_rows(path.name, kern_in, run_id, prov.impl)
    serv = serving_rows(path.name, serv_in, run_id, prov.gpu_count)
    base = {"run_id": run_id, "host": prov.host, "profile": prov.origin, "status": "complete",
            "gpu_name": prov.gpu_name, "gpu_count": prov.gpu_count, "arch": prov.arch, "device": prov.device,
            "started_at": prov.date, "source": "measured",
            "note": json.dumps({"origin": prov.origin, "machine": prov.machine, "source": prov.source,
                                "impl": prov.impl}, sort_keys=True)}
    suites = [(s, rows, label) for s, rows, label in (("kernels", kern, "kernels"), ("e2e", serv, "serving")) if rows]
    tables = {s: _checked(f"{path.name}: {label}", to_table(s, rows, prov)) for s, rows, label in suites}
    tables["runs"] = _checked(f"{path.name}: provenance, runs", to_table(
        "runs", [{**base, "suite": s, "points": len(rows)} for s, rows, _ in suites], prov))
    folder = f"reference/{name}"
    # runs.arrow goes first and comes back last: a half-written import is never listed as a dataset
    for stale in sorted(store.files_under(folder), key=lambda i: i.base_name != "runs.arrow"):
        if stale.base_name.endswith(".arrow") or stale.base_name == MANIFEST:
            store.fs.delete_file(stale.path)
    data = {t: table_bytes(tables[t]) for t in sorted(tables, key=lambda t: t == "runs")}
    for t, body in data.items():
        store.write_bytes(f"{folder}/{t}.arrow", body)
    store.write_bytes(f"{folder}/{MANIFEST}", manifest_bytes(
        {f"{t}.arrow": hashlib.sha256(body).hexdigest() for t, body in sorted(data.items())}))
    return store.full(folder)
