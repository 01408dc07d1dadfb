"""Incremental result files: every point rewrites its table and the run's row, atomically.

A run killed by SIGKILL leaves the files of its last completed point (status "partial"); SIGTERM
is deferred while a file is being written, then ends the run with a note, so the manifest always
matches the files it names.
"""

from __future__ import annotations

import json
import signal
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

from engine import schema, table_files
from engine.env import now_iso
from engine.rows import ROWS, RunRow, set_columns
from engine.schema import RunStatus


class Terminated(Exception):
    """SIGTERM (or SIGINT) arrived; raised outside of file writes only."""


_depth = 0
_pending: int | None = None


def _on_signal(signum: int, _frame: object) -> None:
    global _pending
    if _depth:
        _pending = signum
    else:
        raise Terminated(signum)


def install_signal_handlers() -> None:
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)


@contextmanager
def _critical() -> Iterator[None]:
    global _depth, _pending
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
    if not _depth and _pending is not None:
        signum, _pending = _pending, None
        raise Terminated(signum)


def progress(event: dict[str, Any]) -> None:
    """One machine-readable line for the controller streaming stdout."""
    print("KDBENCH " + json.dumps(event, sort_keys=True, default=str), flush=True)


class SuiteWriter:
    """Owns <suite>.arrow and this suite's row of runs.arrow for one run; points come as the suite's
    typed rows (engine.rows), without run_id and source, which the writer sets."""

    def __init__(self, out_dir: Path, suite: str, profile: str, prov: dict[str, Any], n_points: int):
        self.out, self.suite, self.profile, self.n = Path(out_dir), suite, profile, n_points
        self.out.mkdir(parents=True, exist_ok=True)
        self.prov = dict(prov)
        self.rows: list[Any] = []
        self.run_row: dict[str, Any] = {}
        self.other_runs = self._other_runs()

    def _other_runs(self) -> list[RunRow]:
        """Rows other suites left in runs.arrow of this directory (a later suite appends its own)."""
        path = self.out / "runs.arrow"
        if not path.exists():
            return []
        try:
            rows = table_files.read_table(path).to_pylist()
        except schema.SchemaError:
            return []
        return [RunRow(**r) for r in rows if (r["run_id"], r["suite"]) != (self.prov["run_id"], self.suite)]

    def _write(self, status: RunStatus) -> None:
        self.prov["ended_at"] = now_iso()
        run = {k: self.prov.get(k) for k in schema.PROVENANCE_KEYS}
        run.update(self.run_row, suite=self.suite, profile=self.profile, status=status,
                   points=len(self.rows), source="measured")
        run = RunRow(**run)
        with _critical():
            table_files.write_table(self.out, table_files.to_table(self.suite, self.rows, self.prov))
            table_files.write_table(self.out, table_files.to_table("runs", self.other_runs + [run], self.prov))

    def start(self, **run_fields: Any) -> None:
        """First write: the runs row (with ceilings) and an empty suite table, status partial."""
        self.run_row.update(run_fields)
        self._write(RunStatus.PARTIAL)

    def add(self, row: Any) -> None:
        """Save a point (a row of the suite's table) and announce it with the columns it sets; SIGTERM
        waits for both, so the controller's log names every point the files hold."""
        if not isinstance(row, ROWS[self.suite]):
            raise TypeError(f"{self.suite} suite: a point is an engine.rows.{ROWS[self.suite].__name__}, "
                            f"not {type(row).__name__}")
        row = replace(row, run_id=self.prov["run_id"], source="measured")
        self.rows.append(row)
        with _critical():
            self._write(RunStatus.PARTIAL)
            progress({"event": "point", "suite": self.suite, "i": len(self.rows), "n": self.n, **set_columns(row)})

    def finish(self, status: RunStatus, note: str | None = None) -> None:
        if note:
            self.run_row["note"] = "; ".join(x for x in (self.run_row.get("note"), note) if x)
        with _critical():
            self._write(status)
            progress({"event": "done", "suite": self.suite, "status": status, "points": len(self.rows)})
