"""The inventory's records: a host, a GPU spec sheet, the inventory of both, and what a host file may hold.

Validation lives on the models (pydantic), so every way in (loading hosts/, `kdbench hosts add`, a
flow writing status back) refuses the same bad values with one message naming the field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from flows.inventory.keys import fingerprint, parse_public_key

Arch = Literal["sm_90", "sm_100", "sm_103", "sm_120", "cpu"]
Status = Literal["active", "retired"]
RetiredReason = Literal["unauthorized", "host_key_changed", "released", "unreachable"]
Interconnect = Literal["pcie", "nvlink", "none"]

SAFE_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,62}\Z")  # \Z: `$` would let a trailing newline pass
# The pages docs/notes/ holds beside the host pages (<host>.md): no host may be named like one, in
# any letter case (a case-insensitive checkout would make readme.md and README.md one file).
INDEX_PAGE = "README"
PAGE_NAMES = (INDEX_PAGE,)
# Addresses that mark a shipped file the owner has not filled in yet; never contacted.
PLACEHOLDER_MARKERS = ("replace-me", ".example", ".invalid")
LOCK_DIR = ".locks"
MAX_FILE_BYTES = 64 * 1024  # a host file is a screenful; anything larger is not one
MAX_SHOWN = 80              # characters of a bad value quoted back in a message
MAX_DEPTH = 16              # YAML nesting: a host file has two levels (host_keys); deeper is not one
# What the flows write back: the only fields a notes commit records of a host file (the operator's
# address, user, key path and everything else stay as the committed file has them).
STATUS_FIELDS = ("status", "retired_reason", "retired_at", "presented_host_key_fingerprint",
                 "unreachable_runs", "last_seen")


class InventoryError(Exception):
    """A bad inventory file or request; the message names the file, the field and the problem."""


class Spec(BaseModel):
    """A GPU spec sheet: the figures the projection scales measured numbers with."""

    model_config = ConfigDict(extra="forbid")

    name: str
    gpu: str
    arch: Arch
    memory_gb: float = Field(gt=0)      # device memory as the vendor prints it: binary GB (GiB)
    mem_bw_gbps: float = Field(gt=0)
    tflops: dict[str, float]
    sms: int | None = None
    mem_latency_ns: float | None = Field(default=None, gt=0)   # DRAM load latency: the cross-host carrier's Little's law
    l2_mb: float | None = None
    nvlink_gbps: float | None = None
    pcie_gbps: float | None = None
    sources: dict[str, str]


class Host(BaseModel):
    """One host of the fleet as its YAML file describes it."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    name: str
    address: str = Field(min_length=1)
    port: int = Field(ge=1, le=65535)
    user: str = Field(min_length=1)
    key_file: str = Field(min_length=1)
    host_keys: list[str] = []
    spec: str
    gpus: int = Field(ge=0, le=1024)
    arch: Arch
    interconnect: Interconnect
    python: str = Field(min_length=1)
    work_dir: str = Field(min_length=1)
    status: Status = "active"
    retired_reason: RetiredReason | None = None
    retired_at: datetime | None = None
    presented_host_key_fingerprint: str | None = None
    unreachable_runs: int = Field(default=0, ge=0)
    last_seen: datetime | None = None
    notes: str = ""

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        if not SAFE_NAME.match(v):
            raise ValueError(
                "must be a safe identifier: lower-case letter first, then letters, digits, '-' or '_'"
                " (at most 63 characters)"
            )
        if is_page_name(v):
            raise ValueError(f"{v!r} is the name of a page the notes index writes (docs/notes/{INDEX_PAGE}.md)")
        return v

    @field_validator("work_dir", "python")
    @classmethod
    def _not_an_option(cls, v: str) -> str:
        # both become arguments of remote commands (cd, mkdir, the interpreter itself)
        if v.startswith("-"):
            raise ValueError("must not start with '-' (a command would read it as an option)")
        if any(ord(c) < 32 or ord(c) == 127 for c in v):
            raise ValueError("must not contain control characters")
        return v

    @field_validator("host_keys")
    @classmethod
    def _keys_parse(cls, v: list[str]) -> list[str]:
        for i, line in enumerate(v):
            try:
                parse_public_key(line)
            except ValueError as e:
                raise ValueError(f"entry {i}: {e}") from None
        return v

    @field_validator("retired_at", "last_seen", mode="before")
    @classmethod
    def _plain_utc(cls, v: Any) -> Any:
        # ruamel hands back its own datetime subclass; callers get a plain, timezone-aware one.
        if isinstance(v, datetime):
            v = datetime.fromisoformat(v.isoformat())
            return v if v.tzinfo else v.replace(tzinfo=timezone.utc)
        return v

    @field_validator("notes", mode="before")
    @classmethod
    def _notes_none(cls, v: Any) -> Any:
        return "" if v is None else v

    def fingerprints(self) -> list[str]:
        """SHA256 fingerprints of the pinned host keys, as `ssh-keygen -l` prints them."""
        return [fingerprint(parse_public_key(k)) for k in self.host_keys]

    def is_placeholder(self) -> bool:
        """True while the address is still the shipped placeholder the owner must replace."""
        a = self.address.lower()
        return any(m in a for m in PLACEHOLDER_MARKERS)

    def key_path(self, hosts_dir: Path) -> Path:
        """The client key file; relative paths are relative to the inventory folder."""
        p = Path(self.key_file).expanduser()
        return p if p.is_absolute() else (hosts_dir / p)


@dataclass
class Inventory:
    """Every host and spec sheet of one inventory folder, validated together."""

    dir: Path
    hosts: dict[str, Host] = field(default_factory=dict)
    specs: dict[str, Spec] = field(default_factory=dict)


def is_page_name(name: str) -> bool:
    """Whether a host named `name` would take the file of a page the notes index writes."""
    return name.lower() in {p.lower() for p in PAGE_NAMES}
