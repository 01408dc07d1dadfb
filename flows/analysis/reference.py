"""Reference datasets and stored projections: where the pure projection's inputs come from.

A dataset is a measured run's tables with the machine it ran on: a committed reference set
(artifacts/reference/<name>/: kdbench's own or an imported outside one) or a host's latest complete
measured run in the store. `project_host` projects one host from one and stores the result; the
Prefect task wraps it for the flows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from engine.rows import COLUMNS, Provenance
from engine.schema import SchemaError
from engine.table_checks import check_values
from flows.analysis.projection import Machine, ProjectionError, Tables, project, rows_of
from flows.inventory.hosts import Inventory
from flows.store.layout import StoreError
from flows.store.store import Store

OUTSIDE_ORIGINS = ("published", "outside")   # provenance `origin` of imported figures


@dataclass(frozen=True)
class Dataset:
    """Measured tables plus the machine they ran on."""

    name: str
    machine: Machine
    run_id: str
    tables: Tables

    @property
    def host(self) -> str:
        return self.machine.name


def origin(tables: Tables) -> str:
    """kdbench for kdbench's own runs; published or outside for imported figures."""
    return str(Provenance.of(tables["runs"]).origin or "kdbench")


def is_outside(tables: Tables) -> bool:
    return origin(tables) in OUTSIDE_ORIGINS


def machine_of(inv: Inventory, name: str, spec: str | None = None, gpus: int | None = None,
               interconnect: str | None = None) -> Machine:
    """The inventory host `name`, else a machine of spec sheet `spec` (the name when not given)."""
    host = inv.hosts.get(name)
    spec_name = spec or (host.spec if host else name)
    if spec_name not in inv.specs:
        raise ProjectionError(f"host {name!r}: spec sheet {spec_name!r} not found in hosts/specs/")
    return Machine(name=name, spec=inv.specs[spec_name],
                   gpus=gpus if gpus is not None else (max(host.gpus, 1) if host else 1),
                   interconnect=interconnect or (host.interconnect if host else "none"))


def as_dataset(name: str, tables: Tables, inv: Inventory) -> Dataset:
    """Tables of one run with the machine they ran on (an import names its spec in its provenance).

    Only tables whose every value is one a run can write (engine.table_checks.check_values) make a dataset:
    a store written before values were checked at the door may hold a zero or NaN time, which no
    projection or backtest carries from (ProjectionError says which)."""
    for t, table in tables.items():
        try:
            check_values(table, f"{t}.arrow")
        except SchemaError as e:
            raise ProjectionError(f"reference {name!r}: {e}") from None
    row = rows_of(tables, "runs")[0]
    prov = Provenance.of(tables["runs"])
    spec = prov.spec if isinstance(prov.spec, str) else None   # a projection's spec is its figures, not a sheet
    try:
        machine = machine_of(inv, row.host, spec, prov.gpu_count if prov.spec else None, prov.interconnect)
    except ProjectionError:
        raise ProjectionError(f"reference {name!r} ran on host {row.host!r}, which has no spec sheet in "
                              "hosts/specs/ (an imported dataset names one in its provenance: spec)") from None
    return Dataset(name=name, machine=machine, run_id=row.run_id, tables=tables)


def load_reference(store: Store, inv: Inventory, name: str) -> Dataset:
    """A committed reference set `name`, else the latest complete measured run of host `name`."""
    if name in store.references():
        return as_dataset(name, store.reference(name), inv)
    runs = [r for r in store.runs(name) if r.source == "measured" and r.status == "complete"]
    if not runs:
        raise ProjectionError(
            f"no reference data {name!r}: artifacts/reference/{name}/ is absent and host {name} "
            "has no complete measured run in the store")
    return as_dataset(name, store.load(name, runs[-1].run_id), inv)


def measured_datasets(store: Store, inv: Inventory, outside: bool = False) -> list[Dataset]:
    """The newest complete measured data of every host: its latest store run, else a committed reference.

    Imported outside figures count only with `outside`, each under its own name. Data that does not
    read, or holds values no run can write, is skipped: it costs its own host's figures only.
    """
    by_host: dict[str, Dataset] = {}
    for name in store.references():
        try:
            data = as_dataset(name, store.reference(name), inv)
        except (ProjectionError, StoreError, SchemaError):
            continue
        if is_outside(data.tables):
            if outside:
                by_host[name] = data
            continue
        by_host.setdefault(data.host, data)
    for info in store.runs():   # oldest first, so the newest run of a host wins
        if info.source == "measured" and info.status == "complete":
            try:
                by_host[info.host] = as_dataset(info.host, store.load(info.host, info.run_id), inv)
            except (ProjectionError, StoreError, SchemaError):
                continue
    return [by_host[h] for h in sorted(by_host)]


def project_host(store: Store, inv: Inventory, target: str, reference: str = "h200",
                 also: Sequence[str] = (), evidence: Sequence[object] = ()) -> str:
    """Project `target` from the reference (plus `also` for the band; `evidence`: the stored backtest
    rows the bands come from), store it, return the run id."""
    ref, *more = [load_reference(store, inv, name) for name in (reference, *also)]
    tables = project(ref.tables, ref.machine, machine_of(inv, target),
                     also=[(d.tables, d.machine) for d in more], evidence=evidence)
    run_id = tables["runs"].column(COLUMNS.run_id)[0].as_py()
    store.put_tables(target, run_id, tables)
    return run_id


def unmeasured_hosts(store: Store, inv: Inventory) -> list[str]:
    """Inventory hosts without a measured run of kdbench's own: the ones the notes show projected."""
    measured = {d.host for d in measured_datasets(store, inv)}
    return sorted(h for h in inv.hosts if h not in measured)
