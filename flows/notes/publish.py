"""Step four of the notes: the pages written under docs/notes/ behind the leak check, and the notes commit.

Pages name hosts, GPUs, versions and fingerprints, never addresses, user names or key paths: `leaks`
checks every page before any is written, and every file a commit would record before it is made.
Whatever one host's stored data does to its page (a value no guard foresaw, a page over
MAX_PAGE_BYTES, a leak the check caught), it costs that page, never the fleet's notes (`host_page`).
"""

from __future__ import annotations

import difflib
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Sequence

from flows.inventory.files import host_status_text
from flows.inventory.hosts import INDEX_PAGE, Inventory, InventoryError
from flows.inventory.scrub import leaks, md, redact
from flows.notes.gather import gather
from flows.notes.render import render_host, render_index
from flows.notes.views import HostView
from flows.store.store import Store

MAX_PAGE_BYTES = 4 << 20  # of one page: at engine.schema.MAX_ROWS rows a table a page stays far below it
GIT_ENV = {"GIT_AUTHOR_NAME": "kdbench", "GIT_AUTHOR_EMAIL": "kdbench@localhost",
           "GIT_COMMITTER_NAME": "kdbench", "GIT_COMMITTER_EMAIL": "kdbench@localhost"}


class NotesError(Exception):
    """Notes that cannot be written or committed as asked; the message says why."""


def _inside(path: Path, root: Path) -> Path:
    """path, refused unless it resolves strictly inside root (symlinks included)."""
    full = path.resolve()
    if full == root.resolve() or not full.is_relative_to(root.resolve()):
        raise NotesError(f"refusing to write {path.name}: it resolves outside {root.name}/")
    return path


def _failed_page(view: HostView, why: str, inv: Inventory) -> str:
    return (f"# {view.name}: not rendered\n\nThis page {md(why, inv, cap=1000)}. The other pages are not affected; "
            "`kdbench store reindex` reports stored runs whose files do not validate.\n")


def host_page(view: HostView, notes_dir: Path, inv: Inventory) -> str:
    """The host's page, or a short one saying why it could not be written: whatever one host's stored
    data does to its page (a value no guard foresaw, a page over MAX_PAGE_BYTES, a leak the check
    caught), it costs that page, never the fleet's notes."""
    try:
        text = render_host(view, notes_dir)
    except Exception as e:  # the isolation boundary: the failure is named on the page instead
        return _failed_page(view, f"could not be rendered ({type(e).__name__}: {e})", inv)
    size = len(text.encode())
    if size > MAX_PAGE_BYTES:
        return _failed_page(view, f"was {size} bytes, over the {MAX_PAGE_BYTES}-byte bound, so it is not written", inv)
    bad = leaks(text, inv)
    return _failed_page(view, f"would reveal {', '.join(bad)}, so it is not written", inv) if bad else text


def render_notes(store: Store, inv: Inventory, docs_dir: Path) -> list[Path]:
    """Write every host page, its plots and the fleet index under docs_dir/notes/; returns the files."""
    views = gather(store, inv)
    notes_dir = Path(docs_dir) / "notes"
    notes_dir.mkdir(parents=True, exist_ok=True)
    for v in views:
        _inside(notes_dir / v.name, notes_dir), _inside(notes_dir / f"{v.name}.md", notes_dir)
    pages = {notes_dir / f"{v.name}.md": host_page(v, notes_dir, inv) for v in views}
    pages[notes_dir / f"{INDEX_PAGE}.md"] = render_index(views)
    for path, text in pages.items():
        bad = leaks(text, inv)
        if bad:
            raise NotesError(f"{path.name} would reveal {', '.join(bad)}; no page written")
    for path, text in pages.items():
        path.write_text(text)
    pngs = [p for v in views for p in sorted((notes_dir / v.name).glob("*.png"))]
    return sorted([*pages, *pngs])


def _git(repo: Path, *args: str, check: bool = True, index: Path | None = None,
         stdin: str | None = None, text: bool = True) -> subprocess.CompletedProcess:
    """git in repo, with kdbench's identity and (index) a private index file."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("GIT_")}, **GIT_ENV}
    if index is not None:
        env["GIT_INDEX_FILE"] = str(index)
    return subprocess.run(["git", "-C", str(repo), *args], env=env, capture_output=True, text=text,
                          check=check, timeout=60, input=stdin)


def _host_blob(repo: Path, head: str | None, rel: str) -> str | None:
    """What a notes commit may record of a host file: its HEAD version with only the status fields
    replaced by the working file's. None for a file HEAD does not have: kdbench never commits an
    operator's file (address, user, key path) of its own accord."""
    if head is None:
        return None
    old = _git(repo, "show", f"{head}:{rel}", check=False)
    if old.returncode != 0:
        return None
    try:
        return host_status_text(old.stdout, (repo / rel).read_text(encoding="utf-8"), rel)
    except (InventoryError, OSError, UnicodeDecodeError) as e:
        raise NotesError(f"{rel}: cannot take its status fields: {redact(str(e))}") from None


def _added(old: str, new: str) -> str:
    """The lines of new that old does not have: what a commit adds to the history."""
    return "\n".join(line[1:] for line in difflib.unified_diff(old.splitlines(), new.splitlines(), lineterm="", n=0)
                     if line.startswith("+") and not line.startswith("+++"))


def _check_staged(repo: Path, head: str | None, rels: Sequence[str], index: Path, inv: Inventory | None) -> None:
    """The leak check over every file the commit would record. Pages are checked whole; a host
    file only in the lines kdbench adds (its HEAD version is already history). Binary files (the
    plots) are checked for the inventory's own values only."""
    for rel in rels:
        blob = _git(repo, "cat-file", "blob", f":{rel}", check=False, index=index, text=False)
        if blob.returncode != 0:
            continue  # deleted
        data = blob.stdout
        if b"\0" in data:
            bad = leaks(data.decode("latin-1"), inv, generic=False)
        else:
            text = data.decode("utf-8", errors="replace")
            if rel.startswith("hosts/") and head is not None:
                old = _git(repo, "show", f"{head}:{rel}", check=False)
                text = _added(old.stdout if old.returncode == 0 else "", text)
            bad = leaks(text, inv)
        if bad:
            raise NotesError(f"refusing to commit {rel}: it would reveal {', '.join(bad)}; nothing committed")


def commit_notes(repo: Path, paths: Sequence[Path], message: str, inv: Inventory | None = None) -> str | None:
    """Commit exactly `paths` (under docs/ or hosts/) when they changed; returns the commit id or None.

    The commit is built in a private index from HEAD: pages as written, host files as HEAD has them
    with only the status fields kdbench writes replaced (`_host_blob`), so an operator's address,
    user and key path in the working file never enter the history, nor anything the operator had
    staged. Every recorded file passes the leak check; the working files are left as they are. The
    message is redacted first (addresses, logins, key paths), since callers build it from run
    details that may quote an SSH error.
    """
    repo = Path(repo).resolve()
    rels = []
    for p in paths:
        full = Path(p).resolve() if Path(p).is_absolute() else repo / p
        if not full.is_relative_to(repo) or full.relative_to(repo).parts[:1] not in (("docs",), ("hosts",)):
            raise NotesError(f"refusing to commit {Path(p).name}: notes commits touch only docs/ and hosts/")
        rels.append(full.relative_to(repo).as_posix())
    if not rels:
        return None
    try:
        rev = _git(repo, "rev-parse", "--verify", "-q", "HEAD^{commit}", check=False)
        head = rev.stdout.strip() if rev.returncode == 0 else None
        with tempfile.TemporaryDirectory(prefix="kdbench-index-") as tmp:
            index = Path(tmp) / "index"
            _git(repo, "read-tree", *([head] if head else ["--empty"]), index=index)
            pages = [r for r in rels if r.startswith("docs/")]
            if pages:
                _git(repo, "add", "-A", "--", *pages, index=index)
            for rel in (r for r in rels if r.startswith("hosts/")):
                text = _host_blob(repo, head, rel)
                if text is not None:
                    sha = _git(repo, "hash-object", "-w", "--stdin", stdin=text).stdout.strip()
                    _git(repo, "update-index", "--cacheinfo", f"100644,{sha},{rel}", index=index)
            out = _git(repo, "diff", "--cached", "--name-only", "-z", "--", *rels, index=index).stdout
            staged = [s for s in out.split("\0") if s]
            if not staged:
                return None
            _check_staged(repo, head, staged, index, inv)
            tree = _git(repo, "write-tree", index=index).stdout.strip()
        commit = _git(repo, "commit-tree", tree, *(["-p", head] if head else []),
                      stdin=redact(message, inv)).stdout.strip()
        _git(repo, "update-ref", "-m", "kdbench notes", "HEAD", commit, head or "0" * 40)
        # the real index follows HEAD for what was committed; the working files stay as they are
        _git(repo, "reset", "-q", "--", *staged)
        return commit
    except subprocess.CalledProcessError as e:
        raise NotesError(f"git {e.cmd[3]} failed: {redact(e.stderr.strip()[:300], inv)}") from None
