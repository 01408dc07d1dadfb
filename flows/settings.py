"""Flow settings, read from KDBENCH_* environment variables when a flow run starts.

Read at run time (not import time) so one serve process or worker can be pointed at any
inventory, artifacts store and notes repo by its environment: that is how the tests aim the
real `kdbench serve` at temporary directories, and how a team points every worker at shared storage.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

from pydantic import BaseModel, Field, ValidationError, field_validator

REPO = Path(__file__).resolve().parents[1]

# field -> environment variable; `kdbench serve --help` and docs/running.md list the same names.
ENV = {
    "hosts_dir": "KDBENCH_HOSTS",
    "artifacts": "KDBENCH_ARTIFACTS",
    "docs_dir": "KDBENCH_DOCS",
    "repo": "KDBENCH_REPO",
    "commit": "KDBENCH_COMMIT",
    "suites": "KDBENCH_SUITES",
    "profile": "KDBENCH_PROFILE",
    "reference": "KDBENCH_REFERENCE",
    "unreachable_runs": "KDBENCH_UNREACHABLE_RUNS",
    "probe_retries": "KDBENCH_PROBE_RETRIES",
    "retry_backoff_s": "KDBENCH_RETRY_BACKOFF_S",
    "build_timeout_s": "KDBENCH_BUILD_TIMEOUT_S",
    "bench_timeout_s": "KDBENCH_BENCH_TIMEOUT_S",
}

SUITES = ("kernels", "e2e", "comm")


class SettingsError(ValueError):
    """A KDBENCH_* variable that does not parse; the message names the variable."""


class Settings(BaseModel):
    hosts_dir: Path = REPO / "hosts"
    artifacts: str = str(REPO / "artifacts")  # local path or a pyarrow filesystem URI (s3://...)
    docs_dir: Path = REPO / "docs"
    repo: Path = REPO  # git repository the notes are committed into
    commit: bool = True
    suites: list[str] = Field(default_factory=lambda: list(SUITES))
    profile: str = "full"
    reference: str = "h200"
    unreachable_runs: int = Field(3, ge=1)  # consecutive unreachable runs before a host is released
    probe_retries: int = Field(2, ge=0)
    retry_backoff_s: float = Field(5.0, ge=0)
    build_timeout_s: float = Field(1800.0, gt=0)
    bench_timeout_s: float = Field(3600.0, gt=0)  # per suite

    @field_validator("suites", mode="before")
    @classmethod
    def _split(cls, v: object) -> object:
        return [s.strip() for s in v.split(",") if s.strip()] if isinstance(v, str) else v

    @field_validator("suites")
    @classmethod
    def _known(cls, v: list[str]) -> list[str]:
        bad = [s for s in v if s not in SUITES]
        if bad:
            raise ValueError(f"unknown suites {bad}, expected some of {list(SUITES)}")
        return v

    @field_validator("profile")
    @classmethod
    def _profile(cls, v: str) -> str:
        if v not in ("smoke", "full"):
            raise ValueError(f"unknown profile {v!r}, expected 'smoke' or 'full'")
        return v

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "Settings":
        raw = {field: environ[var] for field, var in ENV.items() if environ.get(var)}
        try:
            return cls.model_validate(raw)
        except ValidationError as e:
            err = e.errors()[0]
            field = str(err["loc"][0]) if err["loc"] else "?"
            raise SettingsError(f"{ENV.get(field, field)}: {err['msg']}") from None

    def env(self) -> dict[str, str]:
        """The variables that reproduce these settings in another process (serve, worker)."""
        out = {}
        for field, var in ENV.items():
            v = getattr(self, field)
            out[var] = ",".join(v) if isinstance(v, list) else str(int(v) if isinstance(v, bool) else v)
        return out
