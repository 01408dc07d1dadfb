"""Generated notes (docs/notes/): one page per host, a fleet index, plots, and the git commit.

Everything on a page is a function of artifacts/ and the inventory alone: no clock, no
environment, fixed number formats and sorted orders, so the same inputs give the same bytes and
git only sees a change when a figure changed. A host with no measured run gets a projected page,
computed here the same (deterministic) way the flows store it. Pages name hosts, GPUs, versions
and fingerprints, never addresses, user names or key paths: `leaks` checks that before writing.
Every string that came from a host (GPU name, versions, kernel, impl, config, run ids) is made
plain and redacted with the inventory when the views are gathered, and escaped with `md` where it
enters a page, so one odd host cannot break a table, inject markup or block the fleet's notes.
"""

from __future__ import annotations

import difflib
import os
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import pyarrow as pa

from engine.schema import provenance
from flows import plots
from flows.inventory import Host, Inventory, InventoryError, Spec, host_status_text
from flows.projection import (TERMS, ProjectionError, Reference, breakdown, load_reference, point_key,
                              project, target_of)
from flows.scrub import leaks, md, plain, redact
from flows.store import Store, StoreError, check_name

NOISE = 0.05            # smallest change flagged as a regression, on top of the measured p10-p90 spread
PLATEAU = 0.9           # plateau M: first M reaching this fraction of the best MoE bandwidth
GIT_ENV = {"GIT_AUTHOR_NAME": "kdbench", "GIT_AUTHOR_EMAIL": "kdbench@localhost",
           "GIT_COMMITTER_NAME": "kdbench", "GIT_COMMITTER_EMAIL": "kdbench@localhost"}


class NotesError(Exception):
    """Notes that cannot be written or committed as asked; the message says why."""


@dataclass
class Run:
    run_id: str
    tables: dict[str, pa.Table]

    def rows(self, table: str) -> list[dict[str, Any]]:
        return self.tables[table].to_pylist() if table in self.tables else []

    @property
    def partial(self) -> bool:
        return any(r["status"] == "partial" for r in self.rows("runs"))

    @property
    def runs_row(self) -> dict[str, Any]:
        rows = self.rows("runs")
        kern = [r for r in rows if r["suite"] == "kernels"]
        return (kern or rows)[0]


@dataclass
class Projected:
    """A projection as a page shows it, whether computed now or read back from the store."""

    run: Run
    ref_host: str
    ref_run_id: str
    ref: Run | None                  # the reference's measured tables, when still at hand
    ref_spec: Spec | None
    assumptions: list[str]
    references: list[str]


@dataclass
class HostView:
    """What one page shows: the host, its data (measured runs or a projection), or why there is none."""

    name: str
    host: Host | None
    spec: Spec | None
    measured: list[Run] = field(default_factory=list)      # oldest first
    projection: Projected | None = None
    missing: str = ""

    @property
    def kind(self) -> str:
        return "measured" if self.measured else "projected" if self.projection else "no data"

    @property
    def latest(self) -> Run | None:
        if self.measured:
            return self.measured[-1]
        if self.projection:
            return self.projection.run
        return None


# -- gathering ----------------------------------------------------------------------------------

def measured_runs(store: Store, name: str) -> list[Run]:
    """Every measured run of a host (partial ones too): ingested runs and committed reference sets."""
    # stored runs in the store's order (the controller's clock), after the committed reference sets
    runs: dict[str, tuple[tuple, Run]] = {}
    for i, info in enumerate(store.runs(name)):
        if info.source == "measured":
            runs[info.run_id] = ((1, i), Run(info.run_id, store.load(name, info.run_id)))
    for ref in store.references():
        tables = store.reference(ref)
        row = tables["runs"].to_pylist()[0]
        if row["host"] == name and row["source"] == "measured":
            runs.setdefault(row["run_id"], ((0, row["started_at"] or ""), Run(row["run_id"], tables)))
    return [r for _, r in sorted(runs.values(), key=lambda x: (x[0], x[1].run_id))]


def stored_projection(store: Store, inv: Inventory, name: str) -> Projected | None:
    """The newest projected run the flows stored for a host, with its reference when still present."""
    runs = [r for r in store.runs(name) if r.source == "projected" and r.status == "complete"]
    if not runs:
        return None
    run = Run(runs[-1].run_id, store.load(name, runs[-1].run_id))
    prov = provenance(run.tables["runs"])
    ref_host, ref_id = prov.get("reference_host", "?"), prov.get("reference_run_id", "?")
    ref = next((r for r in measured_runs(store, ref_host) if r.run_id == ref_id), None)
    host = inv.hosts.get(ref_host)
    return Projected(run, ref_host, ref_id, ref, inv.specs.get(host.spec) if host else None,
                     list(prov.get("assumptions", [])), list(prov.get("references", [ref_id])))


def projected_now(ref: Reference, inv: Inventory, name: str) -> Projected:
    p = project([ref], target_of(inv, name))
    return Projected(Run(p.run_id, p.tables), ref.host, ref.run_id, Run(ref.run_id, ref.tables), ref.spec,
                     p.assumptions, [ref.run_id])


def gather(store: Store, inv: Inventory, reference: str = "h200") -> list[HostView]:
    """Views of every inventory host and every host with data, sorted by name.

    A host without a measured run shows a projection: the one computed now from `reference` (the
    same deterministic computation the flows store), or a stored one made from a newer reference.
    """
    names = set(inv.hosts) | {r.host for r in store.runs()}
    for ref_name in store.references():
        names.add(store.reference(ref_name)["runs"].column("host")[0].as_py())
    names = {n for n in names if _page_name(n)}  # a name becomes a file name under docs/notes/
    ref: Reference | None = None
    ref_error = ""
    try:
        ref = load_reference(store, inv, reference)
    except (ProjectionError, StoreError) as e:
        ref_error = str(e)
    views = []
    for name in sorted(names):
        host = inv.hosts.get(name)
        spec = inv.specs.get(host.spec) if host else None
        view = HostView(name, host, spec, measured_runs(store, name))
        if not view.measured:
            # the projection from the newest reference: a stored one, or one computed now
            options = [p for p in (stored_projection(store, inv, name),
                                   projected_now(ref, inv, name) if ref and spec else None) if p]
            if options:
                view.projection = max(reversed(options), key=lambda p: p.run.runs_row["started_at"] or "")
            elif ref is None:
                view.missing = ref_error
            else:
                view.missing = f"host {name} is not in the inventory, so it has no spec sheet to project onto"
        views.append(_cleaned(view, inv))
    return views


def _page_name(name: object) -> bool:
    """A host name that can name a page and a plot folder: a store name that is not a path."""
    try:
        return isinstance(name, str) and check_name("host", name) == name
    except StoreError:
        return False


def _clean_run(run: Run, inv: Inventory) -> Run:
    """The run with every string a host wrote made plain and redacted (see flows/scrub.py)."""
    def column(col: pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
        if not pa.types.is_string(col.type):
            return col
        return pa.array([None if v is None else plain(v, inv) for v in col.to_pylist()], type=col.type)

    tables = {name: pa.Table.from_arrays([column(c) for c in t.columns], schema=t.schema)
              for name, t in run.tables.items()}
    return Run(plain(run.run_id, inv), tables)


def _cleaned(view: HostView, inv: Inventory) -> HostView:
    """Views are gathered from raw stored tables (lookups need the real ids), then cleaned for display."""
    view.measured = [_clean_run(r, inv) for r in view.measured]
    p = view.projection
    if p:
        view.projection = Projected(_clean_run(p.run, inv), plain(p.ref_host, inv), plain(p.ref_run_id, inv),
                                    _clean_run(p.ref, inv) if p.ref else None, p.ref_spec,
                                    [plain(a, inv, cap=1000) for a in p.assumptions], [plain(r, inv) for r in p.references])
    view.missing = plain(view.missing, inv, cap=1000)
    return view


# -- figures ------------------------------------------------------------------------------------

def ceilings_of(run: Run, spec: Spec | None) -> tuple[float | None, float | None]:
    r = run.runs_row
    return r.get("copy_gbps") or (spec.mem_bw_gbps if spec else None), \
        r.get("matmul_tflops") or (spec.tflops.get("bf16") if spec else None)


def moe_points(run: Run) -> list[dict[str, Any]]:
    """MoE W4A16 points of the run's preferred implementation (Triton where it ran), by M."""
    pts = [k for k in run.rows("kernels") if k["kernel"] == "moe_w4a16" and k["M"]]
    impls = sorted({k["impl"] for k in pts}, key=lambda i: (i != "triton", i))
    return sorted((k for k in pts if impls and k["impl"] == impls[0]), key=lambda k: k["M"])


def plateau_m(points: list[dict[str, Any]]) -> int | None:
    gb = [k["bytes"] / (k["time_us_p50"] * 1e3) for k in points]
    if not gb:
        return None
    return next(k["M"] for k, g in zip(points, gb) if g >= PLATEAU * max(gb))


def best_moe(run: Run) -> dict[str, Any] | None:
    pts = moe_points(run)
    return max(pts, key=lambda k: (k["bytes"] / k["time_us_p50"], -k["M"])) if pts else None


def best_e2e(run: Run) -> dict[str, Any] | None:
    rows = [e for e in run.rows("e2e") if e["tokens_per_s"]]
    return max(rows, key=lambda e: (e["tokens_per_s"], -e["concurrency"])) if rows else None


def fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def sig(x: float | None) -> str:
    """Four significant digits: ceilings span CPU sandboxes (GB/s) to B300s (TB/s)."""
    return "-" if x is None else f"{x:.4g}"


def bandwidth(gbps: float, *more: float) -> str:
    """`3.78 TB/s`, or `11.2 GB/s` below 1 TB/s; extra values (a band) share the first one's unit."""
    scale, unit, spec = (1e3, "TB/s", ".2f") if gbps >= 1e3 else (1.0, "GB/s", ".3g")
    band = f" ({'-'.join(format(x / scale, spec) for x in more)})" if more else ""
    return f"{gbps / scale:{spec}} {unit}{band}"


def headline(view: HostView) -> str:
    """The one-line summary used in the index and the commit message."""
    run = view.latest
    if run is None:
        return "no data"
    parts = []
    moe = best_moe(run)
    if moe:
        gbps = moe["bytes"] / (moe["time_us_p50"] * 1e3)
        copy, _ = ceilings_of(run, view.spec)
        if view.kind == "measured":
            parts.append(f"MoE W4A16 decode {bandwidth(gbps)} at M={moe['M']} = {gbps / copy:.0%} of copy bandwidth")
        else:
            lo = moe["bytes"] / (moe["time_us_high"] * 1e3)
            hi = moe["bytes"] / (moe["time_us_low"] * 1e3)
            parts.append(f"MoE W4A16 decode {bandwidth(gbps, lo, hi)} at M={moe['M']}")
    e2e = best_e2e(run)
    if e2e:
        band = "" if view.kind == "measured" else \
            f" ({e2e['tokens_per_s_low']:,.0f}-{e2e['tokens_per_s_high']:,.0f})"
        parts.append(f"e2e {e2e['tokens_per_s']:,.0f} tok/s{band} at concurrency {e2e['concurrency']}")
    return "; ".join(parts) or "no kernel or e2e points"


def summary_lines(store: Store, inv: Inventory, reference: str = "h200") -> list[str]:
    """Commit message lines: `Measured h200: ...`, `Projected b300 from h200: ...`."""
    return _summary(gather(store, inv, reference))


def _summary(views: Sequence[HostView]) -> list[str]:
    out = []
    for v in views:
        if v.kind == "measured":
            out.append(f"Measured {v.name}: {headline(v)}")
        elif v.kind == "projected":
            out.append(f"Projected {v.name} from {v.projection.ref_host}: {headline(v)}")
    return out


# -- pages --------------------------------------------------------------------------------------

def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out + [""]


def status_line(view: HostView) -> str:
    h = view.host
    if h is None:
        return "not in the inventory"
    if h.status == "retired":
        when = h.retired_at.date().isoformat() if h.retired_at else "date unknown"
        return f"retired ({h.retired_reason or 'reason unknown'}, {when})"
    return "active"


def environment(view: HostView, run: Run) -> list[str]:
    spec, host = view.spec, view.host
    rows = []
    if spec:
        rows += [("GPU", f"{spec.gpu} ({spec.arch})"), ("memory", f"{spec.memory_gb:g} GB"),
                 ("spec bandwidth", f"{spec.mem_bw_gbps:,.0f} GB/s"),
                 ("spec bf16 dense", f"{sig(spec.tflops.get('bf16'))} TFLOP/s")]
    if host:
        rows += [("GPUs", f"{host.gpus} on {host.interconnect}"), ("inventory status", status_line(view))]
    r = run.runs_row
    copy, mm = ceilings_of(run, spec)
    if view.kind == "measured":
        rows += [(k, md(r[k])) for k in ("gpu_name", "driver", "cuda", "torch", "triton", "python",
                                          "payload_hash", "device", "profile", "started_at") if r.get(k)]
        rows += [("measured copy bandwidth", f"{sig(r.get('copy_gbps'))} GB/s"),
                 ("measured matmul", f"{sig(r.get('matmul_tflops'))} TFLOP/s")]
    else:
        rows += [("projected ceilings", f"{sig(copy)} GB/s, {sig(mm)} TFLOP/s")]
    rows.append(("run", md(run.run_id)))
    return ["## Environment", ""] + _table(("", ""), rows)


def moe_section(view: HostView, run: Run, out_dir: Path, rel: str) -> list[str]:
    pts = moe_points(run)
    if not pts:
        return ["## MoE W4A16 GEMM", "", "No MoE points in this run.", ""]
    copy, _ = ceilings_of(run, view.spec)
    spec_bw = view.spec.mem_bw_gbps if view.spec else None
    projected = view.kind == "projected"
    head = ["M", "us", "us/token", "GB/s", "% of copy BW", "% of spec BW", "unique experts (expected)"]
    if projected:
        head[1:2] = ["us", "band (us)", "regime (ref)"]
    rows = []
    for k in pts:
        t = k["time_us_p50"]
        gb = k["bytes"] / (t * 1e3)
        row = [str(k["M"]), fmt(t), fmt(t / k["M"], 2), sig(gb), fmt(100 * gb / copy if copy else None),
               fmt(100 * gb / spec_bw if spec_bw else None),
               f"{k['unique_experts'] if k['unique_experts'] is not None else '-'} ({fmt(k['expected_experts'])})"]
        if projected:
            row[1:2] = [fmt(t), f"{fmt(k['time_us_low'])}-{fmt(k['time_us_high'])}",
                        f"{md(k['regime'])} ({md(k['reference_regime'])})"]
        rows.append(row)
    impl = pts[0]["impl"]
    name = f"{view.name}: MoE W4A16 ({impl})"
    series = [(run.run_id, [k["M"] for k in pts], [k["time_us_p50"] / k["M"] for k in pts],
               ([k["time_us_low"] / k["M"] for k in pts], [k["time_us_high"] / k["M"] for k in pts])
               if projected else None)]
    plots.lines(out_dir / "moe_us_per_token.png", series, f"{name}: time per token", "M (tokens)",
                "us / token", logy=True)
    pct = [(f"% of {label} BW ({sig(bw)} GB/s)", [k["M"] for k in pts],
            [100 * k["bytes"] / (k["time_us_p50"] * 1e3) / bw for k in pts], None)
           for label, bw in (("copy", copy), ("spec", spec_bw)) if bw]
    plots.lines(out_dir / "moe_pct_peak_bw.png", pct, f"{name}: bandwidth", "M (tokens)", "% of peak")
    shape = f"E={pts[0]['E']} routed experts, top-{pts[0]['top_k']}, H={pts[0]['K']}"
    return ["## MoE W4A16 GEMM", "",
            f"{shape}, {md(impl)}; plateau M = {plateau_m(pts)} (first M reaching "
            f"{PLATEAU:.0%} of the best bandwidth).", ""] + _table(head, rows) + [
        f"![MoE us per token]({rel}/moe_us_per_token.png)", "",
        f"![MoE % of peak bandwidth]({rel}/moe_pct_peak_bw.png)", ""]


def other_kernels(view: HostView, run: Run, out_dir: Path, rel: str) -> list[str]:
    pts = sorted((k for k in run.rows("kernels") if k["kernel"] != "moe_w4a16"), key=point_key_sort)
    projected = view.kind == "projected"
    head = ["kernel", "impl", "batch", "budget", "context", "us", "GB/s", "TFLOP/s", "regime"]
    if projected:
        head += ["band (us)", "reference regime"]
    rows = []
    for k in pts:
        t = k["time_us_p50"]
        row = [md(k["kernel"]), md(k["impl"]), fmt(k["batch"], 0) if k["batch"] is not None else "-",
               str(k["budget"]) if k["budget"] is not None else "-",
               str(k["context"]) if k["context"] is not None else "-", fmt(t),
               sig(k["bytes"] / (t * 1e3)), sig(k["flops"] / (t * 1e6)),
               md(k["regime"] or regime_of(k, *ceilings_of(run, view.spec)))]
        if projected:
            row += [f"{fmt(k['time_us_low'])}-{fmt(k['time_us_high'])}", md(k["reference_regime"] or "-")]
        rows.append(row)
    copy, mm = ceilings_of(run, view.spec)
    fams: dict[str, tuple[list[float], list[float]]] = {}
    for k in run.rows("kernels"):
        if k["impl"] != "cpu" and k["bytes"] > 0:
            xs, ys = fams.setdefault(f"{k['kernel']}/{k['impl']}", ([], []))
            xs.append(k["flops"] / k["bytes"])
            ys.append(k["flops"] / (k["time_us_p50"] * 1e6))
    roofs = [(view.name, copy, mm)] if copy and mm else []
    if view.kind == "projected" and view.projection.ref:
        p = view.projection
        roofs.append((f"{p.ref_host} (reference)", *ceilings_of(p.ref, p.ref_spec)))
    out = ["## Attention and tree kernels", ""] + (_table(head, rows) if rows else ["No points.", ""])
    if fams:
        plots.roofline(out_dir / "roofline.png", [(f, xs, ys) for f, (xs, ys) in sorted(fams.items())], roofs,
                       f"{view.name}: roofline ({view.kind})")
        out += [f"![roofline]({rel}/roofline.png)", ""]
    return out


def point_key_sort(k: dict[str, Any]) -> tuple:
    return tuple((v is None, v if v is not None else 0) for v in point_key(k))


def regime_of(k: dict[str, Any], bw: float | None, tf: float | None) -> str:
    if k["impl"] == "cpu":
        return "host"
    if not bw or not tf:
        return "-"
    return "memory" if k["bytes"] / bw >= k["flops"] / (tf * 1e3) else "compute"


def e2e_section(view: HostView, run: Run, out_dir: Path, rel: str) -> list[str]:
    rows = sorted(run.rows("e2e"), key=lambda e: (e["config"], e["budget"], e["concurrency"]))
    if not rows:
        return ["## End to end", "", "No e2e points in this run.", ""]
    projected = view.kind == "projected"
    head = ["config", "layers", "budget", "concurrency", "accepted / step", "tokens/s", "step ms"]
    if projected:
        head.insert(6, "band (tokens/s)")
    table = []
    for e in rows:
        r = [md(e["config"]), str(e["layers"]), str(e["budget"]), str(e["concurrency"]),
             fmt(e["accept_len_mean"], 2), fmt(e["tokens_per_s"], 0), fmt(e["step_ms_p50"], 2)]
        if projected:
            r.insert(6, f"{fmt(e['tokens_per_s_low'], 0)}-{fmt(e['tokens_per_s_high'], 0)}")
        table.append(r)
    level = sorted({e["synthetic_accept"] for e in rows if e["synthetic_accept"] is not None})
    out = ["## End to end", "",
           "Tokens/s = (accepted draft tokens + 1 bonus token) x concurrency / step time. Acceptance is "
           f"synthetic (drafter steered at level {', '.join(f'{x:g}' for x in level) or '-'}).", ""]
    out += _table(head, table)
    # the step split and its Amdahl shares; for a projection, the reference's next to the target's
    ref_rows = {}
    if projected and view.projection.ref:
        ref_rows = {(e["config"], e["budget"], e["concurrency"]): e for e in view.projection.ref.rows("e2e")}
    head = ["point"] + [t.removesuffix("_ms") for t in TERMS] + ["step ms"]
    split, bars = [], []
    ends = {min(e["concurrency"] for e in rows), max(e["concurrency"] for e in rows)} if rows else set()
    for e in rows:
        key = (e["config"], e["budget"], e["concurrency"])
        sides = [(view.projection.ref_host, ref_rows[key])] if key in ref_rows else []
        sides.append((view.name, e))
        for side, row in sides:
            b = breakdown(row)
            step = sum(b.values())
            label = f"B={e['budget']} c={e['concurrency']}" + (f" {side}" if projected else "")
            split.append([label] + [f"{fmt(b[t], 2)} ({100 * b[t] / step:.0f}%)" for t in TERMS] + [fmt(step, 2)])
            if e["concurrency"] in ends:  # the plot keeps the extremes readable; the table has every point
                bars.append((label, b))
    plots.amdahl(out_dir / "amdahl.png", bars,
                 f"{view.name}: step shares at c={'/'.join(map(str, sorted(ends)))}"
                 + (f", {view.projection.ref_host} vs {view.name}" if projected else ""))
    out += ["## Step breakdown", "", "Milliseconds per step and the Amdahl share of each term"
            + (", reference and target side by side: the largest target share is what matters on this machine."
               if projected else "."), ""] + _table(head, split)
    out += [f"![Amdahl shares]({rel}/amdahl.png)", ""]
    busy = [e for e in rows if e.get("kernel_ms") is not None and e.get("outside_ms") is not None]
    if busy:
        out += ["## Time outside kernels", "",
                "GPU busy time per step (kernels and copies, from a second, profiled decode of each point) and "
                "the rest of the measured step: Python, launches, gaps between kernels, the step's one "
                "synchronisation.", ""]
        out += _table(["point", "kernels ms", "outside ms", "outside share"],
                      [[f"B={e['budget']} c={e['concurrency']}", fmt(e["kernel_ms"], 2), fmt(e["outside_ms"], 2),
                        f"{100 * e['outside_ms'] / (e['kernel_ms'] + e['outside_ms']):.0f}%"] for e in busy])
    if projected:
        last = rows[-1]
        b = breakdown(last)
        top = max(TERMS, key=lambda t: (b[t], t))
        out += [f"At concurrency {last['concurrency']} the largest term on {view.name} is "
                f"{top.removesuffix('_ms')} ({100 * b[top] / sum(b.values()):.0f}% of the step).", ""]
    return out


def comparison(view: HostView) -> list[str]:
    """The latest measured run against the previous one; changes beyond the noise are flagged."""
    out = ["## Against the previous run", ""]
    if len(view.measured) < 2:
        return out + ["First measured run of this host: nothing to compare with.", ""]
    prev, cur = view.measured[-2], view.measured[-1]
    old = {point_key(k): k for k in prev.rows("kernels")}
    rows, flagged = [], 0
    for k in sorted(cur.rows("kernels"), key=point_key_sort):
        o = old.get(point_key(k))
        if not o:
            continue
        change = k["time_us_p50"] / o["time_us_p50"] - 1
        noise = max(NOISE, spread(k), spread(o))
        flag = "REGRESSION" if change > noise else "faster" if change < -noise else ""
        flagged += flag == "REGRESSION"
        if flag:
            shape = " ".join(f"{a}={k[a]}" for a in ("M", "batch", "budget", "context") if k[a] is not None)
            rows.append([md(f"{k['kernel']}/{k['impl']}"), shape, fmt(o["time_us_p50"]), fmt(k["time_us_p50"]),
                         f"{change:+.1%}", f"{noise:.1%}", flag])
    olde = {(e["config"], e["budget"], e["concurrency"]): e for e in prev.rows("e2e")}
    for e in cur.rows("e2e"):
        o = olde.get((e["config"], e["budget"], e["concurrency"]))
        if o and o["tokens_per_s"] and e["tokens_per_s"]:
            change = e["tokens_per_s"] / o["tokens_per_s"] - 1
            flag = "REGRESSION" if change < -NOISE else "faster" if change > NOISE else ""
            flagged += flag == "REGRESSION"
            if flag:
                rows.append(["e2e tokens/s", f"c={e['concurrency']} budget={e['budget']}", fmt(o["tokens_per_s"], 0),
                             fmt(e["tokens_per_s"], 0), f"{change:+.1%}", f"{NOISE:.1%}", flag])
    out += [f"Run {md(cur.run_id)} against {md(prev.run_id)}: {flagged} regression(s) beyond the noise "
            f"(the larger of {NOISE:.0%} and the points' p10-p90 spread).", ""]
    return out + (_table(["point", "shape", "before", "now", "change", "noise", ""], rows) if rows else [])


def spread(k: dict[str, Any]) -> float:
    if k.get("time_us_p10") is None or k.get("time_us_p90") is None:
        return 0.0
    return (k["time_us_p90"] - k["time_us_p10"]) / k["time_us_p50"]


def projection_section(view: HostView) -> list[str]:
    p = view.projection
    gpu = f" ({p.ref_spec.gpu})" if p.ref_spec else ""
    return ["## Projection", "",
            f"Reference: host {md(p.ref_host)}, run {md(p.ref_run_id)}{gpu}; "
            f"references used for the band: {', '.join(md(r) for r in p.references)}.", "", "Assumptions:", ""] + \
        [f"- {md(a, cap=1000)}" for a in p.assumptions] + [
        "", "Every figure on this page is a projection with a low-high band, not a measurement.", ""]


def render_host(view: HostView, docs_dir: Path) -> str:
    """The page's markdown; its plots are written under docs_dir/<host>/ on the way."""
    out_dir = docs_dir / view.name
    run = view.latest
    gpu = f" ({view.spec.gpu})" if view.spec else ""
    if view.kind == "measured":
        lines = [f"# {view.name}{gpu}: measured", "",
                 f"**Data: measured.** Latest run {md(run.run_id)}"
                 f"{' (partial: some suites did not finish)' if run.partial else ''}; "
                 f"inventory status: {status_line(view)}.", ""]
    elif view.kind == "projected":
        lines = [f"# {view.name}{gpu}: projected", "",
                 f"**Data: projected** from {md(view.projection.ref_host)} run {md(view.projection.ref_run_id)}; "
                 f"this host has no run of its own yet. Inventory status: {status_line(view)}.", ""]
    else:
        lines = [f"# {view.name}{gpu}: no data", "", f"**Data: none.** {md(view.missing, cap=1000)}", ""]
    if run is not None:
        rel = view.name
        lines += environment(view, run)
        lines += moe_section(view, run, out_dir, rel)
        lines += other_kernels(view, run, out_dir, rel)
        lines += e2e_section(view, run, out_dir, rel)
        lines += comparison(view) if view.kind == "measured" else projection_section(view)
    return "\n".join(lines).rstrip() + "\n"


def render_index(views: Sequence[HostView]) -> str:
    rows = []
    for v in views:
        run = v.latest
        started = md(run.runs_row.get("started_at") or "-") if run else "-"
        gpu = f"{v.host.gpus} x {v.spec.gpu}" if v.host and v.spec else "-"
        retired = "-"
        if v.host and v.host.status == "retired":
            when = v.host.retired_at.date().isoformat() if v.host.retired_at else "-"
            retired = f"{v.host.retired_reason or '-'}, {when}"
        status = v.host.status if v.host else "not in inventory"
        rows.append([f"[{v.name}]({v.name}.md)", gpu, v.host.interconnect if v.host else "-", status, retired,
                     v.kind, f"{md(run.run_id)} ({started})" if run else "-", headline(v)])
    lines = ["# kdbench fleet", "",
             "Generated by `kdbench notes` from artifacts/ and hosts/. A projected host has no run of its own; "
             "its figures are carried from a measured reference and carry a low-high band.", ""]
    lines += _table(["host", "GPUs", "interconnect", "status", "retired (reason, date)", "data", "last run",
                     "headline"], rows)
    return "\n".join(lines).rstrip() + "\n"


# -- writing ------------------------------------------------------------------------------------

def _inside(path: Path, root: Path) -> Path:
    """path, refused unless it resolves strictly inside root (symlinks included)."""
    full = path.resolve()
    if full == root.resolve() or not full.is_relative_to(root.resolve()):
        raise NotesError(f"refusing to write {path.name}: it resolves outside {root.name}/")
    return path


def render_notes(store: Store, inv: Inventory, docs_dir: Path, reference: str = "h200") -> list[Path]:
    """Write every host page, its plots and the fleet index under docs_dir/notes/; returns the files."""
    views = gather(store, inv, reference)
    notes_dir = Path(docs_dir) / "notes"
    notes_dir.mkdir(parents=True, exist_ok=True)
    for v in views:
        _inside(notes_dir / v.name, notes_dir), _inside(notes_dir / f"{v.name}.md", notes_dir)
    pages = {notes_dir / f"{v.name}.md": render_host(v, notes_dir) for v in views}
    pages[notes_dir / "README.md"] = render_index(views)
    for path, text in pages.items():
        bad = leaks(text, inv)
        if bad:
            raise NotesError(f"{path.name} would reveal {', '.join(bad)}; no page written")
    for path, text in pages.items():
        path.write_text(text)
    pngs = [p for v in views for p in sorted((notes_dir / v.name).glob("*.png"))]
    return sorted([*pages, *pngs])


# -- git ----------------------------------------------------------------------------------------

def _git(repo: Path, *args: str, check: bool = True, index: Path | None = None,
         stdin: str | None = None, text: bool = True) -> subprocess.CompletedProcess:
    """git in repo, with kdbench's identity and (index) a private index file."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("GIT_")}, **GIT_ENV}
    if index is not None:
        env["GIT_INDEX_FILE"] = str(index)
    return subprocess.run(["git", "-C", str(repo), *args], env=env, capture_output=True, text=text,
                          check=check, timeout=60, input=stdin)


def _host_blob(repo: Path, head: str | None, rel: str) -> str | None:
    """What a notes commit may record of a host file: its HEAD version with only the status fields
    replaced by the working file's. None for a file HEAD does not have: kdbench never commits an
    operator's file (address, user, key path) of its own accord."""
    if head is None:
        return None
    old = _git(repo, "show", f"{head}:{rel}", check=False)
    if old.returncode != 0:
        return None
    try:
        return host_status_text(old.stdout, (repo / rel).read_text(encoding="utf-8"), rel)
    except (InventoryError, OSError, UnicodeDecodeError) as e:
        raise NotesError(f"{rel}: cannot take its status fields: {redact(str(e))}") from None


def _added(old: str, new: str) -> str:
    """The lines of new that old does not have: what a commit adds to the history."""
    return "\n".join(line[1:] for line in difflib.unified_diff(old.splitlines(), new.splitlines(), lineterm="", n=0)
                     if line.startswith("+") and not line.startswith("+++"))


def _check_staged(repo: Path, head: str | None, rels: Sequence[str], index: Path, inv: Inventory | None) -> None:
    """The leak check over every file the commit would record. Pages are checked whole; a host
    file only in the lines kdbench adds (its HEAD version is already history). Binary files (the
    plots) are checked for the inventory's own values only."""
    for rel in rels:
        blob = _git(repo, "cat-file", "blob", f":{rel}", check=False, index=index, text=False)
        if blob.returncode != 0:
            continue  # deleted
        data = blob.stdout
        if b"\0" in data:
            bad = leaks(data.decode("latin-1"), inv, generic=False)
        else:
            text = data.decode("utf-8", errors="replace")
            if rel.startswith("hosts/") and head is not None:
                old = _git(repo, "show", f"{head}:{rel}", check=False)
                text = _added(old.stdout if old.returncode == 0 else "", text)
            bad = leaks(text, inv)
        if bad:
            raise NotesError(f"refusing to commit {rel}: it would reveal {', '.join(bad)}; nothing committed")


def commit_notes(repo: Path, paths: Sequence[Path], message: str, inv: Inventory | None = None) -> str | None:
    """Commit exactly `paths` (under docs/ or hosts/) when they changed; returns the commit id or None.

    The commit is built in a private index from HEAD: pages as written, host files as HEAD has them
    with only the status fields kdbench writes replaced (`_host_blob`), so an operator's address,
    user and key path in the working file never enter the history, nor anything the operator had
    staged. Every recorded file passes the leak check; the working files are left as they are. The
    message is redacted first (addresses, logins, key paths), since callers build it from run
    details that may quote an SSH error.
    """
    repo = Path(repo).resolve()
    rels = []
    for p in paths:
        full = Path(p).resolve() if Path(p).is_absolute() else repo / p
        if not full.is_relative_to(repo) or full.relative_to(repo).parts[:1] not in (("docs",), ("hosts",)):
            raise NotesError(f"refusing to commit {Path(p).name}: notes commits touch only docs/ and hosts/")
        rels.append(full.relative_to(repo).as_posix())
    if not rels:
        return None
    try:
        rev = _git(repo, "rev-parse", "--verify", "-q", "HEAD^{commit}", check=False)
        head = rev.stdout.strip() if rev.returncode == 0 else None
        with tempfile.TemporaryDirectory(prefix="kdbench-index-") as tmp:
            index = Path(tmp) / "index"
            _git(repo, "read-tree", *([head] if head else ["--empty"]), index=index)
            pages = [r for r in rels if r.startswith("docs/")]
            if pages:
                _git(repo, "add", "-A", "--", *pages, index=index)
            for rel in (r for r in rels if r.startswith("hosts/")):
                text = _host_blob(repo, head, rel)
                if text is not None:
                    sha = _git(repo, "hash-object", "-w", "--stdin", stdin=text).stdout.strip()
                    _git(repo, "update-index", "--cacheinfo", f"100644,{sha},{rel}", index=index)
            out = _git(repo, "diff", "--cached", "--name-only", "-z", "--", *rels, index=index).stdout
            staged = [s for s in out.split("\0") if s]
            if not staged:
                return None
            _check_staged(repo, head, staged, index, inv)
            tree = _git(repo, "write-tree", index=index).stdout.strip()
        commit = _git(repo, "commit-tree", tree, *(["-p", head] if head else []),
                      stdin=redact(message, inv)).stdout.strip()
        _git(repo, "update-ref", "-m", "kdbench notes", "HEAD", commit, head or "0" * 40)
        # the real index follows HEAD for what was committed; the working files stay as they are
        _git(repo, "reset", "-q", "--", *staged)
        return commit
    except subprocess.CalledProcessError as e:
        raise NotesError(f"git {e.cmd[3]} failed: {redact(e.stderr.strip()[:300], inv)}") from None


def notes_message(store: Store, inv: Inventory, reference: str = "h200") -> str:
    """The commit message: a subject naming the hosts, then one summary line per host."""
    views = gather(store, inv, reference)
    named = ", ".join(v.name for v in views if v.kind != "no data") or "no data"
    return f"Notes: {named}\n\n" + "\n".join(_summary(views)) + "\n"
