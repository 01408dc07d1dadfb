"""SSH connections that trust the inventory alone: pinned host keys only, failures classified.

The paramiko client starts with an empty key store and a RejectPolicy that accepts exactly the host's
pinned keys (any of them, several of one type too), with the host-key algorithms narrowed to the pinned
types; no ~/.ssh/config, no agent and no default key search. Failures are classified into the few
outcomes the flows route on (`ProbeOutcome`), so a reprovisioned or revoked machine is told apart from
one that is merely down.
"""

from __future__ import annotations

import logging
import socket
from enum import StrEnum
from pathlib import Path
from typing import Sequence

import paramiko
from pydantic import BaseModel

from flows.inventory.files import display_path
from flows.inventory.hosts import Host, InventoryError
from flows.inventory.keys import fingerprint, parse_public_key


class ProbeOutcome(StrEnum):
    """What contacting a host came to: the flows route on it (a StrEnum: stored and logged as its value)."""

    OK = "ok"
    UNAUTHORIZED = "unauthorized"
    HOST_KEY_CHANGED = "host_key_changed"
    HOST_KEY_UNKNOWN = "host_key_unknown"
    UNREACHABLE = "unreachable"
    TIMEOUT = "timeout"


# paramiko's transport thread logs handshake failures (with tracebacks) that we classify and
# report ourselves; its records go to this logger, silent unless someone attaches a handler.
_PARAMIKO_LOG = f"{__name__}.paramiko"
logging.getLogger(_PARAMIKO_LOG).addHandler(logging.NullHandler())
logging.getLogger(_PARAMIKO_LOG).propagate = False


class Timeouts(BaseModel):
    """Seconds allowed for each stage; `command` bounds the probe's fact-finding command."""

    connect: float = 5
    banner: float = 5
    auth: float = 5
    command: float = 30


class RemoteError(Exception):
    """A connection or remote-command failure; `outcome` says which kind when connecting failed."""

    def __init__(self, message: str, outcome: ProbeOutcome | None = None, presented_fingerprint: str | None = None):
        super().__init__(message)
        self.outcome = outcome
        self.presented_fingerprint = presented_fingerprint


def refuse_placeholder(host: Host, hosts_dir: Path) -> None:
    """Stop before any network activity while the shipped placeholder address is still there."""
    if host.is_placeholder():
        path = display_path(Path(hosts_dir) / f"{host.name}.yaml")
        raise InventoryError(
            f"{path}: field 'address': {host.address!r} is a placeholder; "
            f"edit {path} and set the host's real address before contacting it"
        )


def connect_client(host: Host, hosts_dir: Path, timeouts: Timeouts) -> paramiko.SSHClient:
    """An authenticated client trusting only the pinned keys; RemoteError(outcome=...) otherwise."""
    refuse_placeholder(host, hosts_dir)
    where = display_path(Path(hosts_dir) / f"{host.name}.yaml")
    key_path = host.key_path(hosts_dir)
    if not key_path.is_file():
        raise InventoryError(f"{where}: field 'key_file': file not found")
    try:
        pkey = paramiko.PKey.from_path(key_path)
    except (paramiko.SSHException, ValueError, OSError) as e:
        raise InventoryError(f"{where}: field 'key_file': not a usable private key ({type(e).__name__})") from None
    pinned = [parse_public_key(line) for line in host.host_keys]
    client = paramiko.SSHClient()
    client.set_log_channel(_PARAMIKO_LOG)
    client.set_missing_host_key_policy(_PinnedOnly(pinned))
    try:
        client.connect(
            host.address, port=host.port, username=host.user, pkey=pkey,
            allow_agent=False, look_for_keys=False, timeout=timeouts.connect,
            banner_timeout=timeouts.banner, auth_timeout=timeouts.auth, channel_timeout=timeouts.connect,
            disabled_algorithms={"keys": _unpinned_algorithms(pinned)},
        )
        return client
    except paramiko.BadHostKeyException as e:
        client.close()
        got = fingerprint(e.key)
        raise RemoteError(
            f"presented host key {got} does not match the pinned key(s) {', '.join(host.fingerprints())}",
            ProbeOutcome.HOST_KEY_CHANGED, got,
        ) from None
    except paramiko.AuthenticationException as e:
        client.close()
        if "timeout" in str(e).lower():
            raise RemoteError(f"no answer to authentication within {timeouts.auth:g} s", ProbeOutcome.TIMEOUT) from None
        raise RemoteError("the host refused the client key", ProbeOutcome.UNAUTHORIZED) from None
    except (socket.timeout, TimeoutError):
        client.close()
        raise RemoteError(f"no TCP answer within {timeouts.connect:g} s", ProbeOutcome.UNREACHABLE) from None
    except socket.gaierror:
        client.close()
        raise RemoteError("address not resolved", ProbeOutcome.UNREACHABLE) from None
    except paramiko.ssh_exception.NoValidConnectionsError:
        client.close()
        raise RemoteError("connection refused or no route to host", ProbeOutcome.UNREACHABLE) from None
    except paramiko.SSHException as e:
        msg = str(e).lower()
        t = client.get_transport()
        presented = fingerprint(t.get_remote_server_key()) if t is not None and t.host_key is not None else None
        spoke = t is not None and bool(t.remote_version)
        client.close()
        if "not found in known_hosts" in msg:
            raise RemoteError(
                f"no pinned host key; presented {presented} (pin it with `kdbench hosts trust {host.name}`)",
                ProbeOutcome.HOST_KEY_UNKNOWN, presented,
            ) from None
        if "no acceptable host key" in msg or "incompatible ssh peer" in msg:
            raise RemoteError("the host offers none of the pinned key types", ProbeOutcome.HOST_KEY_CHANGED) from None
        if t is None:
            raise RemoteError(f"SSH connection failed: {e}", ProbeOutcome.UNREACHABLE) from None
        # TCP was accepted: silence before the banner, key exchange or authentication finished.
        stage = "SSH banner" if not spoke else ("key exchange" if presented is None else "authentication")
        limit = timeouts.banner if not spoke else timeouts.auth
        raise RemoteError(f"TCP accepted but no {stage} within {limit:g} s", ProbeOutcome.TIMEOUT) from None
    except (OSError, EOFError) as e:
        client.close()
        why = getattr(e, "strerror", None) or type(e).__name__
        raise RemoteError(f"network error: {why}", ProbeOutcome.UNREACHABLE) from None


class _PinnedOnly(paramiko.RejectPolicy):
    """The client's key store stays empty, so every presented key comes here: one equal to any
    pinned key is accepted, anything else rejected (as a changed key when some key is pinned).

    paramiko's store holds one key per type, so several pinned keys of one type would otherwise
    come down to the last one added."""

    def __init__(self, pinned: Sequence[paramiko.PKey]):
        self.pinned = list(pinned)

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        if any(key == p for p in self.pinned):
            return
        if self.pinned:
            raise paramiko.BadHostKeyException(hostname, key, self.pinned[0])
        super().missing_host_key(client, hostname, key)


def _unpinned_algorithms(pinned: Sequence[paramiko.PKey]) -> list[str]:
    """Host-key algorithms of types nothing is pinned for, so the host presents a pinned type."""
    if not pinned:
        return []
    names = {k.get_name() for k in pinned}
    if "ssh-rsa" in names:
        names |= {"rsa-sha2-512", "rsa-sha2-256"}
    return [a for a in paramiko.Transport._preferred_keys if a not in names]


def fetch_host_key(host: Host, hosts_dir: Path, timeouts: Timeouts = Timeouts()) -> paramiko.PKey:
    """The key the host presents, read without authenticating (for `hosts trust` only)."""
    refuse_placeholder(host, hosts_dir)
    try:
        sock = socket.create_connection((host.address, host.port), timeout=timeouts.connect)
    except socket.gaierror:
        raise RemoteError("address not resolved", ProbeOutcome.UNREACHABLE) from None
    except (socket.timeout, TimeoutError):
        raise RemoteError(f"no TCP answer within {timeouts.connect:g} s", ProbeOutcome.UNREACHABLE) from None
    except OSError:
        raise RemoteError("connection refused or no route to host", ProbeOutcome.UNREACHABLE) from None
    t = paramiko.Transport(sock)
    t.set_log_channel(_PARAMIKO_LOG)
    t.banner_timeout = timeouts.banner
    try:
        t.start_client(timeout=timeouts.banner)
        return t.get_remote_server_key()
    except (paramiko.SSHException, EOFError, OSError):
        raise RemoteError(f"TCP accepted but no SSH answer within {timeouts.banner:g} s", ProbeOutcome.TIMEOUT) from None
    finally:
        t.close()
