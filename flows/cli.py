"""The `kdbench` command: one Typer app, each area contributing its sub-commands."""

from __future__ import annotations

import typer

app = typer.Typer(
    help="kdbench: benchmark DDTree kernels and engines across a changing GPU fleet.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)

from flows.hosts_cli import hosts_app  # noqa: E402
from flows.sandbox_cli import sandbox_app  # noqa: E402
from flows.importer import import_cmd  # noqa: E402
from flows.notes_cli import backtest_cmd, notes  # noqa: E402
from flows.serve import serve, server  # noqa: E402

app.add_typer(hosts_app, name="hosts")
app.add_typer(sandbox_app, name="sandbox")
app.command("notes")(notes)
app.command("backtest")(backtest_cmd)
app.command("import")(import_cmd)
app.command("serve")(serve)
app.command("server")(server)
