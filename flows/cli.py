"""The `kdbench` command: one Typer app, each area contributing its sub-commands."""

from __future__ import annotations

import typer

app = typer.Typer(
    help="kdbench: benchmark DDTree kernels and engines across a changing GPU fleet.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
