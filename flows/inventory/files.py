"""The host inventory: one YAML file per host in `hosts/`, spec sheets in `hosts/specs/`.

The files are the source of truth and are edited both by people and by flows, so loading
validates everything (one clear message naming file and field, never a traceback) and writing
back is a round-trip edit under a lock: comments, key order and every untouched field survive,
and no other file changes.
"""

from __future__ import annotations

import io
import os
from datetime import datetime, timezone
from enum import Enum
from pathlib import Path
from typing import Any

from filelock import FileLock
from pydantic import BaseModel, ValidationError
from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError
from ruamel.yaml.representer import RoundTripRepresenter

from engine.files import atomic_write_bytes
from flows import REPO
from flows.inventory.hosts import (MAX_DEPTH, MAX_FILE_BYTES, MAX_SHOWN, LOCK_DIR, SAFE_NAME, Host, Inventory,
                                   InventoryError, RetiredReason, Spec, STATUS_FIELDS)


def default_hosts_dir() -> Path:
    """KDBENCH_HOSTS when set, else the repo's hosts/ folder."""
    env = os.environ.get("KDBENCH_HOSTS")
    return Path(env) if env else REPO / "hosts"


class _Representer(RoundTripRepresenter):
    """Writes `null` as the shipped files spell it (ruamel's default writes nothing after the colon)."""


_Representer.add_representer(type(None), lambda r, _: r.represent_scalar("tag:yaml.org,2002:null", "null"))


def _yaml() -> YAML:
    y = YAML(typ="rt")
    y.preserve_quotes = True
    y.width = 4096
    y.Representer = _Representer
    return y


def display_path(path: Path) -> str:
    """A path for messages: relative to the cwd when possible, so messages stay readable."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def parse_yaml(text: str, where: str) -> Any:
    """One YAML document, round-trip; anchors and aliases are refused (an alias bomb of a few
    hundred bytes expands exponentially, and nothing in a host file needs them), and so is nesting
    deeper than MAX_DEPTH, before anything is composed: the composer recurses once per level, and the
    scanner's work per token grows with the depth, so a 64 KiB `[[[[...` would take minutes."""
    try:
        depth = 0
        for event in _yaml().parse(text):
            kind = type(event).__name__
            if kind == "AliasEvent" or getattr(event, "anchor", None):
                raise InventoryError(f"{where}: YAML anchors and aliases are not allowed "
                                     f"(line {event.start_mark.line + 1})")
            depth += kind in ("MappingStartEvent", "SequenceStartEvent")
            depth -= kind in ("MappingEndEvent", "SequenceEndEvent")
            if depth > MAX_DEPTH:
                raise InventoryError(f"{where}: YAML nested deeper than {MAX_DEPTH} levels "
                                     f"(line {event.start_mark.line + 1}); not a host file")
        return _yaml().load(text)
    except RecursionError:
        raise InventoryError(f"{where}: YAML nested too deeply to read; not a host file") from None
    except YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise InventoryError(f"{where}: malformed YAML{at}: {problem[:MAX_SHOWN]}") from None


def _read_yaml(path: Path) -> Any:
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
        if len(raw) > MAX_FILE_BYTES:
            raise InventoryError(f"{display_path(path)}: larger than {MAX_FILE_BYTES // 1024} KiB; not a host file")
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InventoryError(f"{display_path(path)}: cannot be read: {e}") from None
    return parse_yaml(text, display_path(path))


def validation_message(path: Path, e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(file)"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        elif err["type"] == "missing":
            msg = "required field is missing"
        elif "input" in err and err["type"] not in ("missing",):
            got = repr(err["input"])
            msg = f"{msg} (got {got if len(got) <= MAX_SHOWN else got[:MAX_SHOWN] + '...'})"
        parts.append(f"field '{loc}': {msg}")
    return f"{display_path(path)}: " + "; ".join(parts)


def _model(cls: type[BaseModel], path: Path, data: Any) -> Any:
    if not isinstance(data, dict):
        raise InventoryError(f"{display_path(path)}: expected a mapping of fields, got {type(data).__name__}")
    try:
        return cls.model_validate(dict(data))
    except ValidationError as e:
        raise InventoryError(validation_message(path, e)) from None


def load_specs(hosts_dir: Path) -> dict[str, Spec]:
    specs: dict[str, Spec] = {}
    for path in sorted((hosts_dir / "specs").glob("*.yaml")):
        spec = _model(Spec, path, _read_yaml(path))
        if spec.name != path.stem:
            raise InventoryError(f"{display_path(path)}: field 'name': must equal the file name '{path.stem}'")
        specs[spec.name] = spec
    return specs


def _host_files(hosts_dir: Path) -> list[Path]:
    return sorted([*hosts_dir.glob("*.yaml"), *hosts_dir.glob("*.yml")], key=lambda p: (p.stem, p.suffix))


def _check_host(path: Path, host: Host, specs: dict[str, Spec], hosts_dir: Path) -> None:
    if host.name != path.stem:
        raise InventoryError(f"{display_path(path)}: field 'name': must equal the file name '{path.stem}' (got {host.name!r})")
    if host.spec not in specs:
        known = ", ".join(sorted(specs)) or "none"
        raise InventoryError(f"{display_path(path)}: field 'spec': unknown spec {host.spec!r} (known: {known})")
    if host.status == "retired" and host.retired_reason is None:
        raise InventoryError(f"{display_path(path)}: field 'retired_reason': required when status is 'retired'")
    if host.status == "active" and host.retired_reason is not None:
        raise InventoryError(f"{display_path(path)}: field 'retired_reason': must be empty when status is 'active'")
    # A retired or not-yet-filled-in host may legitimately lack its key on this machine.
    if host.status == "active" and not host.is_placeholder() and not host.key_path(hosts_dir).is_file():
        raise InventoryError(f"{display_path(path)}: field 'key_file': file not found ({host.key_file})")


def load_inventory(hosts_dir: Path) -> Inventory:
    """Every host and spec of the folder, validated; InventoryError on the first bad file."""
    hosts_dir = Path(hosts_dir)
    if not hosts_dir.is_dir():
        raise InventoryError(f"{display_path(hosts_dir)}: inventory folder not found")
    inv = Inventory(dir=hosts_dir, specs=load_specs(hosts_dir))
    seen: dict[str, Path] = {}
    for path in _host_files(hosts_dir):
        host = _model(Host, path, _read_yaml(path))
        if host.name in seen:
            raise InventoryError(
                f"{display_path(path)}: field 'name': duplicate name {host.name!r} (also in {display_path(seen[host.name])})"
            )
        seen[host.name] = path
        _check_host(path, host, inv.specs, hosts_dir)
        inv.hosts[host.name] = host
    return inv


def host_path(hosts_dir: Path, name: str) -> Path:
    if not SAFE_NAME.match(name):
        raise InventoryError(f"host name {name[:MAX_SHOWN]!r} is not a safe identifier")
    for suffix in (".yaml", ".yml"):
        p = Path(hosts_dir) / f"{name}{suffix}"
        if p.is_file():
            return p
    raise InventoryError(f"{display_path(Path(hosts_dir))}: no host named {name!r} (no {name}.yaml)")


def load_host(hosts_dir: Path, name: str) -> Host:
    """One host, validated against the folder's spec sheets."""
    path = host_path(hosts_dir, name)
    host = _model(Host, path, _read_yaml(path))
    _check_host(path, host, load_specs(Path(hosts_dir)), Path(hosts_dir))
    return host


def _lock(hosts_dir: Path, name: str) -> FileLock:
    d = Path(hosts_dir) / LOCK_DIR
    d.mkdir(exist_ok=True)
    return FileLock(str(d / f"{name}.lock"), timeout=30)


def _atomic_write(path: Path, data: Any) -> None:
    buf = io.StringIO()
    _yaml().dump(data, buf)
    atomic_write_bytes(path, buf.getvalue().encode("utf-8"))


def _to_yaml_value(v: Any) -> Any:
    if isinstance(v, Enum):  # a StrEnum (a probe outcome as the retired reason): YAML holds its plain value
        return v.value
    if isinstance(v, datetime):
        return v.astimezone(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")
    return v


def update_host(hosts_dir: Path, name: str, **changes: Any) -> Host:
    """Change fields of one host file in place: validated, atomic, comments and order kept."""
    path = host_path(hosts_dir, name)
    unknown = sorted(set(changes) - set(Host.model_fields))
    if unknown:
        raise InventoryError(f"{display_path(path)}: field '{unknown[0]}': unknown field")
    with _lock(hosts_dir, name):
        data = _read_yaml(path)
        if not isinstance(data, dict):
            raise InventoryError(f"{display_path(path)}: expected a mapping of fields")
        for k, v in changes.items():
            data[k] = _to_yaml_value(v)
        host = _model(Host, path, data)
        _check_host(path, host, load_specs(Path(hosts_dir)), Path(hosts_dir))
        _atomic_write(path, data)
    return host


def write_new_host(hosts_dir: Path, host: Host) -> Path:
    """Create the file for a new host; refuses to overwrite an existing one."""
    path = Path(hosts_dir) / f"{host.name}.yaml"
    with _lock(hosts_dir, host.name):
        if path.exists() or path.with_suffix(".yml").exists():
            raise InventoryError(f"{display_path(path)}: host {host.name!r} already exists")
        _check_host(path, host, load_specs(Path(hosts_dir)), Path(hosts_dir))
        _atomic_write(path, {k: _to_yaml_value(v) for k, v in host.model_dump().items()})
    return path


def now() -> datetime:
    return datetime.now(timezone.utc).replace(microsecond=0)


def retire(hosts_dir: Path, name: str, reason: RetiredReason, **extra: Any) -> Host:
    """Mark a host retired with its reason and time (extra: e.g. presented_host_key_fingerprint)."""
    return update_host(hosts_dir, name, status="retired", retired_reason=reason, retired_at=now(), **extra)


def activate(hosts_dir: Path, name: str) -> Host:
    """Back into service: clears the retirement fields and the unreachable counter."""
    return update_host(
        hosts_dir, name, status="active", retired_reason=None, retired_at=None,
        presented_host_key_fingerprint=None, unreachable_runs=0,
    )


def host_status_text(base: str, current: str, where: str) -> str:
    """`base` (a host file's text) with only its STATUS_FIELDS taken from `current`; unchanged
    text when they already agree. What a notes commit records of a host file."""
    old, new = parse_yaml(base, where), parse_yaml(current, where)
    if not isinstance(old, dict) or not isinstance(new, dict):
        raise InventoryError(f"{where}: expected a mapping of fields")
    if all(old.get(f) == new.get(f) and (f in old) == (f in new) for f in STATUS_FIELDS):
        return base
    for f in STATUS_FIELDS:
        if f not in new:
            old.pop(f, None)
        elif f not in old or old[f] != new[f]:
            old[f] = new[f]
    out = io.StringIO()
    _yaml().dump(old, out)
    return out.getvalue()
