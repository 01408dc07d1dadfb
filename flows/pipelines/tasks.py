"""The bench flow's Prefect tasks: probe, check the host's python, deploy, build, bench, pull, ingest,
project and notes; and the global concurrency limits that keep two runs off one host.

Every string a host sent passes `host_text` (one capped, redacted line) before it reaches a log record,
an artifact or a report.
"""

from __future__ import annotations

import json
import re
import tempfile
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import Any, Iterator, Sequence

from prefect import Task, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NONE
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import State, TaskRun
from prefect.concurrency.sync import concurrency
from prefect.tasks import exponential_backoff
from pydantic import BaseModel

from flows.analysis import backtest_store
from flows.analysis import reference as references
from flows.analysis import whatif
from flows.inventory.files import host_path, load_inventory
from flows.inventory.hosts import Host, Inventory
from flows.inventory.scrub import LINE_CAP, fenced, line, plain
from flows.notes.publish import commit_notes, render_notes
from flows.notes.summary import summary_lines
from flows.pipelines.progress import Forward, log_line
from flows.pipelines.settings import Settings
from flows.store.layout import RunInfo
from flows.store.store import Store
from flows.transport import deploy as deploy_mod
from flows.transport.connect import ProbeOutcome
from flows.transport.probe import ProbeResult, probe
from flows.transport.pull import Pulled, pull, quarantine
from flows.transport.remote import Remote, TransferError

NOTES_LIMIT = "kdbench-notes"
BUILD_JSON_BYTES = 1 << 20
ARTIFACT_LINE = 300     # characters of each build-log line quoted in the failure artifact (200 lines: ~60 KB)


class BuildFailed(RuntimeError):
    """engine.build failed on the host: the run fails, with the build log attached as an artifact."""


class SuiteStatus(StrEnum):
    """How one suite ended: what it reported at its end (complete, partial, skipped), or what the
    controller saw (failed: a non-zero exit; timeout: the deadline killed it)."""

    COMPLETE = "complete"
    PARTIAL = "partial"
    SKIPPED = "skipped"
    FAILED = "failed"
    TIMEOUT = "timeout"


DONE = (SuiteStatus.COMPLETE, SuiteStatus.PARTIAL, SuiteStatus.SKIPPED)  # a suite's own end; anything else is ignored


class SuiteResult(BaseModel):
    suite: str
    status: SuiteStatus
    rc: int
    elapsed_s: float
    points: int


def limit_name(host: str) -> str:
    return f"kdbench-host-{host}"


def ensure_limit(name: str) -> None:
    """A global concurrency limit of one slot must exist before it can be held (strict)."""
    with get_client(sync_client=True) as client:
        client.upsert_global_concurrency_limit_by_name(name, 1)


@contextmanager
def held(name: str) -> Iterator[None]:
    ensure_limit(name)
    with concurrency(name, occupy=1, strict=True):
        yield


def host_text(host: Host, text: str, cap: int = LINE_CAP) -> str:
    """Host output and SSH errors may quote the host's address, login or key path (a traceback
    under /home/<user>, an error naming user@address), control sequences or pages of text: one
    capped line, redacted with the host's own values too (flows.inventory.scrub.plain), before any sink."""
    return plain(text, Inventory(dir=Path("."), hosts={host.name: host}), cap)


def logged(host: Host, text: str) -> str:
    """`host_text`, then rich markup escaped: what a log record may hold (`prefect ... --watch` renders it)."""
    return line(host_text(host, text))


def forward_lines(log: Any) -> Forward:
    """A command's output lines (scrubbed by the caller) into the run's logs, bounded (flows.pipelines.progress)."""
    return Forward(lambda text: log.info("%s", line(text)))


def artifact_key(prefix: str, host: str) -> str:
    """Artifact keys allow lower-case letters, digits and dashes only."""
    return f"{prefix}-" + re.sub(r"[^a-z0-9-]", "-", host.lower())


# -- tasks ------------------------------------------------------------------------------------

class Unanswered(Exception):
    """The probe got no answer (unreachable or timeout): the one outcome Prefect retries."""

    def __init__(self, result: ProbeResult):
        super().__init__(f"{result.host}: {result.outcome}")
        self.result = result


def _unanswered(task: Task, task_run: TaskRun, state: State) -> bool:
    """retry_condition_fn: retry only when the host did not answer; a refusal or a bug is final."""
    return isinstance(state.result(raise_on_failure=False), Unanswered)


@task(name="probe", cache_policy=NONE, retry_condition_fn=_unanswered)
def probe_host(host: Host, hosts_dir: Path) -> ProbeResult:
    """One probe; raises Unanswered for unreachable/timeout, so that task retries (with backoff) apply."""
    log = get_run_logger()
    res = probe(host, hosts_dir)
    log.info("probe %s: %s (%s) in %.1f s", host.name, res.outcome, logged(host, res.detail), res.elapsed_s)
    for m in res.mismatches:  # they quote what the host reported
        log.warning("inventory mismatch on %s: %s", host.name, logged(host, m))
    if res.outcome in (ProbeOutcome.UNREACHABLE, ProbeOutcome.TIMEOUT):
        raise Unanswered(res)
    return res


def probe_with_retries(host: Host, s: Settings) -> ProbeResult:
    """The probe with KDBENCH_PROBE_RETRIES retries, the first after KDBENCH_RETRY_BACKOFF_S, doubling."""
    state = probe_host.with_options(
        retries=s.probe_retries, retry_delay_seconds=exponential_backoff(s.retry_backoff_s)(s.probe_retries),
    )(host, s.hosts_dir, return_state=True)
    res = state.result(raise_on_failure=False)
    if isinstance(res, Unanswered):
        return res.result
    if isinstance(res, BaseException):
        raise res
    return res


@task(name="check-python", cache_policy=NONE)
def check_python(remote: Remote, host: Host) -> str | None:
    """Why the host's python cannot run the payload (no torch or triton), or None; before any upload."""
    problem = deploy_mod.python_problem(remote, host)
    if problem:
        get_run_logger().error("%s: not measured: %s", host.name, logged(host, problem))
    return host_text(host, problem) if problem else None


@task(name="deploy", cache_policy=NONE)
def deploy_payload(remote: Remote, host: Host) -> deploy_mod.Deployed:
    log = get_run_logger()
    with tempfile.TemporaryDirectory(prefix="kdbench-payload-") as tmp:
        payload = deploy_mod.build_payload(Path(tmp))
        log.info("payload %s (%d bytes)", payload.sha256[:12], payload.path.stat().st_size)
        forward = forward_lines(log)
        try:
            return deploy_mod.deploy(remote, host, payload, log, on_line=lambda text: forward(host_text(host, text)))
        except deploy_mod.DeployError as e:  # it quotes the host's stderr
            raise deploy_mod.DeployError(logged(host, str(e))) from None
        finally:
            forward.close()


@task(name="build", cache_policy=NONE)
def build(remote: Remote, host: Host, dep: deploy_mod.Deployed, run_dir: str, timeout_s: float) -> dict[str, Any]:
    """engine.build for the host's arch; a failure attaches the end of its log and fails the run."""
    log = get_run_logger()
    forward = forward_lines(log)
    out = f"{run_dir}/build"
    try:
        res = remote.run([dep.python, "-m", "engine.build", "--arch", host.arch, "--out", out],
                         timeout_s=timeout_s, cwd=dep.payload_dir,
                         on_line=lambda text: forward(f"build: {host_text(host, text)}"))
    finally:
        forward.close()
    if res.rc != 0 or res.timed_out:
        tail = "\n".join(plain(text, cap=ARTIFACT_LINE) for text in forward.last)
        create_markdown_artifact(
            key=artifact_key("build-log", host.name),
            markdown=f"# Build failed on {host.name}\n\nexit status {res.rc}"
                     f"{' (timed out)' if res.timed_out else ''}, arch {host.arch}\n\n{fenced(tail)}\n",
            description=f"engine.build log of {host.name}",
        )
        raise BuildFailed(f"engine.build failed on {host.name} (exit {res.rc}); the build log is the "
                          f"'{artifact_key('build-log', host.name)}' artifact")
    with tempfile.TemporaryDirectory() as tmp:
        try:  # the host's word, bounded and never trusted: a bad build.json only costs this log line
            remote.get(f"{out}/build.json", Path(tmp) / "build.json", max_bytes=BUILD_JSON_BYTES)
            info = json.loads((Path(tmp) / "build.json").read_text())
        except (TransferError, ValueError, RecursionError) as e:
            log.warning("build.json from %s unusable: %s", host.name, type(e).__name__)
            info = {}
    kernels = info.get("kernels") if isinstance(info, dict) else None
    kernels = kernels if isinstance(kernels, dict) else {}
    log.info("build on %s: %d kernels, %s", host.name, len(kernels), logged(host, ", ".join(
        f"{k} {v.get('status')}" for k, v in sorted(kernels.items()) if isinstance(v, dict))))
    return info


@task(name="bench", task_run_name="bench-{suite}", cache_policy=NONE)
def bench_suite(remote: Remote, host: Host, dep: deploy_mod.Deployed, suite: str, profile: str,
                run_id: str, out_dir: str, timeout_s: float) -> SuiteResult:
    """Run one suite; its output streams into the logs as the host prints it, one line per point
    (the first and last lines of it, when the host prints more than a sweep has points)."""
    log = get_run_logger()
    seen = {"points": 0, "status": None}
    forward = forward_lines(log)

    def on_line(text: str) -> None:
        shown, ev = log_line(suite, text)
        if ev is not None and ev.get("event") == "point":
            seen["points"] += 1
        elif ev is not None and ev.get("event") == "done" and ev.get("status") in DONE:
            seen["status"] = ev["status"]
        forward(host_text(host, shown))

    argv = [dep.python, "-m", "engine.bench", "--suite", suite, "--profile", profile, "--host", host.name,
            "--out", out_dir, "--run-id", run_id, "--payload-hash", dep.payload_hash]
    try:
        res = remote.run(argv, timeout_s=timeout_s, cwd=dep.payload_dir, on_line=on_line)
    finally:
        forward.close()
    if res.timed_out:
        status = SuiteStatus.TIMEOUT
        log.warning("%s on %s timed out after %.0f s: the remote process group was killed; "
                    "what it measured will still be pulled", suite, host.name, timeout_s)
    elif res.rc != 0:
        status = SuiteStatus.FAILED
        log.error("%s on %s exited %d", suite, host.name, res.rc)
    else:
        status = SuiteStatus(seen["status"] or SuiteStatus.COMPLETE)
    return SuiteResult(suite=suite, status=status, rc=res.rc, elapsed_s=res.elapsed_s, points=seen["points"])


@task(name="pull", cache_policy=NONE)
def pull_results(remote: Remote, host: str, run_id: str, out_dir: str, staging: Path) -> Pulled:
    log = get_run_logger()
    pulled = pull(remote, out_dir, staging, host, run_id)
    log.info("pulled %d file(s): %s", len(pulled.accepted), ", ".join(pulled.accepted) or "none")
    for name, why in pulled.quarantined.items():  # both may quote what the host sent
        log.error("quarantined %s: %s", logged(remote.host, name), logged(remote.host, why))
    return pulled


@task(name="ingest", cache_policy=NONE)
def ingest(store: Store, host: str, run_id: str, pulled: Pulled) -> RunInfo | None:
    """The run as stored (its manifest's summary), or None when nothing could be ingested."""
    log = get_run_logger()
    where = quarantine(store, host, run_id, pulled)
    if where:
        log.warning("%d file(s) quarantined under quarantine/host=%s/run=%s", len(pulled.quarantined), host, run_id)
    if "runs.arrow" not in pulled.accepted:
        log.error("no acceptable runs.arrow from %s: nothing ingested", host)
        return None
    info = store.ingest(host, run_id, pulled.accepted_dir)
    log.info("ingested run %s of %s (%s): %s", run_id, host, info.status, line(", ".join(info.suites)))
    return info


@task(name="project", cache_policy=NONE)
def project_task(store_root: str, hosts_dir: str, target: str, reference: str = "h200") -> str:
    """references.project_host for the flows (store and inventory rebuilt from paths), with the bands
    from the backtests the store holds."""
    store = Store(store_root)
    return references.project_host(store, load_inventory(Path(hosts_dir)), target, reference,
                                   evidence=backtest_store.stored_backtest(store))


@task(name="notes", cache_policy=NONE)
def write_notes(store: Store, settings: Settings, subject: str,
                hosts: Sequence[str] = ()) -> tuple[list[str], str | None]:
    """Refresh the stored backtests and what-if grids, render the fleet notes and commit them (with the
    YAML of `hosts` when the inventory lives in the same repo); one writer at a time across every
    process. A host shows the projection its own bench run stored (`kdbench notes` stores one for
    every unmeasured host)."""
    log = get_run_logger()
    with held(NOTES_LIMIT):
        inv = load_inventory(settings.hosts_dir)
        rows = backtest_store.backtests_of(store, inv)
        backtest_store.store_backtest(store, rows)   # the notes read these, never compute them
        if rows:
            whatif.store_grids(store, inv, settings.reference, rows)
        paths = render_notes(store, inv, settings.docs_dir)
        commit = None
        if settings.commit:
            yamls = [host_path(settings.hosts_dir, h) for h in hosts]
            repo = settings.repo.resolve()
            paths_in_repo = [*paths, *(y for y in yamls if y.resolve().is_relative_to(repo))]
            message = "\n".join([subject, "", *summary_lines(store, inv)]) + "\n"
            commit = commit_notes(repo, paths_in_repo, message, inv)
    rel = [_rel(p, settings.docs_dir.parent) for p in paths if p.suffix == ".md"]
    log.info("notes: %d page(s) under %s/notes%s", len(rel), settings.docs_dir.name,
             f", committed {commit[:10]}" if commit else (" (not committed)" if not settings.commit else ", unchanged"))
    return rel, commit


def _rel(p: Path, base: Path) -> str:
    try:
        return str(Path(p).resolve().relative_to(base.resolve()))
    except ValueError:
        return Path(p).name
