"""A local Prefect server for one controller: start it detached, check it answers, stop only the process it started.

Its state (SQLite database, log, pid file) lives in one folder, `.scratch/prefect-server` of the checkout by
default; the pid file records the process itself (pid, start time, command line), so a stop never signals a
process that merely got the same pid later. `spawn_serve` starts `kdbench serve` the same way (the demo and
the end-to-end tests).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Mapping

from engine.files import atomic_write_bytes
from flows import REPO

DEFAULT_HOME = REPO / ".scratch" / "prefect-server"
DEFAULT_PORT = 4200
PID_FILE = "server.pid"  # JSON: pid, create_time and argv of the server process (server_process checks all three)


class ServerError(RuntimeError):
    """The local server could not be started, or a pid file does not name the server it recorded."""


def healthy(api_url: str, timeout_s: float = 2.0) -> bool:
    import urllib.request  # http.client and ssl: loaded when a command talks to the server, not for `--help`

    try:
        with urllib.request.urlopen(f"{api_url.rstrip('/')}/health", timeout=timeout_s) as r:
            return r.status == 200
    except OSError:
        return False


def wait_for_deployment(api_url: str, name: str, timeout_s: float = 120.0,
                        alive: "subprocess.Popen | None" = None) -> bool:
    """True once `flow/deployment` is registered; False on timeout or when `alive` exits first."""
    import urllib.request

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
            raise ServerError(f"prefect server exited with {proc.returncode}: {tail}")
        if healthy(url):
            return proc.pid, url
        time.sleep(0.5)
    stop_process(proc.pid)
    raise ServerError(f"prefect server did not answer on {url} within {wait_s:.0f} s")


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
    ServerError when the file names a process that is not that server (nothing is signalled)."""
    import psutil

    try:
        rec = json.loads(pid_file.read_text())
        pid, born, argv = int(rec["pid"]), float(rec["create_time"]), list(rec["argv"])
    except (OSError, ValueError, KeyError, TypeError):
        raise ServerError(f"{pid_file}: not a pid file this kdbench wrote (it records the process, not just a "
                    "pid); nothing was signalled. Stop the server by hand if one runs, then delete the file") from None
    try:
        p = psutil.Process(pid)
        same = p.create_time() == born and p.cmdline() == argv and os.getpgid(pid) == pid
    except (psutil.NoSuchProcess, ProcessLookupError):
        return None
    except psutil.AccessDenied:
        same = False
    if not same:
        raise ServerError(f"{pid_file}: pid {pid} is now another process, not the Prefect server this command started "
                    "(the server exited and its pid was reused); nothing was signalled. Delete the stale file")
    return pid
