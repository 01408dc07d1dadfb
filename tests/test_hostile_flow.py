"""A hostile host's output against the real flow tasks, a real sandbox sshd and a real Prefect server
(`kdbench server`, as users start it): what reaches the Prefect database is bounded and escaped.
And `kdbench server --stop` signals nothing but the server it started."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest
from rich.text import Text

from flows import REPO
from flows.inventory.scrub import LINE_CAP
from flows.pipelines.progress import HEAD_LINES, TAIL_LINES
from flows.pipelines.tasks import ARTIFACT_LINE
from flows.transport import sandbox as sandbox_mod

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent
LINES = 1300
# The host's "python": whatever it is asked to run, it prints far too much, then every trick it has.
HOSTILE = r"""
import sys
for i in range(int(sys.argv[1])):
    print(f"line {i} " + "y" * 3000)
print("\x1b]8;;https://evil.test\x07click\x1b]8;;\x07 \x1b[31mred\x1b[0m [/x] [link=https://evil.test]here[/link] "
      "from admin@10.1.2.3 " + "z" * 100_000)
sys.exit(3)
"""


def _api(url: str, path: str, body: dict) -> list:
    req = urllib.request.Request(f"{url}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Prefect server started and stopped with `kdbench server`; the stop must find it by its pid file."""
    home = tmp_path_factory.mktemp("prefect-server")
    cli = [str(BIN / "kdbench"), "server", "--home", str(home)]
    res = subprocess.run([*cli, "--port", str(sandbox_mod.free_port()), "--no-ui"], capture_output=True, text=True,
                         timeout=180)
    pid = json.loads((home / "server.pid").read_text())["pid"] if (home / "server.pid").is_file() else None
    try:
        assert res.returncode == 0, res.stderr
        yield res.stdout.strip().splitlines()[-1]
    finally:
        if pid is not None:
            stop = subprocess.run([*cli, "--stop"], capture_output=True, text=True, timeout=60)
            assert stop.returncode == 0 and "stopped the Prefect server" in stop.stdout, stop.stderr
            assert not sandbox_mod._alive(pid)


def _logs(url: str, flow_run: str, until: str) -> list[str]:
    """Every log message of a flow run, once one contains `until` (records reach the server in batches)."""
    deadline = time.monotonic() + 30
    while True:
        out: list[str] = []
        while True:
            page = _api(url, "/logs/filter", {"logs": {"flow_run_id": {"any_": [flow_run]}}, "sort": "TIMESTAMP_ASC",
                                              "limit": 200, "offset": len(out)})
            out += [r["message"] for r in page]
            if len(page) < 200:
                break
        if any(until in m for m in out) or time.monotonic() > deadline:
            return out
        time.sleep(0.5)


def _artifact(url: str, key: str) -> str:
    [row] = _api(url, "/artifacts/filter", {"artifacts": {"key": {"any_": [key]}}, "sort": "CREATED_DESC", "limit": 1})
    return row["data"] if isinstance(row["data"], str) else json.dumps(row["data"])


# The flow's own tasks, pointed at a host whose python is the hostile script, run as a served flow run
# is: a process whose environment points at the server (host output is logged from the SSH reader threads).
FLOW = r"""
import sys
from pathlib import Path
from prefect import flow
from flows.inventory.files import load_host
from flows.pipelines import bench as bench_flow
from flows.pipelines.bench import RunReport
from flows.pipelines.settings import Settings
from flows.pipelines.tasks import BuildFailed, SuiteResult, bench_suite, build
from flows.transport.deploy import Deployed
from flows.transport.remote import Remote

@flow(name="hostile-output")
def hostile_output(hosts_dir: str, name: str, python: str, out_dir: str) -> None:
    host = load_host(Path(hosts_dir), name)
    dep = Deployed(work_dir=host.work_dir, payload_hash="0" * 64, uploaded=False, payload_dir=host.work_dir,
                   python=python, installed=[])
    with Remote(host, Path(hosts_dir)) as remote:
        res = bench_suite(remote, host, dep, "kernels", "smoke", "run-1", out_dir, 120)
        try:
            build(remote, host, dep, out_dir, 120)
        except BuildFailed:
            pass
    headline = "kernels: best 1.0 GB/s (\x1b[31m[/x] [link=https://evil.test]k admin@10.1.2.3 " + "k" * 100_000 + ")"
    bench_flow._publish(RunReport(host=name, route="measured", outcome="partial", run_id="run-1",
                                  suites=[SuiteResult(suite="kernels", status=res.status, rc=res.rc, elapsed_s=1,
                                                      points=0)],
                                  headline=[headline], quarantined={"e2e.arrow": "[/x] " + "q" * 10_000}), Settings())

state = hostile_output(*sys.argv[1:], return_state=True)
print("FLOW_RUN", state.state_details.flow_run_id, state.type.value)
"""


def test_hostile_output_reaches_prefect_bounded_and_escaped(sandbox_factory, prefect_server: str, tmp_path: Path) -> None:
    """N5: every line a host printed became a log record of up to 64 KiB (3,000 lines grew the Prefect
    database by 191 MiB) and a failed build attached its whole tail (12.5 MiB). N6: ESC/OSC sequences
    and rich markup reached the records raw (`[/x]` stopped a watching CLI), and the host table
    artifact carried host strings raw (100 KB, an address-like string)."""
    sbx = sandbox_factory(names=["loud"])
    host = sbx.host("loud")
    script = tmp_path / "hostile.py"
    script.write_text(HOSTILE)
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} {script} {LINES}\n")
    python.chmod(0o755)
    (tmp_path / "hostile_flow.py").write_text(FLOW)
    env = {**os.environ, "PREFECT_API_URL": prefect_server, "PREFECT_HOME": str(tmp_path / "prefect-home")}
    res = subprocess.run([sys.executable, str(tmp_path / "hostile_flow.py"), str(sbx.hosts_dir), "loud", str(python),
                          str(tmp_path / "out")], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    run = [line.split() for line in res.stdout.splitlines() if line.startswith("FLOW_RUN ")]
    assert res.returncode == 0 and run and run[-1][2] == "COMPLETED", res.stderr[-3000:]
    logs = _logs(prefect_server, run[-1][1], "build: line")
    # the commands' own lines, prefixed "kernels: " / "build: " (main wrote "[kernels] " / "[build] ")
    suite = [m for m in logs if m.lstrip("\\[").startswith(("kernels:", "kernels]"))]
    built = [m for m in logs if m.lstrip("\\[").startswith(("build:", "build]"))]
    for lines in (suite, built):  # per command: the first lines, one line saying how many were dropped, the last
        assert len(lines) == HEAD_LINES + TAIL_LINES, len(lines)
    dropped = [m for m in logs if "lines of output dropped here" in m]
    assert len(dropped) == 2 and all(f"{LINES + 1 - HEAD_LINES - TAIL_LINES} lines" in m for m in dropped)
    assert max(map(len, logs)) < LINE_CAP + 200
    for m in logs:  # `prefect deployment run --watch` prints each record as rich markup: no error, no link
        assert "\x1b" not in m and "\x07" not in m and "10.1.2.3" not in m and "admin@" not in m
        shown = Text.from_markup(f"[dim]x[/dim] {m}")
        assert not any("link" in str(span.style) for span in shown.spans)
    assert "\\[/x]" in suite[-1] and "\\[link=https" in suite[-1]
    # the failed build's artifact quotes the end of its log, each line cut short
    log_artifact = _artifact(prefect_server, "build-log-loud")
    assert len(log_artifact) < TAIL_LINES * (ARTIFACT_LINE + 10) + 1000 and f"line {LINES - 1} " in log_artifact
    table = _artifact(prefect_server, "host-loud")
    assert len(table) < 2000 and "\x1b" not in table and "10.1.2.3" not in table and "\\\\[/x]" in table


def test_stop_signals_nothing_but_the_server_it_started(tmp_path: Path) -> None:
    """N14: `kdbench server --stop` signalled whatever process group a stale pid file named."""
    sleeper = subprocess.Popen(["sleep", "300"], start_new_session=True)
    home = tmp_path / "home"
    home.mkdir()
    stop = [str(BIN / "kdbench"), "server", "--home", str(home), "--stop"]
    argv = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", "4200"]
    try:
        for record, words in ((f"{sleeper.pid}\n", "not a pid file this kdbench wrote"),
                              (json.dumps({"pid": sleeper.pid, "create_time": 1.0, "argv": argv}),
                               "is now another process")):
            (home / "server.pid").write_text(record)
            res = subprocess.run(stop, capture_output=True, text=True, timeout=60)
            assert res.returncode == 2 and words in res.stderr and "nothing was signalled" in res.stderr, res.stderr
            time.sleep(0.2)
            assert sleeper.poll() is None, "a process that is not the server was signalled"
        gone = subprocess.Popen(["true"])
        gone.wait()
        (home / "server.pid").write_text(json.dumps({"pid": gone.pid, "create_time": 1.0, "argv": argv}))
        res = subprocess.run(stop, capture_output=True, text=True, timeout=60)
        assert res.returncode == 0 and "had already exited" in res.stdout and not (home / "server.pid").exists()
    finally:
        sleeper.kill()
        sleeper.wait()
