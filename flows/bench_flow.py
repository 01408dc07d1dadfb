"""The Prefect flows: `bench` (one host, deployed as `bench/<host>`) and `fleet` (every host).

One run of `bench`:
    load the host -> retired? -------------------------------------------> project -> notes
                  -> address still a placeholder? -----------------------> project -> notes
    probe (pinned key, bounded retries for unreachable/timeout)
      unauthorized | host_key_changed -> retire in the YAML -----------> project -> notes
      unreachable | timeout -> count it (released after N runs) --------> project -> notes
      ok, but its python lacks torch/triton -> stop before any upload, naming file and field -> notes
      ok -> deploy -> build -> bench kernels -> e2e (-> comm) -> pull -> ingest -> notes
Every branch ends COMPLETED with notes; only a failed build or a real bug ends FAILED. A reachable
host is never projected: when nothing of its run could be ingested, the notes keep its last data.

Two runs on one host never overlap: the flow holds the Prefect global concurrency limit
`kdbench-host-<host>` (limit 1, upserted by `kdbench serve` and on use) for the whole run. It lives
on the Prefect server, so it holds across serve processes and workers on different machines, and a
slot held by a crashed process is freed when its lease expires.
"""

from __future__ import annotations

import asyncio
import json
import re
import tempfile
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator, Sequence

from prefect import Task, flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NONE
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import State, TaskRun
from prefect.concurrency.sync import concurrency
from prefect.context import FlowRunContext
from prefect.deployments.flow_runs import arun_deployment
from prefect.tasks import exponential_backoff
from pydantic import BaseModel

from flows import backtest
from flows import deploy as deploy_mod
from flows import reference as references
from flows import whatif
from flows.inventory import Host, Inventory, host_path, load_host, load_inventory, now, retire, update_host
from flows.notes.publish import commit_notes, render_notes
from flows.notes.summary import summary_lines
from flows.projection import ProjectionError
from flows.progress import Forward, log_line
from flows.pull import Pulled, pull, quarantine, record_unfinished
from flows.scrub import LINE_CAP, fenced, line, md, plain
from flows.settings import Settings
from flows.ssh import ProbeResult, Remote, RemoteError, TransferError, probe
from flows.store import RunInfo, Store

NOTES_LIMIT = "kdbench-notes"
BUILD_JSON_BYTES = 1 << 20
ARTIFACT_LINE = 300     # characters of each build-log line quoted in the failure artifact (200 lines: ~60 KB)
CELL_CAP = 500          # characters of one cell of the host-<h> table artifact
REACHED = ("measured", "python_lacks_torch")  # routes of a reachable host: never projected
DONE = ("complete", "partial", "skipped")  # what a suite may report at its end; anything else is ignored


class BuildFailed(RuntimeError):
    """engine.build failed on the host: the run fails, with the build log attached as an artifact."""


class SuiteResult(BaseModel):
    suite: str
    status: str  # complete | partial | failed | timeout
    rc: int
    elapsed_s: float
    points: int


class RunReport(BaseModel):
    """What one bench run did; published as the run's artifacts and returned by the flow."""

    host: str
    route: str  # measured | python_lacks_torch | retired | not_configured | unauthorized | host_key_changed | host_key_unknown | unreachable | timeout
    outcome: str  # measured | partial | projected | unmeasured
    detail: str = ""
    run_id: str | None = None  # the measured run
    projected_run_id: str | None = None
    payload_hash: str | None = None
    uploaded: bool | None = None
    suites: list[SuiteResult] = []
    results: str | None = None  # the run's partition, host=<h>/run=<id>, under each table folder of the store
    quarantined: dict[str, str] = {}
    headline: list[str] = []
    notes: list[str] = []
    commit: str | None = None


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


def _run_id() -> str:
    ctx = FlowRunContext.get()
    suffix = str(ctx.flow_run.id)[:8] if ctx and ctx.flow_run else f"{time.time_ns() % 10**8:08d}"
    return f"{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}-{suffix}"


def _scrub(host: Host, text: str, cap: int = LINE_CAP) -> str:
    """Host output and SSH errors may quote the host's address, login or key path (a traceback
    under /home/<user>, an error naming user@address), control sequences or pages of text: one
    capped line, redacted with the host's own values too (flows.scrub.plain), before any sink."""
    return plain(text, Inventory(dir=Path("."), hosts={host.name: host}), cap)


def _logged(host: Host, text: str) -> str:
    """`_scrub`, then rich markup escaped: what a log record may hold (`prefect ... --watch` renders it)."""
    return line(_scrub(host, text))


def _forward(log: Any) -> Forward:
    """A command's output lines (scrubbed by the caller) into the run's logs, bounded (flows.progress)."""
    return Forward(lambda text: log.info("%s", line(text)))


def _key(prefix: str, host: str) -> str:
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
    log.info("probe %s: %s (%s) in %.1f s", host.name, res.outcome, _logged(host, res.detail), res.elapsed_s)
    for m in res.mismatches:  # they quote what the host reported
        log.warning("inventory mismatch on %s: %s", host.name, _logged(host, m))
    if res.outcome in ("unreachable", "timeout"):
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
        get_run_logger().error("%s: not measured: %s", host.name, _logged(host, problem))
    return _scrub(host, problem) if problem else None


@task(name="deploy", cache_policy=NONE)
def deploy_payload(remote: Remote, host: Host) -> deploy_mod.Deployed:
    log = get_run_logger()
    with tempfile.TemporaryDirectory(prefix="kdbench-payload-") as tmp:
        payload = deploy_mod.build_payload(Path(tmp))
        log.info("payload %s (%d bytes)", payload.sha256[:12], payload.path.stat().st_size)
        forward = _forward(log)
        try:
            return deploy_mod.deploy(remote, host, payload, log, on_line=lambda text: forward(_scrub(host, text)))
        except deploy_mod.DeployError as e:  # it quotes the host's stderr
            raise deploy_mod.DeployError(_logged(host, str(e))) from None
        finally:
            forward.close()


@task(name="build", cache_policy=NONE)
def build(remote: Remote, host: Host, dep: deploy_mod.Deployed, run_dir: str, timeout_s: float) -> dict[str, Any]:
    """engine.build for the host's arch; a failure attaches the end of its log and fails the run."""
    log = get_run_logger()
    forward = _forward(log)
    out = f"{run_dir}/build"
    try:
        res = remote.run([dep.python, "-m", "engine.build", "--arch", host.arch, "--out", out],
                         timeout_s=timeout_s, cwd=dep.payload_dir,
                         on_line=lambda text: forward(f"build: {_scrub(host, text)}"))
    finally:
        forward.close()
    if res.rc != 0 or res.timed_out:
        tail = "\n".join(plain(text, cap=ARTIFACT_LINE) for text in forward.last)
        create_markdown_artifact(
            key=_key("build-log", host.name),
            markdown=f"# Build failed on {host.name}\n\nexit status {res.rc}"
                     f"{' (timed out)' if res.timed_out else ''}, arch {host.arch}\n\n{fenced(tail)}\n",
            description=f"engine.build log of {host.name}",
        )
        raise BuildFailed(f"engine.build failed on {host.name} (exit {res.rc}); the build log is the "
                          f"'{_key('build-log', host.name)}' artifact")
    with tempfile.TemporaryDirectory() as tmp:
        try:  # the host's word, bounded and never trusted: a bad build.json only costs this log line
            remote.get(f"{out}/build.json", Path(tmp) / "build.json", max_bytes=BUILD_JSON_BYTES)
            info = json.loads((Path(tmp) / "build.json").read_text())
        except (TransferError, ValueError, RecursionError) as e:
            log.warning("build.json from %s unusable: %s", host.name, type(e).__name__)
            info = {}
    kernels = info.get("kernels") if isinstance(info, dict) else None
    kernels = kernels if isinstance(kernels, dict) else {}
    log.info("build on %s: %d kernels, %s", host.name, len(kernels), _logged(host, ", ".join(
        f"{k} {v.get('status')}" for k, v in sorted(kernels.items()) if isinstance(v, dict))))
    return info


@task(name="bench", task_run_name="bench-{suite}", cache_policy=NONE)
def bench_suite(remote: Remote, host: Host, dep: deploy_mod.Deployed, suite: str, profile: str,
                run_id: str, out_dir: str, timeout_s: float) -> SuiteResult:
    """Run one suite; its output streams into the logs as the host prints it, one line per point
    (the first and last lines of it, when the host prints more than a sweep has points)."""
    log = get_run_logger()
    seen = {"points": 0, "status": None}
    forward = _forward(log)

    def on_line(text: str) -> None:
        shown, ev = log_line(suite, text)
        if ev is not None and ev.get("event") == "point":
            seen["points"] += 1
        elif ev is not None and ev.get("event") == "done" and ev.get("status") in DONE:
            seen["status"] = ev["status"]
        forward(_scrub(host, shown))

    argv = [dep.python, "-m", "engine.bench", "--suite", suite, "--profile", profile, "--host", host.name,
            "--out", out_dir, "--run-id", run_id, "--payload-hash", dep.payload_hash]
    try:
        res = remote.run(argv, timeout_s=timeout_s, cwd=dep.payload_dir, on_line=on_line)
    finally:
        forward.close()
    if res.timed_out:
        status = "timeout"
        log.warning("%s on %s timed out after %.0f s: the remote process group was killed; "
                    "what it measured will still be pulled", suite, host.name, timeout_s)
    elif res.rc != 0:
        status = "failed"
        log.error("%s on %s exited %d", suite, host.name, res.rc)
    else:
        status = str(seen["status"] or "complete")
    return SuiteResult(suite=suite, status=status, rc=res.rc, elapsed_s=res.elapsed_s, points=seen["points"])


@task(name="pull", cache_policy=NONE)
def pull_results(remote: Remote, host: str, run_id: str, out_dir: str, staging: Path) -> Pulled:
    log = get_run_logger()
    pulled = pull(remote, out_dir, staging, host, run_id)
    log.info("pulled %d file(s): %s", len(pulled.accepted), ", ".join(pulled.accepted) or "none")
    for name, why in pulled.quarantined.items():  # both may quote what the host sent
        log.error("quarantined %s: %s", _logged(remote.host, name), _logged(remote.host, why))
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
                                   evidence=backtest.stored_backtest(store))


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
        rows = backtest.backtests_of(store, inv)
        backtest.store_backtest(store, rows)   # the notes read these, never compute them
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


# -- routing ----------------------------------------------------------------------------------

def _route_unmeasurable(s: Settings, host: Host, res: ProbeResult) -> str:
    """Write back what the probe found; returns the detail for the report."""
    log = get_run_logger()
    detail = _scrub(host, res.detail)
    if res.outcome in ("unauthorized", "host_key_changed"):
        extra = {"presented_host_key_fingerprint": res.presented_fingerprint} if res.presented_fingerprint else {}
        retire(s.hosts_dir, host.name, res.outcome, **extra)
        log.warning("%s retired (%s): %s", host.name, res.outcome, line(detail))
        return f"retired ({res.outcome}): {detail}"
    if res.outcome in ("unreachable", "timeout"):
        n = host.unreachable_runs + 1
        if n >= s.unreachable_runs:
            retire(s.hosts_dir, host.name, "released", unreachable_runs=n)
            log.warning("%s retired as released after %d consecutive unreachable runs", host.name, n)
            return f"{res.outcome} for the {n}th run in a row: retired as released"
        update_host(s.hosts_dir, host.name, unreachable_runs=n)
        return f"{res.outcome} ({n} of {s.unreachable_runs} consecutive runs before release): {detail}"
    log.warning("%s: %s; not measured (enrol the host key with `kdbench hosts trust`)", host.name, line(detail))
    return detail


def _headline(store: Store, host: str, run_id: str) -> list[str]:
    """A few figures for the run's summary artifacts (its strings come from the host: scrubbed)."""
    tables = store.load(host, run_id)
    out = []
    if "kernels" in tables and tables["kernels"].num_rows:
        rows = tables["kernels"].to_pylist()
        best = max(rows, key=lambda r: r["achieved_gbps"] or 0.0)
        out.append(f"kernels: {len(rows)} points over {len({r['kernel'] for r in rows})} kernels; "
                   f"best {best['achieved_gbps'] or 0:.1f} GB/s ({plain(best['kernel'])}, M={best['M']})")
    if "e2e" in tables and tables["e2e"].num_rows:
        rows = tables["e2e"].to_pylist()
        best = max(rows, key=lambda r: r["tokens_per_s"] or 0.0)
        out.append(f"e2e: {len(rows)} points; best {best['tokens_per_s'] or 0:.1f} tokens/s "
                   f"(budget {best['budget']}, concurrency {best['concurrency']}, accept {best['accept_len_mean'] or 0:.2f})")
    if "comm" in tables and tables["comm"].num_rows:
        rows = [r for r in tables["comm"].to_pylist() if r["status"] == "ok"]
        if rows:
            out.append(f"comm: best bus bandwidth {max(r['busbw_gbps'] or 0 for r in rows):.1f} GB/s")
    return out


def _measure(s: Settings, store: Store, host: Host, suites: list[str], profile: str,
             bench_timeout_s: float, report: RunReport) -> None:
    log = get_run_logger()
    with Remote(host, s.hosts_dir) as remote:
        problem = check_python(remote, host)
        if problem:
            report.route, report.outcome, report.detail = "python_lacks_torch", "unmeasured", problem
            return
        run_id = report.run_id = _run_id()
        dep = deploy_payload(remote, host)
        run_dir = f"{dep.work_dir.rstrip('/')}/runs/{run_id}"
        out_dir = f"{run_dir}/out"
        report.payload_hash, report.uploaded = dep.payload_hash, dep.uploaded
        build(remote, host, dep, run_dir, s.build_timeout_s)
        for suite in suites:
            if suite == "comm" and host.gpus < 2:
                log.info("comm skipped on %s: %d GPU(s)", host.name, host.gpus)
                continue
            res = bench_suite(remote, host, dep, suite, profile, run_id, out_dir, bench_timeout_s)
            report.suites.append(res)
            if res.status == "timeout":
                log.warning("later suites skipped on %s after the timeout", host.name)
                break
        with tempfile.TemporaryDirectory(prefix="kdbench-pull-") as tmp:
            pulled = pull_results(remote, host.name, run_id, out_dir, Path(tmp))
            unfinished = {r.suite: r.status for r in report.suites if r.status in ("timeout", "failed")}
            record_unfinished(pulled, run_id, host.name, profile, unfinished, dep.payload_hash)
            report.quarantined = pulled.quarantined
            info = ingest(store, host.name, run_id, pulled)
    if info is None:
        report.outcome, report.detail = "unmeasured", "no result could be ingested"
        return
    report.results = f"host={host.name}/run={run_id}"
    bad = [r.suite for r in report.suites if r.status not in ("complete", "skipped")]
    partial = info.status == "partial" or bad or report.quarantined
    report.outcome = "partial" if partial else "measured"
    report.detail = (f"partial: {', '.join(f'{r.suite} {r.status}' for r in report.suites if r.suite in bad)}"
                     if bad else ("partial: some files quarantined" if report.quarantined else "all suites complete"))
    report.headline = _headline(store, host.name, run_id)


def _publish(report: RunReport, s: Settings) -> None:
    title = {"measured": "measured", "partial": "measured (partial)", "projected": "projected",
             "unmeasured": "not measured"}[report.outcome]
    lines = [f"# {report.host}: {title}", "", f"- route: **{report.route}** — {md(report.detail, cap=2000)}"]
    if report.run_id:
        lines.append(f"- run: `{report.run_id}`")
    if report.payload_hash:
        lines.append(f"- payload: `{report.payload_hash[:12]}` ({'uploaded' if report.uploaded else 'already on the host'})")
    for sr in report.suites:
        lines.append(f"- suite {sr.suite}: {sr.status}, {sr.points} points, {sr.elapsed_s:.0f} s")
    if report.results:
        lines.append(f"- results: `<table>/{report.results}/` in the artifacts store "
                     "(one folder per table, Hive-partitioned by host and run)")
    if report.projected_run_id:
        lines.append(f"- projection: `<table>/host={report.host}/run={report.projected_run_id}/` (source = projected)")
    for name, why in report.quarantined.items():
        lines.append(f"- quarantined {md(name)}: {md(why, cap=500)}")
    if report.headline:
        lines += ["", "## Headline", *[f"- {md(h)}" for h in report.headline]]
    if report.notes:
        lines += ["", "## Notes", *[f"- `{p}`" for p in report.notes]]
        lines.append(f"- {'commit `' + report.commit[:10] + '`' if report.commit else 'not committed' if not s.commit else 'unchanged'}")
    create_markdown_artifact(key=_key("bench", report.host), markdown="\n".join(lines) + "\n",
                             description=f"bench run of {report.host}")
    create_table_artifact(
        key=_key("host", report.host),
        table=[{"host": report.host, "outcome": report.outcome, "route": report.route,
                "run_id": report.run_id or report.projected_run_id or "",
                "suites": " ".join(f"{r.suite}:{r.status}" for r in report.suites),
                "headline": line("; ".join(report.headline), cap=CELL_CAP), "results": report.results or "",
                "quarantined": line(" ".join(report.quarantined), cap=CELL_CAP)}],
        description=f"bench history of {report.host}",
    )


# -- flows ------------------------------------------------------------------------------------

@flow(name="bench", flow_run_name="bench-{host}")
def bench(host: str, suites: list[str] | None = None, profile: str | None = None,
          reference: str | None = None, notes: bool = True, bench_timeout_s: float | None = None) -> RunReport:
    """Measure one host, or project it when it cannot be measured; then refresh the notes.

    Unset parameters come from the KDBENCH_* settings of the process running the flow.
    """
    s = Settings.from_env()
    suites = Settings(suites=suites).suites if suites else s.suites
    profile = Settings(profile=profile).profile if profile else s.profile
    reference = reference or s.reference
    log = get_run_logger()
    store = Store(s.artifacts)
    with held(limit_name(host)):
        h = load_host(s.hosts_dir, host)
        if h.status == "retired":
            log.info("%s is retired (%s): projection, no connection attempted", host, h.retired_reason)
            report = RunReport(host=host, route="retired", outcome="unmeasured",
                               detail=f"retired ({h.retired_reason}) since {h.retired_at:%Y-%m-%d}" if h.retired_at
                               else f"retired ({h.retired_reason})")
        elif h.is_placeholder():
            log.warning("%s: the address in its YAML is still the shipped placeholder; not contacted. "
                        "Fill in address, user and key_file, then pin its key with `kdbench hosts trust %s`",
                        host, host)
            report = RunReport(host=host, route="not_configured", outcome="unmeasured",
                               detail="address is a placeholder: not contacted")
        else:
            res = probe_with_retries(h, s)
            if res.outcome == "ok":
                update_host(s.hosts_dir, host, unreachable_runs=0, last_seen=now())
                report = RunReport(host=host, route="measured", outcome="measured")
                try:
                    _measure(s, store, h, suites, profile, bench_timeout_s or s.bench_timeout_s, report)
                except RemoteError as e:
                    why = _scrub(h, str(e))
                    log.error("lost %s during the run: %s", host, line(why))
                    report.outcome, report.detail = "unmeasured", f"connection lost: {why}"
            else:
                report = RunReport(host=host, route=res.outcome, outcome="unmeasured",
                                   detail=_route_unmeasurable(s, h, res))
        if report.route not in REACHED:  # a reachable host keeps its last measured data in the notes
            try:
                report.projected_run_id = project_task(s.artifacts, str(s.hosts_dir), host, reference)
                report.outcome = "projected"
            except ProjectionError as e:
                log.error("no projection for %s: %s", host, line(e))
                report.detail += f"; no projection: {e}"
        if notes:
            report.notes, report.commit = write_notes(store, s, f"bench {host}: {report.outcome}", [host])
    _publish(report, s)
    return report


@flow(name="fleet", flow_run_name="fleet")
async def fleet(hosts: list[str] | None = None, suites: list[str] | None = None, profile: str | None = None,
                reference: str | None = None) -> list[dict[str, str]]:
    """Run `bench/<host>` for every host at once (retired ones project), then refresh the notes once.

    `hosts` narrows the fleet to some inventory hosts; by default it is all of them.
    """
    s = Settings.from_env()
    inv = load_inventory(s.hosts_dir)
    names = hosts or sorted(inv.hosts)
    unknown = sorted(set(names) - set(inv.hosts))
    if unknown:
        raise ValueError(f"{s.hosts_dir}: no host named {', '.join(unknown)}")
    log = get_run_logger()
    log.info("fleet: %s", ", ".join(f"{n} ({inv.hosts[n].status})" for n in names))
    params = {"suites": suites, "profile": profile, "reference": reference, "notes": False}
    started = time.monotonic()
    runs = await asyncio.gather(*(
        arun_deployment(f"bench/{n}", parameters={"host": n, **params}, poll_interval=1, timeout=None)
        for n in names))
    elapsed = time.monotonic() - started
    rows = [{"host": n, "state": r.state.name if r.state else "unknown", "flow_run": r.name}
            for n, r in zip(names, runs)]
    log.info("fleet runs done in %.1f s: %s", elapsed, ", ".join(f"{r['host']} {r['state']}" for r in rows))
    store = Store(s.artifacts)
    write_notes(store, s, f"fleet: {len(rows)} hosts", names)
    await create_table_artifact(key="fleet", table=rows, description=f"fleet run, {elapsed:.0f} s")
    failed = [r["host"] for r in rows if r["state"] != "Completed"]
    if failed:
        raise RuntimeError(f"bench runs did not complete for: {', '.join(failed)}")
    return rows
