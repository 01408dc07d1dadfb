"""Commands and transfers on a connected host: every remote command quoted and bounded twice.

Commands and transfers go through a Fabric `Connection` handed the authenticated client of
flows.transport.connect (it never opens one of its own, and loads no SSH or Fabric config files).
Everything a host sends is bounded: invoke's Runner keeps every chunk of output in a list and joins the
whole list for its watchers on each chunk (memory and time grow with the output), so `_BoundedRunner`
replaces its two output handlers with `_Capture`, which splits lines in linear time, cuts overlong lines
and keeps only the tail; invoke's own timer enforces the local deadline however much the host prints,
and its kill first kills the remote process group. SFTP transfers have a size cap and a deadline.
"""

from __future__ import annotations

import codecs
import os
import re
import shlex
import socket
import time
from collections import deque
from pathlib import Path
from typing import IO, Any, Callable, Mapping, Sequence

import fabric
import fabric.runners
import invoke
import paramiko
from pydantic import BaseModel

from engine.files import sha256_file
from flows.inventory.hosts import Host
from flows.transport.connect import RemoteError, Timeouts, connect_client

# timeout(1) exits 124 when it stopped the command, 137 (128+KILL) when -k had to kill it.
_TIMEOUT_RCS = (124, 137)
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


class TransferError(RemoteError):
    """One SFTP transfer refused or stopped (over the size cap, stalled, past its deadline); the
    connection itself may still be good, so a caller can skip that file and go on."""


class RunResult(BaseModel):
    rc: int
    stdout: str
    stderr: str
    timed_out: bool
    elapsed_s: float


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
        self._conn = _fabric_connection(self.host, connect_client(self.host, self.hosts_dir, self.timeouts))
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
