"""`kdbench server` (a local Prefect server) and `kdbench serve` (the deployments).

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

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Optional

import typer
from rich.console import Console
from rich.markup import escape

from engine.files import atomic_write_bytes
from flows import REPO
from flows.inventory.files import InventoryError, load_inventory

if TYPE_CHECKING:
    from prefect.deployments.runner import RunnerDeployment

    from flows.pipelines.settings import Settings

err = Console(stderr=True)
DEFAULT_HOME = REPO / ".scratch" / "prefect-server"
DEFAULT_PORT = 4200
PID_FILE = "server.pid"  # JSON: pid, create_time and argv of the server process (server_process checks all three)


def _fail(message: str) -> typer.Exit:
    err.print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(2)


# -- a local Prefect server -----------------------------------------------------------------

def healthy(api_url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url.rstrip('/')}/health", timeout=timeout_s) as r:
            return r.status == 200
    except OSError:
        return False


def wait_for_deployment(api_url: str, name: str, timeout_s: float = 120.0,
                        alive: "subprocess.Popen | None" = None) -> bool:
    """True once `flow/deployment` is registered; False on timeout or when `alive` exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if alive is not None and alive.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(f"{api_url.rstrip('/')}/deployments/name/{name}", timeout=5):
                return True
        except OSError:
            time.sleep(0.5)
    return False


def spawn_serve(env: Mapping[str, str], log: Path) -> subprocess.Popen:
    """`kdbench serve` in its own session (so stop_process ends it with its flow-run children), output to `log`."""
    with log.open("wb") as out:
        return subprocess.Popen([str(Path(sys.executable).parent / "kdbench"), "serve"], env=dict(env), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def server_env(home: Path, ui: bool = True) -> dict[str, str]:
    """The environment of a Prefect server whose state (SQLite DB included) lives under `home`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update({
        "PREFECT_HOME": str(home),
        "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home / 'prefect.db'}",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_UI_ENABLED": "true" if ui else "false",
        "PREFECT_LOGGING_LEVEL": "WARNING",
        # so `prefect deployment run ... --watch` shows the run's logs (the host's output) live
        "PREFECT_SERVER_LOGS_STREAM_OUT_ENABLED": "true",
        "PREFECT_SERVER_LOGS_STREAM_PUBLISHING_ENABLED": "true",
    })
    return env


def start_server(home: Path, port: int, *, ui: bool = True, wait_s: float = 120.0) -> tuple[int, str]:
    """Start `prefect server start` detached; returns (pid, API URL) once /api/health answers.

    The pid file records the process as well as its pid (its start time and command line), so
    `kdbench server --stop` never signals a process that merely got the same pid later."""
    import psutil

    home.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{port}/api"
    argv = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    with (home / "server.log").open("ab") as log:
        proc = subprocess.Popen(argv, env=server_env(home, ui), stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True, cwd=home)
    try:
        born = psutil.Process(proc.pid).create_time()
    except psutil.NoSuchProcess:
        born = None  # already gone: the wait below reports why
    atomic_write_bytes(home / PID_FILE, json.dumps({"pid": proc.pid, "create_time": born, "argv": argv}).encode())
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = (home / "server.log").read_text(errors="replace")[-800:]
            raise RuntimeError(f"prefect server exited with {proc.returncode}: {tail}")
        if healthy(url):
            return proc.pid, url
        time.sleep(0.5)
    stop_process(proc.pid)
    raise RuntimeError(f"prefect server did not answer on {url} within {wait_s:.0f} s")


def stop_process(pid: int, grace_s: float = 10.0) -> None:
    """SIGTERM the process group we started (the server or serve spawns children), then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    return
            except ChildProcessError:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    return
            time.sleep(0.1)


def server_process(pid_file: Path) -> int | None:
    """The pid of the server `start_server` recorded in `pid_file` when that very process still runs
    (same pid, start time, command line, leading its own process group); None when it has exited.
    typer.Exit (after one message) when the file names a process that is not that server."""
    import psutil

    try:
        rec = json.loads(pid_file.read_text())
        pid, born, argv = int(rec["pid"]), float(rec["create_time"]), list(rec["argv"])
    except (OSError, ValueError, KeyError, TypeError):
        raise _fail(f"{pid_file}: not a pid file this kdbench wrote (it records the process, not just a "
                    "pid); nothing was signalled. Stop the server by hand if one runs, then delete the file") from None
    try:
        p = psutil.Process(pid)
        same = p.create_time() == born and p.cmdline() == argv and os.getpgid(pid) == pid
    except (psutil.NoSuchProcess, ProcessLookupError):
        return None
    except psutil.AccessDenied:
        same = False
    if not same:
        raise _fail(f"{pid_file}: pid {pid} is now another process, not the Prefect server this command started "
                    "(the server exited and its pid was reused); nothing was signalled. Delete the stale file")
    return pid


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
        pid = server_process(pid_file)
        if pid is not None:
            stop_process(pid)
        pid_file.unlink()
        print(f"stopped the Prefect server of {home}" if pid is not None
              else f"the Prefect server of {home} had already exited; removed its pid file")
        return
    if healthy(url):
        print(url)
        err.print(f"a Prefect server already answers on {url}")
        return
    try:
        pid, url = start_server(home, port, ui=ui)
    except RuntimeError as e:
        raise _fail(str(e)) from None
    print(url)
    err.print(f"Prefect server started (pid {pid}, state in {home})"
              + (f"; UI at {url.removesuffix('/api')}" if ui else "") + "\n"
              f"  export PREFECT_API_URL={url}\n  stop it with: kdbench server --stop")


# -- the deployments ------------------------------------------------------------------------

def deployments(s: Settings) -> list[RunnerDeployment]:
    """One `bench/<host>` per inventory host and `fleet/fleet`, loaded by module path so any
    machine with kdbench installed (serve process or worker) can run them."""
    from prefect.deployments.runner import EntrypointType

    from flows.pipelines.bench import bench, fleet

    inv = load_inventory(s.hosts_dir)
    deps = [bench.to_deployment(
        name=h, parameters={"host": h}, tags=["kdbench", f"host-{h}"],
        description=f"Benchmark {h}; projection when it cannot be measured (retired, refused, unreachable).",
        entrypoint_type=EntrypointType.MODULE_PATH,
    ) for h in sorted(inv.hosts)]
    deps.append(fleet.to_deployment(name="fleet", tags=["kdbench"], entrypoint_type=EntrypointType.MODULE_PATH,
                                    description="Every host at once, then the fleet notes."))
    return deps


def _prune(keep: set[str]) -> list[str]:
    """Delete `bench/<host>` deployments whose host left the inventory."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    gone = []
    with get_client(sync_client=True) as client:
        for d in client.read_deployments(flow_filter=FlowFilter(name=FlowFilterName(any_=["bench"]))):
            if d.name not in keep:
                client.delete_deployment(d.id)
                gone.append(d.name)
    return gone


def _ensure_pool(name: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(name)
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(name=name, type="process"))


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
    from prefect import serve as prefect_serve
    from prefect.settings import get_current_settings

    from flows.pipelines.bench import NOTES_LIMIT, ensure_limit, limit_name
    from flows.pipelines.settings import Settings, SettingsError

    api = get_current_settings().api.url
    if not api:
        raise _fail("PREFECT_API_URL is not set: start a server with `kdbench server` and export the URL it prints")
    if not healthy(api):
        raise _fail(f"no Prefect server answers at PREFECT_API_URL={api} (`kdbench server` starts one)")
    if hosts is not None:  # flow runs read KDBENCH_HOSTS when they start; they inherit this environment
        os.environ["KDBENCH_HOSTS"] = str(hosts.resolve())
    try:
        s = Settings.from_env()
        deps = deployments(s)
    except (SettingsError, InventoryError) as e:
        raise _fail(str(e)) from None
    hosts = [d.name for d in deps if d.flow_name == "bench"]
    for h in hosts:
        ensure_limit(limit_name(h))
    ensure_limit(NOTES_LIMIT)
    gone = _prune(set(hosts))
    if gone:
        err.print(f"removed deployments of hosts no longer in the inventory: {', '.join(sorted(gone))}")
    if pool:
        _ensure_pool(pool)
        for d in deps:
            d.apply(work_pool_name=pool)
        print(f"registered {len(deps)} deployments in work pool {pool!r}: "
              + ", ".join(f"{d.flow_name}/{d.name}" for d in deps))
        return
    err.print(f"serving {len(deps)} deployments against {api}: "
              + ", ".join(f"{d.flow_name}/{d.name}" for d in deps))
    prefect_serve(*deps, print_starting_message=False)
