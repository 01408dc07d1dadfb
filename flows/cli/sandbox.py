"""`kdbench sandbox ...`: local loopback sshd hosts to run the pipeline and its failure paths on."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Optional

import typer

from flows.cli.emit import escape, term

# The sandbox (psutil, cryptography, the inventory) is imported inside each command: `--help` needs none of it.
sandbox_app = typer.Typer(help="Local sandbox hosts: real sshd servers on loopback, with faults on demand.",
                          no_args_is_help=True, rich_markup_mode=None)

StateDir = typer.Option(None, "--state", envvar="KDBENCH_SANDBOX",
                        help="Sandbox state folder (default: the repo's .sandbox/).", show_default=False)
out = partial(term, soft_wrap=True)
err = partial(term, stderr=True)


def _fail(e: Exception) -> typer.Exit:
    err().print(f"[red]error:[/red] {escape(str(e))}", highlight=False, soft_wrap=True)
    return typer.Exit(2)


@sandbox_app.command("up")
def up_cmd(
    count: int = typer.Option(2, "--count", "-n", help="How many hosts (named sbx1..sbxN; up checks the bound)."),
    name: Optional[list[str]] = typer.Option(None, "--name", help="Host names instead of sbx1..N (repeatable)."),
    state: Optional[Path] = StateDir,
) -> None:
    """Start the sandbox hosts and print their inventory folder (host keys already pinned)."""
    from flows.transport.sandbox import SandboxError, status, up

    try:
        hosts_dir = up(count, names=name, state_dir=state)
    except SandboxError as e:
        raise _fail(e) from None
    out().print(f"sandbox up: {', '.join(r['name'] for r in status(state))}", highlight=False)
    out().print(f"inventory: {hosts_dir}", highlight=False)
    out().print(f"try: kdbench hosts check --hosts {hosts_dir}", highlight=False)


@sandbox_app.command("down")
def down_cmd(state: Optional[Path] = StateDir) -> None:
    """Stop every sandbox server and listener (by recorded pid)."""
    from flows.transport.sandbox import down

    down(state)
    out().print("sandbox down")


@sandbox_app.command("status")
def status_cmd(state: Optional[Path] = StateDir) -> None:
    """What runs on each sandbox host and which faults are in effect."""
    from flows.transport.sandbox import default_state_dir, status

    rows = status(state)
    if not rows:
        out().print(f"no sandbox in {state or default_state_dir()}", highlight=False)
        return
    from rich.table import Table
    table = Table(title="sandbox hosts")
    for col in ("name", "address", "port", "process", "pid", "faults", "host key"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["name"], r["address"], str(r["port"]), r["process"] or "stopped", str(r["pid"] or "-"),
                      ", ".join(r["faults"]) or "-", r["host_key"])
    out().print(table)


@sandbox_app.command("fault")
def fault_cmd(
    name: str = typer.Argument(..., help="Sandbox host."),
    kind: str = typer.Argument(..., help="rotate-hostkey | revoke-key | stop | blackhole | heal"),
    state: Optional[Path] = StateDir,
) -> None:
    """Inject a fault: rotate-hostkey (reprovisioned), revoke-key (unauthorized), stop (released),
    blackhole (TCP accepted, no SSH), or heal (undo all; the inventory's pinned key is untouched)."""
    from flows.transport.sandbox import FAULTS, SandboxError, fault

    if kind not in FAULTS:
        raise _fail(ValueError(f"unknown fault {kind!r}; choose one of {', '.join(FAULTS)}"))
    try:
        fault(name, kind, state)  # type: ignore[arg-type]
    except SandboxError as e:
        raise _fail(e) from None
    out().print(f"{name}: {kind}", highlight=False)
