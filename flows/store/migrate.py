"""`kdbench store migrate`: move a store of layout 1 to the table-first layout, losing no file.

Layout 1 kept every table of a run in one folder, `runs/host=<h>/run=<id>/<table>.arrow` with a
`_manifest.json` of sha256s, and listed runs in a shared `runs/_index.jsonl`. Each run is checked
(sha256 against its old manifest, full schema validation), written in the new layout with the old
digests recorded in its manifest, read back and compared, and only then are its old files removed.
Anything that cannot be moved (a file that fails its checks, an unknown file) goes, with a
`.reason` beside it, to `_unmigrated/host=<h>/run=<id>/`. Reference datasets (`reference/<name>/`)
are left as they are.

Killed at any point and run again, it loses nothing: a run whose new manifest already records old
files (`migrated_from`) is rewritten from the union of what the store holds and the old files still
there, so a re-run never stores a run from the few files a cut-short first run left behind. The old
index goes last. Two migrations never run at once: a local store is locked (`.migrate.lock`, released
by the OS when the process dies), an object store holds a marker object of the same name (a killed
migration leaves it: `--break-lock` removes it).
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

from filelock import FileLock, Timeout
from pydantic import BaseModel

from engine.schema import TABLES, SchemaError
from flows.store.layout import OLD_INDEX, PART, Manifest, StoreError, hive_key, manifest_path
from flows.store.store import Store

UNMIGRATED = "_unmigrated"
LOCK = ".migrate.lock"
SETTLE_S = 1.0  # after writing the marker: a rival that saw none has written its own by then
_OLD_MANIFEST = "_manifest.json"
_OLD_LOCK = "runs/.index.lock"
_MAX_INDEX = 64 << 20


class Migrated(BaseModel):
    """What `migrate` did: runs moved, files set aside (and why), index lines with no run folder."""

    runs: list[str] = []
    set_aside: dict[str, str] = {}
    index_only: list[str] = []


@contextmanager
def exclusive(store: Store, break_lock: bool = False) -> Iterator[None]:
    """Hold the store's migration lock, or StoreError naming it when another migration holds it."""
    path = store.full(LOCK)
    if store.local:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        try:
            with FileLock(path, timeout=0):
                yield
        except Timeout:
            raise StoreError(f"{path}: another `kdbench store migrate` is running on this store") from None
        return
    if break_lock and store.exists(path):
        store.fs.delete_file(path)
    if store.exists(path):
        raise StoreError(f"{path}: another `kdbench store migrate` holds this store (marker written "
                         f"{_marker(store).get('since', '?')}); if none is running, one was killed: run again with "
                         "--break-lock")
    token = uuid.uuid4().hex
    store.write_bytes(LOCK, json.dumps({"token": token, "since": datetime.now(timezone.utc).isoformat()}).encode())
    time.sleep(SETTLE_S)  # two that both saw no marker: the later PUT wins, and the earlier one sees it
    if _marker(store).get("token") != token:
        raise StoreError(f"{path}: another `kdbench store migrate` started at the same moment; it goes on alone")
    try:
        yield
    finally:
        if _marker(store).get("token") == token:
            store.fs.delete_file(path)


def _marker(store: Store) -> dict:
    try:
        doc = json.loads(store.read_bytes(LOCK, 4096))
    except (OSError, StoreError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _set_aside(store: Store, host: str, run_id: str, name: str, why: str, report: Migrated) -> None:
    """Move one old file out of the way, its reason written first (a kill between the two leaves both)."""
    dest = f"{UNMIGRATED}/host={host}/run={run_id}"
    store.write_bytes(f"{dest}/{name}.reason", (why + "\n").encode())
    store.fs.create_dir(store.full(dest), recursive=True)
    store.fs.move(store.full("runs", f"host={host}", f"run={run_id}", name), store.full(dest, name))
    report.set_aside[f"{dest}/{name}"] = why


def _migrated(store: Store, host: str, run_id: str) -> Manifest | None:
    """The run's new-layout manifest, when a migration (or an ingest) already stored the run."""
    if not store.exists(store.full(manifest_path(host, run_id))):
        return None
    return store.manifest(host, run_id)


def _migrate_run(store: Store, host: str, run_id: str, names: list[str], ingested_at: str,
                 report: Migrated) -> None:
    folder = f"runs/host={host}/run={run_id}"
    arrow = sorted(n for n in names if n.endswith(".arrow") and n[:-len(".arrow")] in TABLES)
    for n in sorted(set(names) - set(arrow) - {_OLD_MANIFEST, PART}):
        _set_aside(store, host, run_id, n, "not a layout-1 result file", report)
    old_manifest = [_OLD_MANIFEST] if _OLD_MANIFEST in names else []
    if not arrow and not old_manifest:
        return
    try:
        done = _migrated(store, host, run_id)
        if done is not None and not done.migrated_from and arrow:
            raise StoreError(f"{folder}: the store already holds run {run_id} of {host}, ingested in the new "
                             "layout; these old files were not merged into it")
        moved = done.migrated_from if done else {}
        if not arrow:
            if done is None and old_manifest:
                _set_aside(store, host, run_id, _OLD_MANIFEST, "no result files beside it", report)
            elif old_manifest:  # a run migrated before the first migration was cut short
                store.fs.delete_file(store.full(folder, _OLD_MANIFEST))
            return
        sums = json.loads(store.read_bytes(f"{folder}/{_OLD_MANIFEST}", 1 << 20))["files"] if old_manifest else {}
        tables, digests = {}, {}
        for n in arrow:
            digests[n] = hashlib.sha256(store.read_bytes(f"{folder}/{n}")).hexdigest()
            if n in sums and sums[n] != digests[n]:
                raise SchemaError(f"{folder}/{n}: sha256 differs from its _manifest.json")
            if n in moved and moved[n] != digests[n]:
                raise SchemaError(f"{folder}/{n}: differs from the copy of it an earlier migration stored")
            tables[n[:-len(".arrow")]] = store.read_arrow(f"{folder}/{n}")
        # what an earlier, cut-short migration already moved stays: the run is the union
        tables = {**(store.load(host, run_id) if done else {}), **tables}
        store.put_tables(host, run_id, tables, migrated_from={**moved, **digests},
                         ingested_at=done.ingested_at if done and done.ingested_at is not None else ingested_at)
        back = store.load(host, run_id)
        if set(back) != set(tables) or not all(back[t].equals(tables[t], check_metadata=True) for t in tables):
            raise StoreError(f"{folder}: the migrated run does not read back equal")
    except (SchemaError, StoreError, ValueError, KeyError, TypeError) as e:
        for n in [*arrow, *old_manifest]:
            _set_aside(store, host, run_id, n, str(e), report)
        return
    for n in [*arrow, *old_manifest]:
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


def migrate(store: Store, break_lock: bool = False) -> Migrated:
    """Move every layout-1 run, holding the migration lock; idempotent, and a no-op on a store
    already in the new layout."""
    with exclusive(store, break_lock):
        return _migrate(store)


def _migrate(store: Store) -> Migrated:
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
