"""The machine and its runs: the environment table, the run history, where a section's figures come from."""

from __future__ import annotations

from engine.rows import COLUMNS
from flows.inventory.scrub import md
from flows.notes.fmt import sig
from flows.notes.pages import SourceLine, Table
from flows.notes.points import ceilings_of
from flows.notes.views import SUITES, HostView, Run, Source

HASH_CHARS = 12         # of a payload hash in the run history
METHOD_CHARS = 2000     # of a run's own note on how its figures were made (e2e and kernel suites)


def status_line(view: HostView) -> str:
    h = view.host
    if h is None:
        return "not in the inventory"
    if h.status == "retired":
        when = h.retired_at.date().isoformat() if h.retired_at else "date unknown"
        return f"retired ({h.retired_reason or 'reason unknown'}, {when})"
    return "active"


def source_line(src: Source | None) -> SourceLine | None:
    if src is None:
        return None
    return SourceLine(md(src.run.run_id), md(src.profile), md(src.status),
                      md(src.run.runs_row.started_at or "-"), md(src.fallback))


def _shown_in(view: HostView) -> dict[str, list[str]]:
    """run id -> the suites whose sections show it."""
    out: dict[str, list[str]] = {}
    for suite, src in view.sources.items():
        out.setdefault(src.run.run_id, []).append(suite)
    return out


def environment(view: HostView) -> Table:
    """The machine, then one column per run the page shows (the column header names its sections)."""
    spec, host = view.spec, view.host
    runs = [view.projection.run] if view.kind == "projected" else view.measured
    shown = [(run, suites) for run in runs for suites in [_shown_in(view).get(run.run_id)] if suites] \
        or [(runs[-1], ["no suite has data"])]
    blank = ("",) * max(len(shown) - 1, 0)
    rows: list[tuple[str, ...]] = []
    if spec:
        rows += [("GPU", f"{spec.gpu} ({spec.arch})", *blank), ("memory", f"{spec.memory_gb:g} GiB", *blank),
                 ("spec bandwidth", f"{spec.mem_bw_gbps:,.0f} GB/s", *blank),
                 ("spec bf16 dense", f"{sig(spec.tflops.get('bf16'))} TFLOP/s", *blank)]
    if host:
        rows += [("GPUs", f"{host.gpus} on {host.interconnect}", *blank), ("inventory status", status_line(view), *blank)]
    if view.kind == "measured":
        for key in (COLUMNS.gpu_name, COLUMNS.driver, COLUMNS.cuda, COLUMNS.torch, COLUMNS.triton, COLUMNS.python,
                    COLUMNS.payload_hash, COLUMNS.device, COLUMNS.profile, COLUMNS.started_at):
            cells = tuple(md(getattr(run.runs_row, key) or "-") for run, _ in shown)
            if any(c != "-" for c in cells):
                rows.append((key, *cells))
        rows += [("measured copy bandwidth", *(f"{sig(run.runs_row.copy_gbps)} GB/s" for run, _ in shown)),
                 ("measured matmul", *(f"{sig(run.runs_row.matmul_tflops)} TFLOP/s" for run, _ in shown))]
    else:
        copy, mm = ceilings_of(view.projection.run, spec)
        rows.append(("projected ceilings", f"{sig(copy)} GB/s, {sig(mm)} TFLOP/s"))
    rows.append(("run", *(md(run.run_id) for run, _ in shown)))
    return Table.of(("", *(", ".join(s) for _, s in shown)), rows)


def history(view: HostView) -> Table:
    """Every measured run, newest first: smoke and partial ones too, and which sections each feeds."""
    shown = _shown_in(view)
    rows = []
    for run in reversed(view.measured):
        suites = sorted(run.rows("runs"), key=lambda r: (r.suite not in SUITES, SUITES.index(r.suite)
                                                          if r.suite in SUITES else 0, r.suite))
        profiles = sorted({r.profile for r in suites})
        listed = ", ".join(r.suite if r.status == "complete" else f"{r.suite} ({r.status})"
                           for r in suites)
        payload = run.runs_row.payload_hash
        rows.append((md(run.run_id), md(run.runs_row.started_at or "-"), md(", ".join(profiles)), md(listed),
                     md(payload[:HASH_CHARS]) if payload else "-", "partial" if run.partial else "complete",
                     ", ".join(shown.get(run.run_id, [])) or "-"))
    return Table.of(("run", "started", "profile", "suites", "payload", "status", "shown here"), rows)


def suite_method(run: Run, suite: str, projected: bool) -> str | None:
    """A suite's own note in its run (how it made its figures), escaped; none for a projection,
    whose assumptions have their own section."""
    row = None if projected else run.suite_row(suite)
    note = row.note if row else None
    return md(note, cap=METHOD_CHARS) if note else None
