"""`kdbench serve` and `kdbench server` refuse bad situations with one message and exit status 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from flows.transport.sandbox import free_port

KDBENCH = str(Path(sys.executable).parent / "kdbench")


def _dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}/api"


def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([KDBENCH, *args], env={**os.environ, **env}, capture_output=True, text=True, timeout=60)


def test_serve_without_a_server_says_how_to_start_one(tmp_path: Path) -> None:
    res = _run("serve", PREFECT_API_URL=_dead_url(), PREFECT_HOME=str(tmp_path))
    assert res.returncode == 2
    assert "no Prefect server answers" in res.stderr and "kdbench server" in res.stderr
    assert "Traceback" not in res.stderr


def test_server_stop_without_a_pid_file_is_a_clear_error(tmp_path: Path) -> None:
    res = _run("server", "--stop", "--home", str(tmp_path))
    assert res.returncode == 2 and "no pid file" in res.stderr and "Traceback" not in res.stderr
