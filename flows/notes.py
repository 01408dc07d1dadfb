"""Generated notes (docs/notes/): one page per host, a fleet index, plots, and the git commit.

Everything on a page is a function of artifacts/ and the inventory alone: no clock, no
environment, fixed number formats and sorted orders, so the same inputs give the same bytes and
git only sees a change when a figure changed. A host with no measured run gets a projected page,
read back as the flows (or `kdbench notes`) stored it: rendering never projects. Backtest figures
come from the stored backtest (flows.backtest) the same way. Pages name hosts, GPUs, versions
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

from engine.config import CONFIGS
from engine.schema import provenance
from flows import plots
from flows.backtest import BacktestRow, goal_gap, stored_backtest
from flows.families import e2e_key, family, host_side, label, point_key, regime, tp_of
from flows.inventory import Host, Inventory, InventoryError, Spec, host_status_text
from flows.projection import TERMS, breakdown
from flows.reference import is_outside
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
    assumptions: list[dict[str, Any]]
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
    outside: list[Run] = field(default_factory=list)       # imported outside figures of this machine
    backtest: list[BacktestRow] = field(default_factory=list)

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
        if row["host"] == name and row["source"] == "measured" and not is_outside(tables):
            runs.setdefault(row["run_id"], ((0, row["started_at"] or ""), Run(row["run_id"], tables)))
    return [r for _, r in sorted(runs.values(), key=lambda x: (x[0], x[1].run_id))]


def outside_runs(store: Store, name: str) -> list[Run]:
    """Imported outside figures (published or otherwise) of a host, never counted as its measurements."""
    out = []
    for ref in store.references():
        tables = store.reference(ref)
        if is_outside(tables) and tables["runs"].column("host")[0].as_py() == name:
            out.append(Run(ref, tables))
    return out


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


def gather(store: Store, inv: Inventory) -> list[HostView]:
    """Views of every inventory host and every host with data, sorted by name.

    A host without a measured run shows the newest projection stored for it (`kdbench notes` and
    the flows store them); a host with neither says how to get one.
    """
    names = set(inv.hosts) | {r.host for r in store.runs()}
    for ref_name in store.references():
        names.add(store.reference(ref_name)["runs"].column("host")[0].as_py())
    names = {n for n in names if _page_name(n)}  # a name becomes a file name under docs/notes/
    backtest = stored_backtest(store)
    views = []
    for name in sorted(names):
        host = inv.hosts.get(name)
        spec = inv.specs.get(host.spec) if host else None
        view = HostView(name, host, spec, measured_runs(store, name), outside=outside_runs(store, name),
                        backtest=backtest)
        if not view.measured:
            view.projection = stored_projection(store, inv, name)
            if view.projection is None:
                view.missing = (f"no projection of {name} is stored: `kdbench notes` stores one from the "
                                "reference" if spec else
                                f"host {name} is not in the inventory, so it has no spec sheet to project onto")
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
    view.outside = [_clean_run(r, inv) for r in view.outside]
    p = view.projection
    if p:
        records = [{k: plain(v, inv) if isinstance(v, str) else v for k, v in a.items()}
                   for a in p.assumptions if isinstance(a, dict)]
        view.projection = Projected(_clean_run(p.run, inv), plain(p.ref_host, inv), plain(p.ref_run_id, inv),
                                    _clean_run(p.ref, inv) if p.ref else None, p.ref_spec,
                                    records, [plain(r, inv) for r in p.references])
    view.missing = plain(view.missing, inv, cap=1000)
    return view


# -- figures ------------------------------------------------------------------------------------

def ceilings_of(run: Run, spec: Spec | None) -> tuple[float | None, float | None]:
    r = run.runs_row
    return r.get("copy_gbps") or (spec.mem_bw_gbps if spec else None), \
        r.get("matmul_tflops") or (spec.tflops.get("bf16") if spec else None)


def moe_points(run: Run) -> list[dict[str, Any]]:
    """MoE W4A16 points at full shapes of the run's preferred implementation (Triton where it ran), by M."""
    pts = [k for k in run.rows("kernels") if family(k["kernel"]) == "moe_w4a16" and k["M"] and tp_of(k) == 1]
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


HEADLINE_CONCURRENCY = (1, 16)


def full_depth(row: dict[str, Any]) -> int:
    return CONFIGS[row["config"]].layers if row["config"] in CONFIGS else row["layers"] or 0


def full_model_rows(run: Run) -> dict[int, dict[str, Any]]:
    """Per headline concurrency, the fastest full-depth e2e row at the run's largest TP degree."""
    rows = [e for e in run.rows("e2e") if e["tokens_per_s"] and e["layers"] and e["layers"] >= full_depth(e)]
    if not rows:
        return {}
    tp = max(tp_of(e) for e in rows)
    out = {}
    for c in HEADLINE_CONCURRENCY:
        at = [e for e in rows if tp_of(e) == tp and e["concurrency"] == c]
        if at:
            out[c] = max(at, key=lambda e: (e["tokens_per_s"], -e["budget"]))
    return out


def model_headline(run: Run, projected: bool) -> str:
    """Full-model tokens/s at C=1 and C=16 with tp, layers and accept length, or why there is none."""
    rows = full_model_rows(run)
    if not rows:
        depths = sorted({e["layers"] for e in run.rows("e2e") if e["layers"]})
        if not depths:
            return ""
        return (f"full model: no full-depth e2e rows yet (the e2e rows here have "
                f"{'/'.join(map(str, depths))} layers: kernel tests, not deployment figures)")
    parts = []
    for c, e in sorted(rows.items()):
        band = f" ({e['tokens_per_s_low']:,.0f}-{e['tokens_per_s_high']:,.0f})" if projected else ""
        parts.append(f"{e['tokens_per_s']:,.0f} tok/s{band} at C={c} (B={e['budget']}, accept "
                     f"{fmt(e['accept_len_mean'], 2)})")
    e = next(iter(rows.values()))
    return f"full model {e['layers']} layers TP-{tp_of(e)}: " + ", ".join(parts)


def outside_headline(view: HostView) -> str:
    """The outside figures' e2e rows, named by who measured them."""
    parts = []
    for run in view.outside:
        prov = provenance(run.tables["runs"])
        for e in sorted(run.rows("e2e"), key=lambda e: e["concurrency"]):
            if e["tokens_per_s"]:
                parts.append(f"{e['tokens_per_s']:,.1f} tok/s at C={e['concurrency']}")
        if parts:
            return f"{md(prov.get('origin'))} ({md(prov.get('impl', '-'))}, TP-{tp_of(run.rows('e2e')[0])}): " + \
                ", ".join(parts)
    return ""


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
        return outside_headline(view) or "no data"
    parts = [model_headline(run, view.kind == "projected")]
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
    outside = outside_headline(view)
    if outside:
        parts.append(outside)
    return "; ".join(p for p in parts if p) or "no kernel or e2e points"


def summary_lines(store: Store, inv: Inventory) -> list[str]:
    """Commit message lines: `Measured h200: ...`, `Projected b300 from h200: ...`."""
    return _summary(gather(store, inv))


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
               md(k["regime"] or regime(k, *ceilings_of(run, view.spec)))]
        if projected:
            row += [f"{fmt(k['time_us_low'])}-{fmt(k['time_us_high'])}", md(k["reference_regime"] or "-")]
        rows.append(row)
    copy, mm = ceilings_of(run, view.spec)
    fams: dict[str, tuple[list[float], list[float]]] = {}
    for k in run.rows("kernels"):
        if not host_side(k) and k["bytes"] > 0:
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


def e2e_section(view: HostView, run: Run, out_dir: Path, rel: str) -> list[str]:
    rows = sorted(run.rows("e2e"), key=lambda e: (e["config"], e["layers"] or 0, tp_of(e), e["budget"],
                                                  e["concurrency"]))
    if not rows:
        return ["## End to end", "", "No e2e points in this run.", ""]
    projected = view.kind == "projected"
    head = ["config", "layers", "tp", "budget", "concurrency", "accepted / step", "tokens/s", "step ms"]
    if projected:
        head.insert(7, "band (tokens/s)")
    table = []
    for e in rows:
        r = [md(e["config"]), str(e["layers"]), str(tp_of(e)), str(e["budget"]), str(e["concurrency"]),
             fmt(e["accept_len_mean"], 2), fmt(e["tokens_per_s"], 0), fmt(e["step_ms_p50"], 2)]
        if projected:
            r.insert(7, f"{fmt(e['tokens_per_s_low'], 0)}-{fmt(e['tokens_per_s_high'], 0)}")
        table.append(r)
    level = sorted({e["synthetic_accept"] for e in rows if e["synthetic_accept"] is not None})
    out = ["## End to end", "",
           "Tokens/s = (accepted draft tokens + 1 bonus token) x concurrency / step time. Acceptance is "
           f"synthetic (drafter steered at level {', '.join(f'{x:g}' for x in level) or '-'}).", ""]
    out += _table(head, table)
    # the step split and its Amdahl shares; for a projection, the reference's next to the target's
    ref_rows = {}
    if projected and view.projection.ref:
        ref_rows = {e2e_key(e, without=("tp",)): e for e in view.projection.ref.rows("e2e")}
    head = ["point"] + [t.removesuffix("_ms") for t in TERMS] + ["step ms"]
    split, bars = [], []
    ends = {min(e["concurrency"] for e in rows), max(e["concurrency"] for e in rows)} if rows else set()
    for e in rows:
        key = e2e_key(e, without=("tp",))
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


def assumption_text(a: dict[str, Any]) -> str:
    """One stored assumption record in words (its strings escaped for the page)."""
    a = {k: md(v) if isinstance(v, str) else v for k, v in a.items()}
    what = a.get("what")
    if what == "reference_ceilings":
        return (f"reference {a['host']} run {a['run_id']} on {a['gpu']}: measured ceilings {sig(a['copy_gbps'])} GB/s "
                f"copy ({a['copy_fraction']:.1%} of its {sig(a['spec_gbps'])} GB/s spec) and {sig(a['matmul_tflops'])} "
                f"TFLOP/s {a['dtype']} matmul ({a['matmul_fraction']:.1%} of its {sig(a['spec_tflops'])} spec)")
    if what == "target_ceilings":
        return (f"target {a['host']} on {a['gpu']}: the same fractions of its spec sheet give "
                f"{sig(a['copy_gbps'])} GB/s and {sig(a['matmul_tflops'])} TFLOP/s {a['dtype']}")
    if what == "kernel_carrier":
        return ("each kernel point keeps its measured efficiency on the resource that bounds it; the other "
                "resource borrows its kernel family's efficiency (band: the family's min to max)")
    if what == "kept":
        return (f"kept as measured: a launch floor of up to {a['launch_floor_us']:g} us per kernel, the host-side "
                f"points ({', '.join(md(h) for h in a['host_side'])}) and latency-bound points (under "
                f"{a['latency_share']:.0%} of both ceilings; band up to their roofline-scaled time)")
    if what == "e2e_terms":
        terms = "; ".join(f"{md(t.removesuffix('_ms'))} like {' + '.join(md(x) for x in f)}"
                          for t, f in sorted(a["terms"].items()))
        return (f"e2e, term by term: {terms} at the step's shapes; draft like the {a['draft_ms']}; "
                f"{', '.join(md(t.removesuffix('_ms')) for t in a['kept'])} kept")
    if what == "tensor_parallel":
        how = {"same": "measured at that degree", "fit": "re-sharded by a fixed + sharded/TP fit of two measured "
               "degrees", "kernels": "re-sharded by the verify kernels' shard-shape points",
               "bytes": "re-sharded assuming all of verify shards (1/TP; band up to no speed-up): no measurement "
               "at this degree"}
        rows = "; ".join(f"{r['points']} row(s) from TP-{r['from_tp']}: {how.get(r['how'], md(r['how']))}"
                         for r in a["rows"])
        return (f"each e2e row is one rank of a TP-{a['target_tp']} deployment on the {a['gpus']} GPU(s); "
                f"draft, tree and accept run replicated; {rows or 'no e2e rows'}")
    if what == "comm":
        link = f"{a['link_gbps']:.0f} GB/s {a['interconnect']}" if a["link_gbps"] else "no link figure"
        how = "calibrated on the reference's all-reduce" if a["calibrated"] else "default constants"
        return (f"comm = {a['allreduces_per_layer']} all-reduces per layer x layers of tokens x hidden x 2 bytes "
                f"over a ring of {a['gpus']}, alpha {a['alpha_us']:g} us, {a['efficiency']:.0%} "
                f"({a['efficiency_low']:.0%}-{a['efficiency_high']:.0%}) of {link} ({how})")
    if what == "e2e_without_split":
        return f"{a['rows']} e2e row(s) of the reference have no step split (outside figures): not projected"
    if what == "band":
        n = len(a["references"])
        return "band: the reference's p10-p90 times" + (f" and the spread across {n} references" if n > 1 else "")
    return ", ".join(f"{md(k)} {md(v)}" for k, v in sorted(a.items()))


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


BACKTEST_COLUMNS = ("backtest", "data", "family", "regime", "points", "median error", "worst error", "in band",
                    "goal")


def backtest_cells(rows: Sequence[BacktestRow]) -> list[list[str]]:
    """One row of BACKTEST_COLUMNS per backtest row; the goal column says how far each misses, or `met`."""
    out = []
    for r in rows:
        med_gap, band_gap = goal_gap(r)
        if r.skipped:
            goal = f"skipped: {r.detail}"
        else:
            bits = []
            if med_gap is not None:
                bits.append("median met" if med_gap == 0 else f"median {med_gap:.1%} over")
            bits.append("band met" if band_gap == 0 else f"band {band_gap:.0%} short")
            goal = ", ".join(bits)
        data = r.reference if r.reference == r.target else f"{r.reference} -> {r.target}"
        out.append([md(r.kind), md(data), md(r.family), md(r.regime), str(r.points), _pct(r.median_error),
                    _pct(r.worst_error), "-" if r.in_band is None else f"{r.in_band:.0%}", md(goal, cap=400)])
    return out


def backtest_table(rows: Sequence[BacktestRow]) -> list[str]:
    return _table(BACKTEST_COLUMNS, backtest_cells(rows))


def backtest_section(rows: Sequence[BacktestRow]) -> list[str]:
    head = ["## How good are the projections", "",
            "Hold-out backtests on the measured data (stored by `kdbench backtest`): each predicts measured points "
            "from other measured points. Error = predicted / measured - 1; in band = share of measured points "
            "inside the predicted band. Goals: median error at most 10% on memory-bound kernel families and 20% "
            "on e2e, bands holding at least 90% of the points; where a row misses, the goal column says by how much.",
            ""]
    if not rows:
        return head + ["No backtest stored yet: run `kdbench backtest`.", ""]
    details = sorted({(r.kind, r.detail) for r in rows if not r.skipped})
    return head + backtest_table(rows) + [f"- {md(k)}: {md(d, cap=400)}" for k, d in details] + [""]


def projection_section(view: HostView) -> list[str]:
    p = view.projection
    gpu = f" ({p.ref_spec.gpu})" if p.ref_spec else ""
    fams = {label(k) for k in p.run.rows("kernels")}
    cited = [r for r in view.backtest if r.family.split(" vs ")[0] in fams or r.regime == "e2e"]
    out = ["## Projection", "",
           f"Reference: host {p.ref_host}, run {p.ref_run_id}{gpu}; "
           f"references used for the band: {', '.join(p.references)}.", "", "Assumptions:", ""] + \
        [f"- {assumption_text(a)}" for a in p.assumptions] + [
        "", "Every figure on this page is a projection with a low-high band, not a measurement.", "",
        "### Backtest error of this page's families", "",
        "How far the same projection missed when it predicted measured points it had not seen "
        "(the fleet index has every backtest).", ""]
    return out + (backtest_table(cited) if cited else ["No backtest stored yet: run `kdbench backtest`.", ""])


def outside_section(view: HostView) -> list[str]:
    """Imported figures of this machine, beside kdbench's own and never mixed with them."""
    if not view.outside:
        return []
    out = ["## Outside measurements", "",
           "Figures measured by others on this kind of machine and imported with `kdbench import`; kdbench did not "
           "run them. They are shown as published, beside kdbench's own figures, and never mixed into them.", ""]
    for run in view.outside:
        prov = provenance(run.tables["runs"])
        out += [f"**{md(run.run_id)}** ({md(prov.get('origin'))}): {md(prov.get('machine', '-'))}; "
                f"{md(prov.get('date', '-'))}; source: {md(prov.get('source', '-'), cap=400)}.", ""]
        e2e = run.rows("e2e")
        if e2e:
            out += _table(["engine", "config", "layers", "tp", "concurrency", "tokens/s", "TTFT ms", "ITL ms"],
                          [[md(prov.get("impl", "-")), md(e["config"]), str(e["layers"] or "-"), str(tp_of(e)),
                            str(e["concurrency"]), fmt(e["tokens_per_s"]), fmt(e["ttft_ms"]), fmt(e["itl_ms_p50"])]
                           for e in sorted(e2e, key=lambda e: e["concurrency"])])
        kern = run.rows("kernels")
        if kern:
            out += _table(["kernel", "impl", "M", "us", "us/token", "GB/s"],
                          [[md(k["kernel"]), md(k["impl"]), str(k["M"] or "-"), fmt(k["time_us_p50"]),
                            fmt(k["time_us_p50"] / k["M"], 2) if k["M"] else "-",
                            sig(k["bytes"] / (k["time_us_p50"] * 1e3))]
                           for k in sorted(kern, key=point_key_sort)])
        notes = prov.get("notes")
        if isinstance(notes, list) and notes:
            out += [f"- {md(n, cap=400)}" for n in notes[:20]] + [""]
    return out


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
        lines += [f"**Headline:** {headline(view)}.", ""]
        lines += environment(view, run)
        lines += moe_section(view, run, out_dir, rel)
        lines += other_kernels(view, run, out_dir, rel)
        lines += e2e_section(view, run, out_dir, rel)
        lines += comparison(view) if view.kind == "measured" else projection_section(view)
    lines += outside_section(view)
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
    lines += backtest_section(views[0].backtest if views else [])
    return "\n".join(lines).rstrip() + "\n"


# -- writing ------------------------------------------------------------------------------------

def _inside(path: Path, root: Path) -> Path:
    """path, refused unless it resolves strictly inside root (symlinks included)."""
    full = path.resolve()
    if full == root.resolve() or not full.is_relative_to(root.resolve()):
        raise NotesError(f"refusing to write {path.name}: it resolves outside {root.name}/")
    return path


def render_notes(store: Store, inv: Inventory, docs_dir: Path) -> list[Path]:
    """Write every host page, its plots and the fleet index under docs_dir/notes/; returns the files."""
    views = gather(store, inv)
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


def notes_message(store: Store, inv: Inventory) -> str:
    """The commit message: a subject naming the hosts, then one summary line per host."""
    views = gather(store, inv)
    named = ", ".join(v.name for v in views if v.kind != "no data") or "no data"
    return f"Notes: {named}\n\n" + "\n".join(_summary(views)) + "\n"
