"""`kdbench store migrate`: move a store of layout 1 to the table-first layout, losing no file.

Layout 1 kept every table of a run in one folder, `runs/host=<h>/run=<id>/<table>.arrow` with a
`_manifest.json` of sha256s, and listed runs in a shared `runs/_index.jsonl`. Each run is checked
(sha256 against its old manifest, full schema validation), written in the new layout with the old
digests recorded in its manifest, read back and compared, and only then are its old files removed.
Anything that cannot be moved (a file that fails its checks, an unknown file) goes, with a
`.reason` beside it, to `_unmigrated/host=<h>/run=<id>/`. The old index goes last, so a migration
cut short is finished by running it again. Reference datasets (`reference/<name>/`) are left as they are.
"""

from __future__ import annotations

import hashlib
import json

from pydantic import BaseModel

from engine.schema import TABLES, SchemaError
from flows.store import OLD_INDEX, PART, Store, StoreError, hive_key

UNMIGRATED = "_unmigrated"
_OLD_MANIFEST = "_manifest.json"
_OLD_LOCK = "runs/.index.lock"
_MAX_INDEX = 64 << 20


class Migrated(BaseModel):
    """What `migrate` did: runs moved, files set aside (and why), index lines with no run folder."""

    runs: list[str] = []
    set_aside: dict[str, str] = {}
    index_only: list[str] = []


def _set_aside(store: Store, host: str, run_id: str, name: str, why: str, report: Migrated) -> None:
    dest = f"{UNMIGRATED}/host={host}/run={run_id}"
    store.fs.create_dir(store.full(dest), recursive=True)
    store.fs.move(store.full("runs", f"host={host}", f"run={run_id}", name), store.full(dest, name))
    store.write_bytes(f"{dest}/{name}.reason", (why + "\n").encode())
    report.set_aside[f"{dest}/{name}"] = why


def _migrate_run(store: Store, host: str, run_id: str, names: list[str], ingested_at: str,
                 report: Migrated) -> None:
    folder = f"runs/host={host}/run={run_id}"
    arrow = sorted(n for n in names if n.endswith(".arrow") and n[:-len(".arrow")] in TABLES)
    for n in sorted(set(names) - set(arrow) - {_OLD_MANIFEST, PART}):
        _set_aside(store, host, run_id, n, "not a layout-1 result file", report)
    if not arrow:
        return
    try:
        sums = json.loads(store.read_bytes(f"{folder}/{_OLD_MANIFEST}", 1 << 20))["files"] \
            if _OLD_MANIFEST in names else {}
        tables, digests = {}, {}
        for n in arrow:
            digests[n] = hashlib.sha256(store.read_bytes(f"{folder}/{n}")).hexdigest()
            if n in sums and sums[n] != digests[n]:
                raise SchemaError(f"{folder}/{n}: sha256 differs from its _manifest.json")
            tables[n[:-len(".arrow")]] = store.read_arrow(f"{folder}/{n}")
        store.put_tables(host, run_id, tables, migrated_from=digests, ingested_at=ingested_at)
        back = store.load(host, run_id)
        if set(back) != set(tables) or not all(back[t].equals(tables[t], check_metadata=True) for t in tables):
            raise StoreError(f"{folder}: the migrated run does not read back equal")
    except (SchemaError, StoreError, ValueError, KeyError, TypeError) as e:
        for n in [*arrow, *([_OLD_MANIFEST] if _OLD_MANIFEST in names else [])]:
            _set_aside(store, host, run_id, n, str(e), report)
        return
    for n in [*arrow, *([_OLD_MANIFEST] if _OLD_MANIFEST in names else [])]:
        store.fs.delete_file(store.full(folder, n))
    report.runs.append(f"{host}/{run_id}")


def _old_index(store: Store) -> list[dict | str]:
    """The layout-1 index: one dict per readable line, the line itself (cut short) otherwise."""
    if not store.exists(store.full(OLD_INDEX)):
        return []
    rows: list[dict | str] = []
    for line in store.read_bytes(OLD_INDEX, _MAX_INDEX).decode(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            rows.append({"host": str(row["host"]), "run_id": str(row["run_id"]),
                         "ingested_at": str(row.get("ingested_at") or "")})
        except (ValueError, KeyError, TypeError, RecursionError):
            rows.append(line[:200])
    return rows


def migrate(store: Store) -> Migrated:
    """Move every layout-1 run; idempotent, and a no-op on a store already in the new layout."""
    report = Migrated()
    index = _old_index(store)
    when = {(r["host"], r["run_id"]): r["ingested_at"] for r in index if isinstance(r, dict)}
    runs: dict[tuple[str, str], list[str]] = {}
    for i in store.files_under("runs"):
        rel = i.path[len(store.base) + 1:]
        key = hive_key(rel)
        if key and rel.count("/") == 3:
            runs.setdefault(key, []).append(i.base_name)
    for (host, run_id), names in sorted(runs.items()):
        _migrate_run(store, host, run_id, names, when.get((host, run_id), ""), report)
    for row in index:
        if isinstance(row, str):
            report.index_only.append(row)
            continue
        try:
            store.run(row["host"], row["run_id"])
        except StoreError:
            report.index_only.append(f"{row['host']}/{row['run_id']}")
    if store.exists(store.full(OLD_INDEX)):
        store.fs.delete_file(store.full(OLD_INDEX))
    if store.exists(store.full(_OLD_LOCK)):
        store.fs.delete_file(store.full(_OLD_LOCK))
    return report
