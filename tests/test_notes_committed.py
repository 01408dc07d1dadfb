"""The committed notes are exactly what the committed store renders to.

This pins the notes byte for byte: a refactor of the notes, the store or the projection that changes
a single figure, word or pixel fails here, and a change meant to alter the notes must regenerate
docs/notes/ (`kdbench notes`) in the same commit.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from flows import REPO
from flows.analysis.backtest_store import refresh
from flows.inventory.files import load_inventory
from flows.notes.publish import render_notes
from flows.store.store import Store


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_the_committed_store_renders_the_committed_notes_byte_for_byte(tmp_path: Path) -> None:
    store_root = tmp_path / "artifacts"
    shutil.copytree(REPO / "artifacts", store_root)
    store, inv = Store(str(store_root)), load_inventory(REPO / "hosts")
    refresh(store, inv, "h200")
    render_notes(store, inv, tmp_path / "docs")
    rendered, committed = _files(tmp_path / "docs" / "notes"), _files(REPO / "docs" / "notes")
    assert sorted(rendered) == sorted(committed)
    changed = [name for name in committed if rendered[name] != committed[name]]
    assert not changed, f"notes differ from the committed docs/notes/: {changed}"
