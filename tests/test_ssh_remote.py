"""Remote.run streaming, quoting and both time bounds; SFTP with sha256 checks on both ends."""

from __future__ import annotations

import hashlib
import time
import uuid
from pathlib import Path

import pytest

from flows.inventory.files import update_host
from flows.transport import remote as ssh
from flows.transport.connect import RemoteError, Timeouts
from flows.transport.probe import probe
from flows.transport.remote import Remote, remote_command
from flows.transport.sandbox import _alive

pytestmark = pytest.mark.integration

HOSTILE = "w $(touch {marker}) `touch {marker}` 'q\" ; x"


def test_remote_command_quotes_every_value() -> None:
    line = remote_command(["echo", "a b", "$(x)"], timeout_s=5, cwd="d $(y)", env={"K": "v;w"})
    assert line == ("cd -- 'd $(y)' && echo \"KDBENCH_PGID $$\" >&2 && exec env K='v;w' "
                    "timeout -k 10 5 echo 'a b' '$(x)'")
    assert "timeout -k 10 1000000 true" in remote_command(["true"], timeout_s=1e6)
    with pytest.raises(ValueError):
        remote_command(["true"], timeout_s=1, env={"A;B": "x"})


def test_run_streams_lines_in_order(sandbox) -> None:
    seen: list[tuple[float, str]] = []
    script = "import sys,time\nprint('first', flush=True)\ntime.sleep(1)\nprint('oops', file=sys.stderr)\nprint('last')"
    with Remote(sandbox.host(), sandbox.hosts_dir) as r:
        t0 = time.monotonic()
        res = r.run([sandbox.host().python, "-c", script], timeout_s=20,
                    on_line=lambda s: seen.append((time.monotonic() - t0, s)))
    assert res.rc == 0 and not res.timed_out
    assert [s for _, s in seen if s != "oops"] == ["first", "last"] and "oops" in [s for _, s in seen]
    assert res.stdout == "first\nlast\n" and res.stderr == "oops\n"
    assert seen[0][0] < res.elapsed_s - 0.5  # the first line arrived before the command ended


def test_remote_timeout_kills_process_group(sandbox, tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    script = f"sleep 60 & echo $! > '{pidfile}'; wait"
    with Remote(sandbox.host(), sandbox.hosts_dir) as r:
        res = r.run(["sh", "-c", script], timeout_s=1)
    assert res.timed_out and res.rc == 124
    assert res.elapsed_s < 5
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


def test_local_deadline(sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    # Local deadline = remote bound + kill grace + slack; shrink it below the remote bound to see it fire.
    monkeypatch.setattr(ssh, "_LOCAL_GRACE_S", -ssh.KILL_AFTER_S - 1.5)
    with Remote(sandbox.host(), sandbox.hosts_dir) as r:
        res = r.run(["sleep", "3"], timeout_s=2)
    assert res.timed_out and res.rc == -1
    assert res.elapsed_s < 1.5


def test_hostile_work_dir_and_names_are_quoted(sandbox, tmp_path: Path) -> None:
    marker = f"kdbench-pwned-{uuid.uuid4().hex}"  # no '/', so it can sit inside a file name
    work = tmp_path / HOSTILE.format(marker=marker)
    work.mkdir()
    update_host(sandbox.hosts_dir, "sbx1", work_dir=str(work))
    r = probe(sandbox.host(), sandbox.hosts_dir)
    assert r.outcome == "ok" and r.facts["work_dir_exists"] is True, r
    name = f"file with spaces 'single' \"double\" $(touch {marker})"
    abs_marker = f"/tmp/{marker}"
    with Remote(sandbox.host(), sandbox.hosts_dir) as rem:
        res = rem.run(["touch", name], timeout_s=10, cwd=str(work), env={"X": f"$(touch {abs_marker})"})
        assert res.rc == 0, res.stderr
        env_res = rem.run(["printenv", "X"], timeout_s=10, env={"X": f"$(touch {abs_marker})"})
    assert (work / name).is_file()
    assert env_res.stdout == f"$(touch {abs_marker})\n"
    for where in (Path.home(), Path.cwd(), tmp_path, work, Path("/tmp")):
        assert not (where / marker).exists(), where


def test_put_get_verify_sha256(sandbox, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "payload 'x'.bin"
    data = bytes(range(256)) * 4000
    src.write_bytes(data)
    want = hashlib.sha256(data).hexdigest()
    remote_dir = sandbox.host().work_dir
    remote_path = f"{remote_dir}/up \"q\" $(no).bin"
    back = tmp_path / "back.bin"
    with Remote(sandbox.host(), sandbox.hosts_dir) as r:
        assert r.sha256(remote_path) is None
        assert r.put(src, remote_path) == want
        assert r.sha256(remote_path) == want
        assert r.get(remote_path, back) == want
        assert back.read_bytes() == data
        # A digest that does not match is refused and leaves nothing under the final name.
        monkeypatch.setattr(Remote, "sha256", lambda self, p: "0" * 64)
        with pytest.raises(RemoteError, match="corrupted"):
            r.put(src, f"{remote_dir}/bad.bin")
        with pytest.raises(RemoteError, match="corrupted"):
            r.get(remote_path, tmp_path / "bad.bin")
    assert Path(remote_path).read_bytes() == data
    assert not Path(f"{remote_dir}/bad.bin").exists() and not (tmp_path / "bad.bin").exists()
    assert not list(Path(remote_dir).glob("*.part-*")) and not list(tmp_path.glob(".*.part-*"))


def test_remote_refuses_when_probe_level_fails(sandbox) -> None:
    sandbox.fault("sbx1", "revoke-key")
    with pytest.raises(RemoteError) as e:
        with Remote(sandbox.host(), sandbox.hosts_dir, Timeouts(connect=2, banner=2, auth=2)):
            pass
    assert e.value.outcome == "unauthorized"
