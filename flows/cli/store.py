"""`kdbench store ...`: move an old store to the table-first layout, rebuild the run manifests."""

from __future__ import annotations

from typing import Optional

import typer

from flows.cli.emit import escape
from flows.cli.hosts import fail, out

store_app = typer.Typer(help="The artifacts store: migrate an old layout, rebuild manifests.", no_args_is_help=True,
                        rich_markup_mode=None)

Artifacts = typer.Option(None, "--artifacts", envvar="KDBENCH_ARTIFACTS", show_default=False,
                         help="Artifacts store: a folder or a pyarrow filesystem URI (default: the repo's artifacts/).")


@store_app.command("migrate")
def migrate_cmd(artifacts: Optional[str] = Artifacts,
                break_lock: bool = typer.Option(False, "--break-lock",
                                                help="Remove the marker a killed migration left on an object store "
                                                     "(only when no other migration is running).")) -> None:
    """Move a store in the old layout (runs/host=H/run=ID/TABLE.arrow plus runs/_index.jsonl) to
    TABLE/host=H/run=ID/part-0.parquet with one manifest per run, losing no file.

    Each run is checked (sha256, schema), rewritten, read back and compared before its old files go;
    a file that cannot be moved is kept, with the reason, under _unmigrated/. Safe to run again, also
    after being killed half-way. One migration at a time: a second one is refused while the first
    holds the store's lock (.migrate.lock: a file lock on a folder, a marker object on S3).
    Exit status 1 when something was set aside.
    """
    from engine.schema import SchemaError
    from flows.store.layout import StoreError
    from flows.store.migrate import migrate
    from flows.store.store import Store

    try:
        report = migrate(Store(artifacts), break_lock)
    except (StoreError, SchemaError, OSError) as e:
        raise fail(str(e)) from None
    out().print(f"migrated {len(report.runs)} run(s)" + (f": {escape(', '.join(report.runs))}" if report.runs else ""),
              highlight=False)
    for path, why in report.set_aside.items():
        out().print(f"[yellow]set aside[/yellow] {escape(path)}: {escape(why)}", highlight=False)
    for run in report.index_only:
        out().print(f"[yellow]in the old index only[/yellow] (no files): {escape(run)}", highlight=False)
    if report.set_aside:
        raise typer.Exit(1)


@store_app.command("reindex")
def reindex_cmd(artifacts: Optional[str] = Artifacts) -> None:
    """Rebuild every run manifest from the files in the table folders (summary, sha256, row counts).

    Partitions without a runs table (an ingest that never finished) and runs whose files do not
    validate are reported and left alone; a manifest that cannot be used (unparseable, or naming
    files that are not its run's own) is set aside under quarantine/_manifests/ with the reason, and
    rebuilt from the run's files. Exit status 1 when any of these happened.
    """
    from engine.schema import SchemaError
    from flows.store.layout import StoreError
    from flows.store.store import Store

    try:
        report = Store(artifacts).reindex()
    except (StoreError, SchemaError, OSError) as e:
        raise fail(str(e)) from None
    out().print(f"{len(report.written)} manifest(s) written, {len(report.unchanged)} unchanged, "
              f"{len(report.removed)} removed (no files left)", highlight=False)
    for path, why in report.set_aside.items():
        out().print(f"[yellow]set aside[/yellow] {escape(path)} (under quarantine/_manifests/): {escape(why)}",
                  highlight=False)
    for run in report.orphans:
        out().print(f"[yellow]orphan[/yellow] {escape(run)}: files without a runs table (an ingest that never finished)",
                  highlight=False)
    for run, why in report.bad.items():
        out().print(f"[red]bad[/red] {escape(run)}: {escape(why)}", highlight=False)
    if report.orphans or report.bad or report.set_aside:
        raise typer.Exit(1)
