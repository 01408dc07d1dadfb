"""`kdbench notes`, `kdbench backtest` and `kdbench import`: regenerate the notes, check the projection, bring in outside figures.

The notes, the projection and the store are imported when a command runs, so `kdbench --help` stays quick.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Optional

import typer

from flows import REPO
from flows.cli.emit import Format, console, emit, escape, term

out = console
err = partial(term, stderr=True)

Artifacts = typer.Option(None, "--artifacts", envvar="KDBENCH_ARTIFACTS", show_default=False,
                         help="Artifacts store: a folder or a pyarrow filesystem URI (default: the repo's artifacts/).")
HostsDir = typer.Option(None, "--hosts", envvar="KDBENCH_HOSTS", show_default=False,
                        help="Inventory folder (default: the repo's hosts/).")
Reference = typer.Option("h200", "--reference", envvar="KDBENCH_REFERENCE",
                         help="Reference set (artifacts/reference/<name>/) or measured host to project from.")


def _expected() -> tuple[type[Exception], ...]:
    """The errors a command reports in one line: bad inventory, store, reference or notes input."""
    from engine.schema import SchemaError
    from flows.analysis.projection import ProjectionError
    from flows.inventory.hosts import InventoryError
    from flows.notes.publish import NotesError
    from flows.store.layout import StoreError
    return InventoryError, StoreError, ProjectionError, SchemaError, NotesError


def _fail(message: str) -> typer.Exit:
    err().print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)
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
    from flows.analysis.backtest_store import refresh
    from flows.inventory.files import default_hosts_dir, load_inventory
    from flows.notes.gather import gather
    from flows.notes.publish import commit_notes, render_notes
    from flows.notes.summary import notes_message
    from flows.store.store import Store

    try:
        store, inv = Store(artifacts), load_inventory(hosts or default_hosts_dir())
        failed = refresh(store, inv, reference)
        views = gather(store, inv)
        paths = render_notes(store, inv, docs)
        sha = commit_notes(docs.resolve().parent, paths, notes_message(store, inv), inv) \
            if commit else None
    except _expected() as e:
        raise _fail(str(e)) from None
    for v in views:
        why = failed.get(v.name) or v.missing
        out().print(f"{v.name}: {v.kind}" + (f" ({escape(why)})" if why and v.kind != "measured" else ""), highlight=False)
    out().print(f"{len(paths)} file(s) under {docs.name}/notes/"
              + (f"; committed {sha[:10]}" if sha else "; nothing to commit" if commit else ""), highlight=False)


def backtest_cmd(artifacts: Optional[str] = Artifacts, hosts: Optional[Path] = HostsDir,
                 fmt: Format = typer.Option(Format.table, "--format", help="table, csv or json.")) -> None:
    """Hold-out backtests of the projection on the measured data; prints them and stores them for the notes.

    composition: each e2e step from the step model calibrated on the other configurations; depth: the
    full-depth step from shallower runs; size: held-out sizes from smaller ones; tp: a TP-N rank from
    TP-1; cross-host: each measured host from every other (and imported outside figures); kernel changed:
    a target's points that ran other code than the reference's, reported apart (no band rests on them).

    Error = predicted / measured - 1, median and worst over the points; "in band" is the share of
    points inside a band built from the other points' held-out errors (the evidence every projected
    figure's band comes from), "half-width" that band's median half-width; "goal" says by how much a
    row misses its goal.
    """
    from dataclasses import asdict

    from flows.analysis.backtest import PER_POINT
    from flows.analysis.backtest_store import backtests_of, store_backtest
    from flows.inventory.files import default_hosts_dir, load_inventory
    from flows.inventory.scrub import plain
    from flows.notes.sections.backtest import BACKTEST_COLUMNS, backtest_cells
    from flows.store.store import Store

    try:
        store, inv = Store(artifacts), load_inventory(hosts or default_hosts_dir())
        rows = backtests_of(store, inv)
        if not rows:
            out().print("no measured data: record a reference (artifacts/reference/<name>/) or run a host first")
            return
        store_backtest(store, rows)
    except _expected() as e:
        raise _fail(str(e)) from None
    cells = backtest_cells(rows, plain)
    for r, c in zip(rows, cells):
        if r.skipped:
            c[-1] = "skipped"
    records = [{k: v for k, v in asdict(r).items() if k not in PER_POINT} for r in rows]
    out().file.write(emit(records, fmt, "projection backtests (predicted / measured - 1)", cells, BACKTEST_COLUMNS,
                        right=("points", "median error", "median |error|", "worst error", "in band", "half-width")))
    if fmt == Format.table:
        for r in rows:
            if r.skipped:
                out().print(f"skipped: {escape(f'{r.kind} {r.family} ({r.reference}): {r.detail}')}",
                          highlight=False, soft_wrap=True)


def import_cmd(file: Path = typer.Argument(..., help="CSV or JSON of kernel points or serving results."),
               name: str = typer.Option(..., "--name", help="Dataset name: writes reference/<name>/ in the store."),
               artifacts: Optional[str] = Artifacts, hosts: Optional[Path] = HostsDir,
               replace: bool = typer.Option(False, "--replace",
                                            help="Take a name already in use: kdbench's own measured reference, "
                                                 "or a host with measured runs.")) -> None:
    """Import outside figures (a kernel sweep, a serving benchmark) as a reference dataset.

    The file carries a provenance header (machine, date, source; origin published|outside; host or
    spec; gpus; impl). The dataset then works as `--reference NAME`, and its e2e rows appear on
    that machine's notes page labelled as outside measurements. Importing again under the same name
    replaces the earlier import; a name kdbench's own data already goes by needs --replace.
    """
    from flows.analysis.importer import ImportFileError, import_file
    from flows.inventory.files import default_hosts_dir, load_inventory
    from flows.inventory.hosts import InventoryError
    from flows.store.layout import StoreError, default_root

    try:
        import_file(file, name, artifacts or default_root(), load_inventory(hosts or default_hosts_dir()), replace)
    except (ImportFileError, InventoryError, StoreError, OSError) as e:
        raise _fail(str(e)) from None
    out().print(f"wrote reference/{escape(name)}/ from {escape(file.name)}", highlight=False)
