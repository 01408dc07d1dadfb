"""`kdbench hosts ...`: list, add, trust, check, retire and activate inventory hosts."""

from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from flows.cli.emit import escape, term

if TYPE_CHECKING:
    from flows.transport.probe import ProbeResult

# The inventory (pydantic, ruamel, paramiko) is imported inside each command, so `--help` needs none of it.
hosts_app = typer.Typer(help="Inventory hosts: list, add, pin host keys, probe, retire.", no_args_is_help=True,
                        rich_markup_mode=None)

HostsDir = typer.Option(
    None, "--hosts", envvar="KDBENCH_HOSTS", help="Inventory folder (default: the repo's hosts/).",
    show_default=False,
)

out = partial(term, soft_wrap=True)
err = partial(term, stderr=True)


def _dir(hosts: Optional[Path]) -> Path:
    from flows.inventory.files import default_hosts_dir
    return Path(hosts) if hosts is not None else default_hosts_dir()


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print one clear message (no traceback) and return the Exit to raise."""
    err().print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


def _when(v: object) -> str:
    return v.strftime("%Y-%m-%d %H:%M") if v is not None else "-"  # type: ignore[attr-defined]


@hosts_app.command("list")
def list_hosts(hosts: Optional[Path] = HostsDir) -> None:
    """Show every host: GPUs, arch, status, why it was retired, when it last answered."""
    from flows.inventory.files import load_inventory
    from flows.inventory.hosts import InventoryError

    try:
        inv = load_inventory(_dir(hosts))
    except InventoryError as e:
        raise fail(str(e)) from None
    from rich.table import Table
    table = Table(title=f"hosts ({len(inv.hosts)})")
    for col in ("name", "GPUs", "arch", "status", "reason", "last seen"):
        table.add_column(col)
    for h in inv.hosts.values():
        gpu = inv.specs[h.spec].gpu
        table.add_row(h.name, f"{h.gpus}x {gpu}" if h.gpus else gpu, h.arch, h.status,
                      h.retired_reason or "-", _when(h.last_seen))
    out().print(table)


@hosts_app.command("add")
def add(
    name: str = typer.Argument(..., help="Host name (becomes hosts/NAME.yaml)."),
    address: str = typer.Option(..., help="DNS name or IP address."),
    port: int = typer.Option(22, help="SSH port."),
    user: str = typer.Option(..., help="Login user."),
    key: str = typer.Option(
        ..., "--key",
        help="Private key file to log in with (the only key offered); relative to the inventory folder, ~ expands.",
    ),
    spec: str = typer.Option(..., help="Spec sheet name from hosts/specs/ (e.g. h200-sxm)."),
    gpus: int = typer.Option(..., help="Number of GPUs."),
    arch: str = typer.Option(..., help="sm_90, sm_100, sm_103, sm_120 or cpu."),
    interconnect: str = typer.Option("pcie", help="pcie, nvlink or none."),
    python: str = typer.Option("python3", help="Python on the host."),
    work_dir: str = typer.Option("kdbench", help="Work folder on the host (relative = under the user's home)."),
    hosts: Optional[Path] = HostsDir,
) -> None:
    """Write a new host file. No host key is pinned: run `kdbench hosts trust NAME` next."""
    from pydantic import ValidationError

    from flows.inventory.files import validation_message, write_new_host
    from flows.inventory.hosts import Host, InventoryError

    d = _dir(hosts)
    try:
        host = Host.model_validate(dict(
            name=name, address=address, port=port, user=user, key_file=key, spec=spec, gpus=gpus,
            arch=arch, interconnect=interconnect, python=python, work_dir=work_dir,
        ))
    except ValidationError as e:
        raise fail(validation_message(d / f"{name}.yaml", e)) from None
    try:
        path = write_new_host(d, host)
    except InventoryError as e:
        raise fail(str(e)) from None
    out().print(f"wrote {path}; next: kdbench hosts trust {name}", highlight=False)


@hosts_app.command("trust")
def trust(
    name: str = typer.Argument(..., help="Host to pin."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Pin without asking."),
    hosts: Optional[Path] = HostsDir,
) -> None:
    """Fetch the host key the host presents, show its fingerprint and pin it after confirmation.

    This is the only way a key is ever pinned; compare the fingerprint with one obtained out of
    band (e.g. `ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub` on the host's console).
    """
    from flows.inventory.files import load_host, update_host
    from flows.inventory.hosts import InventoryError
    from flows.inventory.keys import fingerprint, key_line
    from flows.transport.connect import RemoteError, fetch_host_key

    d = _dir(hosts)
    try:
        host = load_host(d, name)
        key = fetch_host_key(host, d)
    except InventoryError as e:
        raise fail(str(e)) from None
    except RemoteError as e:
        raise fail(f"{name}: {e.outcome}: {e}", 1) from None
    fp = fingerprint(key)
    pinned = host.fingerprints()
    if pinned == [fp]:
        out().print(f"{name}: {fp} is already pinned", highlight=False)
        return
    out().print(f"{name} presents {key.get_name()} {fp}", highlight=False)
    if pinned:
        out().print(f"[yellow]currently pinned:[/yellow] {', '.join(pinned)} (this replaces it)", highlight=False)
    if not yes and not typer.confirm("Pin this key?", default=False):
        raise fail("not pinned", 1)
    try:
        update_host(d, name, host_keys=[key_line(key)])
    except InventoryError as e:
        raise fail(str(e)) from None
    out().print(f"{name}: pinned {fp}", highlight=False)
    if host.status == "retired":
        out().print(f"{name} is still retired ({host.retired_reason}); `kdbench hosts activate {name}` to use it")


def _show(r: ProbeResult) -> None:
    from flows.inventory.scrub import line

    colour = "green" if r.outcome == "ok" else "red"
    out().print(f"{r.host}: [{colour}]{r.outcome}[/{colour}] ({r.elapsed_s:.2f} s) {line(r.detail)}", highlight=False)
    if r.outcome == "host_key_changed":
        out().print(f"  pinned {', '.join(r.pinned_fingerprints) or '-'}; presented {r.presented_fingerprint}",
                  highlight=False)
    if r.outcome == "ok":
        f = r.facts
        gpus = f"{f['gpu_count']}x {f['gpu_names'][0]}" if f["gpu_count"] else "no GPU"
        out().print("  " + line(f"{gpus}, arch {f['arch_found']}, driver {f['driver'] or '-'}, python {f['python']}, "
                        f"torch {f['torch']}, triton {f['triton']}, {f['disk_free_gb']} GB free"), highlight=False)
    for m in r.mismatches:
        out().print(f"  [yellow]mismatch[/yellow] {line(m)}", highlight=False)


@hosts_app.command("check")
def check(
    names: Optional[list[str]] = typer.Argument(None, help="Hosts to probe (default: every active host)."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON list of probe results."),
    connect_timeout: float = typer.Option(5.0, help="Seconds for TCP connect, banner and auth each."),
    hosts: Optional[Path] = HostsDir,
) -> None:
    """Probe hosts over SSH with their pinned keys; exit 1 when any is not `ok`.

    Outcomes: ok, unauthorized, host_key_changed, host_key_unknown, unreachable, timeout.
    Nothing is retired or re-pinned here; `ok` updates the host's last_seen.
    """
    from flows.inventory.files import load_inventory, now, update_host
    from flows.inventory.hosts import InventoryError
    from flows.transport.connect import Timeouts
    from flows.transport.probe import probe

    d = _dir(hosts)
    try:
        inv = load_inventory(d)
        for n in names or []:
            if n not in inv.hosts:
                raise InventoryError(f"{d}: no host named {n!r}")
        targets = [inv.hosts[n] for n in names] if names else [h for h in inv.hosts.values() if h.status == "active"]
        t = Timeouts(connect=connect_timeout, banner=connect_timeout, auth=connect_timeout)
        results = []
        for h in targets:
            r = probe(h, d, t)
            results.append(r)
            if r.outcome == "ok":
                update_host(d, h.name, last_seen=now())
            if not as_json:
                _show(r)
    except InventoryError as e:
        raise fail(str(e)) from None
    if as_json:
        sys.stdout.write(json.dumps([r.model_dump(mode="json") for r in results], indent=2) + "\n")
    if any(r.outcome != "ok" for r in results):
        raise typer.Exit(1)


@hosts_app.command("retire")
def retire_cmd(
    name: str = typer.Argument(..., help="Host to retire."),
    reason: str = typer.Option(..., help="unauthorized, host_key_changed, released or unreachable."),
    hosts: Optional[Path] = HostsDir,
) -> None:
    """Take a host out of service, recording why and when."""
    from flows.inventory.files import retire
    from flows.inventory.hosts import InventoryError, RetiredReason

    allowed = RetiredReason.__args__  # type: ignore[attr-defined]
    if reason not in allowed:
        raise fail(f"--reason: must be one of {', '.join(allowed)} (got {reason!r})")
    try:
        h = retire(_dir(hosts), name, reason)  # type: ignore[arg-type]
    except InventoryError as e:
        raise fail(str(e)) from None
    out().print(f"{h.name}: retired ({h.retired_reason})", highlight=False)


@hosts_app.command("activate")
def activate_cmd(name: str = typer.Argument(..., help="Host to put back into service."), hosts: Optional[Path] = HostsDir) -> None:
    """Put a host back into service (clears the retirement fields; pinned keys are untouched)."""
    from flows.inventory.files import activate
    from flows.inventory.hosts import InventoryError

    try:
        h = activate(_dir(hosts), name)
    except InventoryError as e:
        raise fail(str(e)) from None
    out().print(f"{h.name}: active", highlight=False)

