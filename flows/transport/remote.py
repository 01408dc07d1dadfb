"""SSH transport: pinned host keys only, every remote command quoted and bounded twice.

Trust comes from the inventory alone: the paramiko client starts with an empty key store and a
RejectPolicy that accepts exactly the host's pinned keys (any of them, several of one type too),
with the host-key algorithms narrowed to the pinned types; no ~/.ssh/config, no agent and no default
key search. Failures are classified into the few outcomes the flows route on, so a reprovisioned
or revoked machine is told apart from one that is merely down.

Commands and transfers go through a Fabric `Connection` handed that authenticated client (it never
opens one of its own, and loads no SSH or Fabric config files). Everything a host sends is bounded:
invoke's Runner keeps every chunk of output in a list and joins the whole list for its watchers on
each chunk (memory and time grow with the output), so `_BoundedRunner` replaces its two output
handlers with `_Capture`, which splits lines in linear time, cuts overlong lines and keeps only
the tail; invoke's own timer enforces the local deadline however much the host prints, and its
kill first kills the remote process group. SFTP transfers have a size cap and a deadline.
"""

from __future__ import annotations

import codecs
import logging
import os
import re
import shlex
import socket
import time
from collections import deque
from pathlib import Path
from typing import IO, Any, Callable, Literal, Mapping, Sequence

import fabric
import fabric.runners
import invoke
import paramiko
from pydantic import BaseModel

from engine.schema import loads_untrusted, sha256_file
from flows.inventory.files import Host, InventoryError, display_path, fingerprint, load_specs, parse_public_key

Outcome = Literal["ok", "unauthorized", "host_key_changed", "host_key_unknown", "unreachable", "timeout"]

# timeout(1) exits 124 when it stopped the command, 137 (128+KILL) when -k had to kill it.
_TIMEOUT_RCS = (124, 137)
# paramiko's transport thread logs handshake failures (with tracebacks) that we classify and
# report ourselves; its records go to this logger, silent unless someone attaches a handler.
_PARAMIKO_LOG = "flows.transport.remote.paramiko"
logging.getLogger(_PARAMIKO_LOG).addHandler(logging.NullHandler())
logging.getLogger(_PARAMIKO_LOG).propagate = False
KILL_AFTER_S = 10
_LOCAL_GRACE_S = 5.0
# What one command's output may cost the controller: lines are cut at MAX_LINE characters, and
# each stream keeps its last MAX_KEPT characters (a marker says how many earlier ones were dropped).
MAX_LINE = 64 * 1024
MAX_KEPT = 4 * 1024 * 1024
# SFTP: a file over the cap is refused (before it is fetched, or as soon as it grows past it), and
# a transfer that outlasts its deadline, or stalls for Timeouts.command, is stopped.
MAX_TRANSFER_BYTES = 1 << 30
TRANSFER_S = 600.0
# The wrapper shell reports its pid (the remote process group, once timeout(1) leads it) on stderr.
_PGID = "KDBENCH_PGID "
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")


class Timeouts(BaseModel):
    """Seconds allowed for each stage; `command` bounds the probe's fact-finding command."""

    connect: float = 5
    banner: float = 5
    auth: float = 5
    command: float = 30


class ProbeResult(BaseModel):
    host: str
    outcome: Outcome
    detail: str
    elapsed_s: float
    pinned_fingerprints: list[str]
    presented_fingerprint: str | None = None
    facts: dict[str, Any] = {}
    mismatches: list[str] = []


class RemoteError(Exception):
    """A connection or remote-command failure; `outcome` says which kind when connecting failed."""

    def __init__(self, message: str, outcome: Outcome | None = None, presented_fingerprint: str | None = None):
        super().__init__(message)
        self.outcome = outcome
        self.presented_fingerprint = presented_fingerprint


class TransferError(RemoteError):
    """One SFTP transfer refused or stopped (over the size cap, stalled, past its deadline); the
    connection itself may still be good, so a caller can skip that file and go on."""


class RunResult(BaseModel):
    rc: int
    stdout: str
    stderr: str
    timed_out: bool
    elapsed_s: float


def refuse_placeholder(host: Host, hosts_dir: Path) -> None:
    """Stop before any network activity while the shipped placeholder address is still there."""
    if host.is_placeholder():
        path = display_path(Path(hosts_dir) / f"{host.name}.yaml")
        raise InventoryError(
            f"{path}: field 'address': {host.address!r} is a placeholder; "
            f"edit {path} and set the host's real address before contacting it"
        )


def _connect(host: Host, hosts_dir: Path, timeouts: Timeouts) -> paramiko.SSHClient:
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
            "host_key_changed", got,
        ) from None
    except paramiko.AuthenticationException as e:
        client.close()
        if "timeout" in str(e).lower():
            raise RemoteError(f"no answer to authentication within {timeouts.auth:g} s", "timeout") from None
        raise RemoteError("the host refused the client key", "unauthorized") from None
    except (socket.timeout, TimeoutError):
        client.close()
        raise RemoteError(f"no TCP answer within {timeouts.connect:g} s", "unreachable") from None
    except socket.gaierror:
        client.close()
        raise RemoteError("address not resolved", "unreachable") from None
    except paramiko.ssh_exception.NoValidConnectionsError:
        client.close()
        raise RemoteError("connection refused or no route to host", "unreachable") from None
    except paramiko.SSHException as e:
        msg = str(e).lower()
        t = client.get_transport()
        presented = fingerprint(t.get_remote_server_key()) if t is not None and t.host_key is not None else None
        spoke = t is not None and bool(t.remote_version)
        client.close()
        if "not found in known_hosts" in msg:
            raise RemoteError(
                f"no pinned host key; presented {presented} (pin it with `kdbench hosts trust {host.name}`)",
                "host_key_unknown", presented,
            ) from None
        if "no acceptable host key" in msg or "incompatible ssh peer" in msg:
            raise RemoteError("the host offers none of the pinned key types", "host_key_changed") from None
        if t is None:
            raise RemoteError(f"SSH connection failed: {e}", "unreachable") from None
        # TCP was accepted: silence before the banner, key exchange or authentication finished.
        stage = "SSH banner" if not spoke else ("key exchange" if presented is None else "authentication")
        limit = timeouts.banner if not spoke else timeouts.auth
        raise RemoteError(f"TCP accepted but no {stage} within {limit:g} s", "timeout") from None
    except (OSError, EOFError) as e:
        client.close()
        why = getattr(e, "strerror", None) or type(e).__name__
        raise RemoteError(f"network error: {why}", "unreachable") from None


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


def remote_command(argv: Sequence[str], *, timeout_s: float, cwd: str | None = None,
                   env: Mapping[str, str] | None = None) -> str:
    """The shell line run on the host: every value quoted, bounded by timeout(1) -k.

    The shell first prints its pid on stderr, then execs timeout(1) (same pid), which leads its
    own process group: that is the group the local deadline kills."""
    if not argv:
        raise ValueError("empty command")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive (got {timeout_s})")
    parts: list[str] = []
    if cwd is not None:
        parts += ["cd", "--", shlex.quote(cwd), "&&"]
    parts += ["echo", f'"{_PGID}$$"', ">&2", "&&", "exec"]
    if env:
        parts.append("env")
        for k, v in env.items():
            if not _ENV_NAME.match(k):
                raise ValueError(f"bad environment variable name {k!r}")
            parts.append(f"{k}={shlex.quote(v)}")
    # Plain decimal seconds: timeout(1) does not read exponents such as 1e+06.
    parts += ["timeout", "-k", str(KILL_AFTER_S), f"{timeout_s:.3f}".rstrip("0").rstrip(".")]
    parts += [shlex.quote(a) for a in argv]
    return " ".join(parts)


class _Capture:
    """One output stream of a command: whole lines to `emit` as they arrive, the tail kept for the result.

    Linear in the input: each chunk is scanned once for newlines, a line in progress is held as a
    list of pieces capped at `max_line` characters (the rest is counted, not kept), and finished
    lines are kept in a queue trimmed from the front to `max_kept` characters. With `control`, the
    first line starting with it (before any other such line) is taken as the wrapper shell's pid.
    """

    def __init__(self, emit: Callable[[str], None] | None, *, max_line: int = MAX_LINE,
                 max_kept: int = MAX_KEPT, control: str | None = None):
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._emit, self._max_line, self._max_kept, self._control = emit, max_line, max_kept, control
        self._part: list[str] = []
        self._part_len = 0
        self._cut = 0
        self._kept: deque[str] = deque()
        self._kept_len = 0
        self.dropped = 0  # characters of finished lines no longer kept
        self.pgid: int | None = None

    def feed(self, data: bytes, final: bool = False) -> None:
        s = self._dec.decode(data, final)
        start = 0
        while (i := s.find("\n", start)) >= 0:
            self._add(s, start, i)
            self._end_line("\n")
            start = i + 1
        self._add(s, start, len(s))
        if final and (self._part_len or self._cut):
            self._end_line("")

    def _add(self, s: str, start: int, stop: int) -> None:
        room = self._max_line - self._part_len
        take = min(room, stop - start)
        if take > 0:
            self._part.append(s[start:start + take])
            self._part_len += take
        self._cut += (stop - start) - max(take, 0)

    def _end_line(self, newline: str) -> None:
        line = "".join(self._part)
        if self._cut:
            line += f" [kdbench: {self._cut} more characters of this line cut]"
        self._part, self._part_len, self._cut = [], 0, 0
        if self._control is not None and self.pgid is None and line.startswith(self._control):
            pid = line[len(self._control):]
            if pid.isdigit() and 1 < int(pid) < 1 << 22:
                self.pgid = int(pid)
                return
        if self._emit:
            self._emit(line)
        self._kept.append(line + newline)
        self._kept_len += len(line) + len(newline)
        while self._kept_len > self._max_kept and len(self._kept) > 1:
            gone = self._kept.popleft()
            self._kept_len -= len(gone)
            self.dropped += len(gone)

    @property
    def text(self) -> str:
        head = f"[kdbench: {self.dropped} earlier characters of output dropped]\n" if self.dropped else ""
        return head + "".join(self._kept)


class _BoundedRunner(fabric.runners.Remote):
    """Fabric's remote runner with bounded output and a deadline that also kills the remote group.

    invoke's output handlers append every chunk to a list and join the whole list on each chunk;
    these feed `_Capture`s instead, so what a host prints costs bounded memory and linear time.
    """

    read_chunk_size = 65536

    def run(self, command: str, *, captures: tuple[_Capture, _Capture], **kwargs: Any) -> Any:
        self._captures, self._killed = captures, False
        return super().run(command, **kwargs)

    @property
    def timed_out(self) -> bool:
        """invoke asks whether its timer thread has ended; that thread runs `kill`, whose closing of
        the channel lets the command return while it may still be running: the kill is the answer."""
        return self._killed or super().timed_out

    def _pump(self, read: Callable[[int], bytes], capture: _Capture) -> None:
        while data := read(self.read_chunk_size):
            capture.feed(data)
        capture.feed(b"", final=True)

    def handle_stdout(self, buffer_: list[str], hide: bool, output: IO) -> None:
        self._pump(self.read_proc_stdout, self._captures[0])

    def handle_stderr(self, buffer_: list[str], hide: bool, output: IO) -> None:
        self._pump(self.read_proc_stderr, self._captures[1])

    def kill(self) -> None:
        """invoke's timer calls this at the local deadline: kill the remote process group (which
        timeout(1) should have done already), then close the channel."""
        self._killed = True
        pgid = self._captures[1].pgid
        if pgid is not None:
            try:
                chan = self.context.transport.open_session(timeout=_LOCAL_GRACE_S)
                chan.exec_command(f"env kill -KILL -- -{pgid:d}")
                chan.status_event.wait(_LOCAL_GRACE_S)
                chan.close()
            except (paramiko.SSHException, OSError, EOFError):
                pass  # closing the channel below is all that is left
        super().kill()


def _fabric_connection(host: Host, client: paramiko.SSHClient) -> fabric.Connection:
    """A Fabric Connection over our authenticated client: it loads no SSH or Fabric config
    files, forwards no agent and never opens a client of its own (the one it makes is dropped)."""
    config = fabric.Config(ssh_config=paramiko.SSHConfig(), lazy=True,
                           overrides={"load_ssh_configs": False, "runners": {"remote": _BoundedRunner}})
    conn = fabric.Connection(host.address, user=host.user, port=host.port, config=config,
                             gateway=False, forward_agent=False)
    conn.client, conn.transport = client, client.get_transport()
    return conn


class _CappedWriter:
    """A file-like sink for SFTP downloads that stops past the size cap or the deadline."""

    def __init__(self, f: IO[bytes], limit: int, deadline: float, what: str):
        self._f, self._limit, self._deadline, self._what, self.n = f, limit, deadline, what, 0

    def write(self, data: bytes) -> int:
        self.n += len(data)
        if self.n > self._limit:
            raise TransferError(f"{self._what}: over the {self._limit}-byte cap")
        if time.monotonic() > self._deadline:
            raise TransferError(f"{self._what}: transfer took too long")
        return self._f.write(data)


class _DeadlineReader:
    """A file-like source for SFTP uploads that stops past the deadline (the rest is the file's)."""

    def __init__(self, f: IO[bytes], deadline: float, what: str):
        self._f, self._deadline, self._what = f, deadline, what

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def read(self, n: int = -1) -> bytes:
        if time.monotonic() > self._deadline:
            raise TransferError(f"{self._what}: transfer took too long")
        return self._f.read(n)


class Remote:
    """A connection to one host: `with Remote(host, hosts_dir) as r: r.run([...], timeout_s=60)`."""

    def __init__(self, host: Host, hosts_dir: Path, timeouts: Timeouts = Timeouts()):
        self.host = host
        self.hosts_dir = Path(hosts_dir)
        self.timeouts = timeouts
        self._conn: fabric.Connection | None = None

    def connect(self) -> "Remote":
        """Open the connection; RemoteError(outcome=...) when the host is not `ok`."""
        self._conn = _fabric_connection(self.host, _connect(self.host, self.hosts_dir, self.timeouts))
        return self

    def __enter__(self) -> "Remote":
        return self.connect()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn.client.close()  # Fabric skips it once the transport has died
            self._conn = None

    def _connection(self) -> fabric.Connection:
        if self._conn is None or not self._conn.is_connected:
            raise RemoteError("not connected")
        return self._conn

    def presented_key(self) -> paramiko.PKey:
        return self._connection().transport.get_remote_server_key()

    def run(self, argv: Sequence[str], *, timeout_s: float, cwd: str | None = None,
            env: Mapping[str, str] | None = None, on_line: Callable[[str], None] | None = None) -> RunResult:
        """Run argv on the host; lines of stdout and stderr go to on_line as they arrive.

        Bounded twice: timeout(1) on the host kills the command's process group, and a local
        deadline (remote bound + kill grace + slack) kills that group and closes the channel,
        however much or little the host prints meanwhile. Output is bounded as `_Capture` says.
        """
        command = remote_command(argv, timeout_s=timeout_s, cwd=cwd, env=env)
        out, err = _Capture(on_line), _Capture(on_line, control=_PGID)
        start = time.monotonic()
        local_timeout = False
        lost = (paramiko.SSHException, OSError, EOFError)
        try:
            res = self._connection().run(command, captures=(out, err),
                                         timeout=timeout_s + KILL_AFTER_S + _LOCAL_GRACE_S,
                                         warn=True, hide=True, echo=False, pty=False, in_stream=False)
            rc = res.exited
        except invoke.CommandTimedOut:
            local_timeout, rc = True, -1
        except invoke.ThreadException as e:  # raised in a reader thread: the channel, or on_line
            real = e.exceptions[0].value
            if not isinstance(real, lost):
                raise real from None
            raise RemoteError(f"connection to {self.host.name} failed during a command: "
                              f"{type(real).__name__}") from None
        except lost as e:
            raise RemoteError(f"connection to {self.host.name} failed: {type(e).__name__}") from None
        return RunResult(
            rc=rc if rc is not None else -1, stdout=out.text, stderr=err.text,
            timed_out=local_timeout or rc in _TIMEOUT_RCS, elapsed_s=round(time.monotonic() - start, 3),
        )

    def _sftp(self) -> paramiko.SFTPClient:
        return self._connection().sftp()

    def _reset_sftp(self) -> None:
        """A transfer stopped half-way leaves its SFTP session with requests in flight: drop it
        (Fabric memoizes one per Connection) so the next transfer gets a fresh one."""
        conn = self._connection()
        if conn._sftp is not None:
            conn._sftp.close()
            conn._sftp = None

    def size(self, remote_path: str) -> int | None:
        """The file's size on the host; None when there is no such file."""
        try:
            return self._sftp().stat(remote_path).st_size
        except FileNotFoundError:
            return None

    def sha256(self, remote_path: str) -> str | None:
        """The file's sha256 computed on the host; None when there is no such file."""
        if self.size(remote_path) is None:
            return None
        res = self.run(["sha256sum", "--", remote_path], timeout_s=self.timeouts.command)
        if res.rc != 0 or not res.stdout:
            raise TransferError(f"sha256sum failed on {self.host.name} (rc {res.rc}): {res.stderr.strip()[-500:]}")
        # sha256sum escapes odd names with a leading backslash; the digest is still the first field.
        return res.stdout.split()[0].lstrip("\\")

    def put(self, local: Path, remote_path: str, *, max_bytes: int = MAX_TRANSFER_BYTES,
            timeout_s: float = TRANSFER_S) -> str:
        """Upload then verify on the host; the file appears under its name only when it matches."""
        local = Path(local)
        size = local.stat().st_size
        if size > max_bytes:
            raise TransferError(f"{local.name}: {size} bytes, over the {max_bytes}-byte cap")
        want = sha256_file(local)
        tmp = f"{remote_path}.part-{os.getpid()}"
        sftp = self._sftp()
        sftp.get_channel().settimeout(self.timeouts.command)  # a stall
        try:
            with local.open("rb") as f:
                self._connection().put(_DeadlineReader(f, time.monotonic() + timeout_s, local.name), tmp)
        except (TransferError, socket.timeout, TimeoutError) as e:
            self._reset_sftp()
            why = str(e) or type(e).__name__
            raise TransferError(f"upload of {local.name} to {self.host.name} stopped: {why}") from None
        got = self.sha256(tmp)
        if got != want:
            self._sftp().remove(tmp)
            raise RemoteError(f"upload to {self.host.name} corrupted: sha256 {got} != {want}")
        self._sftp().posix_rename(tmp, remote_path)
        return want

    def get(self, remote_path: str, local: Path, *, max_bytes: int = MAX_TRANSFER_BYTES,
            timeout_s: float = TRANSFER_S) -> str:
        """Download then verify locally against the digest the host computed.

        A file over `max_bytes` is refused before anything is fetched (and stopped if it grows past
        the cap meanwhile); TransferError says so, or that the transfer stalled or ran too long."""
        local = Path(local)
        name = remote_path.rsplit("/", 1)[-1]
        size = self.size(remote_path)
        if size is None:
            raise TransferError(f"{self.host.name}: no such file {name!r}")
        if size > max_bytes:
            raise TransferError(f"{name}: {size} bytes on the host, over the {max_bytes}-byte cap (not fetched)")
        want = self.sha256(remote_path)
        if want is None:
            raise TransferError(f"{self.host.name}: no such file {name!r}")
        tmp = local.with_name(f".{local.name}.part-{os.getpid()}")
        self._sftp().get_channel().settimeout(self.timeouts.command)  # a stall
        try:
            with tmp.open("wb") as f:
                self._connection().get(remote_path, _CappedWriter(f, max_bytes, time.monotonic() + timeout_s, name))
        except (TransferError, socket.timeout, TimeoutError) as e:
            tmp.unlink(missing_ok=True)
            self._reset_sftp()
            why = str(e) or type(e).__name__
            raise TransferError(f"download of {name} stopped: {why}") from None
        got = sha256_file(tmp)
        if got != want:
            tmp.unlink(missing_ok=True)
            raise TransferError(f"download from {self.host.name} corrupted: sha256 {got} != {want}")
        os.replace(tmp, local)
        return want


# One small program, run with the host's own python, reports what the host really has.
_FACTS = r"""
import json, os, shutil, subprocess, sys
from importlib import metadata
f = {"python": sys.version.split()[0]}
for m in ("torch", "triton"):
    try:
        f[m] = metadata.version(m)
    except Exception:
        f[m] = None
d = sys.argv[1]
while d and not os.path.isdir(d):
    d = os.path.dirname(d.rstrip("/")) or "."
f["work_dir_exists"] = os.path.isdir(sys.argv[1])
f["disk_free_gb"] = round(shutil.disk_usage(d or ".").free / 1e9, 1)
f["nvidia_smi"] = None
if shutil.which("nvidia-smi"):
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,compute_cap",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        f["nvidia_smi"] = r.stdout[:20000] if r.returncode == 0 else None
    except Exception:
        pass
print("KDBENCH_FACTS " + json.dumps(f))
"""

_CAP_TO_ARCH = {"9.0": "sm_90", "10.0": "sm_100", "10.3": "sm_103", "12.0": "sm_120"}


def _parse_facts(stdout: str) -> dict[str, Any]:
    """Facts from the host's output, validated: wrong types become None, never an exception."""
    raw: dict[str, Any] = {}
    for line in stdout.splitlines():
        if line.startswith("KDBENCH_FACTS "):
            raw = loads_untrusted(line.removeprefix("KDBENCH_FACTS "))
    if not isinstance(raw, dict):
        raw = {}

    def s(v: Any) -> str | None:
        return v[:200] if isinstance(v, str) else None

    facts: dict[str, Any] = {
        "python": s(raw.get("python")), "torch": s(raw.get("torch")), "triton": s(raw.get("triton")),
        "disk_free_gb": raw.get("disk_free_gb") if isinstance(raw.get("disk_free_gb"), (int, float)) else None,
        "work_dir_exists": raw.get("work_dir_exists") is True,
        "gpu_names": [], "gpu_count": 0, "driver": None, "arch_found": "cpu",
    }
    smi = raw["nvidia_smi"][:20000] if isinstance(raw.get("nvidia_smi"), str) else ""
    caps: set[str] = set()
    for row in smi.splitlines():
        cols = [c.strip() for c in row.split(",")]
        if len(cols) != 3 or not cols[0]:
            continue
        facts["gpu_names"].append(cols[0][:100])
        facts["driver"] = cols[1][:50]
        caps.add(cols[2][:10])
    facts["gpu_count"] = len(facts["gpu_names"])
    if caps:
        archs = sorted({_CAP_TO_ARCH.get(c, f"compute_cap {c}") for c in caps})
        facts["arch_found"] = archs[0] if len(archs) == 1 else ",".join(archs)
    return facts


def _mismatches(host: Host, facts: dict[str, Any], gpu_model: str | None) -> list[str]:
    out = []
    if facts["arch_found"] != host.arch:
        out.append(f"arch: inventory says {host.arch}, host has {facts['arch_found']}")
    if facts["gpu_count"] != host.gpus:
        out.append(f"gpus: inventory says {host.gpus}, host has {facts['gpu_count']}")
    if gpu_model and host.gpus and facts["gpu_names"]:
        others = sorted({n for n in facts["gpu_names"] if gpu_model.lower() not in n.lower()})
        if others:
            out.append(f"gpu: spec says {gpu_model}, host has {', '.join(others)}")
    if facts["python"] is None:
        out.append(f"python: {host.python!r} did not run on the host")
    elif facts["torch"] is None:
        out.append("torch: not installed for the host's python")
    if facts["python"] is not None and not facts["work_dir_exists"]:
        out.append("work_dir: does not exist yet")
    return out


def probe(host: Host, hosts_dir: Path, timeouts: Timeouts = Timeouts()) -> ProbeResult:
    """Connect with the pinned keys, classify the outcome, and on `ok` read the host's facts."""
    start = time.monotonic()
    pinned = host.fingerprints()

    def result(outcome: Outcome, detail: str, presented: str | None = None, **kw: Any) -> ProbeResult:
        return ProbeResult(
            host=host.name, outcome=outcome, detail=detail, elapsed_s=round(time.monotonic() - start, 3),
            pinned_fingerprints=pinned, presented_fingerprint=presented, **kw,
        )

    remote = Remote(host, hosts_dir, timeouts)
    try:
        remote.connect()
        presented = fingerprint(remote.presented_key())
        try:
            res = remote.run([host.python, "-c", _FACTS, host.work_dir], timeout_s=timeouts.command)
        except (RemoteError, paramiko.SSHException, OSError, EOFError) as e:
            return result("timeout", f"no answer to the fact-finding command: {type(e).__name__}", presented)
        if res.timed_out:
            return result("timeout", f"fact-finding command took over {timeouts.command:g} s", presented)
    except RemoteError as e:
        return result(e.outcome or "unreachable", str(e), e.presented_fingerprint)
    finally:
        remote.close()
    facts = _parse_facts(res.stdout)
    spec = load_specs(Path(hosts_dir)).get(host.spec)
    mismatches = _mismatches(host, facts, spec.gpu if spec and host.arch != "cpu" else None)
    detail = "connected" + (f"; {len(mismatches)} mismatch(es) with the inventory" if mismatches else "")
    return result("ok", detail, presented, facts=facts, mismatches=mismatches)


def fetch_host_key(host: Host, hosts_dir: Path, timeouts: Timeouts = Timeouts()) -> paramiko.PKey:
    """The key the host presents, read without authenticating (for `hosts trust` only)."""
    refuse_placeholder(host, hosts_dir)
    try:
        sock = socket.create_connection((host.address, host.port), timeout=timeouts.connect)
    except socket.gaierror:
        raise RemoteError("address not resolved", "unreachable") from None
    except (socket.timeout, TimeoutError):
        raise RemoteError(f"no TCP answer within {timeouts.connect:g} s", "unreachable") from None
    except OSError:
        raise RemoteError("connection refused or no route to host", "unreachable") from None
    t = paramiko.Transport(sock)
    t.set_log_channel(_PARAMIKO_LOG)
    t.banner_timeout = timeouts.banner
    try:
        t.start_client(timeout=timeouts.banner)
        return t.get_remote_server_key()
    except (paramiko.SSHException, EOFError, OSError):
        raise RemoteError(f"TCP accepted but no SSH answer within {timeouts.banner:g} s", "timeout") from None
    finally:
        t.close()
