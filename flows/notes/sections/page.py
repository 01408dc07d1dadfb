"""A host page and the fleet index assembled from their sections, with the charts the sections return."""

from __future__ import annotations

from typing import Sequence

from flows.inventory.scrub import md
from flows.notes.pages import IndexView, Page, Table
from flows.notes.plots import Chart
from flows.notes.sections.backtest import BACKTEST_COLUMNS, backtest_cells
from flows.notes.sections.comm import comm_view
from flows.notes.sections.compare import comparison
from flows.notes.sections.e2e import e2e_view
from flows.notes.sections.kernels import kernels_view
from flows.notes.sections.machine import environment, history, status_line
from flows.notes.sections.moe import moe_view
from flows.notes.sections.outside import outside_entries
from flows.notes.sections.projected import band_caveat, projection_view
from flows.notes.sections.whatif import whatif_view
from flows.notes.summary import guarded_headline, headline
from flows.notes.views import HostView


def page_view(view: HostView) -> tuple[Page, tuple[Chart, ...]]:
    """Everything one host page shows, and the charts it shows (drawn under <host>/ beside the page)."""
    rel = view.name
    gpu = f" ({view.spec.gpu})" if view.spec else ""
    if view.kind == "measured":
        latest = view.measured[-1]
        data = (f"**Data: measured.** Latest run {md(latest.run_id)}"
                f"{' (partial: some suites did not finish)' if latest.partial else ''}; "
                f"inventory status: {status_line(view)}.")
    elif view.kind == "projected":
        data = (f"**Data: projected** from {md(view.projection.ref_host)} run {md(view.projection.ref_run_id)}; "
                f"this host has no run of its own yet. Inventory status: {status_line(view)}.")
    else:
        data = f"**Data: none.** {md(view.missing, cap=1000)}"
    some = view.latest is not None
    head, env = (headline(view), environment(view)) if some else (None, None)
    hist = history(view) if view.kind == "measured" else None
    moe, moe_charts = moe_view(view, rel) if some else (None, ())
    kernels, kernel_charts = kernels_view(view, rel) if some else (None, ())
    e2e, e2e_charts = e2e_view(view, rel) if some else (None, ())
    page = Page(
        name=view.name, gpu=gpu, kind=view.kind, data_line=data, headline=head, environment=env, history=hist,
        moe=moe, kernels=kernels, e2e=e2e,
        comm=comm_view(view) if some else None,
        comparison=comparison(view) if view.kind == "measured" else None,
        projection=projection_view(view) if view.kind == "projected" else None,
        outside=outside_entries(view), whatif=whatif_view(view.whatif.tables) if view.whatif else None,
        band_note=band_caveat(view.projection.assumptions, view.name) if view.kind == "projected" else None)
    return page, (*moe_charts, *kernel_charts, *e2e_charts)


def index_view(views: Sequence[HostView]) -> IndexView:
    rows = []
    for v in views:
        run = v.latest
        started = md(run.runs_row.started_at or "-") if run else "-"
        gpu = f"{v.host.gpus} x {v.spec.gpu}" if v.host and v.spec else "-"
        retired = "-"
        if v.host and v.host.status == "retired":
            when = v.host.retired_at.date().isoformat() if v.host.retired_at else "-"
            retired = f"{v.host.retired_reason or '-'}, {when}"
        status = v.host.status if v.host else "not in inventory"
        rows.append([f"[{v.name}]({v.name}.md)", gpu, v.host.interconnect if v.host else "-", status, retired,
                     v.kind, f"{md(run.run_id)} ({started})" if run else "-", guarded_headline(v)])
    backtest = views[0].backtest if views else []
    details = sorted({(r.kind, r.detail) for r in backtest if not r.skipped})
    return IndexView(Table.of(["host", "GPUs", "interconnect", "status", "retired (reason, date)", "data", "last run",
                               "headline"], rows),
                     Table.of(BACKTEST_COLUMNS, backtest_cells(backtest)) if backtest else None,
                     tuple(f"{md(k)}: {md(d, cap=400)}" for k, d in details))
