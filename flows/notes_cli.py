"""`kdbench notes` and `kdbench backtest`: regenerate the notes from artifacts/, check the projection.

The notes, the projection and the store are imported when a command runs, so `kdbench --help` stays quick.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from flows.inventory import InventoryError, default_hosts_dir, load_inventory, repo_root

out = Console()
err = Console(stderr=True)

Artifacts = typer.Option(None, "--artifacts", envvar="KDBENCH_ARTIFACTS", show_default=False,
                         help="Artifacts store: a folder or a pyarrow filesystem URI (default: the repo's artifacts/).")
HostsDir = typer.Option(None, "--hosts", envvar="KDBENCH_HOSTS", show_default=False,
                        help="Inventory folder (default: the repo's hosts/).")
Reference = typer.Option("h200", "--reference", envvar="KDBENCH_REFERENCE",
                         help="Reference set (artifacts/reference/<name>/) or measured host to project from.")


def _expected() -> tuple[type[Exception], ...]:
    """The errors a command reports in one line: bad inventory, store, reference or notes input."""
    from engine.schema import SchemaError
    from flows.notes import NotesError
    from flows.projection import ProjectionError
    from flows.store import StoreError
    return InventoryError, StoreError, ProjectionError, SchemaError, NotesError


def _fail(message: str) -> typer.Exit:
    err.print(f"[red]error:[/red] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(2)


def notes(artifacts: Optional[str] = Artifacts, hosts: Optional[Path] = HostsDir, reference: str = Reference,
          docs: Path = typer.Option(repo_root() / "docs", "--docs", envvar="KDBENCH_DOCS",
                                    help="docs/ folder; the pages go to <docs>/notes/."),
          commit: bool = typer.Option(False, "--commit/--no-commit",
                                      help="Commit the notes with git (only when they changed).")) -> None:
    """Regenerate docs/notes/ (one page per host, the fleet index, plots) from artifacts/ alone.

    A host with no measured run gets a projected page, carried from the reference.

    The same inputs always give the same bytes, so a commit only happens when a figure changed.
    """
    from flows.notes import commit_notes, gather, notes_message, render_notes
    from flows.store import Store

    try:
        store, inv = Store(artifacts), load_inventory(hosts or default_hosts_dir())
        views = gather(store, inv, reference)
        paths = render_notes(store, inv, docs, reference)
        sha = commit_notes(docs.resolve().parent, paths, notes_message(store, inv, reference), inv) \
            if commit else None
    except _expected() as e:
        raise _fail(str(e)) from None
    for v in views:
        out.print(f"{v.name}: {v.kind}" + (f" ({v.missing})" if v.missing else ""), highlight=False)
    out.print(f"{len(paths)} file(s) under {docs.name}/notes/"
              + (f"; committed {sha[:10]}" if sha else "; nothing to commit" if commit else ""), highlight=False)


def backtest_cmd(artifacts: Optional[str] = Artifacts, hosts: Optional[Path] = HostsDir) -> None:
    """Project every measured host from every measured host and print the error per kernel family and e2e.

    Error = projected / measured - 1, median and worst over the matched points.

    "in band" is the share of measured points inside the projected low-high band.

    A host projected from itself must show zero error: that row checks the projection's arithmetic.
    """
    from flows.projection import backtest
    from flows.store import Store

    try:
        rows = backtest(Store(artifacts), load_inventory(hosts or default_hosts_dir()))
    except _expected() as e:
        raise _fail(str(e)) from None
    if not rows:
        out.print("no measured data: record a reference (artifacts/reference/<name>/) or run a host first")
        return
    table = Table(title="projection backtest (projected / measured - 1)")
    for col in ("reference", "target", "family", "points", "median error", "worst error", "in band"):
        table.add_column(col, no_wrap=True,
                         justify="right" if col in ("points", "median error", "worst error", "in band") else "left")
    for r in rows:
        table.add_row(r.reference, r.target, r.family, str(r.points), f"{r.median_error:+.1%}",
                      f"{r.worst_error:+.1%}", f"{r.in_band:.0%}")
    out.print(table)
    if len({r.target for r in rows}) < 2:
        out.print("only one host has measured data: the table checks self-consistency; "
                  "cross-host errors appear once a second host is measured", highlight=False)
