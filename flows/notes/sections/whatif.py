"""The what-if section of a host page, from the grid flows.analysis.whatif stored (the notes never compute one).

One table per measured acceptance level: a row per concurrency, a column per context; each cell gives
tokens/s with its band and the step's largest term (and the spare memory when it fits tightly), or
says that the configuration does not fit the GPU's memory and what it would need.
"""

from __future__ import annotations

from typing import Any, Mapping

from engine.rows import E2ERow, Provenance
from flows.analysis.ceilings import rows_of
from flows.inventory.scrub import md
from flows.notes.pages import LevelTable, WhatIfView


def _context(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else f"{n:,}"


def _cell(row: E2ERow, note: Mapping[str, Any]) -> str:
    if row.status != "ok":
        return md(row.skip_reason or "does not fit")
    band = (f" ({row.tokens_per_s_low:,.0f}-{row.tokens_per_s_high:,.0f})"
            if row.tokens_per_s_low is not None else " (band unknown)")
    tight = f"; {md(note['tight'])}" if note.get("tight") else ""
    return f"{row.tokens_per_s:,.0f} tok/s{band}; {md(note.get('largest', ''))}{tight}"


def whatif_view(tables: Mapping[str, Any]) -> WhatIfView | None:
    """The page section of a stored what-if run (None when it has no rows)."""
    rows = rows_of(tables, "e2e")
    if not rows:
        return None
    prov = Provenance.of(tables["runs"])
    if all(r.status != "ok" for r in rows):
        return _nothing_fits(rows, prov)
    notes: list[Any] = list(prov.answers or [])
    notes += [{}] * (len(rows) - len(notes))
    levels: dict[Any, list[tuple[E2ERow, Mapping[str, Any]]]] = {}
    for r, n in zip(rows, notes):
        levels.setdefault((r.synthetic_accept, r.accept_len_mean), []).append((r, n if isinstance(n, dict) else {}))
    out = []
    for (level, accept), cells in sorted(levels.items(), key=lambda kv: (kv[0][0] is None, kv[0][0] or 0, kv[0][1])):
        contexts = sorted({r.context for r, _ in cells})
        concs = sorted({r.concurrency for r, _ in cells})
        at = {(r.concurrency, r.context): (r, n) for r, n in cells}
        body = tuple((f"C = {c}", *(_cell(*at[(c, s)]) if (c, s) in at else "-" for s in contexts)) for c in concs)
        name = f"level {level:g}, " if level is not None else ""
        out.append(LevelTable(f"{name}{accept:.2f} accepted draft tokens a step",
                              ("", *(f"{_context(s)} context" for s in contexts)), body))
    first = rows[0]
    extrapolated = sorted({e for n in notes if isinstance(n, dict) for e in n.get("extrapolated", [])})
    unknown = sorted({u for n in notes if isinstance(n, dict) for u in n.get("band_unknown", [])})
    pooled = sorted({u for n in notes if isinstance(n, dict) for u in n.get("band_pooled", [])})
    lines = []
    if extrapolated:
        lines.append("extrapolated beyond the measured shapes in some cells: " + md(", ".join(extrapolated), cap=600))
    if unknown:
        lines.append("band unknown where a carry has too little held-out evidence: " + md(", ".join(unknown), cap=400))
    if pooled:
        lines.append("band pooled over the carries of the same kind and regime where a carry has too few held-out "
                     "configurations of its own: " + md(", ".join(pooled), cap=400))
    intro = (f"The step model's answers (projected, not measured) at TP-{first.tp}, tree budget {first.budget}, "
             f"from {md(prov.reference_host or '?')} run {md(prov.reference_run_id or '?')}: tokens/s = C x "
             "(accepted + 1) / (step + comm), the steady state of a full batch, with its band from the backtests' "
             "held-out errors, and the step's largest term.")
    return WhatIfView(intro, tuple(out), tuple(lines))


def _nothing_fits(rows: list[E2ERow], prov: Provenance) -> WhatIfView:
    """One sentence instead of tables of "does not fit": the smallest configuration and what it needs."""
    least = min(rows, key=lambda r: (r.concurrency, r.context))
    return WhatIfView(
        f"No configuration of the grid fits this host's memory at TP-{least.tp}: the smallest, C = "
        f"{least.concurrency} at {_context(least.context)} context, {md(least.skip_reason or 'does not fit')}. "
        f"Its measured rows fit because the bench holds fewer distinct MoE weight sets than the model has "
        f"layers (engine.model's `weight_sets`); a served model holds one a layer. From "
        f"{md(prov.reference_host or '?')} run {md(prov.reference_run_id or '?')}.", (), ())
