"""A hostile host against the real transport and pull: a sandbox sshd whose output and result files
are swapped for hostile ones. None of it may stop, crash or fill the controller, and none of it may
cost a good file of the same pull or anything already ingested."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from engine.schema import MAX_ROWS, SchemaError
from engine.table_files import read_table, to_table, write_manifest, write_table
from flows.notes.gather import measured_runs
from flows.store.store import Store
from flows.transport import pull as pull_mod
from flows.transport import remote as ssh
from flows.transport.pull import pull, quarantine, record_unfinished
from flows.transport.remote import Remote, TransferError, _Capture
from flows.transport.sandbox import _alive

pytestmark = pytest.mark.integration

HOST, RUN, EARLIER = "evil", "20261201T000000Z-evil0001", "20261130T000000Z-evil0000"
PROV = {"run_id": RUN, "host": HOST}

# The "payload": one script, run with the host's python, that emits each hostile output in turn.
HOSTILE = r"""
import os, subprocess, sys
mode = sys.argv[1]
if mode == "endless":  # prints forever; a silent child in the same process group outlives the printing
    child = subprocess.Popen(["sleep", "120"])
    open(sys.argv[2], "w").write(str(child.pid))
    while True:
        sys.stdout.write("x" * 100 + "\n")
elif mode == "lines":  # far more output than anyone should keep
    line = "y" * 99 + "\n"
    for _ in range(int(sys.argv[2]) // 100):
        sys.stdout.write(line)
    sys.stdout.write("the last line\n")
elif mode == "flood":  # one line, no newline at all
    chunk = "z" * (1 << 20)
    for _ in range(int(sys.argv[2]) >> 20):
        sys.stdout.write(chunk)
"""


def _script(host_dir: Path) -> Path:
    path = host_dir / "hostile.py"
    path.write_text(HOSTILE)
    return path


# -- transport ------------------------------------------------------------------------------------

def test_endless_output_is_stopped_at_the_local_deadline_and_its_group_killed(
        sandbox, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The remote bound is 60 s; the local deadline is brought down to 2 s to fire while output flows.
    monkeypatch.setattr(ssh, "_LOCAL_GRACE_S", -ssh.KILL_AFTER_S - 58)
    host = sandbox.host()
    pidfile = tmp_path / "child.pid"
    lines = 0

    def count(_: str) -> None:
        nonlocal lines
        lines += 1

    with Remote(host, sandbox.hosts_dir) as r:
        res = r.run([host.python, str(_script(tmp_path)), "endless", str(pidfile)], timeout_s=60, on_line=count)
    assert res.timed_out and res.rc == -1
    assert res.elapsed_s < 30 and lines > 1000
    assert len(res.stdout) <= ssh.MAX_KEPT + 200
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the silent child of the killed command survived"


def test_the_deadline_counts_as_a_timeout_while_the_kill_is_still_finishing(
        sandbox, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kill runs on invoke's timer thread and closes the channel, which lets the command return
    at once; a kill still busy after that (a slow `kill -KILL` session, a slow close) must not turn
    the deadline into rc -1 with timed_out False."""
    monkeypatch.setattr(ssh, "_LOCAL_GRACE_S", -ssh.KILL_AFTER_S - 58)
    kill = ssh._BoundedRunner.kill

    def lingering_kill(self: ssh._BoundedRunner) -> None:
        kill(self)
        time.sleep(1.0)

    monkeypatch.setattr(ssh._BoundedRunner, "kill", lingering_kill)
    host = sandbox.host()
    with Remote(host, sandbox.hosts_dir) as r:
        res = r.run([host.python, str(_script(tmp_path)), "endless", str(tmp_path / "child.pid")], timeout_s=60)
    assert res.timed_out and res.rc == -1


def test_output_kept_is_bounded_to_the_tail(sandbox, tmp_path: Path) -> None:
    host = sandbox.host()
    size = 3 * ssh.MAX_KEPT
    with Remote(host, sandbox.hosts_dir) as r:
        res = r.run([host.python, str(_script(tmp_path)), "lines", str(size)], timeout_s=120)
    assert res.rc == 0 and not res.timed_out
    assert len(res.stdout) <= ssh.MAX_KEPT + 200
    first, rest = res.stdout.split("\n", 1)
    assert "earlier characters of output dropped" in first
    dropped = int(first.split("kdbench: ")[1].split()[0])
    assert dropped + len(rest) == size // 100 * 100 + len("the last line\n")
    assert rest.endswith("the last line\n")


def test_no_newline_flood_is_cut_into_one_bounded_line(sandbox, tmp_path: Path) -> None:
    host = sandbox.host()
    size = 32 << 20
    seen: list[str] = []
    with Remote(host, sandbox.hosts_dir) as r:
        res = r.run([host.python, str(_script(tmp_path)), "flood", str(size)], timeout_s=120, on_line=seen.append)
    assert res.rc == 0 and not res.timed_out
    assert len(seen) == 1 and seen[0].startswith("z" * ssh.MAX_LINE)
    assert seen[0].endswith(f"[kdbench: {size - ssh.MAX_LINE} more characters of this line cut]")
    assert res.stdout == seen[0]


def test_capture_holds_a_bounded_part_of_a_line_in_progress() -> None:
    """Linear splitting: a line without newline is kept only up to the cut, never re-joined whole."""
    got: list[str] = []
    cap = _Capture(got.append, max_line=10, max_kept=25)
    for _ in range(1000):
        cap.feed(b"a" * 4096)
        assert cap._part_len <= 10
    cap.feed("é\nbb\n".encode()[:1])  # a multi-byte character split across chunks
    cap.feed("é\nbb\n".encode()[1:] + b"c" * 30 + b"\n", final=True)
    assert got[0] == "a" * 10 + f" [kdbench: {4096 * 1000 - 10 + 1} more characters of this line cut]"
    assert got[1:] == ["bb", "c" * 10 + " [kdbench: 20 more characters of this line cut]"]
    assert cap.text.startswith("[kdbench: ")
    assert cap.text.endswith("c" * 10 + " [kdbench: 20 more characters of this line cut]\n")


def test_sftp_get_refuses_a_file_over_the_cap(sandbox, tmp_path: Path) -> None:
    host = sandbox.host()
    big = Path(host.work_dir) / "big.bin"
    big.write_bytes(b"\0" * 100_000)
    with Remote(host, sandbox.hosts_dir) as r:
        with pytest.raises(TransferError, match="cap"):
            r.get(str(big), tmp_path / "big.bin", max_bytes=50_000)
        assert r.get(str(big), tmp_path / "ok.bin", max_bytes=200_000)  # the session still works
    assert not (tmp_path / "big.bin").exists() and not list(tmp_path.glob(".*.part-*"))


def test_sftp_transfer_past_its_deadline_is_stopped(sandbox, tmp_path: Path) -> None:
    host = sandbox.host()
    src = tmp_path / "up.bin"
    src.write_bytes(b"u" * 1_000_000)
    with Remote(host, sandbox.hosts_dir) as r:
        with pytest.raises(TransferError, match="too long"):
            r.put(src, f"{host.work_dir}/up.bin", timeout_s=0)
        with pytest.raises(TransferError, match="too long"):
            r.get(str(src), tmp_path / "down.bin", timeout_s=0)
        assert r.put(src, f"{host.work_dir}/up.bin")  # a fresh SFTP session after the stopped one
    assert not (tmp_path / "down.bin").exists()


# -- result files ---------------------------------------------------------------------------------

def _runs(**over: object) -> pa.Table:
    return to_table("runs", [{"run_id": RUN, "host": HOST, "suite": "kernels", "profile": "smoke",
                              "status": "complete", "source": "measured", **over}], PROV)


def _kernels(n: int = 3, source: str = "measured", **over: object) -> pa.Table:
    return to_table("kernels", [{"run_id": RUN, "kernel": "moe_w4a16", "impl": "torch", "dtype": "bf16",
                                 "device": "cpu", "M": i, "time_us_p50": 10.0, "bytes": 1e6, "flops": 1e6,
                                 "source": source, **over} for i in range(1, n + 1)], PROV)


def _e2e(**over: object) -> pa.Table:
    return to_table("e2e", [{"run_id": RUN, "config": "k2-mini", "device": "cpu", "concurrency": 1,
                             "budget": b, "tokens_per_s": 5.0, "source": "measured", **over} for b in (16, 32, 64)],
                    PROV)


def _raw(path: Path, table: pa.Table, compression: str | None = None) -> None:
    with ipc.new_file(str(path), table.schema, options=ipc.IpcWriteOptions(compression=compression)) as w:
        w.write_table(table)


def _bad_offsets(out: Path) -> None:
    t = _e2e()
    col = t.column("config").combine_chunks()
    offsets = np.frombuffer(col.buffers()[1], dtype=np.int32).copy()
    offsets[1] = 1 << 30  # points far past the data (first and last stay in bounds, as a basic check wants)
    bad = pa.Array.from_buffers(pa.string(), len(col), [None, pa.py_buffer(offsets.tobytes()), col.buffers()[2]])
    _raw(out / "e2e.arrow", t.set_column(t.schema.get_field_index("config"), t.schema.field("config"), bad))


def _compressed(out: Path) -> None:
    big = to_table("e2e", [{"run_id": RUN, "config": "k2-mini" * 8, "device": "cpu", "concurrency": 1,
                            "budget": 16, "source": "measured"}] * 200_000, PROV)
    _raw(out / "e2e.arrow", big, "zstd")
    assert (out / "e2e.arrow").stat().st_size * 10 < big.nbytes


def _duplicate(out: Path) -> None:
    t = _e2e()
    _raw(out / "e2e.arrow", pa.Table.from_arrays(
        t.columns + [t.column("config")],
        schema=pa.schema(list(t.schema) + [t.schema.field("config")], metadata=t.schema.metadata)))


def _bad_metadata(out: Path) -> None:
    t = _e2e()
    _raw(out / "e2e.arrow", t.replace_schema_metadata({**t.schema.metadata, b"kdbench.table": b"\xff\xfee2e"}))


def _no_provenance(out: Path) -> None:
    t = _runs()
    meta = {k: v for k, v in t.schema.metadata.items() if k != b"kdbench.provenance"}
    _raw(out / "runs.arrow", t.replace_schema_metadata(meta))


def _projected_rows(out: Path) -> None:
    write_table(out, _kernels(source="projected"))


def _projected_run(out: Path) -> None:
    write_table(out, _runs(source="projected"))


def _other_host(out: Path) -> None:  # what ingest refuses is refused at pull, by the same check
    write_table(out, _runs(host="someone-else"))


def _oversize(out: Path) -> None:
    write_table(out, _kernels(n=2000))


def _with_column(t: pa.Table, name: str, value: object) -> pa.Table:
    """`t` with one more column, as a host may send it (to_table refuses unknown columns)."""
    return pa.Table.from_arrays([*t.columns, pa.array([value] * t.num_rows)],
                                schema=pa.schema([*t.schema, pa.field(name, pa.string())], metadata=t.schema.metadata))


# values a host may send that pass every type check (N1, N4, N10): refused at the door, row and column named
VALUES: dict[str, tuple[Callable[[Path], None], str, str]] = {
    "zero-time": (lambda out: write_table(out, _kernels(time_us_p50=0.0)), "kernels.arrow",
                  "row 1, column 'time_us_p50': 0.0 must be finite"),
    "nan-time": (lambda out: write_table(out, _kernels(time_us_p50=float("nan"))), "kernels.arrow",
                 "row 1, column 'time_us_p50': nan"),
    "zero-kernel-ms": (lambda out: write_table(out, _e2e(kernel_ms=0.0, outside_ms=0.0)), "e2e.arrow",
                       "row 1, column 'kernel_ms'"),
    "absurd-shape": (lambda out: write_table(out, _kernels(M=10 ** 12)), "kernels.arrow", "column 'M'"),
    "infinite-ceiling": (lambda out: write_table(out, _runs(copy_gbps=float("inf"))), "runs.arrow",
                         "column 'copy_gbps': inf"),
    "unknown-column": (lambda out: _raw(out / "kernels.arrow", _with_column(_kernels(), "host", "evil")),
                       "kernels.arrow", "unknown column(s) ['host']"),
    "too-many-rows": (lambda out: write_table(out, _kernels(n=MAX_ROWS + 1)), "kernels.arrow",
                      f"{MAX_ROWS + 1} rows, over the {MAX_ROWS}-row bound"),
}


# (what the host does, the file it spoils, words of the reason); the other files stay good
CASES: dict[str, tuple[Callable[[Path], None], str, str]] = {
    "bad-offsets": (_bad_offsets, "e2e.arrow", "invalid Arrow data"),
    "compressed": (_compressed, "e2e.arrow", "compressed"),
    "duplicate-column": (_duplicate, "e2e.arrow", "duplicate column"),
    "bad-metadata": (_bad_metadata, "e2e.arrow", "not UTF-8"),
    "runs-without-provenance": (_no_provenance, "runs.arrow", "no provenance"),
    "rows-labelled-projected": (_projected_rows, "kernels.arrow", "only measured"),
    "run-labelled-projected": (_projected_run, "runs.arrow", "only measured"),
    "oversize": (_oversize, "kernels.arrow", "cap"),
    "run-of-another-host": (_other_host, "runs.arrow", "names host"),
    **VALUES,
}


@pytest.fixture
def hostile(sandbox_factory, tmp_path: Path):
    """A sandbox host named like the run, its results folder, and a store holding an earlier run."""
    sbx = sandbox_factory(names=[HOST])
    host = sbx.host(HOST)
    out = Path(host.work_dir) / "runs" / RUN / "out"  # the sandbox host's disk is this machine's
    out.mkdir(parents=True)
    store = Store(str(tmp_path / "artifacts"))
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    prov = {"run_id": EARLIER, "host": HOST}
    write_table(earlier, to_table("runs", [{"run_id": EARLIER, "host": HOST, "suite": "kernels", "profile": "smoke",
                                            "status": "complete", "source": "measured"}], prov))
    store.ingest(HOST, EARLIER, earlier)
    return sbx, host, out, store


def _pull_and_ingest(sbx, host, out: Path, store: Store, staging: Path):
    with Remote(host, sbx.hosts_dir) as r:
        pulled = pull(r, str(out), staging, HOST, RUN)
    record_unfinished(pulled, RUN, HOST, "smoke", {}, None)
    quarantine(store, HOST, RUN, pulled)
    if "runs.arrow" in pulled.accepted:
        store.ingest(HOST, RUN, pulled.accepted_dir)
    return pulled


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_hostile_file_is_quarantined_and_the_good_ones_land(hostile, tmp_path: Path, case: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    sbx, host, out, store = hostile
    spoil, bad, words = CASES[case]
    for t in (_runs(), _kernels(), _e2e()):
        write_table(out, t)
    spoil(out)
    write_manifest(out)  # the host vouches for its hostile file: only the controller's checks stop it
    if case == "oversize":
        monkeypatch.setattr(pull_mod, "MAX_FILE_BYTES", (out / "e2e.arrow").stat().st_size * 2)
    pulled = _pull_and_ingest(sbx, host, out, store, tmp_path / "staging")
    assert set(pulled.quarantined) == {bad}, pulled.quarantined
    assert words in pulled.quarantined[bad]
    good = {"runs.arrow", "kernels.arrow", "e2e.arrow"} - {bad}
    assert good <= set(pulled.accepted)
    tables = store.load(HOST, RUN)
    assert {f"{t}.arrow" for t in tables} >= good
    for t in tables.values():  # everything stored reads back fully valid
        t.validate(full=True)
    reason = Path(store.base) / "quarantine" / f"host={HOST}" / f"run={RUN}" / f"{bad}.reason"
    assert words in reason.read_text()
    if bad == "runs.arrow":  # the controller's own row says the run is partial and why
        assert [r.status for r in store.runs(HOST) if r.run_id == RUN] == ["partial"]
        rows = {r["suite"]: r for r in tables["runs"].to_pylist()}
        assert rows["kernels"]["points"] == 3 and "quarantined" in rows["kernels"]["note"]
    assert store.load(HOST, EARLIER)["runs"].num_rows == 1  # what was ingested before is still there


@pytest.mark.parametrize("manifest", ["nested", "huge"])
def test_a_hostile_manifest_never_stops_the_pull(hostile, tmp_path: Path, manifest: str) -> None:
    sbx, host, out, store = hostile
    for t in (_runs(), _kernels()):
        write_table(out, t)
    depth = 30_000 if manifest == "nested" else 200_000
    (out / "manifest.json").write_text("[" * depth + "]" * depth)
    pulled = _pull_and_ingest(sbx, host, out, store, tmp_path / "staging")
    assert pulled.accepted == [] and set(pulled.quarantined) == {"runs.arrow", "kernels.arrow"}
    assert all("manifest.json" in why for why in pulled.quarantined.values())
    assert [r.run_id for r in store.runs(HOST)] == [EARLIER]


def test_many_odd_names_are_reported_in_bounded_form(hostile, tmp_path: Path) -> None:
    sbx, host, out, store = hostile
    for t in (_runs(), _kernels()):
        write_table(out, t)
    for i in range(100):
        (out / f"extra_{i}.arrow").write_bytes(b"x")
    pulled = _pull_and_ingest(sbx, host, out, store, tmp_path / "staging")
    assert pulled.accepted == ["kernels.arrow", "runs.arrow"]
    assert len(pulled.quarantined) == pull_mod.MAX_LISTED + 1
    assert pulled.quarantined["80 more"] == "unexpected file names (not fetched)"


def test_read_table_refuses_what_would_crash_a_reader(tmp_path: Path) -> None:
    """The same files, read locally: one SchemaError each, never a crash or a different exception."""
    for case, (spoil, bad, words) in CASES.items():
        if case == "oversize":
            continue
        d = tmp_path / case
        d.mkdir()
        for t in (_runs(), _kernels(), _e2e()):
            write_table(d, t)
        spoil(d)
        if case.endswith("projected") or case == "run-of-another-host" or (case in VALUES and case != "unknown-column"):
            read_table(d / bad)  # a valid file, refused at pull by check_run_tables
            continue
        with pytest.raises(SchemaError, match=re.escape(words)):
            read_table(d / bad)


def test_a_far_future_started_at_does_not_stay_latest(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "artifacts"))
    later = "20261202T000000Z-evil0002"
    for run_id, started in ((RUN, "9999-12-31T23:59:59+00:00"), (later, "2026-12-02T00:00:00+00:00")):
        d = tmp_path / run_id
        d.mkdir()
        write_table(d, to_table("runs", [{"run_id": run_id, "host": HOST, "suite": "kernels", "profile": "smoke",
                                          "status": "complete", "source": "measured", "started_at": started}],
                                {"run_id": run_id, "host": HOST}))
        store.ingest(HOST, run_id, d)
    assert [r.run_id for r in store.runs(HOST)] == [RUN, later]
    # runs stored before ingested_at was recorded still read, ordered by run id, before newer ones
    manifest = Path(store.base) / "_manifests" / f"host={HOST}" / f"run={RUN}.json"
    m = json.loads(manifest.read_text())
    m.pop("ingested_at")
    manifest.write_text(json.dumps(m))
    assert [r.run_id for r in store.runs(HOST)][-1] == later
    assert measured_runs(store, HOST)[-1].run_id == later  # what the notes call the latest run


def test_a_failed_suite_with_a_hostile_runs_table_still_ingests_the_good_files(hostile, tmp_path: Path) -> None:
    """N10: an unknown column passed pull, and when a suite had also failed, `record_unfinished` refused
    it between pull and ingest: the flow failed with none of the run's good files ingested or quarantined."""
    sbx, host, out, store = hostile
    write_table(out, _kernels())
    _raw(out / "runs.arrow", _with_column(_runs(), "host_note", "x"))
    write_manifest(out)
    with Remote(host, sbx.hosts_dir) as r:
        pulled = pull(r, str(out), tmp_path / "staging", HOST, RUN)
    assert "unknown column" in pulled.quarantined["runs.arrow"]
    record_unfinished(pulled, RUN, HOST, "smoke", {"e2e": "failed"}, None)
    assert quarantine(store, HOST, RUN, pulled)
    info = store.ingest(HOST, RUN, pulled.accepted_dir)
    assert (info.status, info.suites) == ("partial", ["e2e", "kernels"])
    assert store.load(HOST, RUN)["kernels"].num_rows == 3


def test_a_host_cannot_send_the_controllers_whatif_suite() -> None:
    """suite 'whatif' names the controller's own stored what-if answers (projected); a measured runs
    table naming it is refused where pull checks a host's files, and accepted for a projected run."""
    from engine.schema import SchemaError
    from engine.table_checks import check_run_tables

    with pytest.raises(SchemaError, match="suite 'whatif'"):
        check_run_tables(HOST, RUN, {"runs": _runs(suite="whatif")}, sources=("measured",))
    check_run_tables(HOST, RUN, {"runs": _runs(suite="whatif", source="projected")})
