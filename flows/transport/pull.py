"""Bring a run's result files back from a host and accept only the ones we can trust.

A file is accepted when it is one of the known tables, under the size cap, its sha256 matches
the host's manifest, it passes engine.table_files.read_table (read whole into memory, uncompressed,
every offset checked, no column the contract lacks) and the same per-run check ingest applies
(engine.table_checks.check_run_tables: its run, its host, only `measured` rows, so a host cannot send
projections, and every value one a run can write: rows bounded, numbers finite and in range). Anything else is
quarantined under `<artifacts>/quarantine/host=<h>/run=<id>/` with a `.reason` file beside it, and
named in the run's logs and notes; it is never ingested. One bad file never stops the others.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

from pydantic import BaseModel

from engine.files import sha256_file
from engine.rows import Provenance, RunRow, table_rows
from engine.schema import MAX_TEXT, TABLES, RunStatus, SchemaError
from engine.table_checks import check_run_tables
from engine.table_files import MANIFEST, MAX_FILE_BYTES, read_table, to_table, write_manifest, write_table
from flows.store.layout import check_name
from flows.store.store import Store
from flows.transport.remote import Remote, TransferError

_NAME = re.compile(r"^[a-z0-9_]{1,64}\.arrow\Z")
_SHA256 = re.compile(r"^[0-9a-f]{64}\Z")
SHORT_S = 120.0
MAX_MANIFEST_BYTES = 64 << 10
MAX_LISTED = 20  # odd names reported one by one; beyond that, one line says how many more


class Pulled(BaseModel):
    accepted_dir: Path  # holds only accepted files and a fresh manifest.json
    accepted: list[str]
    quarantined: dict[str, str]  # file name -> why


def _remote_listing(remote: Remote, remote_dir: str) -> list[str]:
    res = remote.run(["find", remote_dir, "-maxdepth", "1", "-type", "f", "-name", "*.arrow"],
                     timeout_s=SHORT_S)
    if res.rc != 0:
        return []
    return sorted(line.rsplit("/", 1)[-1] for line in res.stdout.splitlines() if line.strip())


def _manifest(remote: Remote, remote_dir: str, staging: Path) -> tuple[dict[str, str], str | None]:
    """The host's manifest as {file: sha256}, or ({}, why it is unusable)."""
    path = f"{remote_dir}/{MANIFEST}"
    if remote.size(path) is None:
        return {}, "no manifest.json on the host"
    local = staging / MANIFEST
    try:
        remote.get(path, local, max_bytes=MAX_MANIFEST_BYTES, timeout_s=SHORT_S)
    except TransferError as e:
        return {}, f"manifest.json not fetched ({e})"
    try:
        files = json.loads(local.read_text())["files"]
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        return {}, f"manifest.json unreadable ({type(e).__name__})"
    if not isinstance(files, dict) or not all(isinstance(v, str) and _SHA256.match(v) for v in files.values()):
        return {}, "manifest.json unreadable (files is not a name -> sha256 map)"
    return files, None


def _verdict(path: Path, expected: str | None, manifest_problem: str | None, host: str, run_id: str) -> str | None:
    """None when the file is good, else the reason to quarantine it."""
    if expected is None:
        return manifest_problem or "not listed in manifest.json"
    got = sha256_file(path)
    if got != expected:
        return f"sha256 {got[:12]} does not match the manifest's {expected[:12]}"
    try:
        check_run_tables(host, run_id, {path.stem: read_table(path)}, sources=("measured",))
    except SchemaError as e:
        return str(e)
    return None


def pull(remote: Remote, remote_dir: str, staging: Path, host: str, run_id: str) -> Pulled:
    """Fetch every result file of `remote_dir` into `staging`, sorting them into accepted/ and quarantine/."""
    accepted_dir, bad_dir = staging / "accepted", staging / "quarantine"
    for d in (accepted_dir, bad_dir):
        d.mkdir(parents=True, exist_ok=True)
    manifest, problem = _manifest(remote, remote_dir, staging)
    names = sorted(set(_remote_listing(remote, remote_dir)) | set(manifest))
    accepted: list[str] = []
    quarantined: dict[str, str] = {}
    odd = [n for n in names if not _NAME.match(n) or n[:-len(".arrow")] not in TABLES]
    for name in odd[:MAX_LISTED]:
        quarantined[ascii(name)[:80]] = "unexpected file name (not fetched)"
    if len(odd) > MAX_LISTED:
        quarantined[f"{len(odd) - MAX_LISTED} more"] = "unexpected file names (not fetched)"
    for name in (n for n in names if n not in odd):
        local = staging / name
        try:
            remote.get(f"{remote_dir}/{name}", local, max_bytes=MAX_FILE_BYTES)
        except TransferError as e:
            quarantined[name] = f"not fetched: {e}"
            continue
        why = _verdict(local, manifest.get(name), problem, host, run_id)
        if why is None:
            local.replace(accepted_dir / name)
            accepted.append(name)
        else:
            local.replace(bad_dir / name)
            quarantined[name] = why
    write_manifest(accepted_dir)
    return Pulled(accepted_dir=accepted_dir, accepted=accepted, quarantined=quarantined)


def record_unfinished(pulled: Pulled, run_id: str, host: str, profile: str, unfinished: dict[str, str],
                      payload_hash: str | None) -> None:
    """Mark every suite the controller saw time out or fail as `partial` in runs.arrow (adding a
    row for one stopped before it wrote anything), so the run's manifest never calls such a run
    complete, even when the suite had written "complete" just before it was killed. When the
    host's runs.arrow was quarantined, the suites whose tables were accepted get a `partial` row
    of the controller's own, so those good files are still ingested."""
    path = pulled.accepted_dir / "runs.arrow"
    extra = {suite: (0, f"{why} before the suite wrote any result") for suite, why in unfinished.items()}
    if path.is_file():
        table = read_table(path)
        rows, prov = table_rows(table, "runs"), Provenance.of(table)
    else:
        rows, prov = [], Provenance(run_id=run_id, host=host, payload_hash=payload_hash)
        if "runs.arrow" in pulled.quarantined:
            for name in pulled.accepted:
                points = read_table(pulled.accepted_dir / name).num_rows
                extra.setdefault(name.removesuffix(".arrow"), (points, "the host's runs.arrow was quarantined"))
    changed = False
    for i, row in enumerate(rows):
        why = unfinished.get(row.suite)
        if why and row.status != RunStatus.PARTIAL:
            ours = f"{why} seen by the controller"
            note = "; ".join(filter(None, [(row.note or "")[:MAX_TEXT - len(ours) - 2], ours]))
            rows[i], changed = replace(row, status=RunStatus.PARTIAL, note=note), True
    have = {r.suite for r in rows}
    added = [RunRow(run_id=run_id, host=host, suite=suite, profile=profile, status=RunStatus.PARTIAL,
                    payload_hash=payload_hash, points=points, source="measured", note=note)
             for suite, (points, note) in extra.items() if suite not in have]
    if added or changed:
        write_table(pulled.accepted_dir, to_table("runs", rows + added, prov))
        if "runs.arrow" not in pulled.accepted:
            pulled.accepted.append("runs.arrow")


def quarantine(store: Store, host: str, run_id: str, pulled: Pulled) -> str | None:
    """Keep the rejected files (and why) in the artifacts store, beside (never in) the table folders."""
    if not pulled.quarantined:
        return None
    fs = store.fs
    dest = f"{store.base}/quarantine/host={check_name('host', host)}/run={check_name('run id', run_id)}"
    fs.create_dir(dest, recursive=True)
    src_dir = pulled.accepted_dir.parent / "quarantine"
    for name, why in pulled.quarantined.items():
        if not _NAME.match(name):
            continue  # never fetched; its odd name stays in the logs and notes only
        src = src_dir / name
        if src.is_file():
            with src.open("rb") as f, fs.open_output_stream(f"{dest}/{name}") as out:
                shutil.copyfileobj(f, out)
        with fs.open_output_stream(f"{dest}/{name}.reason") as out:
            out.write((why + "\n").encode())
    return dest
