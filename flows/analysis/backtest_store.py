"""The backtests kept in the store: run every one over the store's measured data, keep the rows the notes
and the bands read (artifacts/backtest/backtest.json), and refresh what the notes read and never compute."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Iterable, cast

from flows.analysis.backtest import BacktestRow, backtest
from flows.analysis.projection import ProjectionError
from flows.analysis.reference import is_outside, measured_datasets, project_host, unmeasured_hosts
from flows.analysis.whatif import store_grids
from flows.inventory.hosts import Inventory
from flows.store.layout import StoreError
from flows.store.store import Store

STORED = "backtest/backtest.json"


def backtests_of(store: Store, inv: Inventory) -> list[BacktestRow]:
    """Every backtest over the store's measured data (none when there is none)."""
    own = measured_datasets(store, inv)
    if not own:
        return []
    return backtest(own, [d for d in measured_datasets(store, inv, outside=True) if is_outside(d.tables)])


def store_backtest(store: Store, rows: Iterable[BacktestRow]) -> None:
    store.put_json(STORED, [asdict(r) for r in rows])


def stored_backtest(store: Store) -> list[BacktestRow]:
    """The backtest rows `kdbench backtest` (or the flow) stored last; empty when never run."""
    return [BacktestRow(**{**r, "ratios": tuple(r.get("ratios", ())), "groups": tuple(r.get("groups", ())),
                           "strata": tuple(r.get("strata", ()))})
            for r in cast("list[dict[str, Any]]", store.get_json(STORED) or [])]


def refresh(store: Store, inv: Inventory, reference: str) -> dict[str, str]:
    """Store what the notes read and never compute: the backtests, then (with their evidence for the
    bands) a projection from `reference` of every inventory host without a measured run and every
    host's what-if grid. Returns the hosts that could not be projected, and why."""
    rows = backtests_of(store, inv)
    store_backtest(store, rows)
    failed = {}
    for host in unmeasured_hosts(store, inv):
        try:
            project_host(store, inv, host, reference, evidence=rows)
        except (ProjectionError, StoreError) as e:
            failed[host] = str(e)
    if rows:
        store_grids(store, inv, reference, rows)
    return failed
