"""The context axis: tokens/s against the prompt length at the model's full depth, one line per series
(measured or projected, as the page is), where attention overtakes the MoE, and the skipped points."""

from __future__ import annotations

from engine.config import CONFIGS
from engine.costs import prefill_flops
from engine.rows import E2ERow
from flows.analysis.families import tp_of
from flows.inventory.scrub import md
from flows.notes.fmt import band_text, fmt
from flows.notes.pages import ContextView, Table
from flows.notes.plots import Lines
from flows.notes.points import at_full_depth, ceilings_of, no_full_depth
from flows.notes.views import HostView, Run


def context_series(run: Run) -> dict[tuple, list[E2ERow]]:
    """Full-depth rows by (tp, concurrency, level, budget), shortest prompt first, where a series
    has two or more prompt lengths: tokens/s against context."""
    groups: dict[tuple, list[E2ERow]] = {}
    for e in at_full_depth(run):
        if e.context is not None:
            key = (tp_of(e), e.concurrency, e.synthetic_accept or 0.0, e.budget)
            groups.setdefault(key, []).append(e)
    return {k: sorted(v, key=lambda e: e.context) for k, v in sorted(groups.items())
            if len({e.context for e in v}) > 1}


def crossover(name: str, series: list[E2ERow]) -> str:
    """Where attention's GPU time a step passes the MoE's along one series, from the rows' own
    per-family split; said to be unknown where the rows have none."""
    split = [e for e in series if e.attention_ms is not None and e.moe_ms is not None]
    if not split:
        return (f"{name}: these rows have no per-family split of the step (the profiled CUDA decode records "
                "attention and MoE time), so where attention overtakes the MoE is not known.")
    lack = "" if len(split) == len(series) else f" (of the {len(split)} prompt lengths with a per-family split)"

    def at(e: E2ERow) -> str:
        return f"{fmt(e.attention_ms, 2)} vs {fmt(e.moe_ms, 2)} ms a step at {e.context:,} tokens"

    over = next((i for i, e in enumerate(split) if e.attention_ms > e.moe_ms), None)
    if over is None:
        return f"{name}: attention stays below the MoE up to {split[-1].context:,} tokens{lack} ({at(split[-1])})."
    if over == 0:
        return f"{name}: attention already takes longer than the MoE at the shortest prompt{lack} ({at(split[0])})."
    return (f"{name}: attention overtakes the MoE between {split[over - 1].context:,} and "
            f"{split[over].context:,} tokens{lack} ({at(split[over - 1])}; {at(split[over])}).")


def ttft_floor_ms(e: E2ERow, matmul_tflops: float | None) -> float | None:
    """The compute floor of a row's TTFT: its sequences' prefill flops (`prefill_flops`, at the row's
    prompt length, depth and TP degree) at the run's bf16 matmul rate; None where a piece is unknown."""
    cfg = CONFIGS.get(e.config or "")
    if cfg is None or not matmul_tflops or not e.context or not e.concurrency:
        return None
    return e.concurrency * prefill_flops(cfg, e.context, e.layers, tp_of(e)) / (matmul_tflops * 1e9)


def skipped_points(rows: list[E2ERow]) -> tuple[str, ...]:
    """Each skipped e2e point in words: its key, the bytes it needed and the run's reason."""
    out = []
    for e in sorted((e for e in rows if e.status != "ok"), key=lambda e: (tp_of(e), e.concurrency,
                                                                             e.context or 0, e.budget)):
        gb = f", {e.memory_bytes / 1e9:,.1f} GB needed" if e.memory_bytes else ""
        ctx = "-" if e.context is None else f"{e.context:,}"
        out.append(f"TP-{tp_of(e)} C={e.concurrency} B={e.budget} context {ctx}{gb}: "
                   f"{md(e.status)}: {md(e.skip_reason or '-', cap=400)}")
    return tuple(out)


def context_view(view: HostView, run: Run, rel: str) -> tuple[ContextView, tuple[Lines, ...]]:
    """The section's table and words, and its chart (none without a series of two prompt lengths)."""
    skipped = skipped_points(run.rows("e2e"))
    series = context_series(run)
    if not series:
        why = no_full_depth(run) or ("the e2e rows here have one prompt length per tensor-parallel degree and "
                                     "concurrency (the CUDA full profile's context axis adds prompts of 1k-128k tokens)")
        return ContextView(None, None, (), skipped, why), ()
    projected = view.kind == "projected"
    head = ["tp", "concurrency", "level", "budget", "context", "tokens/s", "TTFT ms", "TTFT floor ms",
            "TTFT / floor", "step ms (p50)", "attention ms", "MoE ms", "attention / MoE"]
    matmul = ceilings_of(run, view.spec)[1]
    if projected:
        head.insert(6, "band (tokens/s)")
    table, words = [], []
    for (tp, conc, level, budget), rows in series.items():
        for e in rows:
            att, moe, floor = e.attention_ms, e.moe_ms, ttft_floor_ms(e, matmul)
            r = [str(tp), str(conc), f"{level:g}", str(budget), f"{e.context:,}", fmt(e.tokens_per_s, 0),
                 fmt(e.ttft_ms, 0), fmt(floor, 1), fmt(e.ttft_ms / floor, 1) if e.ttft_ms and floor else "-",
                 fmt(e.step_ms_p50, 2), fmt(att, 2), fmt(moe, 2),
                 fmt(att / moe, 2) if att is not None and moe else "-"]
            if projected:
                r.insert(6, band_text(e.tokens_per_s_low, e.tokens_per_s_high, 0))
            table.append(r)
        words.append(crossover(_series_name(tp, conc, level, budget), rows))
    chart = context_chart(view, series)
    return ContextView(Table.of(head, table), f"{rel}/{chart.file}", tuple(words), skipped, ""), (chart,)


def _series_name(tp: int, conc: int, level: float, budget: int) -> str:
    return f"TP-{tp} C={conc} (level {level:g}, B={budget})"


def context_chart(view: HostView, series: dict[tuple, list[E2ERow]]) -> Lines:
    """Tokens/s against context, a line per series, a band where projected."""
    projected = view.kind == "projected"
    lines = [(_series_name(*key), [e.context for e in rows], [e.tokens_per_s for e in rows],
              ([e.tokens_per_s_low for e in rows], [e.tokens_per_s_high for e in rows])
              if projected and all(e.tokens_per_s_low is not None for e in rows) else None)
             for key, rows in series.items()]
    return Lines("tokens_vs_context.png", lines, f"{view.name}: full model, tokens/s by context ({view.kind})",
                 "context (prompt tokens a sequence)", "tokens/s")
