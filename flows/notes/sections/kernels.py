"""The kernels section: every non-MoE point in a table, the dense GEMMs by op, and the roofline chart."""

from __future__ import annotations

from engine.rows import DenseShape, KernelRow
from flows.analysis.families import DENSE, host_side, label, regime, tp_of
from flows.inventory.scrub import md
from flows.notes.fmt import band_text, fmt, per, sig
from flows.notes.pages import KernelsView, Table
from flows.notes.plots import Roofline
from flows.notes.points import ceilings_of, gbps, group_by, point_key_sort, tflops
from flows.notes.sections.machine import source_line
from flows.notes.views import HostView, Run


def kernels_view(view: HostView, rel: str) -> tuple[KernelsView | None, tuple[Roofline, ...]]:
    """The section's tables, and its roofline chart (drawn under the page's plot folder `rel`)."""
    src = view.source("kernels")
    if src is None:
        return None, ()
    run = src.run
    pts = sorted((k for k in run.rows("kernels") if k.kernel not in ("moe_w4a16", DENSE)),
                 key=point_key_sort)
    projected = view.kind == "projected"
    head = ["kernel", "impl", "batch", "budget", "context", "us", "GB/s", "TFLOP/s", "regime"]
    if projected:
        head += ["band (us)", "reference regime"]
    copy, mm = ceilings_of(run, view.spec)
    rows = []
    for k in pts:
        t = k.time_us_p50
        row = [md(k.kernel), md(k.impl), fmt(k.batch, 0) if k.batch is not None else "-",
               str(k.budget) if k.budget is not None else "-",
               str(k.context) if k.context is not None else "-", fmt(t),
               sig(gbps(k)), sig(tflops(k)), md(k.regime or regime(k, copy, mm))]
        if projected:
            row += [band_text(k.time_us_low, k.time_us_high), md(k.reference_regime or "-")]
        rows.append(row)
    chart = roofline_chart(view, run)
    return KernelsView(source_line(src), Table.of(head, rows) if rows else None,
                       f"{rel}/{chart.file}" if chart else None, dense_table(run.rows("kernels"), copy, mm)), \
        (chart,) if chart else ()


def roofline_chart(view: HostView, run: Run) -> Roofline | None:
    """Every GPU point by family under the run's ceilings (and the reference's, for a projection); none
    when the run has no GPU point that moves bytes."""
    copy, mm = ceilings_of(run, view.spec)
    fams: dict[str, tuple[list[float], list[float]]] = {}
    for k in run.rows("kernels"):
        if not host_side(k) and k.bytes > 0:  # a shard shape is its own series: full and shard never mix
            xs, ys = fams.setdefault(label(k) + (f" TP-{tp_of(k)} shard" if tp_of(k) > 1 else ""), ([], []))
            xs.append(per(k.flops, k.bytes))
            ys.append(tflops(k))
    if not fams:
        return None
    roofs = [(view.name, copy, mm)] if copy and mm else []
    if view.kind == "projected" and view.projection.ref:
        p = view.projection
        roofs.append((f"{p.ref_host} (reference)", *ceilings_of(p.ref, p.ref_spec)))
    return Roofline("roofline.png", [(f, xs, ys) for f, (xs, ys) in sorted(fams.items())], roofs,
                    f"{view.name}: roofline ({view.kind})")


def dense_table(kern: list[KernelRow], copy: float | None, mm: float | None) -> Table | None:
    """The dense GEMMs, a row per (op, TP degree): us at each M, and the best and worst share of the
    roofline (max(bytes / copy, flops / matmul) over the time) across M."""
    pts = [k for k in kern if k.kernel == DENSE and k.time_us_p50 > 0]
    if not pts:
        return None
    ms = sorted({k.M for k in pts})
    rows = []
    def key(k: KernelRow) -> tuple:
        s = DenseShape.of(k)
        return s.op or "-", tp_of(k), s.out_features, s.in_features, s.heads or 1

    for (op, tp, n, k_, heads), group in sorted(group_by(pts, key).items()):
        at = {k.M: k for k in group}
        roof = [max(k.bytes / (copy * 1e3), k.flops / (mm * 1e6)) / k.time_us_p50 * 100
                for k in group] if copy and mm else []
        rows.append([md(op), str(tp), f"{n} x {k_}" + (f" x {heads} heads" if heads > 1 else "")]
                    + [fmt(at[m].time_us_p50) if m in at else "-" for m in ms]
                    + [f"{min(roof):.0f}-{max(roof):.0f}" if roof else "-"])
    return Table.of(["op", "tp", "N x K"] + [f"M={m} us" for m in ms] + ["roofline %"], rows)
