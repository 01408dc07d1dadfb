"""The `kdbench` command: one Typer app, each area contributing its sub-commands.

Every sub-command module imports only typer, rich and the inventory at the top; Prefect, pyarrow,
matplotlib and the projection load inside the commands that use them (`make bench-cli` times it).
"""

from __future__ import annotations

import typer

from flows.hosts_cli import hosts_app
from flows.notes_cli import backtest_cmd, import_cmd, notes
from flows.project_cli import project_cmd
from flows.sandbox_cli import sandbox_app
from flows.serve import serve, server
from flows.store_cli import store_app

app = typer.Typer(
    help="kdbench: benchmark DDTree kernels and engines across a changing GPU fleet.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.add_typer(hosts_app, name="hosts")
app.add_typer(sandbox_app, name="sandbox")
app.add_typer(store_app, name="store")
app.command("notes")(notes)
app.command("backtest")(backtest_cmd)
app.command("project")(project_cmd)
app.command("import")(import_cmd)
app.command("serve")(serve)
app.command("server")(server)
