"""`kdbench import FILE --name NAME`: outside figures (kernel points, serving results) as a reference set.

The file is JSON ({"provenance": {...}, "kernels": [...], "serving": [...]}) or CSV (`# key: value`
provenance lines, then a header row and one point per row; a `kernel` column makes it kernel
points, a `concurrency` column serving results). The provenance names the machine, the date and
the source; `origin` is `published` or `outside` (the default). Serving records may use the keys an
SGLang or vLLM serving benchmark prints (max_concurrency, output_throughput, median_ttft_ms,
median_itl_ms). Bytes and flops of a kernel kdbench knows are computed from its shape (engine.costs).

The result is artifacts/reference/NAME/ in the kdbench schema: `source` = measured (somebody measured
them), `impl` naming the outside kernel, the provenance's `origin` marking them as not kdbench's own,
so the notes show them beside kdbench's figures and never as a kdbench measurement.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import Any


from engine.config import CONFIGS
from engine.costs import expected_experts
from engine.schema import to_table, write_table
from flows.families import family
from flows.inventory import Inventory
from flows.kernelfit import cost_of
from flows.scrub import leaks
from flows.reference import OUTSIDE_ORIGINS
from flows.store import check_name

MAX_BYTES = 4 << 20
MAX_ROWS = 10_000
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
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ImportFileError(f"{where}, column {col!r}: {str(value)[:40]!r} is not a number") from None
    if not math.isfinite(x) or (positive and x <= 0):
        raise ImportFileError(f"{where}, column {col!r}: {x:g} must be a finite number above 0")
    if integer:
        if x != int(x):
            raise ImportFileError(f"{where}, column {col!r}: {x:g} must be a whole number")
        return int(x)
    return x


def _text(where: str, col: str, value: Any, limit: int = 200) -> str:
    """Text that reaches the notes: bounded, printable, no table separators, nothing shaped like an
    address, login or key path (the notes' leak check would refuse every page)."""
    if not isinstance(value, str) or not value.strip() or len(value) > limit:
        raise ImportFileError(f"{where}, column {col!r}: must be text of 1-{limit} characters")
    if not value.isprintable() or "|" in value or "`" in value:
        raise ImportFileError(f"{where}, column {col!r}: control characters, '|' and '`' are not accepted")
    found = leaks(value)
    if found:
        raise ImportFileError(f"{where}, column {col!r}: looks like {', '.join(found)}; leave it out")
    return value.strip()


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
    rows = list(csv.DictReader(io.StringIO("\n".join(body))))
    cols = set(rows[0]) if rows else set()
    if "kernel" in cols:
        return prov, rows, []
    if cols & {"concurrency", "max_concurrency"}:
        return prov, [], rows
    raise ImportFileError(f"{path.name}: the header needs a 'kernel' column (kernel points) or a "
                          "'concurrency' column (serving results)")


def check_provenance(label: str, prov: dict[str, Any], inv: Inventory, name: str) -> dict[str, Any]:
    where = f"{label}: provenance"
    out = {k: _text(where, k, prov.get(k)) for k in REQUIRED}
    origin = prov.get("origin", "outside")
    if origin not in OUTSIDE_ORIGINS:
        raise ImportFileError(f"{where}, column 'origin': {str(origin)[:40]!r}, expected one of {OUTSIDE_ORIGINS}")
    host = check_name("host", _text(where, "host", prov.get("host", name), 128))
    spec = prov.get("spec") or (inv.hosts[host].spec if host in inv.hosts else None)
    if spec not in inv.specs:
        raise ImportFileError(f"{where}, column 'spec': {str(spec)[:60]!r} is not a spec sheet in hosts/specs/ "
                              f"(host {host!r} is not in the inventory, so the file must name one)")
    gpus = _num(where, "gpus", prov.get("gpus", inv.hosts[host].gpus if host in inv.hosts else 1), integer=True)
    notes = prov.get("notes", [])
    if isinstance(notes, str):
        notes = [notes]
    return {**out, "origin": origin, "host": host, "spec": spec, "gpu_count": gpus,
            "interconnect": prov.get("interconnect") or (inv.hosts[host].interconnect if host in inv.hosts else "none"),
            "impl": _text(where, "impl", prov.get("impl", "outside"), 64),
            "notes": [_text(where, "notes", n, 400) for n in notes]}


def kernel_rows(label: str, records: list[dict[str, Any]], run_id: str, impl: str) -> list[dict[str, Any]]:
    out = []
    for i, raw in enumerate(records, 1):
        where = f"{label}: kernels row {i}"
        r = {KERNEL_ALIASES.get(k, k): v for k, v in raw.items() if v not in (None, "")}
        kernel = family(_text(where, "kernel", r.get("kernel"), 64))
        t = _num(where, "time_us", r.get("time_us"))
        config = _text(where, "config", r.get("config", "k2"), 32)
        if config not in CONFIGS:
            raise ImportFileError(f"{where}, column 'config': {config!r}, expected one of {sorted(CONFIGS)}")
        cfg = CONFIGS[config]
        tp = _num(where, "tp", r.get("tp", 1), integer=True)
        row: dict[str, Any] = {"run_id": run_id, "kernel": kernel, "impl": _text(where, "impl", r.get("impl", impl), 64),
                               "dtype": _text(where, "dtype", r.get("dtype", "bfloat16"), 32), "device": "cuda",
                               "tp": tp, "time_us_p50": t, "source": "measured"}
        for col in ("M", "batch", "budget", "context"):
            if col in r:
                row[col] = _num(where, col, r[col], integer=True)
        if kernel in KNOWN:
            for col in SHAPE[kernel]:
                if col not in row:
                    raise ImportFileError(f"{where}, column {col!r}: missing ({kernel} needs {', '.join(SHAPE[kernel])})")
            nbytes, flops = cost_of(kernel, cfg, row, tp)
            if kernel == "moe_w4a16":
                row.update(N=2 * cfg.moe_inter // tp, K=cfg.hidden, E=cfg.experts, top_k=cfg.top_k,
                           expected_experts=expected_experts(cfg.experts, cfg.top_k, row["M"]))
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
        config = _text(where, "config", r.get("config", "k2"), 32)
        if config not in CONFIGS:
            raise ImportFileError(f"{where}, column 'config': {config!r}, expected one of {sorted(CONFIGS)}")
        row = {"run_id": run_id, "config": config, "device": "cuda", "source": "measured",
               "concurrency": _num(where, "concurrency", r.get("concurrency"), integer=True),
               "tokens_per_s": _num(where, "tokens_per_s", r.get("tokens_per_s")),
               "layers": _num(where, "layers", r.get("layers", CONFIGS[config].layers), integer=True),
               "tp": _num(where, "tp", r.get("tp", gpus), integer=True),
               "budget": _num(where, "budget", r.get("budget", 0), integer=True, positive=False),
               "comm_source": "measured" if int(r.get("tp", gpus)) > 1 else "none"}
        for col, dst in (("ttft_ms", "ttft_ms"), ("itl_ms", "itl_ms_p50"), ("accept_len_mean", "accept_len_mean")):
            if col in r:
                row[dst] = _num(where, col, r[col])
        out.append(row)
    return out


def import_file(path: Path, name: str, root: Path, inv: Inventory) -> Path:
    """Validate `path` and write artifacts/reference/<name>/ (replacing an earlier import of that name)."""
    check_name("dataset name", name)
    prov_in, kern_in, serv_in = read_file(path)
    prov = check_provenance(path.name, prov_in, inv, name)
    if len(kern_in) + len(serv_in) > MAX_ROWS:
        raise ImportFileError(f"{path.name}: more than {MAX_ROWS} rows")
    if not kern_in and not serv_in:
        raise ImportFileError(f"{path.name}: no kernel points and no serving results")
    run_id = f"{prov['origin']}-{name}"[:128]
    kern = kernel_rows(path.name, kern_in, run_id, prov["impl"])
    serv = serving_rows(path.name, serv_in, run_id, prov["gpu_count"])
    spec = inv.specs[prov["spec"]]
    meta = {"run_id": run_id, "host": prov["host"], "gpu_name": spec.gpu, "gpu_count": prov["gpu_count"],
            "arch": spec.arch, "device": "cuda", "started_at": prov["date"], **prov}
    base = {"run_id": run_id, "host": prov["host"], "profile": prov["origin"], "status": "complete",
            "gpu_name": spec.gpu, "gpu_count": prov["gpu_count"], "arch": spec.arch, "device": "cuda",
            "started_at": prov["date"], "source": "measured",
            "note": json.dumps({k: prov[k] for k in ("origin", "machine", "source", "impl")}, sort_keys=True)}
    out = root / "reference" / name
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.arrow"):
        stale.unlink()
    suites = [(s, rows) for s, rows in (("kernels", kern), ("e2e", serv)) if rows]
    for suite, rows in suites:
        write_table(out, to_table(suite, rows, meta))
    write_table(out, to_table("runs", [{**base, "suite": s, "points": len(rows)} for s, rows in suites], meta))
    return out
