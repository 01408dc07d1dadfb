"""Generated notes (docs/notes/): one page per host, a fleet index, plots, and the git commit.

Each section of a host page (kernels, e2e, comm) shows its suite's latest complete full-profile
data, whichever run that came from, and says which run that is; a smoke or partial run appears in
the page's run history and never displaces full data (`pick_source`). Pages are laid out by the
jinja2 templates in flows/templates/ from small page views built here (`Page`, `IndexView`).

Everything on a page is a function of artifacts/ and the inventory alone: no clock, no
environment, fixed number formats and sorted orders, so the same inputs give the same bytes and
git only sees a change when a figure changed. A host with no measured run gets a projected page,
read back as the flows (or `kdbench notes`) stored it: rendering never projects. Backtest figures
come from the stored backtest (flows.backtest) the same way. Pages name hosts, GPUs, versions
and fingerprints, never addresses, user names or key paths: `leaks` checks that before writing.
Every string that came from a host (GPU name, versions, kernel, impl, config, run ids) is made
plain and redacted with the inventory when the views are gathered, and escaped with `md` when the
page views are built, so the templates never escape and one odd host cannot break a table, inject
markup or block the fleet's notes. Nor can its numbers: every division by a stored figure goes through
`per` (a zero, NaN or missing denominator shows as "-"), and a page that still fails, or comes out over
MAX_PAGE_BYTES, is replaced by one line saying why (`host_page`); a host whose stored data does not read
gets a page saying so, and the other pages are written as always.
"""

from __future__ import annotations

import difflib
import functools
import math
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import jinja2
import pyarrow as pa

from engine.config import CONFIGS
from engine.schema import SchemaError, provenance
from flows import plots
from flows.backtest import BacktestRow, goal_gap, stored_backtest
from flows.families import DENSE, e2e_key, host_side, label, point_key, preferred, regime, tp_of
from flows.inventory import INDEX_PAGE, Host, Inventory, InventoryError, Spec, host_status_text, is_page_name
from flows.projection import TERMS, breakdown
from flows.reference import is_outside
from flows.scrub import leaks, md, plain, redact
from flows.store import Store, StoreError, check_name
from flows.notes_whatif import WhatIfView, whatif_view
from flows.whatif import SUITE as WHATIF, stored_whatif

NOISE = 0.05            # smallest change flagged as a regression, on top of the measured p10-p90 spread
PLATEAU = 0.9           # plateau M: first M reaching this fraction of the best MoE bandwidth
SUITES = ("kernels", "e2e", "comm")
SHARD_TP = 8            # the shard an 8-GPU box runs: its MoE table is expected beside the full shapes
HASH_CHARS = 12         # of a payload hash in the run history
METHOD_CHARS = 2000     # of a run's own note on how its figures were made (e2e and kernel suites)
MAX_PAGE_BYTES = 4 << 20  # of one page: at engine.schema.MAX_ROWS rows a table a page stays far below it
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

    def suite_row(self, suite: str) -> dict[str, Any] | None:
        """The runs-table row of one suite of this run (None when the run did not include it)."""
        return next((r for r in self.rows("runs") if r["suite"] == suite), None)

    @property
    def partial(self) -> bool:
        return any(r["status"] == "partial" for r in self.rows("runs"))

    @property
    def runs_row(self) -> dict[str, Any]:
        rows = self.rows("runs")
        kern = [r for r in rows if r["suite"] == "kernels"]
        return (kern or rows)[0]


@dataclass
class Source:
    """Which run a section of a page shows, and why that one (`fallback`: empty for the latest
    complete full-profile data)."""

    suite: str
    run: Run
    profile: str
    status: str
    fallback: str = ""


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
    whatif: Run | None = None                               # the stored what-if grid (flows.whatif)

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

    def source(self, suite: str) -> Source | None:
        """The run a suite's section shows: the projection, or the measured run `pick_source` chose."""
        if self.projection and not self.measured:
            run = self.projection.run
            row = run.suite_row(suite)
            return Source(suite, run, row["profile"], row["status"]) if row and run.rows(suite) else None
        return pick_source(self.measured, suite)

    @property
    def sources(self) -> dict[str, Source]:
        return {s: src for s in SUITES if (src := self.source(s)) is not None}


# -- gathering ----------------------------------------------------------------------------------

def _tier(row: dict[str, Any]) -> int:
    """How well a suite's runs row stands for the host (lower is better): full and complete, full
    and skipped, any other complete or skipped profile (smoke), partial."""
    done = row["status"] in ("complete", "skipped")
    if row["profile"] == "full" and done:
        return 0 if row["status"] == "complete" else 1
    return 2 if done else 3


def pick_source(runs: Sequence[Run], suite: str) -> Source | None:
    """The latest run (of `runs`, oldest first) holding the suite's best data: complete full-profile
    data whenever there is any, so a later smoke or partial run never displaces it."""
    best: tuple[int, Run, dict[str, Any]] | None = None
    for run in runs:
        row = run.suite_row(suite)
        if row is None or not run.rows(suite):
            continue
        tier = _tier(row)
        if best is None or tier <= best[0]:
            best = (tier, run, row)
    if best is None:
        return None
    tier, run, row = best
    fallback = {2: f"no complete full-profile {suite} run yet", 3: f"no complete {suite} run yet"}.get(tier, "")
    return Source(suite, run, row["profile"], row["status"], fallback)


def measured_runs(store: Store, name: str) -> list[Run]:
    """Every measured run of a host (partial ones too): ingested runs and committed reference sets."""
    # stored runs in the store's order (the controller's clock), after the committed reference sets
    runs: dict[str, tuple[tuple, Run]] = {}
    for i, info in enumerate(store.runs(name)):
        if info.source == "measured":
            runs[info.run_id] = ((1, i), Run(info.run_id, store.load(name, info.run_id)))
    for tables in readable_references(store).values():
        row = tables["runs"].to_pylist()[0]
        if row["host"] == name and row["source"] == "measured" and not is_outside(tables):
            runs.setdefault(row["run_id"], ((0, row["started_at"] or ""), Run(row["run_id"], tables)))
    return [r for _, r in sorted(runs.values(), key=lambda x: (x[0], x[1].run_id))]


def outside_runs(store: Store, name: str) -> list[Run]:
    """Imported outside figures (published or otherwise) of a host, never counted as its measurements."""
    out = []
    for ref, tables in readable_references(store).items():
        if is_outside(tables) and tables["runs"].column("host")[0].as_py() == name:
            out.append(Run(ref, tables))
    return out


def readable_references(store: Store) -> dict[str, dict[str, pa.Table]]:
    """Every committed reference set that reads; one that does not costs only itself (skipped)."""
    out = {}
    for name in store.references():
        try:
            out[name] = store.reference(name)
        except (StoreError, SchemaError):
            continue
    return out


def stored_projection(store: Store, inv: Inventory, name: str) -> Projected | None:
    """The newest projected run the flows stored for a host, with its reference when still present."""
    runs = [r for r in store.runs(name) if r.source == "projected" and r.status == "complete"
            and WHATIF not in r.suites]
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
    for tables in readable_references(store).values():
        names.add(tables["runs"].column("host")[0].as_py())
    names = {n for n in names if _page_name(n)}  # a name becomes a file name under docs/notes/
    backtest = stored_backtest(store)
    views = []
    for name in sorted(names):
        host = inv.hosts.get(name)
        spec = inv.specs.get(host.spec) if host else None
        grid = stored_whatif(store, name)
        try:
            view = HostView(name, host, spec, measured_runs(store, name), outside=outside_runs(store, name),
                            backtest=backtest,
                            whatif=Run(grid["runs"].column("run_id")[0].as_py(), grid) if grid else None)
            if not view.measured:
                view.projection = stored_projection(store, inv, name)
                if view.projection is None:
                    view.missing = (f"no projection of {name} is stored: `kdbench notes` stores one from the "
                                    "reference" if spec else
                                    f"host {name} is not in the inventory, so it has no spec sheet to project onto")
        except (StoreError, SchemaError) as e:  # one host's unreadable data costs its own page only
            view = HostView(name, host, spec, backtest=backtest, missing=f"its stored data could not be read: {e}")
        views.append(_cleaned(view, inv))
    return views


def _page_name(name: object) -> bool:
    """A host name that can name a page and a plot folder: a store name that is not a path, nor the
    name of a page the index writes (README)."""
    try:
        return isinstance(name, str) and check_name("host", name) == name and not is_page_name(name)
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
    view.whatif = _clean_run(view.whatif, inv) if view.whatif else None
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


def moe_points(run: Run, tp: int = 1) -> list[dict[str, Any]]:
    """MoE W4A16 points at one TP degree's shapes (1: full shapes) of the kernel the engine runs
    at each M (CUDA or Triton: `preferred`), by M. Full and shard rows are never mixed."""
    pts = [k for k in run.rows("kernels") if k["kernel"] == "moe_w4a16" and k["M"] and tp_of(k) == tp]
    return sorted(preferred(pts), key=lambda k: k["M"])


def impls_of(pts: list[dict[str, Any]]) -> str:
    """The implementations of some points, in order of first appearance: "cuda, triton"."""
    return ", ".join(dict.fromkeys(k["impl"] for k in pts))


def moe_degrees(run: Run) -> list[int]:
    """The TP degrees the run's MoE points were measured at: 1 (full shapes) first, then the shards."""
    return sorted({tp_of(k) for k in run.rows("kernels") if k["kernel"] == "moe_w4a16" and k["M"]})


def plateau_m(points: list[dict[str, Any]]) -> int | None:
    gb = [per(k["bytes"], k["time_us_p50"] * 1e3) for k in points]
    top = max((g for g in gb if math.isfinite(g)), default=None)
    return next((k["M"] for k, g in zip(points, gb) if top is not None and g >= PLATEAU * top), None)


def best_moe(run: Run) -> dict[str, Any] | None:
    """The MoE point of the highest bandwidth (None when no point has a usable one)."""
    pts = [k for k in moe_points(run) if math.isfinite(per(k["bytes"], k["time_us_p50"]))]
    return max(pts, key=lambda k: (per(k["bytes"], k["time_us_p50"]), -k["M"])) if pts else None


HEADLINE_CONCURRENCY = (1, 16)


def full_depth(row: dict[str, Any]) -> int:
    return CONFIGS[row["config"]].layers if row["config"] in CONFIGS else row["layers"] or 0


def at_full_depth(run: Run) -> list[dict[str, Any]]:
    """The run's e2e rows with a figure that decode the model's whole depth: deployment figures."""
    return [e for e in run.rows("e2e") if e["tokens_per_s"] and e["layers"] and e["layers"] >= full_depth(e)]


def shortest_context(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows at the shortest prompts of their (tp, concurrency): the short-prompt sweep, not the
    context axis beside it (a row without a context counts as short)."""
    low: dict[tuple[int, int], int] = {}
    for e in rows:
        key = (tp_of(e), e["concurrency"])
        low[key] = min(low.get(key, e["context"] or 0), e["context"] or 0)
    return [e for e in rows if (e["context"] or 0) == low[(tp_of(e), e["concurrency"])]]


def full_model_rows(run: Run) -> dict[int, dict[str, Any]]:
    """Per headline concurrency, the fastest full-depth e2e row at the run's largest TP degree, at
    its shortest prompts."""
    rows = shortest_context(at_full_depth(run))
    if not rows:
        return {}
    tp = max(tp_of(e) for e in rows)
    out = {}
    for c in HEADLINE_CONCURRENCY:
        at = [e for e in rows if tp_of(e) == tp and e["concurrency"] == c]
        if at:
            out[c] = max(at, key=lambda e: (e["tokens_per_s"], -e["budget"]))
    return out


def no_full_depth(run: Run) -> str:
    """Why a run has no deployment figure, in words ("" when it has one or has no e2e rows)."""
    if at_full_depth(run):
        return ""
    depths = sorted({e["layers"] for e in run.rows("e2e") if e["layers"]})
    if not depths:
        return ""
    return (f"no full-depth e2e rows yet (the e2e rows here have {'/'.join(map(str, depths))} layers: "
            "kernel tests, not deployment figures)")


def model_headline(run: Run, projected: bool) -> str:
    """Full-model tokens/s at C=1 and C=16 with tp, layers and accept length, or why there is none."""
    rows = full_model_rows(run)
    if not rows:
        why = no_full_depth(run)
        return f"full model: {why}" if why else ""
    parts = []
    for c, e in sorted(rows.items()):
        band = f" ({band_text(e['tokens_per_s_low'], e['tokens_per_s_high'], 0).replace('unknown', 'band unknown')})" \
            if projected else ""
        parts.append(f"{fmt(e['tokens_per_s'], 0)} tok/s{band} at C={c} (B={e['budget']}, accept "
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
                parts.append(f"{fmt(e['tokens_per_s'])} tok/s at C={e['concurrency']}")
        if parts:
            return f"{md(prov.get('origin'))} ({md(prov.get('impl', '-'))}, TP-{tp_of(run.rows('e2e')[0])}): " + \
                ", ".join(parts)
    return ""


def per(num: float | None, den: float | None) -> float:
    """num / den, or NaN where a stored figure makes it meaningless (a zero, negative, missing or
    non-finite denominator, a missing numerator): no page divides by a host's number unguarded, and
    NaN shows as "-" (fmt, sig, share) and is skipped by the plots."""
    if num is None or den is None or not math.isfinite(den) or den <= 0:
        return math.nan
    return num / den


def fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:,.{digits}f}"


def band_text(lo: float | None, hi: float | None, digits: int = 1) -> str:
    """`lo-hi`, or `unknown` for a band the evidence cannot give (flows.bands)."""
    return "unknown" if lo is None or hi is None else f"{fmt(lo, digits)}-{fmt(hi, digits)}"


def sig(x: float | None) -> str:
    """Four significant digits: ceilings span CPU sandboxes (GB/s) to B300s (TB/s)."""
    return "-" if x is None or not math.isfinite(x) else f"{x:.4g}"


def share(x: float | None, spec: str = ".0%") -> str:
    """A fraction as a percentage (`spec`), "-" where it could not be computed."""
    return "-" if x is None or not math.isfinite(x) else format(x, spec)


def bandwidth(gbps: float, *more: float) -> str:
    """`3.78 TB/s`, or `11.2 GB/s` below 1 TB/s; extra values (a band) share the first one's unit."""
    scale, unit, spec = (1e3, "TB/s", ".2f") if gbps >= 1e3 else (1.0, "GB/s", ".3g")
    band = f" ({'-'.join(format(x / scale, spec) for x in more)})" if more else ""
    return f"{gbps / scale:{spec}} {unit}{band}"


def headline(view: HostView) -> str:
    """The one-line summary used in the index and the commit message, from the runs the page shows."""
    if view.latest is None:
        return outside_headline(view) or "no data"
    kern, e2e = view.source("kernels"), view.source("e2e")
    parts = [model_headline(e2e.run, view.kind == "projected") if e2e else ""]
    moe = best_moe(kern.run) if kern else None
    if moe:
        gbps = per(moe["bytes"], moe["time_us_p50"] * 1e3)
        copy, _ = ceilings_of(kern.run, view.spec)
        if view.kind == "measured":
            parts.append(f"MoE W4A16 decode {bandwidth(gbps)} at M={moe['M']} = {share(per(gbps, copy))} of copy "
                         "bandwidth")
        else:
            if moe["time_us_low"] is None:
                parts.append(f"MoE W4A16 decode {bandwidth(gbps)} (band unknown) at M={moe['M']}")
            else:
                band = [per(moe["bytes"], t * 1e3) for t in (moe["time_us_high"], moe["time_us_low"])]
                parts.append(f"MoE W4A16 decode {bandwidth(gbps, *band) if all(map(math.isfinite, band)) else bandwidth(gbps)}"
                             f" at M={moe['M']}")
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


# -- page views: what the templates lay out ----------------------------------------------------
# Every string a view holds is page text already: host strings went through `md` when the view was
# built, so the templates (flows/templates/) only arrange them and never escape.

@dataclass(frozen=True)
class Table:
    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]

    @staticmethod
    def of(header: Sequence[str], rows: Sequence[Sequence[str]]) -> "Table":
        return Table(tuple(header), tuple(tuple(r) for r in rows))


@dataclass(frozen=True)
class SourceLine:
    """Where a section's figures come from, as the page says it."""

    run_id: str
    profile: str
    status: str
    started: str
    fallback: str


@dataclass(frozen=True)
class MoeTable:
    title: str
    shape: str
    impl: str
    plateau: int | None
    table: Table


@dataclass(frozen=True)
class MoeView:
    source: SourceLine | None
    tables: tuple[MoeTable, ...]
    plots: tuple[tuple[str, str], ...]            # (alt text, relative path)
    missing_shard: int | None = None              # the shard degree an 8-GPU box runs, when not measured
    method: str | None = None                     # the kernel suite's own note in that run: how it timed


@dataclass(frozen=True)
class KernelsView:
    source: SourceLine | None
    table: Table | None
    roofline: str | None
    dense: Table | None = None


@dataclass(frozen=True)
class AcceptView:
    table: Table | None
    plot: str | None
    why_not: str                                  # when there is no full-depth row to plot


@dataclass(frozen=True)
class ContextView:
    table: Table | None
    plot: str | None
    crossover: tuple[str, ...]                    # per series: where attention overtakes the MoE, or why unknown
    skipped: tuple[str, ...]                      # every skipped e2e point: reason and bytes
    why_not: str                                  # when there is no series to plot


@dataclass(frozen=True)
class E2EView:
    source: SourceLine
    method: str | None  # the e2e suite's own note in that run: how its figures were made
    projected: bool
    levels: str
    table: Table
    accept: AcceptView
    context: ContextView
    split: Table
    amdahl: str
    busy: Table | None
    largest: str
    families: Table | None = None   # the step by kernel family, where the rows have that split


@dataclass(frozen=True)
class CommView:
    source: SourceLine
    table: Table


@dataclass(frozen=True)
class Comparison:
    first: bool
    sentence: str
    table: Table | None


@dataclass(frozen=True)
class ProjectionView:
    ref_line: str
    assumptions: tuple[str, ...]
    cited: Table | None


@dataclass(frozen=True)
class OutsideEntry:
    line: str
    e2e: Table | None
    kernels: Table | None
    notes: tuple[str, ...]


@dataclass(frozen=True)
class Page:
    name: str
    gpu: str
    kind: str
    data_line: str
    headline: str | None
    environment: Table | None
    history: Table | None
    moe: MoeView | None
    kernels: KernelsView | None
    e2e: E2EView | None
    comm: CommView | None
    comparison: Comparison | None
    projection: ProjectionView | None
    outside: tuple[OutsideEntry, ...]
    whatif: WhatIfView | None = None


@dataclass(frozen=True)
class IndexView:
    hosts: Table
    backtest: Table | None
    backtest_details: tuple[str, ...]


def status_line(view: HostView) -> str:
    h = view.host
    if h is None:
        return "not in the inventory"
    if h.status == "retired":
        when = h.retired_at.date().isoformat() if h.retired_at else "date unknown"
        return f"retired ({h.retired_reason or 'reason unknown'}, {when})"
    return "active"


def source_line(src: Source | None) -> SourceLine | None:
    if src is None:
        return None
    return SourceLine(md(src.run.run_id), md(src.profile), md(src.status),
                      md(src.run.runs_row.get("started_at") or "-"), md(src.fallback))


def _shown_in(view: HostView) -> dict[str, list[str]]:
    """run id -> the suites whose sections show it."""
    out: dict[str, list[str]] = {}
    for suite, src in view.sources.items():
        out.setdefault(src.run.run_id, []).append(suite)
    return out


def environment(view: HostView) -> Table:
    """The machine, then one column per run the page shows (the column header names its sections)."""
    spec, host = view.spec, view.host
    runs = [view.projection.run] if view.kind == "projected" else view.measured
    shown = [(run, suites) for run in runs for suites in [_shown_in(view).get(run.run_id)] if suites] \
        or [(runs[-1], ["no suite has data"])]
    blank = ("",) * max(len(shown) - 1, 0)
    rows: list[tuple[str, ...]] = []
    if spec:
        rows += [("GPU", f"{spec.gpu} ({spec.arch})", *blank), ("memory", f"{spec.memory_gb:g} GB", *blank),
                 ("spec bandwidth", f"{spec.mem_bw_gbps:,.0f} GB/s", *blank),
                 ("spec bf16 dense", f"{sig(spec.tflops.get('bf16'))} TFLOP/s", *blank)]
    if host:
        rows += [("GPUs", f"{host.gpus} on {host.interconnect}", *blank), ("inventory status", status_line(view), *blank)]
    if view.kind == "measured":
        for key in ("gpu_name", "driver", "cuda", "torch", "triton", "python", "payload_hash", "device", "profile",
                    "started_at"):
            cells = tuple(md(run.runs_row.get(key) or "-") for run, _ in shown)
            if any(c != "-" for c in cells):
                rows.append((key, *cells))
        rows += [("measured copy bandwidth", *(f"{sig(run.runs_row.get('copy_gbps'))} GB/s" for run, _ in shown)),
                 ("measured matmul", *(f"{sig(run.runs_row.get('matmul_tflops'))} TFLOP/s" for run, _ in shown))]
    else:
        copy, mm = ceilings_of(view.projection.run, spec)
        rows.append(("projected ceilings", f"{sig(copy)} GB/s, {sig(mm)} TFLOP/s"))
    rows.append(("run", *(md(run.run_id) for run, _ in shown)))
    return Table.of(("", *(", ".join(s) for _, s in shown)), rows)


def history(view: HostView) -> Table:
    """Every measured run, newest first: smoke and partial ones too, and which sections each feeds."""
    shown = _shown_in(view)
    rows = []
    for run in reversed(view.measured):
        suites = sorted(run.rows("runs"), key=lambda r: (r["suite"] not in SUITES, SUITES.index(r["suite"])
                                                          if r["suite"] in SUITES else 0, r["suite"]))
        profiles = sorted({r["profile"] for r in suites})
        listed = ", ".join(r["suite"] if r["status"] == "complete" else f"{r['suite']} ({r['status']})"
                           for r in suites)
        payload = run.runs_row.get("payload_hash")
        rows.append((md(run.run_id), md(run.runs_row.get("started_at") or "-"), md(", ".join(profiles)), md(listed),
                     md(payload[:HASH_CHARS]) if payload else "-", "partial" if run.partial else "complete",
                     ", ".join(shown.get(run.run_id, [])) or "-"))
    return Table.of(("run", "started", "profile", "suites", "payload", "status", "shown here"), rows)


def roofline_us(k: dict[str, Any], copy: float | None, mm: float | None) -> float | None:
    """A point's floor: max(bytes / copy bandwidth, flops / matmul rate) at the run's own ceilings (us)."""
    if not copy or not mm:
        return None
    return max(k["bytes"] / (copy * 1e3), k["flops"] / (mm * 1e6))


def moe_table(view: HostView, run: Run, pts: list[dict[str, Any]], tp: int) -> MoeTable:
    copy, mm = ceilings_of(run, view.spec)
    spec_bw = view.spec.mem_bw_gbps if view.spec else None
    projected = view.kind == "projected"
    head = ["M", "impl", "us", "host us", "us/token", "MB moved", "GB/s", "% of copy BW", "% of spec BW",
            "roofline %", "unique experts (expected)"]
    if projected:
        head[2:3] = ["us", "band (us)", "regime (ref)"]
    rows = []
    for k in pts:
        t = k["time_us_p50"]
        gb = per(k["bytes"], t * 1e3)
        floor = roofline_us(k, copy, mm)
        row = [str(k["M"]), md(k["impl"]), fmt(t), fmt(k.get("host_us")), fmt(per(t, k["M"]), 2), fmt(k["bytes"] / 1e6),
               sig(gb), fmt(per(100 * gb, copy)), fmt(per(100 * gb, spec_bw)),
               fmt(per(100 * floor, t) if floor else None),
               f"{k['unique_experts'] if k['unique_experts'] is not None else '-'} ({fmt(k['expected_experts'])})"]
        if projected:
            row[2:3] = [fmt(t), band_text(k["time_us_low"], k["time_us_high"]),
                        f"{md(k['regime'])} ({md(k['reference_regime'])})"]
        rows.append(row)
    p = pts[0]
    inter = f", expert intermediate {p['N'] // 2} (gate_up N = {p['N']}, down K = {p['N'] // 2})" if p["N"] else ""
    title = "Full shapes" if tp == 1 else f"TP-{tp} shard shapes (one rank of a TP-{tp} deployment)"
    shape = f"E={p['E']} routed experts, top-{p['top_k']}, H={p['K']}{inter}"
    return MoeTable(title, shape, md(impls_of(pts)), plateau_m(pts), Table.of(head, rows))


def _shape_label(tp: int) -> str:
    return "full shape" if tp == 1 else f"TP-{tp} shard"


def suite_method(run: Run, suite: str, projected: bool) -> str | None:
    """A suite's own note in its run (how it made its figures), escaped; none for a projection,
    whose assumptions have their own section."""
    note = None if projected else (run.suite_row(suite) or {}).get("note")
    return md(note, cap=METHOD_CHARS) if note else None


def moe_view(view: HostView, out_dir: Path, rel: str) -> MoeView:
    """One table per shape (full, then each shard degree); the plots draw each shape as its own line."""
    src = view.source("kernels")
    degrees = moe_degrees(src.run) if src else []
    if not degrees:
        return MoeView(source_line(src), (), ())
    run = src.run
    copy, _ = ceilings_of(run, view.spec)
    spec_bw = view.spec.mem_bw_gbps if view.spec else None
    projected = view.kind == "projected"
    tables, per_token, pct = [], [], []
    for tp in degrees:
        pts = moe_points(run, tp)
        tables.append(moe_table(view, run, pts, tp))
        ms = [k["M"] for k in pts]
        per_token.append((f"{_shape_label(tp)} ({impls_of(pts)})", ms, [per(k["time_us_p50"], k["M"]) for k in pts],
                          ([per(k["time_us_low"], k["M"]) for k in pts], [per(k["time_us_high"], k["M"]) for k in pts])
                          if projected and all(k["time_us_low"] is not None for k in pts) else None))
        pct += [(f"{_shape_label(tp)}, % of {label} BW ({sig(bw)} GB/s)", ms,
                 [per(100 * per(k["bytes"], k["time_us_p50"] * 1e3), bw) for k in pts], None)
                for label, bw in (("copy", copy), ("spec", spec_bw)) if bw]
    name = f"{view.name}: MoE W4A16"
    plots.lines(out_dir / "moe_us_per_token.png", per_token, f"{name}: time per token", "M (tokens)",
                "us / token", logy=True)
    plots.lines(out_dir / "moe_pct_peak_bw.png", pct, f"{name}: bandwidth", "M (tokens)", "% of peak")
    return MoeView(source_line(src), tuple(tables), (("MoE us per token", f"{rel}/moe_us_per_token.png"),
                                                     ("MoE % of peak bandwidth", f"{rel}/moe_pct_peak_bw.png")),
                   None if SHARD_TP in degrees else SHARD_TP, suite_method(run, "kernels", projected))


def point_key_sort(k: dict[str, Any]) -> tuple:
    return tuple((v is None, v if v is not None else 0) for v in point_key(k))


def kernels_view(view: HostView, out_dir: Path, rel: str) -> KernelsView | None:
    src = view.source("kernels")
    if src is None:
        return None
    run = src.run
    pts = sorted((k for k in run.rows("kernels") if k["kernel"] not in ("moe_w4a16", DENSE)),
                 key=point_key_sort)
    projected = view.kind == "projected"
    head = ["kernel", "impl", "batch", "budget", "context", "us", "GB/s", "TFLOP/s", "regime"]
    if projected:
        head += ["band (us)", "reference regime"]
    copy, mm = ceilings_of(run, view.spec)
    rows = []
    for k in pts:
        t = k["time_us_p50"]
        row = [md(k["kernel"]), md(k["impl"]), fmt(k["batch"], 0) if k["batch"] is not None else "-",
               str(k["budget"]) if k["budget"] is not None else "-",
               str(k["context"]) if k["context"] is not None else "-", fmt(t),
               sig(per(k["bytes"], t * 1e3)), sig(per(k["flops"], t * 1e6)), md(k["regime"] or regime(k, copy, mm))]
        if projected:
            row += [band_text(k["time_us_low"], k["time_us_high"]), md(k["reference_regime"] or "-")]
        rows.append(row)
    fams: dict[str, tuple[list[float], list[float]]] = {}
    for k in run.rows("kernels"):
        if not host_side(k) and k["bytes"] > 0:  # a shard shape is its own series: full and shard never mix
            xs, ys = fams.setdefault(label(k) + (f" TP-{tp_of(k)} shard" if tp_of(k) > 1 else ""), ([], []))
            xs.append(per(k["flops"], k["bytes"]))
            ys.append(per(k["flops"], k["time_us_p50"] * 1e6))
    roofs = [(view.name, copy, mm)] if copy and mm else []
    if projected and view.projection.ref:
        p = view.projection
        roofs.append((f"{p.ref_host} (reference)", *ceilings_of(p.ref, p.ref_spec)))
    plot = None
    if fams:
        plots.roofline(out_dir / "roofline.png", [(f, xs, ys) for f, (xs, ys) in sorted(fams.items())], roofs,
                       f"{view.name}: roofline ({view.kind})")
        plot = f"{rel}/roofline.png"
    return KernelsView(source_line(src), Table.of(head, rows) if rows else None, plot,
                       dense_table(run.rows("kernels"), copy, mm))


def dense_table(kern: list[dict[str, Any]], copy: float | None, mm: float | None) -> Table | None:
    """The dense GEMMs, a row per (op, TP degree): us at each M, and the best and worst share of the
    roofline (max(bytes / copy, flops / matmul) over the time) across M."""
    pts = [k for k in kern if k["kernel"] == DENSE and k["time_us_p50"] > 0]
    if not pts:
        return None
    ms = sorted({k["M"] for k in pts})
    rows = []
    for (op, tp, n, k_, heads), group in sorted(_group_by(pts, lambda k: (k["op"] or "-", tp_of(k), k["N"], k["K"],
                                                                             k["batch"] or 1)).items()):
        at = {k["M"]: k for k in group}
        roof = [max(k["bytes"] / (copy * 1e3), k["flops"] / (mm * 1e6)) / k["time_us_p50"] * 100
                for k in group] if copy and mm else []
        rows.append([md(op), str(tp), f"{n} x {k_}" + (f" x {heads} heads" if heads > 1 else "")]
                    + [fmt(at[m]["time_us_p50"]) if m in at else "-" for m in ms]
                    + [f"{min(roof):.0f}-{max(roof):.0f}" if roof else "-"])
    return Table.of(["op", "tp", "N x K"] + [f"M={m} us" for m in ms] + ["roofline %"], rows)


def _group_by(rows: list[dict[str, Any]], key: Any) -> dict[Any, list[dict[str, Any]]]:
    out: dict[Any, list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault(key(r), []).append(r)
    return out


def accept_view(view: HostView, run: Run, out_dir: Path, rel: str) -> AcceptView:
    """Tokens/s against the measured accepted length at the model's full depth, one line per
    (tp, concurrency): a reader with their own drafter's acceptance reads off their figure. At each
    acceptance level the fastest node budget stands for the point; the shortest prompts only (the
    context axis has its own section)."""
    rows = shortest_context(at_full_depth(run))
    if not rows:
        why = no_full_depth(run) or "no e2e rows with a figure"
        return AcceptView(None, None, why)
    projected = view.kind == "projected"
    best: dict[tuple, dict[str, Any]] = {}
    for e in rows:
        key = (tp_of(e), e["concurrency"], e["synthetic_accept"])
        if key not in best or (e["tokens_per_s"], -e["budget"]) > (best[key]["tokens_per_s"], -best[key]["budget"]):
            best[key] = e
    ordered = sorted(best.values(), key=lambda e: (tp_of(e), e["concurrency"], e["accept_len_mean"] or 0,
                                                   e["synthetic_accept"] or 0))
    head = ["tp", "layers", "concurrency", "level", "accepted / step", "budget", "tokens/s"]
    if projected:
        head.append("band (tokens/s)")
    table = []
    for e in ordered:
        r = [str(tp_of(e)), str(e["layers"]), str(e["concurrency"]),
             "-" if e["synthetic_accept"] is None else f"{e['synthetic_accept']:g}", fmt(e["accept_len_mean"], 2),
             str(e["budget"]), fmt(e["tokens_per_s"], 0)]
        if projected:
            r.append(band_text(e["tokens_per_s_low"], e["tokens_per_s_high"], 0))
        table.append(r)
    series = []
    for tp, conc in sorted({(tp_of(e), e["concurrency"]) for e in ordered}):
        line = [e for e in ordered if tp_of(e) == tp and e["concurrency"] == conc and e["accept_len_mean"] is not None]
        if line:
            series.append((f"TP-{tp} C={conc}", [e["accept_len_mean"] for e in line], [e["tokens_per_s"] for e in line],
                           ([e["tokens_per_s_low"] for e in line], [e["tokens_per_s_high"] for e in line])
                           if projected and all(e["tokens_per_s_low"] is not None for e in line) else None))
    plots.lines(out_dir / "tokens_vs_accept.png", series,
                f"{view.name}: full model ({ordered[0]['layers']} layers), tokens/s by acceptance",
                "accepted draft tokens per step (measured; + 1 bonus token)", "tokens/s", logx=False)
    return AcceptView(Table.of(head, table), f"{rel}/tokens_vs_accept.png", "")


def context_series(run: Run) -> dict[tuple, list[dict[str, Any]]]:
    """Full-depth rows by (tp, concurrency, level, budget), shortest prompt first, where a series
    has two or more prompt lengths: tokens/s against context."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for e in at_full_depth(run):
        if e["context"] is not None:
            key = (tp_of(e), e["concurrency"], e["synthetic_accept"] or 0.0, e["budget"])
            groups.setdefault(key, []).append(e)
    return {k: sorted(v, key=lambda e: e["context"]) for k, v in sorted(groups.items())
            if len({e["context"] for e in v}) > 1}


def crossover(name: str, series: list[dict[str, Any]]) -> str:
    """Where attention's GPU time a step passes the MoE's along one series, from the rows' own
    per-family split; said to be unknown where the rows have none."""
    split = [e for e in series if e["attention_ms"] is not None and e["moe_ms"] is not None]
    if not split:
        return (f"{name}: these rows have no per-family split of the step (the profiled CUDA decode records "
                "attention and MoE time), so where attention overtakes the MoE is not known.")
    lack = "" if len(split) == len(series) else f" (of the {len(split)} prompt lengths with a per-family split)"

    def at(e: dict[str, Any]) -> str:
        return f"{fmt(e['attention_ms'], 2)} vs {fmt(e['moe_ms'], 2)} ms a step at {e['context']:,} tokens"

    over = next((i for i, e in enumerate(split) if e["attention_ms"] > e["moe_ms"]), None)
    if over is None:
        return f"{name}: attention stays below the MoE up to {split[-1]['context']:,} tokens{lack} ({at(split[-1])})."
    if over == 0:
        return f"{name}: attention already takes longer than the MoE at the shortest prompt{lack} ({at(split[0])})."
    return (f"{name}: attention overtakes the MoE between {split[over - 1]['context']:,} and "
            f"{split[over]['context']:,} tokens{lack} ({at(split[over - 1])}; {at(split[over])}).")


def skipped_points(rows: list[dict[str, Any]]) -> tuple[str, ...]:
    """Each skipped e2e point in words: its key, the bytes it needed and the run's reason."""
    out = []
    for e in sorted((e for e in rows if e["status"] != "ok"), key=lambda e: (tp_of(e), e["concurrency"],
                                                                             e["context"] or 0, e["budget"])):
        gb = f", {e['memory_bytes'] / 1e9:,.1f} GB needed" if e["memory_bytes"] else ""
        ctx = "-" if e["context"] is None else f"{e['context']:,}"
        out.append(f"TP-{tp_of(e)} C={e['concurrency']} B={e['budget']} context {ctx}{gb}: "
                   f"{md(e['status'])}: {md(e['skip_reason'] or '-', cap=400)}")
    return tuple(out)


def context_view(view: HostView, run: Run, out_dir: Path, rel: str) -> ContextView:
    """Tokens/s against the prompt length at the model's full depth, one line per (tp, concurrency)
    (measured or projected, as the page is), where attention overtakes the MoE, and the skipped points."""
    skipped = skipped_points(run.rows("e2e"))
    series = context_series(run)
    if not series:
        why = no_full_depth(run) or ("the e2e rows here have one prompt length per tensor-parallel degree and "
                                     "concurrency (the CUDA full profile's context axis adds prompts of 1k-128k tokens)")
        return ContextView(None, None, (), skipped, why)
    projected = view.kind == "projected"
    head = ["tp", "concurrency", "level", "budget", "context", "tokens/s", "TTFT ms", "step ms (p50)",
            "attention ms", "MoE ms", "attention / MoE"]
    if projected:
        head.insert(6, "band (tokens/s)")
    table, lines, words = [], [], []
    for (tp, conc, level, budget), rows in series.items():
        name = f"TP-{tp} C={conc} (level {level:g}, B={budget})"
        for e in rows:
            att, moe = e["attention_ms"], e["moe_ms"]
            r = [str(tp), str(conc), f"{level:g}", str(budget), f"{e['context']:,}", fmt(e["tokens_per_s"], 0),
                 fmt(e["ttft_ms"], 0), fmt(e["step_ms_p50"], 2), fmt(att, 2), fmt(moe, 2),
                 fmt(att / moe, 2) if att is not None and moe else "-"]
            if projected:
                r.insert(6, band_text(e["tokens_per_s_low"], e["tokens_per_s_high"], 0))
            table.append(r)
        lines.append((name, [e["context"] for e in rows], [e["tokens_per_s"] for e in rows],
                      ([e["tokens_per_s_low"] for e in rows], [e["tokens_per_s_high"] for e in rows])
                      if projected and all(e["tokens_per_s_low"] is not None for e in rows) else None))
        words.append(crossover(name, rows))
    plots.lines(out_dir / "tokens_vs_context.png", lines, f"{view.name}: full model, tokens/s by context ({view.kind})",
                "context (prompt tokens a sequence)", "tokens/s")
    return ContextView(Table.of(head, table), f"{rel}/tokens_vs_context.png", tuple(words), skipped, "")


def e2e_view(view: HostView, out_dir: Path, rel: str) -> E2EView | None:
    src = view.source("e2e")
    if src is None:
        return None
    run = src.run
    every = sorted(run.rows("e2e"), key=lambda e: (e["config"], e["layers"] or 0, tp_of(e),
                                                   e["synthetic_accept"] or 0, e["budget"], e["context"] or 0,
                                                   e["concurrency"]))
    projected = view.kind == "projected"
    head = ["config", "layers", "tp", "level", "budget", "concurrency", "context", "accepted / step", "tokens/s",
            "step ms (p50)"]
    if projected:
        head.insert(9, "band (tokens/s)")
    table = []
    for e in every:
        r = [md(e["config"]), str(e["layers"]), str(tp_of(e)),
             "-" if e["synthetic_accept"] is None else f"{e['synthetic_accept']:g}", str(e["budget"]),
             str(e["concurrency"]), "-" if e["context"] is None else f"{e['context']:,}", fmt(e["accept_len_mean"], 2),
             fmt(e["tokens_per_s"], 0) if e["status"] == "ok" else md(e["status"]), fmt(e["step_ms_p50"], 2)]
        if projected:
            r.insert(9, band_text(e["tokens_per_s_low"], e["tokens_per_s_high"], 0))
        table.append(r)
    rows = [e for e in every if e["status"] == "ok" and e["step_ms_p50"]]   # points with figures
    level = sorted({e["synthetic_accept"] for e in rows if e["synthetic_accept"] is not None})
    # the step split and its Amdahl shares; for a projection, the reference's next to the target's
    ref_rows = {}
    if projected and view.projection.ref:
        ref_rows = {e2e_key(e, without=("tp",)): e for e in view.projection.ref.rows("e2e")}
    split, fams, bars = [], [], []
    point_label = point_labels(rows)
    ends = {min(e["concurrency"] for e in rows), max(e["concurrency"] for e in rows)} if rows else set()
    for e in rows:
        key = e2e_key(e, without=("tp",))
        sides = [(view.projection.ref_host, ref_rows[key])] if key in ref_rows else []
        sides.append((view.name, e))
        for side, row in sides:
            name = point_label(e) + (f" {side}" if projected else "")
            b = family_split(row)
            if b is not None:
                fams.append([name] + [f"{fmt(b[t], 2)} ({share(per(b[t], sum(b.values())))})" for t in FAMILY_TERMS]
                            + [fmt(sum(b.values()), 2)])
            if any(row.get(t) is not None for t in TERMS if t != "comm_ms"):   # the stage split
                b = breakdown(row)
                step = sum(b.values())
                split.append([name] + [f"{fmt(b[t], 2)} ({share(per(b[t], step))})" for t in TERMS] + [fmt(step, 2)])
            if e["concurrency"] in ends:  # the plot keeps the extremes readable; the table has every point
                bars.append((name, family_split(row) or breakdown(row)))
    plots.amdahl(out_dir / "amdahl.png", bars,
                 f"{view.name}: step shares at c={'/'.join(map(str, sorted(ends)))}"
                 + (f", {view.projection.ref_host} vs {view.name}" if projected else ""))
    # a profiled decode's figures: a projection's modelled host time is in its family table instead
    busy = [e for e in rows if e.get("kernel_ms") is not None and e.get("outside_ms") is not None and not projected]
    busy_table = Table.of(["point", "kernels ms", "outside ms", "outside share"],
                          [[point_label(e), fmt(e["kernel_ms"], 2), fmt(e["outside_ms"], 2),
                            share(per(e["outside_ms"], e["kernel_ms"] + e["outside_ms"]))] for e in busy]) \
        if busy else None
    largest = ""
    if projected and rows:
        last = rows[-1]
        b = family_split(last) or breakdown(last)
        top = max(b, key=lambda t: (b[t], t))
        largest = (f"At concurrency {last['concurrency']} the largest term on {view.name} is "
                   f"{top.removesuffix('_ms')} ({share(per(b[top], sum(b.values())))} of the step).")
    return E2EView(source_line(src), suite_method(run, "e2e", projected), projected, ", ".join(f"{x:g}" for x in level) or "-", Table.of(head, table),
                   accept_view(view, run, out_dir, rel), context_view(view, run, out_dir, rel),
                   Table.of(["point"] + [t.removesuffix("_ms") for t in TERMS] + ["step ms"], split),
                   f"{rel}/amdahl.png", busy_table, largest,
                   Table.of(["point"] + [FAMILY_NAMES[t] for t in FAMILY_TERMS] + ["step ms"], fams) if fams else None)


# The per-family split of a step (GPU kernel families, the host time outside them, comm) as columns
FAMILY_TERMS = ("moe_ms", "attention_ms", "dense_ms", "lm_head_ms", "tree_ms", "gpu_other_ms", "outside_ms", "comm_ms")
FAMILY_NAMES = {"moe_ms": "moe", "attention_ms": "attention", "dense_ms": "dense", "lm_head_ms": "lm_head",
                "tree_ms": "tree", "gpu_other_ms": "other kernels", "outside_ms": "host", "comm_ms": "comm"}


def family_split(row: dict[str, Any]) -> dict[str, float] | None:
    """The step by kernel family, host time and comm (ms), where the row has the family split."""
    if row.get("moe_ms") is None:
        return None
    return {t: float(row.get(t) or 0.0) for t in FAMILY_TERMS}


def point_labels(rows: Sequence[dict[str, Any]]) -> Callable[[dict[str, Any]], str]:
    """How an e2e point is named in the split, busy and comparison tables: its budget and
    concurrency, plus depth, TP degree, acceptance level and context where the rows differ in them."""
    axes = [(name, get) for name, get in (("L", lambda e: e["layers"]), ("tp", tp_of),
                                          ("a", lambda e: e["synthetic_accept"]), ("ctx", lambda e: e["context"]))
            if len({get(e) for e in rows}) > 1]

    def name(e: dict[str, Any]) -> str:
        return " ".join([f"B={e['budget']} c={e['concurrency']}"] +
                        [f"{a}={'-' if get(e) is None else format(get(e), 'g')}" for a, get in axes])
    return name


def comm_view(view: HostView) -> CommView | None:
    src = view.source("comm")
    if src is None:
        return None
    rows = sorted(src.run.rows("comm"), key=lambda c: (c["op"], c["world_size"], c["bytes"]))
    return CommView(source_line(src), Table.of(
        ["op", "GPUs", "bytes", "us", "algbw GB/s", "busbw GB/s", "status"],
        [[md(c["op"]), str(c["world_size"]), f"{c['bytes']:,}", fmt(c["time_us_p50"]), sig(c["algbw_gbps"]),
          sig(c["busbw_gbps"]), md(c["status"] if c["status"] == "ok" else f"{c['status']}: {c['skip_reason'] or '-'}")]
         for c in rows]))


def comparison(view: HostView) -> Comparison:
    """The latest measured run against the previous run of the same profile (a smoke run against a
    smoke run, a full run against a full one); changes beyond the noise are flagged."""
    cur = view.measured[-1]
    profile = cur.runs_row["profile"]
    prev = next((r for r in reversed(view.measured[:-1]) if r.runs_row["profile"] == profile), None)
    if prev is None:
        return Comparison(True, f"First measured {md(profile)}-profile run of this host: nothing to compare with.",
                          None)
    old = {point_key(k): k for k in prev.rows("kernels")}
    rows, flagged = [], 0
    for k in sorted(cur.rows("kernels"), key=point_key_sort):
        o = old.get(point_key(k))
        if not o:
            continue
        change = per(k["time_us_p50"], o["time_us_p50"]) - 1
        noise = max(NOISE, spread(k), spread(o))
        flag = "REGRESSION" if change > noise else "faster" if change < -noise else ""
        flagged += flag == "REGRESSION"
        if flag:
            shape = " ".join(f"{a}={k[a]}" for a in ("M", "batch", "budget", "context") if k[a] is not None)
            shape += f" tp={tp_of(k)}" if tp_of(k) > 1 else ""
            rows.append([md(label(k)), shape, fmt(o["time_us_p50"]), fmt(k["time_us_p50"]),
                         share(change, "+.1%"), share(noise, ".1%"), flag])
    olde = {e2e_key(e): e for e in prev.rows("e2e")}
    point_label = point_labels(cur.rows("e2e"))
    for e in cur.rows("e2e"):
        o = olde.get(e2e_key(e))
        if o and o["tokens_per_s"] and e["tokens_per_s"]:
            change = per(e["tokens_per_s"], o["tokens_per_s"]) - 1
            flag = "REGRESSION" if change < -NOISE else "faster" if change > NOISE else ""
            flagged += flag == "REGRESSION"
            if flag:
                rows.append(["e2e tokens/s", point_label(e), fmt(o["tokens_per_s"], 0),
                             fmt(e["tokens_per_s"], 0), share(change, "+.1%"), f"{NOISE:.1%}", flag])
    sentence = (f"Run {md(cur.run_id)} against {md(prev.run_id)} (both {md(profile)} profile): {flagged} "
                f"regression(s) beyond the noise (the larger of {NOISE:.0%} and the points' p10-p90 spread).")
    return Comparison(False, sentence, Table.of(["point", "shape", "before", "now", "change", "noise", ""], rows)
                      if rows else None)


def spread(k: dict[str, Any]) -> float:
    if k.get("time_us_p10") is None or k.get("time_us_p90") is None:
        return 0.0
    s = per(k["time_us_p90"] - k["time_us_p10"], k["time_us_p50"])
    return s if math.isfinite(s) else 0.0


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
    if what == "kernel_models":
        sms = a.get("sms") or [None, None]
        lat = a.get("latency_ns") or [None, None]
        little = (f"the bandwidth term by Little's law: bytes in flight per SM x {sms[1]} SMs / latency against "
                  f"{sms[0]} SMs on the reference" if all(sms) else
                  "the bandwidth term at the point's share of the copy ceiling (no SM count on a spec sheet)")
        latency = "" if all(lat) else " (DRAM latency taken equal on both: not on both spec sheets)"
        return (f"kernel families {', '.join(md(f) for f in a['families'])}: each fitted on the reference's sweep as "
                f"latency + bytes / bandwidth + flops / compute, times each measured point's own residual "
                f"(interpolated between measured shapes); on the target the latency is kept, {little}{latency}, "
                "the compute term by the ratio of the matmul ceilings; tree kernels as measured")
    if what == "kept":
        return (f"kept as measured: a launch floor of up to {a['launch_floor_us']:g} us per kernel, the host-side "
                f"points ({', '.join(md(h) for h in a['host_side'])}) and latency-bound points (under "
                f"{a['latency_share']:.0%} of both ceilings; band up to their roofline-scaled time)")
    if what == "step_model":
        factors = ", ".join(f"{md(f)} {lo:.2f}" + (f"-{hi:.2f}" if hi - lo >= 0.005 else "")
                            for f, (lo, hi) in sorted(a.get("factors", {}).items()))
        how = (f"each family scaled by its in-step/suite factor from the rows' per-family split: {factors or '-'}"
               if a["split"] else
               "no per-family split in the reference's rows: every GPU kernel the suite does not explain counts as "
               "other kernels")
        notes = "; ".join(md(n) for n in a.get("notes", []))
        return (f"e2e, by the step model: moe, attention, dense GEMMs, lm-heads and tree kernels from their kernel "
                f"models at the step's shapes, calibrated on {a['rows']} measured e2e row(s) at TP "
                f"{'/'.join(map(str, a['tps'])) or '-'} ({how}); other kernels and the host time outside them "
                f"({a['host_fixed_ms']:.2f} ms + {a['host_per_layer_ms']:.3f} ms a layer) kept as the reference "
                f"measured them" + (f"; {notes}" if notes else ""))
    if what == "tensor_parallel":
        how = {"same": "measured at that degree", "fit": "re-sharded by a fixed + sharded/TP fit of two measured "
               "degrees", "kernels": "re-sharded by the verify kernels' shard-shape points",
               "bytes": "re-sharded assuming all of verify shards (1/TP; band up to no speed-up): no measurement "
               "at this degree", "model": "re-sharded by the step model (each family at the degree's shard shapes, "
               "the measured shard-shape kernels where the suite has them)"}
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
    if what == "e2e_not_measured":
        listed = "; ".join(f"TP-{int(q['tp'])} C={int(q['concurrency'])} B={int(q['budget'])} context "
                           f"{'-' if q['context'] is None else format(int(q['context']), ',')}: "
                           f"{md(q['reason'], cap=300)}" for q in a["points"])
        more = f"; and {a['count'] - len(a['points'])} more" if a["count"] > len(a["points"]) else ""
        return f"{a['count']} e2e point(s) the reference skipped (not measured there), so not projected: {listed}{more}"
    if what == "e2e_without_split":
        return f"{a['rows']} e2e row(s) of the reference have no step split (outside figures): not projected"
    if what == "band":
        n = len(a["references"])
        return (f"band: from the held-out errors of the carries each figure uses (the backtests: composition, tp, "
                f"size, cross-host) and the measurement spread; unknown where a carry has fewer than "
                f"{a.get('min_points', 5)} held-out points" + (f"; widened to the spread across {n} references"
                                                               if n > 1 else ""))
    return ", ".join(f"{md(k)} {md(v)}" for k, v in sorted(a.items()))


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


BACKTEST_COLUMNS = ("backtest", "data", "family", "regime", "points", "median error", "median |error|",
                    "worst error", "in band", "half-width", "goal")


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
            if band_gap is None:
                bits.append("band unknown (under 5 other points)")
            else:
                bits.append("band met" if band_gap == 0 else f"band {band_gap:.0%} short")
            goal = ", ".join(bits)
        data = r.reference if r.reference == r.target else f"{r.reference} -> {r.target}"
        in_band = "-" if r.in_band is None else f"{r.in_band:.0%}" + (f" ({r.unknown} unknown)" if r.unknown else "")
        out.append([md(r.kind), md(data), md(r.family), md(r.regime), str(r.points), _pct(r.median_error),
                    "-" if r.median_abs_error is None else f"{r.median_abs_error:.1%}", _pct(r.worst_error), in_band, "-" if r.half_width is None else f"{r.half_width:.1%}",
                    md(goal, cap=400)])
    return out


def projection_view(view: HostView) -> ProjectionView:
    p = view.projection
    gpu = f" ({p.ref_spec.gpu})" if p.ref_spec else ""
    fams = {label(k) for k in p.run.rows("kernels")}
    cited = [r for r in view.backtest if r.family.split(" vs ")[0] in fams or r.regime == "e2e"]
    return ProjectionView(f"Reference: host {md(p.ref_host)}, run {md(p.ref_run_id)}{gpu}; references used for the "
                          f"band: {', '.join(md(r) for r in p.references)}.",
                          tuple(assumption_text(a) for a in p.assumptions),
                          Table.of(BACKTEST_COLUMNS, backtest_cells(cited)) if cited else None)


def outside_entries(view: HostView) -> tuple[OutsideEntry, ...]:
    """Imported figures of this machine, beside kdbench's own and never mixed with them."""
    out = []
    for run in view.outside:
        prov = provenance(run.tables["runs"])
        e2e, kern = run.rows("e2e"), run.rows("kernels")
        notes = prov.get("notes")
        out.append(OutsideEntry(
            f"**{md(run.run_id)}** ({md(prov.get('origin'))}): {md(prov.get('machine', '-'))}; "
            f"{md(prov.get('date', '-'))}; source: {md(prov.get('source', '-'), cap=400)}.",
            Table.of(["engine", "config", "layers", "tp", "concurrency", "tokens/s", "TTFT ms", "ITL ms"],
                     [[md(prov.get("impl", "-")), md(e["config"]), str(e["layers"] or "-"), str(tp_of(e)),
                       str(e["concurrency"]), fmt(e["tokens_per_s"]), fmt(e["ttft_ms"]), fmt(e["itl_ms_p50"])]
                      for e in sorted(e2e, key=lambda e: e["concurrency"])]) if e2e else None,
            Table.of(["kernel", "impl", "M", "us", "us/token", "GB/s"],
                     [[md(k["kernel"]), md(k["impl"]), str(k["M"] or "-"), fmt(k["time_us_p50"]),
                       fmt(per(k["time_us_p50"], k["M"]), 2), sig(per(k["bytes"], k["time_us_p50"] * 1e3))]
                      for k in sorted(kern, key=point_key_sort)]) if kern else None,
            tuple(md(n, cap=400) for n in notes[:20]) if isinstance(notes, list) else ()))
    return tuple(out)


def page_view(view: HostView, docs_dir: Path) -> Page:
    """Everything one host page shows; its plots are written under docs_dir/<host>/ on the way."""
    out_dir, rel = docs_dir / view.name, view.name
    gpu = f" ({view.spec.gpu})" if view.spec else ""
    if view.kind == "measured":
        latest = view.measured[-1]
        data = (f"**Data: measured.** Latest run {md(latest.run_id)}"
                f"{' (partial: some suites did not finish)' if latest.partial else ''}; "
                f"inventory status: {status_line(view)}.")
    elif view.kind == "projected":
        data = (f"**Data: projected** from {md(view.projection.ref_host)} run {md(view.projection.ref_run_id)}; "
                f"this host has no run of its own yet. Inventory status: {status_line(view)}.")
    else:
        data = f"**Data: none.** {md(view.missing, cap=1000)}"
    some = view.latest is not None
    return Page(
        name=view.name, gpu=gpu, kind=view.kind, data_line=data,
        headline=headline(view) if some else None,
        environment=environment(view) if some else None,
        history=history(view) if view.kind == "measured" else None,
        moe=moe_view(view, out_dir, rel) if some else None,
        kernels=kernels_view(view, out_dir, rel) if some else None,
        e2e=e2e_view(view, out_dir, rel) if some else None,
        comm=comm_view(view) if some else None,
        comparison=comparison(view) if view.kind == "measured" else None,
        projection=projection_view(view) if view.kind == "projected" else None,
        outside=outside_entries(view), whatif=whatif_view(view.whatif.tables) if view.whatif else None)


def index_view(views: Sequence[HostView]) -> IndexView:
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
                     v.kind, f"{md(run.run_id)} ({started})" if run else "-", guarded_headline(v)])
    backtest = views[0].backtest if views else []
    details = sorted({(r.kind, r.detail) for r in backtest if not r.skipped})
    return IndexView(Table.of(["host", "GPUs", "interconnect", "status", "retired (reason, date)", "data", "last run",
                               "headline"], rows),
                     Table.of(BACKTEST_COLUMNS, backtest_cells(backtest)) if backtest else None,
                     tuple(f"{md(k)}: {md(d, cap=400)}" for k, d in details))


# -- templates ----------------------------------------------------------------------------------

@functools.cache
def _templates() -> jinja2.Environment:
    """The page templates shipped in flows/templates/ (layout only: every value is page text already)."""
    return jinja2.Environment(loader=jinja2.PackageLoader("flows", "templates"), undefined=jinja2.StrictUndefined,
                              trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True, autoescape=False)


def _render(template: str, **context: object) -> str:
    text = _templates().get_template(template).render(**context)
    return re.sub(r"\n{3,}", "\n\n", text).rstrip() + "\n"


def render_host(view: HostView, docs_dir: Path) -> str:
    """The page's markdown; its plots are written under docs_dir/<host>/ on the way."""
    return _render("host.md.j2", page=page_view(view, docs_dir))


def render_index(views: Sequence[HostView]) -> str:
    return _render("index.md.j2", index=index_view(views))


# -- writing ------------------------------------------------------------------------------------

def _inside(path: Path, root: Path) -> Path:
    """path, refused unless it resolves strictly inside root (symlinks included)."""
    full = path.resolve()
    if full == root.resolve() or not full.is_relative_to(root.resolve()):
        raise NotesError(f"refusing to write {path.name}: it resolves outside {root.name}/")
    return path


def _failed_page(view: HostView, why: str, inv: Inventory) -> str:
    return (f"# {view.name}: not rendered\n\nThis page {md(why, inv, cap=1000)}. The other pages are not affected; "
            "`kdbench store reindex` reports stored runs whose files do not validate.\n")


def host_page(view: HostView, notes_dir: Path, inv: Inventory) -> str:
    """The host's page, or a short one saying why it could not be written: whatever one host's stored
    data does to its page (a value no guard foresaw, a page over MAX_PAGE_BYTES, a leak the check
    caught), it costs that page, never the fleet's notes."""
    try:
        text = render_host(view, notes_dir)
    except Exception as e:  # the isolation boundary: the failure is named on the page instead
        return _failed_page(view, f"could not be rendered ({type(e).__name__}: {e})", inv)
    size = len(text.encode())
    if size > MAX_PAGE_BYTES:
        return _failed_page(view, f"was {size} bytes, over the {MAX_PAGE_BYTES}-byte bound, so it is not written", inv)
    bad = leaks(text, inv)
    return _failed_page(view, f"would reveal {', '.join(bad)}, so it is not written", inv) if bad else text


def render_notes(store: Store, inv: Inventory, docs_dir: Path) -> list[Path]:
    """Write every host page, its plots and the fleet index under docs_dir/notes/; returns the files."""
    views = gather(store, inv)
    notes_dir = Path(docs_dir) / "notes"
    notes_dir.mkdir(parents=True, exist_ok=True)
    for v in views:
        _inside(notes_dir / v.name, notes_dir), _inside(notes_dir / f"{v.name}.md", notes_dir)
    pages = {notes_dir / f"{v.name}.md": host_page(v, notes_dir, inv) for v in views}
    pages[notes_dir / f"{INDEX_PAGE}.md"] = render_index(views)
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
