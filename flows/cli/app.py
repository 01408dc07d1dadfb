"""The `kdbench` command: one Typer app, each area contributing its sub-commands.

Every sub-command module imports only typer and rich at the top; the inventory (pydantic, ruamel,
paramiko), the store (pyarrow), Prefect, matplotlib and the projection load inside the commands that use
them, so `--help` needs none of them (tests/test_cli_imports.py checks it; `make bench-cli` times it).
"""

from __future__ import annotations

import typer

from flows.cli.hosts import hosts_app
from flows.cli.notes import backtest_cmd, import_cmd, notes
from flows.cli.project import project_cmd
from flows.cli.sandbox import sandbox_app
from flows.cli.serve import serve, server
from flows.cli.store import store_app

app = typer.Typer(
    help="kdbench: benchmark DDTree kernels and engines across a changing GPU fleet.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # click's plain help: typer's rich help loads rich.markdown and markdown_it (~0.2 s)
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
