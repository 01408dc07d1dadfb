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
import tempfile
import time
from datetime import datetime, timezone
from enum import StrEnum
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.context import FlowRunContext
from prefect.deployments.flow_runs import arun_deployment
from pydantic import BaseModel

from engine.rows import table_rows
from engine.schema import PointStatus
from flows.analysis.projection import ProjectionError
from flows.inventory.files import load_host, load_inventory, now, retire, update_host
from flows.inventory.hosts import Host
from flows.inventory.scrub import line, md, plain
from flows.pipelines.settings import Settings
from flows.pipelines.tasks import (SuiteResult, SuiteStatus, artifact_key, bench_suite, build, check_python,
                                   deploy_payload, held, host_text, ingest, limit_name, probe_with_retries,
                                   project_task, pull_results, write_notes)
from flows.store.layout import RunStatus
from flows.store.store import Store
from flows.transport.connect import ProbeOutcome, RemoteError
from flows.transport.probe import ProbeResult
from flows.transport.pull import record_unfinished
from flows.transport.remote import Remote

CELL_CAP = 500          # characters of one cell of the host-<h> table artifact


class Route(StrEnum):
    """The way a bench run went: measured, stopped at the host's python, or why the host was not contacted
    or not reachable (the probe's outcomes). A StrEnum: reports, artifacts and logs hold its value."""

    MEASURED = "measured"
    PYTHON_LACKS_TORCH = "python_lacks_torch"
    WRONG_GPU = "wrong_gpu"
    RETIRED = "retired"
    NOT_CONFIGURED = "not_configured"
    UNAUTHORIZED = ProbeOutcome.UNAUTHORIZED.value
    HOST_KEY_CHANGED = ProbeOutcome.HOST_KEY_CHANGED.value
    HOST_KEY_UNKNOWN = ProbeOutcome.HOST_KEY_UNKNOWN.value
    UNREACHABLE = ProbeOutcome.UNREACHABLE.value
    TIMEOUT = ProbeOutcome.TIMEOUT.value


class RunOutcome(StrEnum):
    """What a bench run left for the notes."""

    MEASURED = "measured"
    PARTIAL = "partial"
    PROJECTED = "projected"
    UNMEASURED = "unmeasured"


REACHED = (Route.MEASURED, Route.PYTHON_LACKS_TORCH, Route.WRONG_GPU)  # routes of a reachable host: never projected


class RunReport(BaseModel):
    """What one bench run did; published as the run's artifacts and returned by the flow."""

    host: str
    route: Route
    outcome: RunOutcome
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


def _run_id() -> str:
    ctx = FlowRunContext.get()
    suffix = str(ctx.flow_run.id)[:8] if ctx and ctx.flow_run else f"{time.time_ns() % 10**8:08d}"
    return f"{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}-{suffix}"


# -- routing ----------------------------------------------------------------------------------

def _route_unmeasurable(s: Settings, host: Host, res: ProbeResult) -> str:
    """Write back what the probe found; returns the detail for the report."""
    log = get_run_logger()
    detail = host_text(host, res.detail)
    if res.outcome in (ProbeOutcome.UNAUTHORIZED, ProbeOutcome.HOST_KEY_CHANGED):
        extra = {"presented_host_key_fingerprint": res.presented_fingerprint} if res.presented_fingerprint else {}
        retire(s.hosts_dir, host.name, res.outcome, **extra)
        log.warning("%s retired (%s): %s", host.name, res.outcome, line(detail))
        return f"retired ({res.outcome}): {detail}"
    if res.outcome in (ProbeOutcome.UNREACHABLE, ProbeOutcome.TIMEOUT):
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
        kern = table_rows(tables["kernels"], "kernels")
        best = max(kern, key=lambda r: r.achieved_gbps or 0.0)
        out.append(f"kernels: {len(kern)} points over {len({r.kernel for r in kern})} kernels; "
                   f"best {best.achieved_gbps or 0:.1f} GB/s ({plain(best.kernel)}, M={best.M})")
    if "e2e" in tables and tables["e2e"].num_rows:
        e2e = table_rows(tables["e2e"], "e2e")
        top = max(e2e, key=lambda r: r.tokens_per_s or 0.0)
        out.append(f"e2e: {len(e2e)} points; best {top.tokens_per_s or 0:.1f} tokens/s "
                   f"(budget {top.budget}, concurrency {top.concurrency}, accept {top.accept_len_mean or 0:.2f})")
    if "comm" in tables and tables["comm"].num_rows:
        comm = [r for r in table_rows(tables["comm"], "comm") if r.status == PointStatus.OK]
        if comm:
            out.append(f"comm: best bus bandwidth {max(r.busbw_gbps or 0 for r in comm):.1f} GB/s")
    return out


def _measure(s: Settings, store: Store, host: Host, suites: list[str], profile: str,
             bench_timeout_s: float, report: RunReport) -> None:
    log = get_run_logger()
    with Remote(host, s.hosts_dir) as remote:
        problem = check_python(remote, host)
        if problem:
            report.route, report.outcome, report.detail = Route.PYTHON_LACKS_TORCH, RunOutcome.UNMEASURED, problem
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
            if res.status == SuiteStatus.TIMEOUT:
                log.warning("later suites skipped on %s after the timeout", host.name)
                break
        with tempfile.TemporaryDirectory(prefix="kdbench-pull-") as tmp:
            pulled = pull_results(remote, host.name, run_id, out_dir, Path(tmp))
            unfinished = {r.suite: r.status for r in report.suites if r.status in (SuiteStatus.TIMEOUT, SuiteStatus.FAILED)}
            record_unfinished(pulled, run_id, host.name, profile, unfinished, dep.payload_hash)
            report.quarantined = pulled.quarantined
            info = ingest(store, host.name, run_id, pulled)
    if info is None:
        report.outcome, report.detail = RunOutcome.UNMEASURED, "no result could be ingested"
        return
    report.results = f"host={host.name}/run={run_id}"
    bad = [r.suite for r in report.suites if r.status not in (SuiteStatus.COMPLETE, SuiteStatus.SKIPPED)]
    partial = info.status == RunStatus.PARTIAL or bad or report.quarantined
    report.outcome = RunOutcome.PARTIAL if partial else RunOutcome.MEASURED
    report.detail = (f"partial: {', '.join(f'{r.suite} {r.status}' for r in report.suites if r.suite in bad)}"
                     if bad else ("partial: some files quarantined" if report.quarantined else "all suites complete"))
    report.headline = _headline(store, host.name, run_id)


def _publish(report: RunReport, s: Settings) -> None:
    title = {RunOutcome.MEASURED: "measured", RunOutcome.PARTIAL: "measured (partial)",
             RunOutcome.PROJECTED: "projected", RunOutcome.UNMEASURED: "not measured"}[report.outcome]
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
    create_markdown_artifact(key=artifact_key("bench", report.host), markdown="\n".join(lines) + "\n",
                             description=f"bench run of {report.host}")
    create_table_artifact(
        key=artifact_key("host", report.host),
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
            report = RunReport(host=host, route=Route.RETIRED, outcome=RunOutcome.UNMEASURED,
                               detail=f"retired ({h.retired_reason}) since {h.retired_at:%Y-%m-%d}" if h.retired_at
                               else f"retired ({h.retired_reason})")
        elif h.is_placeholder():
            log.warning("%s: the address in its YAML is still the shipped placeholder; not contacted. "
                        "Fill in address, user and key_file, then pin its key with `kdbench hosts trust %s`",
                        host, host)
            report = RunReport(host=host, route=Route.NOT_CONFIGURED, outcome=RunOutcome.UNMEASURED,
                               detail="address is a placeholder: not contacted")
        else:
            res = probe_with_retries(h, s)
            if res.outcome == ProbeOutcome.OK:
                update_host(s.hosts_dir, host, unreachable_runs=0, last_seen=now())
            if res.outcome == ProbeOutcome.OK and res.wrong_gpu:
                # measured figures would be filed, and projected, under a machine the host is not
                wrong = host_text(h, res.wrong_gpu)
                log.error("%s not measured: %s; fix `spec` in its YAML (or the host)", host, line(wrong))
                report = RunReport(host=host, route=Route.WRONG_GPU, outcome=RunOutcome.UNMEASURED,
                                   detail=f"not measured: {wrong}; fix `spec` in hosts/{host}.yaml or the host")
            elif res.outcome == ProbeOutcome.OK:
                report = RunReport(host=host, route=Route.MEASURED, outcome=RunOutcome.MEASURED)
                try:
                    _measure(s, store, h, suites, profile, bench_timeout_s or s.bench_timeout_s, report)
                except RemoteError as e:
                    why = host_text(h, str(e))
                    log.error("lost %s during the run: %s", host, line(why))
                    report.outcome, report.detail = RunOutcome.UNMEASURED, f"connection lost: {why}"
            else:
                report = RunReport(host=host, route=Route(res.outcome), outcome=RunOutcome.UNMEASURED,
                                   detail=_route_unmeasurable(s, h, res))
        if report.route not in REACHED:  # a reachable host keeps its last measured data in the notes
            try:
                report.projected_run_id = project_task(s.artifacts, str(s.hosts_dir), host, reference)
                report.outcome = RunOutcome.PROJECTED
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
