"""`kdbench store ...`: move an old store to the table-first layout, rebuild the run manifests."""

from __future__ import annotations

from typing import Optional

import typer

from flows.hosts_cli import fail, out

store_app = typer.Typer(help="The artifacts store: migrate an old layout, rebuild manifests.", no_args_is_help=True)

Artifacts = typer.Option(None, "--artifacts", envvar="KDBENCH_ARTIFACTS", show_default=False,
                         help="Artifacts store: a folder or a pyarrow filesystem URI (default: the repo's artifacts/).")


@store_app.command("migrate")
def migrate_cmd(artifacts: Optional[str] = Artifacts) -> None:
    """Move a store in the old layout (runs/host=H/run=ID/TABLE.arrow plus runs/_index.jsonl) to
    TABLE/host=H/run=ID/part-0.parquet with one manifest per run, losing no file.

    Each run is checked (sha256, schema), rewritten, read back and compared before its old files go;
    a file that cannot be moved is kept, with the reason, under _unmigrated/. Safe to run again.
    Exit status 1 when something was set aside.
    """
    from engine.schema import SchemaError
    from flows.store import Store, StoreError
    from flows.store_migrate import migrate

    try:
        report = migrate(Store(artifacts))
    except (StoreError, SchemaError, OSError) as e:
        raise fail(str(e)) from None
    out.print(f"migrated {len(report.runs)} run(s)" + (f": {', '.join(report.runs)}" if report.runs else ""),
              highlight=False)
    for path, why in report.set_aside.items():
        out.print(f"[yellow]set aside[/yellow] {path}: {why}", highlight=False)
    for run in report.index_only:
        out.print(f"[yellow]in the old index only[/yellow] (no files): {run}", highlight=False)
    if report.set_aside:
        raise typer.Exit(1)


@store_app.command("reindex")
def reindex_cmd(artifacts: Optional[str] = Artifacts) -> None:
    """Rebuild every run manifest from the files in the table folders (summary, sha256, row counts).

    Partitions without a runs table (an ingest that never finished) and runs whose files do not
    validate are reported and left alone; exit status 1 when there are any.
    """
    from engine.schema import SchemaError
    from flows.store import Store, StoreError

    try:
        report = Store(artifacts).reindex()
    except (StoreError, SchemaError, OSError) as e:
        raise fail(str(e)) from None
    out.print(f"{len(report.written)} manifest(s) written, {len(report.unchanged)} unchanged, "
              f"{len(report.removed)} removed (no files left)", highlight=False)
    for run in report.orphans:
        out.print(f"[yellow]orphan[/yellow] {run}: files without a runs table (an ingest that never finished)",
                  highlight=False)
    for run, why in report.bad.items():
        out.print(f"[red]bad[/red] {run}: {why}", highlight=False)
    if report.orphans or report.bad:
        raise typer.Exit(1)
