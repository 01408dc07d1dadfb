"""The end-to-end section: every e2e row, the step split by stage and by kernel family (the reference's
beside the target's for a projection), the host's busy time, and the Amdahl chart of the step's shares;
the accepted-length and context sections below it are built from the same run."""

from __future__ import annotations

from typing import Iterator

from engine.rows import E2ERow
from flows.analysis.families import e2e_key, tp_of
from flows.analysis.projection import TERMS, breakdown
from flows.inventory.scrub import md
from flows.notes.fmt import band_text, fmt, per, share
from flows.notes.pages import E2EView, Table
from flows.notes.plots import Amdahl, Chart
from flows.notes.points import FAMILY_NAMES, FAMILY_TERMS, family_split, point_labels
from flows.notes.sections.accept import accept_view
from flows.notes.sections.context import context_view
from flows.notes.sections.machine import source_line, suite_method
from flows.notes.views import HostView


def e2e_view(view: HostView, rel: str) -> tuple[E2EView | None, tuple[Chart, ...]]:
    """The section (with its accepted-length and context parts), and their charts."""
    src = view.source("e2e")
    if src is None:
        return None, ()
    run = src.run
    every = sorted(run.rows("e2e"), key=lambda e: (e.config, e.layers or 0, tp_of(e),
                                                   e.synthetic_accept or 0, e.budget, e.context or 0,
                                                   e.concurrency))
    projected = view.kind == "projected"
    head = ["config", "layers", "tp", "level", "budget", "concurrency", "context", "accepted / step", "tokens/s",
            "step ms (p50)"]
    if projected:
        head.insert(9, "band (tokens/s)")
    table = []
    for e in every:
        r = [md(e.config), str(e.layers), str(tp_of(e)),
             "-" if e.synthetic_accept is None else f"{e.synthetic_accept:g}", str(e.budget),
             str(e.concurrency), "-" if e.context is None else f"{e.context:,}", fmt(e.accept_len_mean, 2),
             fmt(e.tokens_per_s, 0) if e.status == "ok" else md(e.status), fmt(e.step_ms_p50, 2)]
        if projected:
            r.insert(9, band_text(e.tokens_per_s_low, e.tokens_per_s_high, 0))
        table.append(r)
    rows = [e for e in every if e.status == "ok" and e.step_ms_p50]   # points with figures
    level = sorted({e.synthetic_accept for e in rows if e.synthetic_accept is not None})
    # the step split and its Amdahl shares; for a projection, the reference's next to the target's
    split, fams = [], []
    for _, name, row in _sides(view, rows):
        b = family_split(row)
        if b is not None:
            fams.append([name] + [f"{fmt(b[t], 2)} ({share(per(b[t], sum(b.values())))})" for t in FAMILY_TERMS]
                        + [fmt(sum(b.values()), 2)])
        if any(getattr(row, t) is not None for t in TERMS if t != "comm_ms"):   # the stage split
            b = breakdown(row)
            step = sum(b.values())
            split.append([name] + [f"{fmt(b[t], 2)} ({share(per(b[t], step))})" for t in TERMS] + [fmt(step, 2)])
    point_label = point_labels(rows)
    # a profiled decode's figures: a projection's modelled host time is in its family table instead
    busy = [e for e in rows if e.kernel_ms is not None and e.outside_ms is not None and not projected]
    busy_table = Table.of(["point", "kernels ms", "outside ms", "outside share"],
                          [[point_label(e), fmt(e.kernel_ms, 2), fmt(e.outside_ms, 2),
                            share(per(e.outside_ms, e.kernel_ms + e.outside_ms))] for e in busy]) \
        if busy else None
    largest = ""
    if projected and rows:
        last = rows[-1]
        b = family_split(last) or breakdown(last)
        top = max(b, key=lambda t: (b[t], t))
        largest = (f"At concurrency {last.concurrency} the largest term on {view.name} is "
                   f"{top.removesuffix('_ms')} ({share(per(b[top], sum(b.values())))} of the step).")
    accept, accept_charts = accept_view(view, run, rel)
    context, context_charts = context_view(view, run, rel)
    chart = amdahl_chart(view, rows)
    return E2EView(source_line(src), suite_method(run, "e2e", projected), projected,
                   ", ".join(f"{x:g}" for x in level) or "-", Table.of(head, table), accept, context,
                   Table.of(["point"] + [t.removesuffix("_ms") for t in TERMS] + ["step ms"], split),
                   f"{rel}/{chart.file}", busy_table, largest,
                   Table.of(["point"] + [FAMILY_NAMES[t] for t in FAMILY_TERMS] + ["step ms"], fams) if fams else None), \
        (chart, *accept_charts, *context_charts)


def _sides(view: HostView, rows: list[E2ERow]) -> Iterator[tuple[E2ERow, str, E2ERow]]:
    """(point, its name in the tables, the row) for each point: for a projection, the reference's row
    (where it has one) and then the target's, each named by its host."""
    projected = view.kind == "projected"
    ref_rows = {}
    if projected and view.projection.ref:
        ref_rows = {e2e_key(e, without=("tp",)): e for e in view.projection.ref.rows("e2e")}
    point_label = point_labels(rows)
    for e in rows:
        key = e2e_key(e, without=("tp",))
        sides = [(view.projection.ref_host, ref_rows[key])] if key in ref_rows else []
        sides.append((view.name, e))
        for side, row in sides:
            yield e, point_label(e) + (f" {side}" if projected else ""), row


def amdahl_chart(view: HostView, rows: list[E2ERow]) -> Amdahl:
    """The step's shares by family (or by stage, where a row has no family split) at the lowest and the
    highest concurrency: the plot keeps the extremes readable; the tables have every point."""
    projected = view.kind == "projected"
    ends = {min(e.concurrency for e in rows), max(e.concurrency for e in rows)} if rows else set()
    bars = [(name, family_split(row) or breakdown(row)) for e, name, row in _sides(view, rows)
            if e.concurrency in ends]
    return Amdahl("amdahl.png", bars, f"{view.name}: step shares at c={'/'.join(map(str, sorted(ends)))}"
                  + (f", {view.projection.ref_host} vs {view.name}" if projected else ""))
