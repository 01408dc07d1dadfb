"""Local sandbox hosts: a real OpenSSH sshd per host on its own loopback address and port.

They let the whole pipeline (and its failure paths) run on one machine without GPUs: each host
has its own host key and authorized client key, and faults reproduce what happens to real
machines — a reprovisioned box (new host key), a revoked account, a released box (nothing
listens), a half-dead one (TCP accepted, no SSH banner). Servers run detached so the CLI can
return; their pids are recorded so `down` stops exactly what `up` started.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Literal, Sequence

import psutil
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from filelock import FileLock
from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap

from engine.files import atomic_write_bytes
from flows import REPO
from flows.inventory.hosts import SAFE_NAME, Host
from flows.inventory.keys import fingerprint, key_line, parse_public_key

Fault = Literal["rotate-hostkey", "revoke-key", "stop", "blackhole", "heal"]
FAULTS: tuple[str, ...] = ("rotate-hostkey", "revoke-key", "stop", "blackhole", "heal")
SSHD = "/usr/sbin/sshd"
STATE_FILE = "sandbox.json"
_START_TIMEOUT_S = 10.0
MAX_HOSTS = 200  # one loopback address each: 127.0.0.10 .. 127.0.0.209

# Accepts TCP connections and never says a word: what a wedged machine looks like to a client.
_BLACKHOLE = (
    "import socket,sys\n"
    "s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(128); held=[]\n"
    "while True: held.append(s.accept()[0])\n"
)
_BLACKHOLE_MARK = "kdbench-blackhole"


class SandboxError(Exception):
    """The sandbox could not do what was asked; the message says why."""


def default_state_dir() -> Path:
    return REPO / ".sandbox"


def _state_dir(state_dir: Path | None) -> Path:
    return Path(state_dir) if state_dir is not None else default_state_dir()


def _server_dir(state: Path, name: str) -> Path:
    """Keys, sshd config, log and work dir of one sandbox host."""
    return state / "servers" / name


def _load(state: Path) -> dict[str, Any]:
    f = state / STATE_FILE
    return json.loads(f.read_text()) if f.is_file() else {"hosts": {}}


def _save(state: Path, data: dict[str, Any]) -> None:
    atomic_write_bytes(state / STATE_FILE, json.dumps(data, indent=2, sort_keys=True).encode())


def _lock(state: Path) -> FileLock:
    state.mkdir(parents=True, exist_ok=True)
    return FileLock(str(state / ".lock"), timeout=60)


def _write_key(path: Path) -> str:
    """A new ed25519 private key at path (mode 0600); returns its public key line."""
    key = Ed25519PrivateKey.generate()
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                  serialization.NoEncryption()))
    pub = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return pub.decode()


def free_port(address: str = "127.0.0.1") -> int:
    """A TCP port free on `address` right now (the sandbox, the demo and the tests pick theirs so)."""
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def _alive(pid: int | None) -> bool:
    """True while pid runs (a zombie counts as gone; our own children get reaped here)."""
    if not pid:
        return False
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:
        pass
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""


def _descendants(pid: int) -> list[int]:
    """Every process below pid (sshd's per-connection children and their commands)."""
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def _ours(pid: int, marker: str) -> bool:
    """Guard against pid reuse: only stop a process whose command line is the one we started."""
    return marker in _cmdline(pid)


def _kill(pids: Sequence[int]) -> None:
    """SIGTERM, then SIGKILL what is still there after 3 s (psutil reaps our own children)."""
    procs = []
    for p in pids:
        try:
            procs.append(psutil.Process(p))
        except psutil.NoSuchProcess:
            pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            try:
                p.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
        _, procs = psutil.wait_procs(procs, timeout=3)
        if not procs:
            return


def _stop_process(hdir: Path, rec: dict[str, Any]) -> None:
    pid = rec.get("pid")
    marker = str(hdir / "sshd_config") if rec.get("process") == "sshd" else _BLACKHOLE_MARK
    if pid and _alive(pid) and _ours(pid, marker):
        _kill([pid, *_descendants(pid)])
    rec["pid"] = None
    rec["process"] = None


def _wait_listening(rec: dict[str, Any], want_banner: bool, log: Path | None) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        if not _alive(rec["pid"]):
            break
        try:
            with socket.create_connection((rec["address"], rec["port"]), timeout=1) as s:
                if not want_banner:
                    return
                s.settimeout(2)
                if s.recv(64).startswith(b"SSH-"):
                    return
        except OSError:
            time.sleep(0.03)
    tail = log.read_text(errors="replace")[-500:] if log and log.is_file() else ""
    raise SandboxError(f"sandbox server on port {rec['port']} did not start: {tail.strip()}")


def _sshd_config(hdir: Path, rec: dict[str, Any]) -> Path:
    cfg = hdir / "sshd_config"
    cfg.write_text(
        "\n".join([
            f"ListenAddress {rec['address']}:{rec['port']}",
            f"HostKey {hdir / rec['host_key']}",
            f"PidFile {hdir / 'sshd.pid'}",
            f"AuthorizedKeysFile {hdir / 'authorized_keys'}",
            "StrictModes no",
            "UsePAM no",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "AuthenticationMethods publickey",
            "PermitRootLogin prohibit-password",
            "PermitUserEnvironment no",
            "UseDNS no",
            "PrintMotd no",
            "X11Forwarding no",
            "AllowTcpForwarding no",
            "MaxStartups 100",
            "LogLevel INFO",
            "Subsystem sftp internal-sftp",
            "",
        ])
    )
    return cfg


def _start_sshd(hdir: Path, rec: dict[str, Any]) -> None:
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)
    cfg = _sshd_config(hdir, rec)
    log = hdir / "sshd.log"
    with log.open("ab") as err:
        p = subprocess.Popen([SSHD, "-D", "-e", "-f", str(cfg)], stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    rec["pid"], rec["process"] = p.pid, "sshd"
    _wait_listening(rec, want_banner=True, log=log)


def _start_blackhole(rec: dict[str, Any]) -> None:
    p = subprocess.Popen([sys.executable, "-c", _BLACKHOLE, rec["address"], str(rec["port"]), _BLACKHOLE_MARK],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    rec["pid"], rec["process"] = p.pid, "blackhole"
    _wait_listening(rec, want_banner=False, log=None)


def _host_yaml(state: Path, name: str, rec: dict[str, Any], host_pub: str) -> None:
    hdir = _server_dir(state, name)
    host = Host(
        name=name, address=rec["address"], port=rec["port"], user=rec["user"],
        key_file=str(hdir / "client_key"), host_keys=[key_line(parse_public_key(host_pub))],
        spec="cpu-sandbox", gpus=0, arch="cpu", interconnect="none", python=sys.executable,
        work_dir=str(hdir / "work"), notes="local sandbox host (loopback sshd), made by `kdbench sandbox up`",
    )
    data = CommentedMap(host.model_dump(exclude={"retired_at", "presented_host_key_fingerprint", "last_seen"}))
    data.yaml_set_start_comment(f"Sandbox host {name}: a real sshd on loopback; the engine runs on the CPU.")
    y = YAML(typ="rt")
    y.width = 4096
    with (state / "hosts" / f"{name}.yaml").open("w") as f:
        y.dump(data, f)


def up(count: int = 2, *, names: Sequence[str] | None = None, state_dir: Path | None = None) -> Path:
    """Start `count` sandbox hosts (or one per name); returns their inventory folder."""
    state = _state_dir(state_dir)
    names = list(names) if names else [f"sbx{i + 1}" for i in range(count)]
    for n in names:
        if not SAFE_NAME.match(n):
            raise SandboxError(f"sandbox host name {n!r} is not a safe identifier")
    if len(set(names)) != len(names) or not 1 <= len(names) <= MAX_HOSTS:
        raise SandboxError(f"sandbox host names must be distinct, 1 to {MAX_HOSTS} of them")
    if not os.path.exists(SSHD):
        raise SandboxError(f"{SSHD} not found: install openssh-server (`make sshd`)")
    with _lock(state):
        old = _load(state)
        if any(_alive(r.get("pid")) for r in old["hosts"].values()):
            raise SandboxError(f"sandbox in {state} is already up; run `kdbench sandbox down` first")
        for n in old["hosts"]:
            shutil.rmtree(_server_dir(state, n), ignore_errors=True)
        shutil.rmtree(state / "hosts", ignore_errors=True)
        (state / "hosts").mkdir(parents=True)
        shutil.copytree(REPO / "hosts" / "specs", state / "hosts" / "specs")
        data: dict[str, Any] = {"hosts": {}}
        try:
            for i, name in enumerate(names):
                hdir = _server_dir(state, name)
                (hdir / "work").mkdir(parents=True)
                host_pub = _write_key(hdir / "host_key")
                client_pub = _write_key(hdir / "client_key")
                (hdir / "client_key.pub").write_text(client_pub + "\n")
                (hdir / "authorized_keys").write_text(client_pub + "\n")
                address = f"127.0.0.{10 + i}"
                rec = {"address": address, "port": free_port(address), "user": _user(),
                       "host_key": "host_key", "pid": None, "process": None, "faults": []}
                data["hosts"][name] = rec
                _start_sshd(hdir, rec)
                _host_yaml(state, name, rec, host_pub)
        except BaseException:
            for n, rec in data["hosts"].items():
                _stop_process(_server_dir(state, n), rec)
            raise
        finally:
            _save(state, data)
    return state / "hosts"


def _user() -> str:
    return pwd.getpwuid(os.getuid()).pw_name


def down(state_dir: Path | None = None) -> None:
    """Stop every server and listener the sandbox started (by recorded pid); keeps the files."""
    state = _state_dir(state_dir)
    if not (state / STATE_FILE).is_file():
        return
    with _lock(state):
        data = _load(state)
        for name, rec in data["hosts"].items():
            _stop_process(_server_dir(state, name), rec)
        _save(state, data)


def status(state_dir: Path | None = None) -> list[dict[str, Any]]:
    """One row per sandbox host: what runs there now and which faults are in effect."""
    state = _state_dir(state_dir)
    data = _load(state)
    rows = []
    for name, rec in data["hosts"].items():
        running = _alive(rec.get("pid"))
        rows.append({
            "name": name, "address": rec["address"], "port": rec["port"],
            "process": rec.get("process") if running else None, "pid": rec.get("pid") if running else None,
            "faults": list(rec.get("faults", [])),
            "host_key": fingerprint(parse_public_key(_pub_of(_server_dir(state, name) / rec["host_key"]))),
        })
    return rows


def _pub_of(private_key: Path) -> str:
    key = serialization.load_ssh_private_key(private_key.read_bytes(), password=None)
    return key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()


def fault(name: str, kind: Fault, state_dir: Path | None = None) -> None:
    """Inject (or, with heal, undo) a fault on one sandbox host."""
    if kind not in FAULTS:
        raise SandboxError(f"unknown fault {kind!r}; choose one of {', '.join(FAULTS)}")
    state = _state_dir(state_dir)
    with _lock(state):
        data = _load(state)
        rec = data["hosts"].get(name)
        if rec is None:
            known = ", ".join(data["hosts"]) or "none (run `kdbench sandbox up`)"
            raise SandboxError(f"no sandbox host named {name!r} in {state}; known: {known}")
        hdir = _server_dir(state, name)
        faults = set(rec.get("faults", []))
        if kind == "rotate-hostkey":
            _write_key(hdir / "host_key.rotated")
            rec["host_key"] = "host_key.rotated"
            _stop_process(hdir, rec)
            _start_sshd(hdir, rec)
            faults = (faults - {"stop", "blackhole"}) | {kind}
        elif kind == "revoke-key":
            (hdir / "authorized_keys").write_text("")
            faults.add(kind)
        elif kind == "stop":
            _stop_process(hdir, rec)
            faults = (faults - {"blackhole"}) | {kind}
        elif kind == "blackhole":
            _stop_process(hdir, rec)
            _start_blackhole(rec)
            faults = (faults - {"stop"}) | {kind}
        else:  # heal: back to the original host key, the client key authorized, sshd running
            rec["host_key"] = "host_key"
            shutil.copyfile(hdir / "client_key.pub", hdir / "authorized_keys")
            _stop_process(hdir, rec)
            _start_sshd(hdir, rec)
            faults = set()
        rec["faults"] = sorted(set(faults))
        _save(state, data)
