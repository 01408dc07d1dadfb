"""Step one of the notes: the store and the inventory gathered into one view per host (flows.notes.views).

Everything on a page is a function of artifacts/ and the inventory alone. A host with no measured run
shows the projection the flows (or `kdbench notes`) stored for it, read back here: the notes never
project. Every string a host wrote is made plain and redacted with the inventory here (`_cleaned`),
after the lookups that need the real ids; one host's unreadable data costs its own page only.
"""

from __future__ import annotations

import pyarrow as pa

from engine.rows import COLUMNS, Provenance
from engine.schema import SchemaError
from flows.analysis.assumptions import map_strings, parse
from flows.analysis.backtest_store import stored_backtest
from flows.analysis.ceilings import rows_of
from flows.analysis.reference import is_outside
from flows.analysis.whatif import SUITE as WHATIF, stored_whatif
from flows.inventory.hosts import Inventory, is_page_name
from flows.inventory.scrub import plain
from flows.notes.views import HostView, Projected, Run
from flows.store.layout import StoreError, check_name
from flows.store.store import Store


def measured_runs(store: Store, name: str) -> list[Run]:
    """Every measured run of a host (partial ones too): ingested runs and committed reference sets."""
    # stored runs in the store's order (the controller's clock), after the committed reference sets
    runs: dict[str, tuple[tuple, Run]] = {}
    for i, info in enumerate(store.runs(name)):
        if info.source == "measured":
            runs[info.run_id] = ((1, i), Run(info.run_id, store.load(name, info.run_id)))
    for tables in readable_references(store).values():
        row = rows_of(tables, "runs")[0]
        if row.host == name and row.source == "measured" and not is_outside(tables):
            runs.setdefault(row.run_id, ((0, row.started_at or ""), Run(row.run_id, tables)))
    return [r for _, r in sorted(runs.values(), key=lambda x: (x[0], x[1].run_id))]


def outside_runs(store: Store, name: str) -> list[Run]:
    """Imported outside figures (published or otherwise) of a host, never counted as its measurements."""
    out = []
    for ref, tables in readable_references(store).items():
        if is_outside(tables) and tables["runs"].column(COLUMNS.host)[0].as_py() == name:
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
    prov = Provenance.of(run.tables["runs"])
    ref_host, ref_id = prov.reference_host or "?", prov.reference_run_id or "?"
    ref = next((r for r in measured_runs(store, ref_host) if r.run_id == ref_id), None)
    host = inv.hosts.get(ref_host)
    return Projected(run, ref_host, ref_id, ref, inv.specs.get(host.spec) if host else None,
                     [parse(a) for a in prov.assumptions or [] if isinstance(a, dict)],
                     list(prov.references if prov.references is not None else [ref_id]))


def gather(store: Store, inv: Inventory) -> list[HostView]:
    """Views of every inventory host and every host with data, sorted by name.

    A host without a measured run shows the newest projection stored for it (`kdbench notes` and
    the flows store them); a host with neither says how to get one.
    """
    names = set(inv.hosts) | {r.host for r in store.runs()}
    for tables in readable_references(store).values():
        names.add(tables["runs"].column(COLUMNS.host)[0].as_py())
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
                            whatif=Run(grid["runs"].column(COLUMNS.run_id)[0].as_py(), grid) if grid else None)
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
    """The run with every string a host wrote made plain and redacted (see flows/inventory/scrub.py)."""
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
        records = [map_strings(a, lambda v: plain(v, inv)) for a in p.assumptions]
        view.projection = Projected(_clean_run(p.run, inv), plain(p.ref_host, inv), plain(p.ref_run_id, inv),
                                    _clean_run(p.ref, inv) if p.ref else None, p.ref_spec,
                                    records, [plain(r, inv) for r in p.references])
    view.missing = plain(view.missing, inv, cap=1000)
    return view
