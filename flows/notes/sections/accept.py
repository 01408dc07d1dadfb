"""Tokens/s against the accepted length at the model's full depth: a table and a chart, one line per
(tp, concurrency), so a reader with their own drafter's acceptance reads off their figure."""

from __future__ import annotations

from engine.rows import E2ERow
from flows.analysis.families import tp_of
from flows.notes.fmt import band_text, fmt
from flows.notes.pages import AcceptView, Table
from flows.notes.plots import Lines
from flows.notes.points import at_full_depth, no_full_depth, shortest_context
from flows.notes.views import HostView, Run


def accept_view(view: HostView, run: Run, rel: str) -> tuple[AcceptView, tuple[Lines, ...]]:
    """At each acceptance level the fastest node budget stands for the point; the shortest prompts only
    (the context axis has its own section). No chart without a full-depth row."""
    rows = shortest_context(at_full_depth(run))
    if not rows:
        why = no_full_depth(run) or "no e2e rows with a figure"
        return AcceptView(None, None, why), ()
    projected = view.kind == "projected"
    best: dict[tuple, E2ERow] = {}
    for e in rows:
        key = (tp_of(e), e.concurrency, e.synthetic_accept)
        if key not in best or (e.tokens_per_s, -e.budget) > (best[key].tokens_per_s, -best[key].budget):
            best[key] = e
    ordered = sorted(best.values(), key=lambda e: (tp_of(e), e.concurrency, e.accept_len_mean or 0,
                                                   e.synthetic_accept or 0))
    head = ["tp", "layers", "concurrency", "level", "accepted / step", "budget", "tokens/s"]
    if projected:
        head.append("band (tokens/s)")
    table = []
    for e in ordered:
        r = [str(tp_of(e)), str(e.layers), str(e.concurrency),
             "-" if e.synthetic_accept is None else f"{e.synthetic_accept:g}", fmt(e.accept_len_mean, 2),
             str(e.budget), fmt(e.tokens_per_s, 0)]
        if projected:
            r.append(band_text(e.tokens_per_s_low, e.tokens_per_s_high, 0))
        table.append(r)
    chart = accept_chart(view, ordered)
    return AcceptView(Table.of(head, table), f"{rel}/{chart.file}", ""), (chart,)


def accept_chart(view: HostView, ordered: list[E2ERow]) -> Lines:
    """Tokens/s against the measured accepted length, a line per (tp, concurrency), a band where projected."""
    projected = view.kind == "projected"
    series = []
    for tp, conc in sorted({(tp_of(e), e.concurrency) for e in ordered}):
        line = [e for e in ordered if tp_of(e) == tp and e.concurrency == conc and e.accept_len_mean is not None]
        if line:
            series.append((f"TP-{tp} C={conc}", [e.accept_len_mean for e in line], [e.tokens_per_s for e in line],
                           ([e.tokens_per_s_low for e in line], [e.tokens_per_s_high for e in line])
                           if projected and all(e.tokens_per_s_low is not None for e in line) else None))
    return Lines("tokens_vs_accept.png", series,
                 f"{view.name}: full model ({ordered[0].layers} layers), tokens/s by acceptance",
                 "accepted draft tokens per step (measured; + 1 bonus token)", "tokens/s", logx=False)
