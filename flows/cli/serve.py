"""`kdbench server` (a local Prefect server) and `kdbench serve` (register and serve the deployments).

Deployments: `bench/<host>` for every inventory host (parameters: host, suites, profile,
reference; unset ones come from the KDBENCH_* settings of the process that runs the flow) and
`fleet/fleet`. `kdbench serve` reads hosts/ when it starts, so restarting it picks up added or
removed hosts; deployments of hosts that left the inventory are deleted.

Two ways to run them:
  * one controller: `kdbench serve` runs flow runs itself, as subprocesses, until stopped;
  * a team: `kdbench serve --pool kdbench` registers the same deployments into a Prefect process
    work pool and returns; every controller machine runs `prefect worker start --pool kdbench`
    with the artifacts root on shared storage (docs/running.md).

Prefect and the flows are imported inside the commands that need them, so `kdbench --help` stays quick.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Optional

import typer

from flows.cli.emit import escape, term
from flows.pipelines.server import (DEFAULT_HOME, DEFAULT_PORT, PID_FILE, ServerError, healthy, server_process,
                                    start_server, stop_process)

err = partial(term, stderr=True)


def _fail(message: str) -> typer.Exit:
    err().print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(2)


def server(
    port: int = typer.Option(DEFAULT_PORT, help="Port on 127.0.0.1."),
    home: Path = typer.Option(DEFAULT_HOME, help="Server state: SQLite DB, log, pid file."),
    stop: bool = typer.Option(False, "--stop", help="Stop the server this command started (pid file in --home); "
                                                    "a pid file naming any other process signals nothing."),
    ui: bool = typer.Option(True, "--ui/--no-ui", help="Serve the Prefect UI too."),
) -> None:
    """Start a local Prefect server (SQLite) unless one answers already; print its API URL."""
    url = f"http://127.0.0.1:{port}/api"
    pid_file = home / PID_FILE
    if stop:
        if not pid_file.is_file():
            raise _fail(f"{pid_file}: no pid file, nothing to stop")
        try:
            pid = server_process(pid_file)
        except ServerError as e:
            raise _fail(str(e)) from None
        if pid is not None:
            stop_process(pid)
        pid_file.unlink()
        print(f"stopped the Prefect server of {home}" if pid is not None
              else f"the Prefect server of {home} had already exited; removed its pid file")
        return
    if healthy(url):
        print(url)
        err().print(f"a Prefect server already answers on {url}")
        return
    try:
        pid, url = start_server(home, port, ui=ui)
    except ServerError as e:
        raise _fail(str(e)) from None
    print(url)
    err().print(f"Prefect server started (pid {pid}, state in {home})"
              + (f"; UI at {url.removesuffix('/api')}" if ui else "") + "\n"
              f"  export PREFECT_API_URL={url}\n  stop it with: kdbench server --stop")


def serve(
    pool: Optional[str] = typer.Option(
        None, "--pool", help="Register the deployments into this Prefect process work pool (created if "
                             "missing) and return; run `prefect worker start --pool NAME` on each controller."),
    hosts: Optional[Path] = typer.Option(
        None, "--hosts", show_default=False,
        help="Inventory folder (default: KDBENCH_HOSTS, else the repo's hosts/). The flow runs served "
             "here read it too; workers of a --pool read their own KDBENCH_HOSTS."),
) -> None:
    """Register `bench/<host>` for every host in hosts/ and `fleet/fleet`, and serve them.

    Talks to PREFECT_API_URL (`kdbench server` starts one). Settings come from KDBENCH_HOSTS,
    KDBENCH_ARTIFACTS, KDBENCH_DOCS, KDBENCH_REPO, KDBENCH_COMMIT, KDBENCH_SUITES, KDBENCH_PROFILE,
    KDBENCH_REFERENCE, KDBENCH_UNREACHABLE_RUNS, KDBENCH_PROBE_RETRIES, KDBENCH_RETRY_BACKOFF_S,
    KDBENCH_BUILD_TIMEOUT_S and KDBENCH_BENCH_TIMEOUT_S, read by each flow run.
    Restart it after editing hosts/ to add or drop deployments.
    """
    from flows.inventory.hosts import InventoryError
    from flows.pipelines.deployments import ServeError, serve_deployments
    from flows.pipelines.settings import SettingsError

    try:
        serve_deployments(pool, hosts, lambda text: err().print(text))
    except (ServeError, SettingsError, InventoryError) as e:
        raise _fail(str(e)) from None
