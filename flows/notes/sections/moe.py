"""The MoE W4A16 section: one table per shape (full, then each shard degree) and two charts that draw
each shape as its own line (time per token; share of the copy and spec bandwidth)."""

from __future__ import annotations

from engine.rows import KernelRow, MoeShape
from flows.inventory.scrub import md
from flows.notes.fmt import band_text, fmt, per, sig
from flows.notes.pages import MoeTable, MoeView, Table
from flows.notes.plots import Lines
from flows.notes.points import ceilings_of, gbps, impls_of, moe_degrees, moe_points, plateau_m, roofline_us
from flows.notes.sections.machine import source_line, suite_method
from flows.notes.views import HostView, Run

SHARD_TP = 8            # the shard an 8-GPU box runs: its MoE table is expected beside the full shapes


def moe_table(view: HostView, run: Run, pts: list[KernelRow], tp: int) -> MoeTable:
    copy, mm = ceilings_of(run, view.spec)
    spec_bw = view.spec.mem_bw_gbps if view.spec else None
    projected = view.kind == "projected"
    head = ["M", "impl", "us", "host us", "us/token", "MB moved", "GB/s", "% of copy BW", "% of spec BW",
            "roofline %", "unique experts (expected)"]
    if projected:
        head[2:3] = ["us", "band (us)", "regime (ref)"]
    rows = []
    for k in pts:
        t = k.time_us_p50
        gb = gbps(k)
        floor = roofline_us(k, copy, mm)
        row = [str(k.M), md(k.impl), fmt(t), fmt(k.host_us), fmt(per(t, k.M), 2), fmt(k.bytes / 1e6),
               sig(gb), fmt(per(100 * gb, copy)), fmt(per(100 * gb, spec_bw)),
               fmt(per(100 * floor, t) if floor else None),
               f"{k.unique_experts if k.unique_experts is not None else '-'} ({fmt(k.expected_experts)})"]
        if projected:
            row[2:3] = [fmt(t), band_text(k.time_us_low, k.time_us_high),
                        f"{md(k.regime)} ({md(k.reference_regime)})"]
        rows.append(row)
    s = MoeShape.of(pts[0])
    inter = (f", expert intermediate {s.gate_up_rows // 2} (gate_up N = {s.gate_up_rows}, down K = "
             f"{s.gate_up_rows // 2})" if s.gate_up_rows else "")
    title = "Full shapes" if tp == 1 else f"TP-{tp} shard shapes (one rank of a TP-{tp} deployment)"
    shape = f"E={s.experts} routed experts, top-{s.top_k}, H={s.hidden}{inter}"
    return MoeTable(title, shape, md(impls_of(pts)), plateau_m(pts), Table.of(head, rows))


def _shape_label(tp: int) -> str:
    return "full shape" if tp == 1 else f"TP-{tp} shard"


def moe_view(view: HostView, rel: str) -> tuple[MoeView, tuple[Lines, ...]]:
    """The section's tables, and its charts (drawn under the page's plot folder `rel`)."""
    src = view.source("kernels")
    degrees = moe_degrees(src.run) if src else []
    if not degrees:
        return MoeView(source_line(src), (), ()), ()
    run = src.run
    tables = tuple(moe_table(view, run, moe_points(run, tp), tp) for tp in degrees)
    charts = moe_charts(view, run, degrees)
    alts = ("MoE us per token", "MoE % of peak bandwidth")
    return MoeView(source_line(src), tables, tuple((alt, f"{rel}/{c.file}") for alt, c in zip(alts, charts)),
                   None if SHARD_TP in degrees else SHARD_TP,
                   suite_method(run, "kernels", view.kind == "projected")), charts


def moe_charts(view: HostView, run: Run, degrees: list[int]) -> tuple[Lines, Lines]:
    """Time per token and share of peak bandwidth against M, a line per shape (a band where projected)."""
    copy, _ = ceilings_of(run, view.spec)
    spec_bw = view.spec.mem_bw_gbps if view.spec else None
    projected = view.kind == "projected"
    per_token, pct = [], []
    for tp in degrees:
        pts = moe_points(run, tp)
        ms = [k.M for k in pts]
        per_token.append((f"{_shape_label(tp)} ({impls_of(pts)})", ms, [per(k.time_us_p50, k.M) for k in pts],
                          ([per(k.time_us_low, k.M) for k in pts], [per(k.time_us_high, k.M) for k in pts])
                          if projected and all(k.time_us_low is not None for k in pts) else None))
        pct += [(f"{_shape_label(tp)}, % of {label} BW ({sig(bw)} GB/s)", ms,
                 [per(100 * gbps(k), bw) for k in pts], None)
                for label, bw in (("copy", copy), ("spec", spec_bw)) if bw]
    name = f"{view.name}: MoE W4A16"
    return (Lines("moe_us_per_token.png", per_token, f"{name}: time per token", "M (tokens)", "us / token",
                  logy=True),
            Lines("moe_pct_peak_bw.png", pct, f"{name}: bandwidth", "M (tokens)", "% of peak"))
