"""Flow settings, read from KDBENCH_* environment variables when a flow run starts (pydantic-settings).

Read at run time (not import time) so one serve process or worker can be pointed at any
inventory, artifacts store and notes repo by its environment: that is how the tests aim the
real `kdbench serve` at temporary directories, and how a team points every worker at shared storage.
Each field's variable is KDBENCH_<FIELD>, except hosts_dir (KDBENCH_HOSTS) and docs_dir (KDBENCH_DOCS);
`kdbench serve --help` and docs/running.md list the same names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import AliasChoices, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from flows import REPO

SUITES = ("kernels", "e2e", "comm")
PREFIX = "KDBENCH_"


class SettingsError(ValueError):
    """A KDBENCH_* variable that does not parse; the message names the variable."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=PREFIX, env_ignore_empty=True, populate_by_name=True,
                                      extra="ignore")

    hosts_dir: Path = Field(REPO / "hosts", validation_alias=AliasChoices("hosts_dir", "KDBENCH_HOSTS"))
    artifacts: str = str(REPO / "artifacts")  # local path or a pyarrow filesystem URI (s3://...)
    docs_dir: Path = Field(REPO / "docs", validation_alias=AliasChoices("docs_dir", "KDBENCH_DOCS"))
    repo: Path = REPO  # git repository the notes are committed into
    commit: bool = True
    suites: Annotated[list[str], NoDecode] = Field(default_factory=lambda: list(SUITES))  # "kernels,e2e"
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
    def from_env(cls) -> "Settings":
        """The settings of this process's environment; a bad variable is one SettingsError naming it."""
        try:
            return cls()
        except ValidationError as e:
            err = e.errors()[0]
            field = str(err["loc"][0]) if err["loc"] else "?"
            raise SettingsError(f"{env_var(field)}: {err['msg']}") from None

    def env(self) -> dict[str, str]:
        """The variables that reproduce these settings in another process (serve, worker)."""
        out = {}
        for field in type(self).model_fields:
            v = getattr(self, field)
            out[env_var(field)] = ",".join(v) if isinstance(v, list) else str(int(v) if isinstance(v, bool) else v)
        return out


def env_var(field: str) -> str:
    """The KDBENCH_* variable of a settings field (the variable's own name passes through)."""
    info = Settings.model_fields.get(field)
    alias = info.validation_alias if info else None
    if isinstance(alias, AliasChoices):
        return str(alias.choices[-1])
    return field if field.startswith(PREFIX) else f"{PREFIX}{field.upper()}"
