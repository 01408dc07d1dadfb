"""`kdbench notes` and `kdbench backtest`: regenerate the notes from artifacts/, check the projection."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from engine.schema import SchemaError
from flows.inventory import InventoryError, default_hosts_dir, load_inventory
from flows.backtest import backtests_of, refresh, store_backtest
from flows.notes import (BACKTEST_COLUMNS, NotesError, backtest_cells, commit_notes, gather, notes_message,
                         render_notes)
from flows.projection import ProjectionError
from flows.settings import REPO
from flows.store import Store, StoreError, default_root

out = Console()
err = Console(stderr=True)

Artifacts = typer.Option(None, "--artifacts", envvar="KDBENCH_ARTIFACTS", show_default=False,
                         help="Artifacts store: a folder or a pyarrow filesystem URI (default: the repo's artifacts/).")
HostsDir = typer.Option(None, "--hosts", envvar="KDBENCH_HOSTS", show_default=False,
                        help="Inventory folder (default: the repo's hosts/).")
Reference = typer.Option("h200", "--reference", envvar="KDBENCH_REFERENCE",
                         help="Reference set (artifacts/reference/<name>/) or measured host to project from.")
EXPECTED = (InventoryError, StoreError, ProjectionError, SchemaError, NotesError)


def _fail(message: str) -> typer.Exit:
    err.print(f"[red]error:[/red] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(2)


def notes(artifacts: Optional[str] = Artifacts, hosts: Optional[Path] = HostsDir, reference: str = Reference,
          docs: Path = typer.Option(REPO / "docs", "--docs", envvar="KDBENCH_DOCS",
                                    help="docs/ folder; the pages go to <docs>/notes/."),
          commit: bool = typer.Option(False, "--commit/--no-commit",
                                      help="Commit the notes with git (only when they changed).")) -> None:
    """Regenerate docs/notes/ (one page per host, the fleet index, plots) from artifacts/ alone.

    First stores what the pages read: a projection from the reference for every inventory host
    without a measured run, and the backtests. Then renders from the store alone.

    The same inputs always give the same bytes, so a commit only happens when a figure changed.
    """
    try:
        store, inv = Store(artifacts or default_root()), load_inventory(hosts or default_hosts_dir())
        failed = refresh(store, inv, reference)
        views = gather(store, inv)
        paths = render_notes(store, inv, docs)
        sha = commit_notes(docs.resolve().parent, paths, notes_message(store, inv), inv) \
            if commit else None
    except EXPECTED as e:
        raise _fail(str(e)) from None
    for v in views:
        why = failed.get(v.name) or v.missing
        out.print(f"{v.name}: {v.kind}" + (f" ({why})" if why and v.kind != "measured" else ""), highlight=False)
    out.print(f"{len(paths)} file(s) under {docs.name}/notes/"
              + (f"; committed {sha[:10]}" if sha else "; nothing to commit" if commit else ""), highlight=False)


def backtest_cmd(artifacts: Optional[str] = Artifacts, hosts: Optional[Path] = HostsDir) -> None:
    """Hold-out backtests of the projection on the measured data; prints them and stores them for the notes.

    composition: each e2e step from the kernel points; depth: the full-depth step from shallower runs;
    size: held-out sizes from smaller ones; tp: a TP-N rank from TP-1; cross-host: each measured host
    from every other (and imported outside figures).

    Error = predicted / measured - 1, median and worst over the points; "in band" is the share of
    measured points inside the predicted band; "goal" says by how much a row misses its goal.
    """
    try:
        store, inv = Store(artifacts or default_root()), load_inventory(hosts or default_hosts_dir())
        rows = backtests_of(store, inv)
        if not rows:
            out.print("no measured data: record a reference (artifacts/reference/<name>/) or run a host first")
            return
        store_backtest(store, rows)
    except EXPECTED as e:
        raise _fail(str(e)) from None
    table = Table(title="projection backtests (predicted / measured - 1)")
    for col in BACKTEST_COLUMNS:
        table.add_column(col, overflow="fold",
                         justify="right" if col in ("points", "median error", "worst error", "in band") else "left")
    skipped = []
    for r, cells in zip(rows, backtest_cells(rows)):
        if r.skipped:
            skipped.append(f"{r.kind} {r.family} ({r.reference}): {r.detail}")
            cells[-1] = "skipped"
        table.add_row(*cells)
    out.print(table)
    for line in skipped:
        out.print(f"skipped: {line}", highlight=False, soft_wrap=True)
