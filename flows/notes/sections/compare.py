"""The comparison section: the latest measured run against the previous run of the same profile."""

from __future__ import annotations

from engine.rows import COLUMNS
from flows.analysis.families import e2e_key, label, point_key, tp_of
from flows.inventory.scrub import md
from flows.notes.fmt import fmt, per, share
from flows.notes.pages import Comparison, Table
from flows.notes.points import point_key_sort, point_labels, spread
from flows.notes.views import HostView

NOISE = 0.05            # smallest change flagged as a regression, on top of the measured p10-p90 spread


def comparison(view: HostView) -> Comparison:
    """The latest measured run against the previous run of the same profile (a smoke run against a
    smoke run, a full run against a full one); changes beyond the noise are flagged."""
    cur = view.measured[-1]
    profile = cur.runs_row.profile
    prev = next((r for r in reversed(view.measured[:-1]) if r.runs_row.profile == profile), None)
    if prev is None:
        return Comparison(True, f"First measured {md(profile)}-profile run of this host: nothing to compare with.",
                          None)
    old = {point_key(k): k for k in prev.rows("kernels")}
    rows, flagged = [], 0
    for k in sorted(cur.rows("kernels"), key=point_key_sort):
        o = old.get(point_key(k))
        if not o:
            continue
        change = per(k.time_us_p50, o.time_us_p50) - 1
        noise = max(NOISE, spread(k), spread(o))
        flag = "REGRESSION" if change > noise else "faster" if change < -noise else ""
        flagged += flag == "REGRESSION"
        if flag:
            shape = " ".join(f"{a}={getattr(k, a)}" for a in (COLUMNS.M, COLUMNS.batch, COLUMNS.budget, COLUMNS.context)
                             if getattr(k, a) is not None)
            shape += f" tp={tp_of(k)}" if tp_of(k) > 1 else ""
            rows.append([md(label(k)), shape, fmt(o.time_us_p50), fmt(k.time_us_p50),
                         share(change, "+.1%"), share(noise, ".1%"), flag])
    olde = {e2e_key(e): e for e in prev.rows("e2e")}
    point_label = point_labels(cur.rows("e2e"))
    for e in cur.rows("e2e"):
        was = olde.get(e2e_key(e))
        if was and was.tokens_per_s and e.tokens_per_s:
            change = per(e.tokens_per_s, was.tokens_per_s) - 1
            flag = "REGRESSION" if change < -NOISE else "faster" if change > NOISE else ""
            flagged += flag == "REGRESSION"
            if flag:
                rows.append(["e2e tokens/s", point_label(e), fmt(was.tokens_per_s, 0),
                             fmt(e.tokens_per_s, 0), share(change, "+.1%"), f"{NOISE:.1%}", flag])
    sentence = (f"Run {md(cur.run_id)} against {md(prev.run_id)} (both {md(profile)} profile): {flagged} "
                f"regression(s) beyond the noise (the larger of {NOISE:.0%} and the points' p10-p90 spread).")
    return Comparison(False, sentence, Table.of(["point", "shape", "before", "now", "change", "noise", ""], rows)
                      if rows else None)
