"""SSH transport: pinned host keys only, every remote command quoted and bounded twice.

Trust comes from the inventory alone: the paramiko client starts with an empty key store filled
with the host's pinned keys, RejectPolicy for anything else, no ~/.ssh/config, no agent and no
default key search. Failures are classified into the few outcomes the flows route on, so a
reprovisioned or revoked machine is told apart from one that is merely down.
"""

from __future__ import annotations

import codecs
import json
import logging
import os
import re
import shlex
import socket
import time
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Sequence

import paramiko
from pydantic import BaseModel

from engine.schema import sha256_file
from flows.inventory import Host, InventoryError, display_path, fingerprint, load_specs, parse_public_key

Outcome = Literal["ok", "unauthorized", "host_key_changed", "host_key_unknown", "unreachable", "timeout"]

# timeout(1) exits 124 when it stopped the command, 137 (128+KILL) when -k had to kill it.
_TIMEOUT_RCS = (124, 137)
# paramiko's transport thread logs handshake failures (with tracebacks) that we classify and
# report ourselves; its records go to this logger, silent unless someone attaches a handler.
_PARAMIKO_LOG = "flows.ssh.paramiko"
logging.getLogger(_PARAMIKO_LOG).addHandler(logging.NullHandler())
logging.getLogger(_PARAMIKO_LOG).propagate = False
KILL_AFTER_S = 10
_LOCAL_GRACE_S = 5.0
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
    client = paramiko.SSHClient()
    client.set_log_channel(_PARAMIKO_LOG)
    entry = host.address if host.port == 22 else f"[{host.address}]:{host.port}"
    store = client.get_host_keys()
    for line in host.host_keys:
        key = parse_public_key(line)
        store.add(entry, key.get_name(), key)
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    try:
        client.connect(
            host.address, port=host.port, username=host.user, pkey=pkey,
            allow_agent=False, look_for_keys=False, timeout=timeouts.connect,
            banner_timeout=timeouts.banner, auth_timeout=timeouts.auth, channel_timeout=timeouts.connect,
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
    except OSError as e:
        client.close()
        raise RemoteError(f"network error: {e.strerror or type(e).__name__}", "unreachable") from None


def remote_command(argv: Sequence[str], *, timeout_s: float, cwd: str | None = None,
                   env: Mapping[str, str] | None = None) -> str:
    """The shell line run on the host: every value quoted, bounded by timeout(1) -k."""
    if not argv:
        raise ValueError("empty command")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive (got {timeout_s})")
    parts: list[str] = []
    if cwd is not None:
        parts += ["cd", "--", shlex.quote(cwd), "&&"]
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


class _LineSplitter:
    """Turns chunks of bytes into whole lines, decoding UTF-8 safely across chunk borders."""

    def __init__(self, emit: Callable[[str], None] | None):
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buf = ""
        self._emit = emit
        self.text: list[str] = []

    def feed(self, data: bytes, final: bool = False) -> None:
        s = self._dec.decode(data, final)
        self.text.append(s)
        self._buf += s
        *lines, self._buf = self._buf.split("\n")
        if final and self._buf:
            lines.append(self._buf)
            self._buf = ""
        if self._emit:
            for line in lines:
                self._emit(line)


class Remote:
    """A connection to one host: `with Remote(host, hosts_dir) as r: r.run([...], timeout_s=60)`."""

    def __init__(self, host: Host, hosts_dir: Path, timeouts: Timeouts = Timeouts()):
        self.host = host
        self.hosts_dir = Path(hosts_dir)
        self.timeouts = timeouts
        self._client: paramiko.SSHClient | None = None
        self._sftp: paramiko.SFTPClient | None = None

    def connect(self) -> "Remote":
        """Open the connection; RemoteError(outcome=...) when the host is not `ok`."""
        self._client = _connect(self.host, self.hosts_dir, self.timeouts)
        return self

    def __enter__(self) -> "Remote":
        return self.connect()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._sftp is not None:
            self._sftp.close()
            self._sftp = None
        if self._client is not None:
            self._client.close()
            self._client = None

    def _transport(self) -> paramiko.Transport:
        if self._client is None or self._client.get_transport() is None:
            raise RemoteError("not connected")
        return self._client.get_transport()  # type: ignore[return-value]

    def run(self, argv: Sequence[str], *, timeout_s: float, cwd: str | None = None,
            env: Mapping[str, str] | None = None, on_line: Callable[[str], None] | None = None) -> RunResult:
        """Run argv on the host; lines of stdout and stderr go to on_line as they arrive.

        Bounded twice: timeout(1) on the host kills the command's process group, and a local
        deadline (remote bound + kill grace + slack) closes the channel if the host goes silent.
        """
        command = remote_command(argv, timeout_s=timeout_s, cwd=cwd, env=env)
        start = time.monotonic()
        deadline = start + timeout_s + KILL_AFTER_S + _LOCAL_GRACE_S
        chan = self._transport().open_session(timeout=self.timeouts.connect)
        out, err = _LineSplitter(on_line), _LineSplitter(on_line)
        local_timeout = False
        try:
            chan.exec_command(command)
            while True:
                busy = False
                if chan.recv_ready():
                    out.feed(chan.recv(65536))
                    busy = True
                if chan.recv_stderr_ready():
                    err.feed(chan.recv_stderr(65536))
                    busy = True
                if not busy:
                    if chan.exit_status_ready() and not chan.recv_ready() and not chan.recv_stderr_ready():
                        break
                    if time.monotonic() > deadline:
                        local_timeout = True
                        break
                    chan.status_event.wait(0.02)
            rc = chan.recv_exit_status() if not local_timeout else -1
        finally:
            chan.close()
        out.feed(b"", final=True)
        err.feed(b"", final=True)
        return RunResult(
            rc=rc, stdout="".join(out.text), stderr="".join(err.text),
            timed_out=local_timeout or rc in _TIMEOUT_RCS, elapsed_s=round(time.monotonic() - start, 3),
        )

    def sftp(self) -> paramiko.SFTPClient:
        if self._sftp is None:
            self._sftp = self._client.open_sftp()  # type: ignore[union-attr]
        return self._sftp

    def sha256(self, remote_path: str) -> str | None:
        """The file's sha256 computed on the host; None when there is no such file."""
        try:
            self.sftp().stat(remote_path)
        except FileNotFoundError:
            return None
        res = self.run(["sha256sum", "--", remote_path], timeout_s=self.timeouts.command)
        if res.rc != 0 or not res.stdout:
            raise RemoteError(f"sha256sum failed on {self.host.name} (rc {res.rc}): {res.stderr.strip()}")
        # sha256sum escapes odd names with a leading backslash; the digest is still the first field.
        return res.stdout.split()[0].lstrip("\\")

    def put(self, local: Path, remote_path: str) -> str:
        """Upload then verify on the host; the file appears under its name only when it matches."""
        local = Path(local)
        want = sha256_file(local)
        tmp = f"{remote_path}.part-{os.getpid()}"
        sftp = self.sftp()
        sftp.put(str(local), tmp)
        got = self.sha256(tmp)
        if got != want:
            sftp.remove(tmp)
            raise RemoteError(f"upload to {self.host.name} corrupted: sha256 {got} != {want}")
        sftp.posix_rename(tmp, remote_path)
        return want

    def get(self, remote_path: str, local: Path) -> str:
        """Download then verify locally against the digest the host computed."""
        local = Path(local)
        want = self.sha256(remote_path)
        if want is None:
            raise RemoteError(f"{self.host.name}: no such file {remote_path!r}")
        tmp = local.with_name(f".{local.name}.part-{os.getpid()}")
        self.sftp().get(remote_path, str(tmp))
        got = sha256_file(tmp)
        if got != want:
            tmp.unlink(missing_ok=True)
            raise RemoteError(f"download from {self.host.name} corrupted: sha256 {got} != {want}")
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
            try:
                raw = json.loads(line.removeprefix("KDBENCH_FACTS "))
            except ValueError:
                raw = {}
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
    except RemoteError as e:
        return result(e.outcome or "unreachable", str(e), e.presented_fingerprint)
    with remote:
        presented = fingerprint(remote._transport().get_remote_server_key())
        try:
            res = remote.run([host.python, "-c", _FACTS, host.work_dir], timeout_s=timeouts.command)
        except (paramiko.SSHException, OSError) as e:
            return result("timeout", f"no answer to the fact-finding command: {type(e).__name__}", presented)
        if res.timed_out:
            return result("timeout", f"fact-finding command took over {timeouts.command:g} s", presented)
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
