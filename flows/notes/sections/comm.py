"""The comm section: each collective the run timed, by op, GPU count and size."""

from __future__ import annotations

from flows.inventory.scrub import md
from flows.notes.fmt import fmt, sig
from flows.notes.pages import CommView, Table
from flows.notes.sections.machine import source_line
from flows.notes.views import HostView


def comm_view(view: HostView) -> CommView | None:
    src = view.source("comm")
    if src is None:
        return None
    rows = sorted(src.run.rows("comm"), key=lambda c: (c.op, c.world_size, c.bytes))
    return CommView(source_line(src), Table.of(
        ["op", "GPUs", "bytes", "us", "algbw GB/s", "busbw GB/s", "status"],
        [[md(c.op), str(c.world_size), f"{c.bytes:,}", fmt(c.time_us_p50), sig(c.algbw_gbps),
          sig(c.busbw_gbps), md(c.status if c.status == "ok" else f"{c.status}: {c.skip_reason or '-'}")]
         for c in rows]))
