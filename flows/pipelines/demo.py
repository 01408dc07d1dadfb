"""`python -m flows.pipelines.demo` (what `make demo` runs): the whole pipeline on this machine, then cleanup.

Starts a sandbox host (a real sshd on loopback; the engine runs on the CPU), a local Prefect server
and `kdbench serve`; runs `prefect deployment run bench/sbx1 --watch` (measured) and
`prefect deployment run bench/b300 --watch` (the retired B300: projected, never contacted); prints
where the results and the notes are; stops every process it started.

Nothing is committed into your checkout: notes are committed into a scratch clone under
.scratch/demo/notes-repo (or, with --no-commit, only written under .scratch/demo/docs).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from flows import REPO
from flows.inventory.files import load_host
from flows.inventory.hosts import InventoryError
from flows.pipelines.server import spawn_serve, start_server, stop_process, wait_for_deployment
from flows.store.store import Store
from flows.transport import sandbox

BIN = Path(sys.executable).parent
SANDBOX_HOST = "sbx1"
RETIRED_HOST = "b300"
REFERENCE = "h200"


def say(msg: str) -> None:
    print(f"\n== {msg}", flush=True)


def _git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def _inventory(state: Path) -> Path:
    """The sandbox host plus the shipped files of B300 (to project) and H200 (the reference it is
    projected from), each only when retired: the demo never contacts a real machine."""
    hosts = sandbox.up(names=[SANDBOX_HOST], state_dir=state / "sandbox")
    for name in (RETIRED_HOST, REFERENCE):
        try:
            host = load_host(REPO / "hosts", name)
        except InventoryError as e:
            print(f"   {name} left out: {e}")
            continue
        if host.status != "retired":
            print(f"   {name} left out: hosts/{name}.yaml is active, and the demo contacts only sandbox hosts")
            continue
        shutil.copy(REPO / "hosts" / f"{name}.yaml", hosts / f"{name}.yaml")
    return hosts


def _reference(hosts: Path, artifacts: Path) -> str:
    """The committed reference dataset when the checkout has one, else the sandbox run itself."""
    src = REPO / "artifacts" / "reference" / REFERENCE
    if (src / "runs.arrow").is_file() and (hosts / f"{REFERENCE}.yaml").is_file():
        shutil.copytree(src, artifacts / "reference" / REFERENCE)
        print(f"   projections carry from the committed {REFERENCE} reference data")
        return REFERENCE
    print(f"   no usable artifacts/reference/{REFERENCE}/: projections carry from {SANDBOX_HOST}'s run")
    return SANDBOX_HOST


def _notes_target(state: Path, commit: bool) -> tuple[Path, Path | None]:
    """(docs dir, repo): a scratch clone of this checkout when committing, else a plain folder."""
    if not commit:
        return state / "docs", None
    if not (REPO / ".git").exists():
        print("   this checkout is not a git repository: notes are written, not committed")
        return state / "docs", None
    clone = state / "notes-repo"
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(REPO), str(clone)], check=True)
    _git("config", "user.name", "kdbench demo", cwd=clone)
    _git("config", "user.email", "kdbench-demo@localhost", cwd=clone)
    return clone / "docs", clone


def _run(name: str, env: dict[str, str]) -> int:
    cmd = [str(BIN / "prefect"), "deployment", "run", name, "--watch"]
    say(" ".join(["prefect", *cmd[1:]]))
    return subprocess.run(cmd, env=env).returncode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flows.pipelines.demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-commit", action="store_true", help="write the notes without committing them anywhere")
    ap.add_argument("--state", type=Path, default=REPO / ".scratch" / "demo", help="scratch folder (replaced)")
    a = ap.parse_args(argv)
    t0 = time.monotonic()
    state = a.state.resolve()
    sandbox.down(state / "sandbox")  # a previous demo interrupted hard
    shutil.rmtree(state, ignore_errors=True)
    state.mkdir(parents=True)
    procs: list[int] = []
    try:
        say(f"sandbox host {SANDBOX_HOST} (sshd on loopback) and the inventory")
        hosts = _inventory(state)
        print(f"   inventory: {hosts}")
        artifacts = state / "artifacts"
        artifacts.mkdir()
        reference = _reference(hosts, artifacts)
        docs, repo = _notes_target(state, not a.no_commit)

        say("local Prefect server (SQLite)")
        pid, api = start_server(state / "prefect-server", sandbox.free_port())
        procs.append(pid)
        print(f"   {api}  (UI: {api.removesuffix('/api')})")

        env = {**os.environ, "PREFECT_API_URL": api, "PREFECT_HOME": str(state / "prefect-client"),
               "KDBENCH_HOSTS": str(hosts), "KDBENCH_ARTIFACTS": str(artifacts), "KDBENCH_DOCS": str(docs),
               "KDBENCH_COMMIT": "0" if repo is None else "1", "KDBENCH_REPO": str(repo or state),
               "KDBENCH_PROFILE": "smoke", "KDBENCH_SUITES": "kernels,e2e", "KDBENCH_REFERENCE": reference}
        say("kdbench serve")
        log = state / "serve.log"
        serve = spawn_serve(env, log)
        procs.append(serve.pid)
        if not wait_for_deployment(api, "fleet/fleet", 180, serve):
            print(log.read_text()[-3000:])
            return 1
        print(f"   deployments: {', '.join(f'bench/{p.stem}' for p in sorted(hosts.glob('*.yaml')))}, fleet/fleet "
              f"(log: {log})")

        rcs = [_run(f"bench/{SANDBOX_HOST}", env)]
        if (hosts / f"{RETIRED_HOST}.yaml").is_file():
            rcs.append(_run(f"bench/{RETIRED_HOST}", env))

        say("results")
        store = Store(str(artifacts))
        for r in store.runs():
            print(f"   {r.host:8} {r.source:9} {r.status:8} {r.run_id}  suites: {', '.join(r.suites)}")
        print(f"   artifacts: {artifacts}/<table>/host=<host>/run=<run id>/part-0.parquet")
        print(f"   read them: python -c \"import pyarrow.dataset as ds; "
              f"print(ds.dataset('{artifacts}/kernels', partitioning='hive').to_table())\"")
        print(f"   notes: {docs / 'notes'}")
        if repo is not None:
            print(f"   committed into the scratch clone {repo} (your checkout is untouched):")
            for line in _git("log", "--format=%h %s", "-3", cwd=repo).splitlines():
                print(f"     {line}")
        else:
            print("   not committed (--no-commit)")
        ok = all(rc == 0 for rc in rcs)
        say(f"{'done' if ok else 'FAILED'} in {time.monotonic() - t0:.0f} s")
        return 0 if ok else 1
    finally:
        for pid in reversed(procs):
            stop_process(pid)
        sandbox.down(state / "sandbox")
        print("   stopped: kdbench serve, the Prefect server, the sandbox sshd", flush=True)


if __name__ == "__main__":
    sys.exit(main())
