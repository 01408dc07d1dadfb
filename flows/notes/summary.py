"""One line per host: the headline of its page, the index row and the notes commit message.

Each is taken from the runs the host's page shows (`HostView.source`), so the index, the commit
message and the page never disagree; one host's data never stops the index or the message.
"""

from __future__ import annotations

import math
from typing import Sequence

from engine.rows import Provenance
from flows.analysis.families import tp_of
from flows.inventory.hosts import Inventory
from flows.inventory.scrub import md
from flows.notes.fmt import band_text, bandwidth, fmt, per, share
from flows.notes.gather import gather
from flows.notes.points import best_moe, ceilings_of, full_model_rows, gbps, no_full_depth
from flows.notes.views import HostView, Run
from flows.store.store import Store


def model_headline(run: Run, projected: bool) -> str:
    """Full-model tokens/s at C=1 and C=16 with tp, layers and accept length, or why there is none."""
    rows = full_model_rows(run)
    if not rows:
        why = no_full_depth(run)
        return f"full model: {why}" if why else ""
    parts = []
    for c, e in sorted(rows.items()):
        band = f" ({band_text(e.tokens_per_s_low, e.tokens_per_s_high, 0).replace('unknown', 'band unknown')})" \
            if projected else ""
        parts.append(f"{fmt(e.tokens_per_s, 0)} tok/s{band} at C={c} (B={e.budget}, accept "
                     f"{fmt(e.accept_len_mean, 2)})")
    e = next(iter(rows.values()))
    return f"full model {e.layers} layers TP-{tp_of(e)}: " + ", ".join(parts)


def outside_headline(view: HostView) -> str:
    """The outside figures' e2e rows, named by who measured them."""
    parts = []
    for run in view.outside:
        prov = Provenance.of(run.tables["runs"])
        for e in sorted(run.rows("e2e"), key=lambda e: e.concurrency):
            if e.tokens_per_s:
                parts.append(f"{fmt(e.tokens_per_s)} tok/s at C={e.concurrency}")
        if parts:
            return f"{md(prov.origin)} ({md(prov.impl or '-')}, TP-{tp_of(run.rows('e2e')[0])}): " + \
                ", ".join(parts)
    return ""


def headline(view: HostView) -> str:
    """The one-line summary used in the index and the commit message, from the runs the page shows."""
    if view.latest is None:
        return outside_headline(view) or "no data"
    kern, e2e = view.source("kernels"), view.source("e2e")
    parts = [model_headline(e2e.run, view.kind == "projected") if e2e else ""]
    moe = best_moe(kern.run) if kern else None
    if moe:
        gb = gbps(moe)
        copy, _ = ceilings_of(kern.run, view.spec)
        if view.kind == "measured":
            parts.append(f"MoE W4A16 decode {bandwidth(gb)} at M={moe.M} = {share(per(gb, copy))} of copy "
                         "bandwidth")
        else:
            if moe.time_us_low is None:
                parts.append(f"MoE W4A16 decode {bandwidth(gb)} (band unknown) at M={moe.M}")
            else:
                band = [per(moe.bytes, t * 1e3) for t in (moe.time_us_high, moe.time_us_low)]
                parts.append(f"MoE W4A16 decode {bandwidth(gb, *band) if all(map(math.isfinite, band)) else bandwidth(gb)}"
                             f" at M={moe.M}")
    outside = outside_headline(view)
    if outside:
        parts.append(outside)
    return "; ".join(p for p in parts if p) or "no kernel or e2e points"


def guarded_headline(view: HostView) -> str:
    """`headline`, or why there is none: one host's data never stops the index or the commit message."""
    try:
        return headline(view)
    except Exception as e:  # the per-page isolation boundary (see render_notes)
        return f"not rendered ({type(e).__name__})"


def summary_lines(store: Store, inv: Inventory) -> list[str]:
    """Commit message lines: `Measured h200: ...`, `Projected b300 from h200: ...`."""
    return _summary(gather(store, inv))


def _summary(views: Sequence[HostView]) -> list[str]:
    out = []
    for v in views:
        if v.kind == "measured":
            out.append(f"Measured {v.name}: {guarded_headline(v)}")
        elif v.kind == "projected":
            out.append(f"Projected {v.name} from {v.projection.ref_host}: {guarded_headline(v)}")
    return out


def notes_message(store: Store, inv: Inventory) -> str:
    """The commit message: a subject naming the hosts, then one summary line per host."""
    views = gather(store, inv)
    named = ", ".join(v.name for v in views if v.kind != "no data") or "no data"
    return f"Notes: {named}\n\n" + "\n".join(_summary(views)) + "\n"
