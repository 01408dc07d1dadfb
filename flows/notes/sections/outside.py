"""Imported figures of a machine (published or otherwise), beside kdbench's own and never mixed with them."""

from __future__ import annotations

from engine.rows import Provenance
from flows.analysis.families import tp_of
from flows.inventory.scrub import md
from flows.notes.fmt import fmt, per, sig
from flows.notes.pages import OutsideEntry, Table
from flows.notes.points import gbps, point_key_sort
from flows.notes.views import HostView


def outside_entries(view: HostView) -> tuple[OutsideEntry, ...]:
    """Imported figures of this machine, beside kdbench's own and never mixed with them."""
    out = []
    for run in view.outside:
        prov = Provenance.of(run.tables["runs"])
        e2e, kern = run.rows("e2e"), run.rows("kernels")
        notes = prov.notes
        out.append(OutsideEntry(
            f"**{md(run.run_id)}** ({md(prov.origin)}): {md(prov.machine or '-')}; "
            f"{md(prov.date or '-')}; source: {md(prov.source or '-', cap=400)}.",
            Table.of(["engine", "config", "layers", "tp", "concurrency", "tokens/s", "TTFT ms", "ITL ms"],
                     [[md(prov.impl or "-"), md(e.config), str(e.layers or "-"), str(tp_of(e)),
                       str(e.concurrency), fmt(e.tokens_per_s), fmt(e.ttft_ms), fmt(e.itl_ms_p50)]
                      for e in sorted(e2e, key=lambda e: e.concurrency)]) if e2e else None,
            Table.of(["kernel", "impl", "M", "us", "us/token", "GB/s"],
                     [[md(k.kernel), md(k.impl), str(k.M or "-"), fmt(k.time_us_p50),
                       fmt(per(k.time_us_p50, k.M), 2), sig(gbps(k))]
                      for k in sorted(kern, key=point_key_sort)]) if kern else None,
            tuple(md(n, cap=400) for n in notes[:20]) if isinstance(notes, list) else ()))
    return tuple(out)
