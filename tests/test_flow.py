"""End to end: a real Prefect server, the real `kdbench serve`, real sandbox sshd hosts, and runs
started the way people start them: `prefect deployment run bench/<host> --watch`.

One server, one serve process and one sandbox for the whole module (they take most of the time);
the tests run in file order and build on each other: the healthy pro6000 run is the reference the
later projections carry from, and the worker test goes last because it re-registers the deployments.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

import pyarrow.dataset as ds
import pytest

from engine.schema import SchemaError
from engine.table_files import read_table
from flows.inventory.files import load_host, retire, update_host
from flows.pipelines.server import spawn_serve, stop_process, wait_for_deployment
from flows.store.store import Store
from flows.transport import sandbox as sandbox_mod

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent
HOSTS = ["pro6000", "f2", "f3", "f4", "revoked", "rotated", "stopped", "nopy"]
TIMES: dict[str, float] = {}


def _api(url: str, path: str, body: dict | None = None) -> object:
    req = urllib.request.Request(f"{url}{path}", data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json"}, method="POST" if body is not None else "GET")
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One real Prefect server (SQLite in a tmp dir) for the session, started and stopped by
    `kdbench server` as a user would."""
    home = tmp_path_factory.mktemp("prefect-server")
    cli = [str(BIN / "kdbench"), "server", "--home", str(home)]
    res = subprocess.run([*cli, "--port", str(sandbox_mod.free_port()), "--no-ui"], capture_output=True, text=True, timeout=180)
    try:
        assert res.returncode == 0, res.stderr
        url = res.stdout.strip().splitlines()[-1]
        assert url.startswith("http://127.0.0.1:") and url.endswith("/api")
        yield url
    finally:
        if (home / "server.pid").is_file():
            subprocess.run([*cli, "--stop"], capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, prefect_api: str) -> Iterator[dict]:
    """Sandbox hosts, a notes git repo, an artifacts root and the environment pointing at them."""
    state = tmp_path_factory.mktemp("flow-sandbox")
    hosts_dir = sandbox_mod.up(names=HOSTS, state_dir=state)
    try:
        repo = tmp_path_factory.mktemp("notes-repo")
        for cmd in (["init", "-q", "-b", "main"], ["config", "user.name", "kdbench test"],
                    ["config", "user.email", "kdbench-test@localhost"]):
            subprocess.run(["git", *cmd], cwd=repo, check=True)
        (repo / "README.md").write_text("notes\n")
        subprocess.run(["git", "add", "README.md"], cwd=repo, check=True)
        subprocess.run(["git", "commit", "-q", "-m", "init"], cwd=repo, check=True)
        artifacts = tmp_path_factory.mktemp("artifacts")
        env = {**os.environ,
               "PREFECT_API_URL": prefect_api, "PREFECT_HOME": str(tmp_path_factory.mktemp("prefect-client")),
               "PREFECT_RUNNER_POLL_FREQUENCY": "1", "PREFECT_WORKER_QUERY_SECONDS": "1",
               "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
               "KDBENCH_HOSTS": str(hosts_dir), "KDBENCH_ARTIFACTS": str(artifacts),
               "KDBENCH_DOCS": str(repo / "docs"), "KDBENCH_REPO": str(repo), "KDBENCH_COMMIT": "1",
               "KDBENCH_PROFILE": "smoke", "KDBENCH_SUITES": "kernels", "KDBENCH_REFERENCE": "pro6000",
               "KDBENCH_UNREACHABLE_RUNS": "2", "KDBENCH_PROBE_RETRIES": "1", "KDBENCH_RETRY_BACKOFF_S": "0.2"}
        yield {"state": state, "hosts": hosts_dir, "repo": repo, "artifacts": artifacts, "env": env,
               "api": prefect_api}
    finally:
        sandbox_mod.down(state)


class Served:
    """`kdbench serve` as a subprocess, stopped by pid."""

    def __init__(self, env: dict, log: Path):
        self.log = log
        self.proc = spawn_serve(env, log)

    def stop(self) -> None:
        if self.proc.poll() is None:
            stop_process(self.proc.pid)


@pytest.fixture(scope="module")
def served(world: dict, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    s = Served(world["env"], tmp_path_factory.mktemp("serve") / "serve.log")
    try:
        assert wait_for_deployment(world["api"], "fleet/fleet", 120, s.proc), s.log.read_text()[-3000:]
        time.sleep(2)  # the runner starts polling right after registering
        yield s
    finally:
        s.stop()


def deployment_run(world: dict, name: str, *extra: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
    """The real CLI, exactly as documented; wall time recorded under the deployment name."""
    t0 = time.monotonic()
    res = subprocess.run([str(BIN / "prefect"), "deployment", "run", name, *extra, "--watch"],
                         env=world["env"], capture_output=True, text=True, timeout=timeout_s)
    TIMES[name] = time.monotonic() - t0
    return res


def _ok(res: subprocess.CompletedProcess) -> None:
    assert res.returncode == 0, f"rc {res.returncode}\n{res.stdout[-4000:]}\n{res.stderr[-2000:]}"
    assert "Completed" in res.stdout


def _artifact(world: dict, key: str) -> str:
    rows = _api(world["api"], "/artifacts/filter",
                {"artifacts": {"key": {"any_": [key]}}, "sort": "CREATED_DESC", "limit": 1})
    assert rows, f"no artifact {key}"
    return json.dumps(rows[0]["data"]) if not isinstance(rows[0]["data"], str) else rows[0]["data"]


def _logs(world: dict, flow_run: str, until: str) -> list[str]:
    """A flow run's newest 200 log messages, oldest first, fetched until one matches `until` (30 s at
    most): a served run's logs reach the server in batches, which may land after `--watch` returned."""
    deadline = time.monotonic() + 30
    while True:
        rows = _api(world["api"], "/logs/filter", {"logs": {"flow_run_id": {"any_": [flow_run]}},
                                                   "sort": "TIMESTAMP_DESC", "limit": 200})
        logs = [r["message"] for r in reversed(rows)]
        if any(re.match(until, m) for m in logs) or time.monotonic() > deadline:
            return logs
        time.sleep(0.5)


def _flow_run(cli_output: str) -> str:
    return re.search(r"UUID: ([0-9a-f-]{36})", cli_output).group(1)


def _notes_text(world: dict) -> str:
    docs = world["repo"] / "docs"
    return "\n".join(p.read_text() for p in sorted(docs.rglob("*.md")))


@pytest.fixture(scope="module")
def measured(world: dict, served: Served) -> subprocess.CompletedProcess:
    """The healthy run every later test builds on (it is also the projections' reference)."""
    return deployment_run(world, "bench/pro6000")


def test_healthy_host_is_measured_ingested_and_noted(world: dict, measured: subprocess.CompletedProcess) -> None:
    _ok(measured)
    store = Store(str(world["artifacts"]))
    runs = store.runs("pro6000")
    assert [(r.source, r.status) for r in runs] == [("measured", "complete")]
    run_id = runs[0].run_id
    # the results are readable with pyarrow.dataset in one line
    kernels = ds.dataset(str(world["artifacts"] / "kernels"), partitioning="hive").to_table()
    assert kernels.num_rows > 0 and set(kernels.column("host").to_pylist()) == {"pro6000"}
    assert set(kernels.column("run").to_pylist()) == {run_id}
    assert set(kernels.column("source").to_pylist()) == {"measured"}
    host = load_host(world["hosts"], "pro6000")
    assert host.status == "active" and host.last_seen is not None and host.unreachable_runs == 0
    assert "pro6000" in _notes_text(world)
    log = subprocess.run(["git", "log", "--format=%s"], cwd=world["repo"], capture_output=True, text=True).stdout
    assert "pro6000" in log.splitlines()[0]
    summary = _artifact(world, "bench-pro6000")
    assert "measured" in summary and run_id in summary and "uploaded" in summary
    # the host's output streamed into the run's logs line by line
    point = r"kernels \d+/\d+ \S+ \S+.*: [\d.]+ (us|ms|s),"
    logs = _logs(world, _flow_run(measured.stdout), point)
    # one readable line per point (suite, i/n, label, time, headline), not the raw JSON
    points = [m for m in logs if re.match(point, m)]
    assert points and all("\n" not in m and "{" not in m for m in points)
    assert not [m for m in logs if "KDBENCH" in m]
    assert "pro6000" in _artifact(world, "host-pro6000")


def test_fleet_runs_hosts_in_parallel(world: dict, measured: subprocess.CompletedProcess) -> None:
    fleet = ["pro6000", "f2", "f3", "f4"]
    since = datetime.now(timezone.utc).isoformat()
    res = deployment_run(world, "fleet/fleet", "--params", json.dumps({"hosts": fleet}))
    _ok(res)
    store = Store(str(world["artifacts"]))
    for h in fleet:
        assert any(r.source == "measured" and r.status == "complete" for r in store.runs(h)), h
    children = _api(world["api"], "/flow_runs/filter", {
        "flows": {"name": {"any_": ["bench"]}}, "flow_runs": {"start_time": {"after_": since}}})
    assert sorted(c["parameters"]["host"] for c in children) == sorted(fleet)
    # all four were running at the same moment (how much faster that makes the fleet depends on the
    # controller's cores: printed, not asserted; on a 2-core CI box four CPU benches share 2 cores)
    assert max(c["start_time"] for c in children) < min(c["end_time"] for c in children)
    ratio = TIMES["fleet/fleet"] / TIMES["bench/pro6000"]
    print(f"\nfleet of {len(fleet)}: {TIMES['fleet/fleet']:.1f} s; one host: {TIMES['bench/pro6000']:.1f} s; "
          f"ratio {ratio:.2f}")


def _new_runs(world: dict, host: str, before: set[str]) -> list:
    return [r for r in Store(str(world["artifacts"])).runs(host) if r.run_id not in before]


def _bench_pids(out_dir: Path) -> list[int]:
    """The engine.bench processes writing into out_dir (the sandbox host's processes are local)."""
    pids = []
    for p in Path("/proc").iterdir():
        try:
            cmd = (p / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if p.name.isdigit() and b"engine.bench" in cmd and str(out_dir).encode() in cmd:
            pids.append(int(p.name))
    return pids


def test_killed_bench_leaves_a_partial_run_with_what_it_measured(world: dict,
                                                                 measured: subprocess.CompletedProcess) -> None:
    """The full e2e sweep takes several seconds on a CPU; it is killed as soon as its first point is written."""
    before = {r.run_id for r in Store(str(world["artifacts"])).runs("pro6000")}
    runs_dir = Path(load_host(world["hosts"], "pro6000").work_dir) / "runs"
    known = set(runs_dir.iterdir())
    cli = subprocess.Popen([str(BIN / "prefect"), "deployment", "run", "bench/pro6000", "--params",
                            json.dumps({"profile": "full", "suites": ["e2e"]}), "--watch"],
                           env=world["env"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killed = []
    deadline = time.monotonic() + 240
    while not killed and time.monotonic() < deadline and cli.poll() is None:
        for run in set(runs_dir.iterdir()) - known:
            out = run / "out"
            try:
                points = read_table(out / "e2e.arrow").num_rows
            except (SchemaError, FileNotFoundError):
                points = 0
            if points:
                for pid in _bench_pids(out):
                    os.kill(pid, signal.SIGTERM)
                    killed.append(pid)
        time.sleep(0.05)
    output = cli.communicate(timeout=300)[0]
    assert killed, "the bench was never caught mid-way"
    assert cli.returncode == 0, output[-4000:]
    new = _new_runs(world, "pro6000", before)
    assert [(r.source, r.status) for r in new] == [("measured", "partial")]
    tables = Store(str(world["artifacts"])).load("pro6000", new[0].run_id)
    logs = _logs(world, _flow_run(output), r"e2e \d+/\d+ ")
    announced = {int(m.group(1)) for m in (re.match(r"e2e \d+/(\d+) ", line) for line in logs) if m}
    assert 0 < tables["e2e"].num_rows < max(announced)
    assert {r["status"] for r in tables["runs"].to_pylist()} == {"partial"}
    assert "suite e2e: failed" in _artifact(world, "bench-pro6000")


def test_bench_timeout_kills_the_remote_process_group(world: dict, measured: subprocess.CompletedProcess) -> None:
    """A 3 s limit per suite cuts the full sweeps short: the run still completes, nothing of the
    bench survives on the host, and the run is ingested as partial with whatever was measured."""
    before = {r.run_id for r in Store(str(world["artifacts"])).runs("pro6000")}
    res = deployment_run(world, "bench/pro6000", "--params", json.dumps(
        {"profile": "full", "suites": ["kernels", "e2e"], "bench_timeout_s": 3}))
    _ok(res)
    assert "timeout" in _artifact(world, "bench-pro6000")
    runs_dir = Path(load_host(world["hosts"], "pro6000").work_dir) / "runs"
    assert not [pid for run in runs_dir.iterdir() for pid in _bench_pids(run / "out")]
    new = _new_runs(world, "pro6000", before)
    assert [(r.source, r.status) for r in new] == [("measured", "partial")]


# engine.bench swapped on the host: good runs and kernels files (the run dated 9999), an e2e.arrow
# labelled projected, a line of 8 MB without a newline, and an event line too deep for json.
HOSTILE_BENCH = r"""
import argparse, sys
from pathlib import Path
from engine.table_files import to_table, write_table
p = argparse.ArgumentParser()
for k in ("suite", "profile", "host", "out", "run-id", "payload-hash"):
    p.add_argument("--" + k)
a = p.parse_args()
out = Path(a.out)
out.mkdir(parents=True, exist_ok=True)
prov = {"run_id": a.run_id, "host": a.host, "started_at": "9999-12-31T23:59:59+00:00"}
write_table(out, to_table("runs", [{"run_id": a.run_id, "host": a.host, "suite": "kernels", "profile": a.profile,
                                    "status": "complete", "source": "measured", "started_at": prov["started_at"],
                                    "payload_hash": a.payload_hash}], prov))
write_table(out, to_table("kernels", [{"run_id": a.run_id, "kernel": "moe_w4a16", "impl": "torch", "dtype": "bf16",
                                       "device": "cpu", "M": m, "time_us_p50": 10.0, "bytes": 1e6, "flops": 1e6,
                                       "source": "measured"} for m in (1, 2, 4)], prov))
write_table(out, to_table("e2e", [{"run_id": a.run_id, "config": "k2-mini", "device": "cpu", "concurrency": 1,
                                   "budget": 16, "tokens_per_s": 1e9, "source": "projected"}], prov))
sys.stdout.write("z" * (8 << 20))
sys.stdout.write("\n")
print("KDBENCH " + "[" * 50000 + "]" * 50000)  # an event too deep for json
"""
# engine.build swapped too: it succeeds but leaves a build.json too deep for json
HOSTILE_BUILD = r"""
import argparse
from pathlib import Path
p = argparse.ArgumentParser()
p.add_argument("--arch")
p.add_argument("--out")
out = Path(p.parse_args().out)
out.mkdir(parents=True, exist_ok=True)
(out / "build.json").write_text('{"kernels": ' + "[" * 50000 + "]" * 50000 + "}")
"""


def test_hostile_payload_is_contained_and_earlier_runs_survive(world: dict, measured: subprocess.CompletedProcess,
                                                               tmp_path: Path) -> None:
    """A host whose engine.bench and engine.build are swapped: the run completes, the good files
    land, the projected e2e.arrow is quarantined with its reason, and every run stored before is
    still there."""
    import shutil
    import tarfile

    from flows.transport import deploy as deploy_mod

    host = load_host(world["hosts"], "f3")
    payload = deploy_mod.build_payload(tmp_path)
    pdir = Path(host.work_dir) / "payloads" / payload.sha256
    shutil.rmtree(pdir, ignore_errors=True)
    with tarfile.open(payload.path) as tar:
        tar.extractall(pdir, filter="data")
    (pdir / "engine" / "bench.py").write_text(HOSTILE_BENCH)
    (pdir / "engine" / "build.py").write_text(HOSTILE_BUILD)
    (pdir / ".complete").touch()
    store = Store(str(world["artifacts"]))
    before = [(r.host, r.run_id) for r in store.runs()]
    try:
        res = deployment_run(world, "bench/f3")
    finally:
        shutil.rmtree(pdir)  # the next run of f3 gets the real payload again
    _ok(res)
    new = _new_runs(world, "f3", {r for h, r in before if h == "f3"})
    assert [(r.source, r.status) for r in new] == [("measured", "complete")]
    tables = store.load("f3", new[0].run_id)
    assert tables["kernels"].num_rows == 3 and "e2e" not in tables
    reason = world["artifacts"] / "quarantine" / "host=f3" / f"run={new[0].run_id}" / "e2e.arrow.reason"
    assert "only measured" in reason.read_text()
    assert "quarantined e2e.arrow: " in _artifact(world, "bench-f3")  # the name as md() renders it
    assert store.runs()[-1].run_id == new[0].run_id
    for h, r in before:  # nothing stored before is lost
        assert store.load(h, r)["runs"].num_rows


def test_failed_build_fails_the_run_with_its_log(world: dict, measured: subprocess.CompletedProcess) -> None:
    """sm_90 asked of a CPU-only host: engine.build refuses, and that is a real failure."""
    update_host(world["hosts"], "f4", arch="sm_90")
    res = deployment_run(world, "bench/f4")
    assert res.returncode == 1 and "Failed" in res.stdout
    log = _artifact(world, "build-log-f4")
    assert "Build failed on f4" in log and "sm_90" in log


def test_two_runs_of_one_host_never_overlap(world: dict, measured: subprocess.CompletedProcess) -> None:
    """Started together, the second run waits for the host's concurrency slot (a retired host
    keeps it cheap: projection and notes only)."""
    retire(world["hosts"], "f2", "released")
    t0 = time.monotonic()
    cmd = [str(BIN / "prefect"), "deployment", "run", "bench/f2", "--watch"]
    procs = [subprocess.Popen(cmd, env=world["env"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    spans = []
    for out in outs:
        tasks = _api(world["api"], "/task_runs/filter", {"flow_runs": {"id": {"any_": [_flow_run(out)]}}})
        spans.append((min(t["start_time"] for t in tasks), max(t["end_time"] for t in tasks)))
    first, second = sorted(spans)
    assert first[1] <= second[0], f"the two runs overlapped: {spans}"
    print(f"\ntwo serialised runs of f2: {time.monotonic() - t0:.1f} s")


def _projected(world: dict, host: str) -> None:
    runs = Store(str(world["artifacts"])).runs(host)
    assert runs and runs[-1].source == "projected", runs
    assert host in _notes_text(world)


def _probe_attempts(world: dict, cli_output: str) -> int:
    """How often Prefect ran the probe task of that flow run (1 + its retries)."""
    tasks = _api(world["api"], "/task_runs/filter", {"flow_runs": {"id": {"any_": [_flow_run(cli_output)]}}})
    [probe] = [t for t in tasks if t["name"].startswith("probe")]
    return probe["run_count"]


def test_revoked_client_key_retires_and_projects(world: dict, measured: subprocess.CompletedProcess) -> None:
    sandbox_mod.fault("revoked", "revoke-key", world["state"])
    res = deployment_run(world, "bench/revoked")
    _ok(res)
    assert _probe_attempts(world, res.stdout) == 1  # a refusal is final: no retry
    host = load_host(world["hosts"], "revoked")
    assert (host.status, host.retired_reason) == ("retired", "unauthorized") and host.retired_at is not None
    _projected(world, "revoked")


def test_rotated_host_key_retires_without_pinning_it(world: dict, measured: subprocess.CompletedProcess) -> None:
    pinned = load_host(world["hosts"], "rotated").host_keys
    sandbox_mod.fault("rotated", "rotate-hostkey", world["state"])
    new_fp = next(r["host_key"] for r in sandbox_mod.status(world["state"]) if r["name"] == "rotated")
    _ok(deployment_run(world, "bench/rotated"))
    host = load_host(world["hosts"], "rotated")
    assert (host.status, host.retired_reason) == ("retired", "host_key_changed")
    assert host.presented_host_key_fingerprint == new_fp and host.host_keys == pinned
    assert new_fp not in host.fingerprints()
    _projected(world, "rotated")


def test_stopped_host_is_released_after_n_unreachable_runs(world: dict, measured: subprocess.CompletedProcess) -> None:
    sandbox_mod.fault("stopped", "stop", world["state"])
    res = deployment_run(world, "bench/stopped")
    _ok(res)
    assert _probe_attempts(world, res.stdout) == 2  # KDBENCH_PROBE_RETRIES=1: Prefect retried once
    host = load_host(world["hosts"], "stopped")
    assert (host.status, host.unreachable_runs) == ("active", 1)
    _projected(world, "stopped")
    _ok(deployment_run(world, "bench/stopped"))
    host = load_host(world["hosts"], "stopped")
    assert (host.status, host.retired_reason, host.unreachable_runs) == ("retired", "released", 2)


def test_a_python_without_torch_ends_the_run_with_a_clear_outcome(world: dict, served: Served,
                                                                  tmp_path_factory: pytest.TempPathFactory) -> None:
    """COMPLETED, not measured, nothing uploaded or installed, not retired, not projected (the host is
    reachable), and one message naming the file, the field, what was found and what has torch."""
    from test_deploy import python_envs

    bare, with_torch = python_envs(tmp_path_factory.mktemp("envs"))
    update_host(world["hosts"], "nopy", python=str(bare))
    res = deployment_run(world, "bench/nopy")
    _ok(res)
    summary = _artifact(world, "bench-nopy")
    assert "python_lacks_torch" in summary and "not measured" in summary
    assert "nopy.yaml: field 'python':" in summary and "no torch and no triton" in summary and str(with_torch) in summary
    host = load_host(world["hosts"], "nopy")
    assert host.status == "active" and host.last_seen is not None
    assert Store(str(world["artifacts"])).runs("nopy") == []
    work = Path(host.work_dir)
    assert not (work / "payloads").exists() and not (work / "venv").exists()
    logs = _logs(world, _flow_run(res.stdout), r".*field 'python'")
    assert not any("Traceback" in m for m in logs)
    assert sum("field 'python'" in m for m in logs) == 1


def test_process_worker_runs_the_same_deployments(world: dict, served: Served,
                                                  measured: subprocess.CompletedProcess,
                                                  tmp_path: Path) -> None:
    """The team setup: deployments in a process work pool, run by `prefect worker start`."""
    served.stop()  # one runner at a time: the served deployments are re-registered into the pool
    # serve re-reads hosts/: a new host gets its deployment, a removed one loses it
    hosts = world["hosts"]
    (hosts / "f5.yaml").write_text((hosts / "f3.yaml").read_text().replace("name: f3", "name: f5"))
    (hosts / "f4.yaml").unlink()
    reg = subprocess.run([str(BIN / "kdbench"), "serve", "--pool", "kdbench-test"], env=world["env"],
                         capture_output=True, text=True, timeout=120)
    assert reg.returncode == 0, reg.stderr
    assert "bench/f5" in reg.stdout and "bench/f4" not in reg.stdout and "f4" in reg.stderr
    assert wait_for_deployment(world["api"], "bench/f5", 5)
    assert not wait_for_deployment(world["api"], "bench/f4", 1)
    log = tmp_path / "worker.log"
    with log.open("wb") as out:
        worker = subprocess.Popen([str(BIN / "prefect"), "worker", "start", "--pool", "kdbench-test",
                                   "--type", "process"], env=world["env"], stdout=out,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    try:
        if load_host(hosts, "revoked").status == "active":  # run alone, without the routing tests
            retire(hosts, "revoked", "unauthorized")
        res = deployment_run(world, "bench/revoked")  # retired: the cheap projection path
        _ok(res)
        run = _api(world["api"], f"/flow_runs/{_flow_run(res.stdout)}")
        assert run["work_pool_name"] == "kdbench-test" and run["state"]["type"] == "COMPLETED"
        assert "projected" in _artifact(world, "bench-revoked")
    finally:
        stop_process(worker.pid)
