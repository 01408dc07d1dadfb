"""The deployments `kdbench serve` registers: `bench/<host>` for every inventory host and `fleet/fleet`.

They load the flows by module path (flows.pipelines.bench), so any machine with kdbench installed (the
serve process or a worker of a Prefect work pool) can run them. Registering also upserts the per-host
concurrency limits and deletes the deployments of hosts that left the inventory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from prefect import serve as prefect_serve
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.filters import FlowFilter, FlowFilterName
from prefect.deployments.runner import EntrypointType, RunnerDeployment
from prefect.exceptions import ObjectNotFound
from prefect.settings import get_current_settings

from flows.inventory.files import load_inventory
from flows.pipelines.bench import bench, fleet
from flows.pipelines.server import healthy
from flows.pipelines.settings import Settings
from flows.pipelines.tasks import NOTES_LIMIT, ensure_limit, limit_name


class ServeError(RuntimeError):
    """No Prefect server to register with; the message says how to start one."""


def deployments(s: Settings) -> list[RunnerDeployment]:
    """One `bench/<host>` per inventory host and `fleet/fleet`, loaded by module path so any
    machine with kdbench installed (serve process or worker) can run them."""
    inv = load_inventory(s.hosts_dir)
    deps = [bench.to_deployment(
        name=h, parameters={"host": h}, tags=["kdbench", f"host-{h}"],
        description=f"Benchmark {h}; projection when it cannot be measured (retired, refused, unreachable).",
        entrypoint_type=EntrypointType.MODULE_PATH,
    ) for h in sorted(inv.hosts)]
    deps.append(fleet.to_deployment(name="fleet", tags=["kdbench"], entrypoint_type=EntrypointType.MODULE_PATH,
                                    description="Every host at once, then the fleet notes."))
    return deps


def _prune(keep: set[str]) -> list[str]:
    """Delete `bench/<host>` deployments whose host left the inventory."""
    gone = []
    with get_client(sync_client=True) as client:
        for d in client.read_deployments(flow_filter=FlowFilter(name=FlowFilterName(any_=["bench"]))):
            if d.name not in keep:
                client.delete_deployment(d.id)
                gone.append(d.name)
    return gone


def _ensure_pool(name: str) -> None:
    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(name)
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(name=name, type="process"))


def serve_deployments(pool: str | None, hosts: Path | None, say: Callable[[str], None]) -> None:
    """Register the deployments and serve them until stopped, or, with `pool`, apply them to that
    work pool and return. ServeError, SettingsError or InventoryError (one message) when it cannot."""
    api = get_current_settings().api.url
    if not api:
        raise ServeError("PREFECT_API_URL is not set: start a server with `kdbench server` and export the URL it prints")
    if not healthy(api):
        raise ServeError(f"no Prefect server answers at PREFECT_API_URL={api} (`kdbench server` starts one)")
    if hosts is not None:  # flow runs read KDBENCH_HOSTS when they start; they inherit this environment
        os.environ["KDBENCH_HOSTS"] = str(hosts.resolve())
    deps = deployments(Settings.from_env())
    names = [d.name for d in deps if d.flow_name == "bench"]
    for h in names:
        ensure_limit(limit_name(h))
    ensure_limit(NOTES_LIMIT)
    gone = _prune(set(names))
    if gone:
        say(f"removed deployments of hosts no longer in the inventory: {', '.join(sorted(gone))}")
    listed = ", ".join(f"{d.flow_name}/{d.name}" for d in deps)
    if pool:
        _ensure_pool(pool)
        for d in deps:
            d.apply(work_pool_name=pool)
        print(f"registered {len(deps)} deployments in work pool {pool!r}: {listed}")
        return
    say(f"serving {len(deps)} deployments against {api}: {listed}")
    prefect_serve(*deps, print_starting_message=False)
