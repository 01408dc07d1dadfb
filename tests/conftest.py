"""Shared fixtures: the inventory (read-only, or a copy to edit) and real loopback sshd sandbox hosts that are
always brought down again. The synthetic runs tests write live in tests/support/."""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import pytest

from flows import REPO
from flows.inventory.files import load_host, load_inventory
from flows.inventory.hosts import Host, Inventory
from flows.store.store import Store
from flows.transport import sandbox as sandbox_mod
from support.runs import model_run, write_run

DYING_GRACE_S = 10.0  # how long a killed remote command may take to go after the sandbox is down


@dataclass
class SandboxHosts:
    """A running sandbox: its state folder, its inventory folder and its host names."""

    state_dir: Path
    hosts_dir: Path
    names: list[str]

    def host(self, name: str | None = None) -> Host:
        """The host as the sandbox inventory describes it now (default: the first one)."""
        return load_host(self.hosts_dir, name or self.names[0])

    def fault(self, name: str, kind: sandbox_mod.Fault) -> None:
        sandbox_mod.fault(name, kind, self.state_dir)

    def pids(self) -> list[int]:
        return [r["pid"] for r in sandbox_mod.status(self.state_dir) if r["pid"]]


@pytest.fixture
def sandbox_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., SandboxHosts]]:
    """`make(count=1, names=None)` starts sandbox hosts in a fresh tmp state dir; all stopped at teardown.

    Register a sandbox host under a real host's name with `make(names=["pro6000"])`.
    """
    started: list[Path] = []

    def make(count: int = 1, names: Sequence[str] | None = None) -> SandboxHosts:
        state = tmp_path_factory.mktemp("sandbox")
        started.append(state)
        hosts_dir = sandbox_mod.up(count, names=names, state_dir=state)
        listed = [r["name"] for r in sandbox_mod.status(state)]
        return SandboxHosts(state_dir=state, hosts_dir=hosts_dir, names=listed)

    try:
        yield make
    finally:
        for state in started:
            pids = [r["pid"] for r in sandbox_mod.status(state) if r["pid"]]
            pids += [c for p in pids for c in sandbox_mod._descendants(p)]
            sandbox_mod.down(state)
            # a remote command the test had killed may still be dying, reparented away from sshd: give it
            # a grace, then stop whatever is left (nothing outlives the test) and fail
            deadline = time.monotonic() + DYING_GRACE_S
            while any(sandbox_mod._alive(p) for p in pids) and time.monotonic() < deadline:
                time.sleep(0.1)
            left = [p for p in pids if sandbox_mod._alive(p)]
            sandbox_mod._kill(left)
            assert not left, "a sandbox process outlived `down`"


@pytest.fixture
def sandbox(sandbox_factory: Callable[..., SandboxHosts]) -> SandboxHosts:
    """One sandbox host named sbx1, up for the duration of the test."""
    return sandbox_factory(count=1)


@pytest.fixture(scope="session")
def inv() -> Inventory:
    """The repo's own inventory (hosts/ and its spec sheets), read once."""
    return load_inventory(REPO / "hosts")


@pytest.fixture
def inv_dir(tmp_path: Path) -> Path:
    """A copy of the repo's hosts/ (host files, spec sheets; no lock files) that a test may edit."""
    d = tmp_path / "hosts"
    shutil.copytree(REPO / "hosts", d, ignore=shutil.ignore_patterns(".locks"))
    return d


@pytest.fixture
def store(tmp_path: Path) -> Store:
    """A fresh store whose H200 reference is the synthetic kernel-level run (support.runs.write_run)."""
    write_run(tmp_path / "art" / "reference" / "h200")
    return Store(str(tmp_path / "art"))


@pytest.fixture
def model_store(tmp_path: Path) -> Store:
    """A fresh store whose H200 reference is the synthetic model-level run (support.runs.model_run)."""
    model_run(tmp_path / "art" / "reference" / "h200")
    return Store(str(tmp_path / "art"))
