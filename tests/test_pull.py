"""Pulled files are accepted only when their sha256 and schema check out; the rest is quarantined."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from engine.table_files import to_table, write_manifest, write_table
from flows.store.store import Store
from flows.transport.pull import pull, quarantine
from flows.transport.remote import Remote

pytestmark = pytest.mark.integration

RUN = "r1"


def _results(out: Path) -> None:
    prov = {"run_id": RUN, "host": "pull1"}
    write_table(out, to_table("runs", [{"run_id": RUN, "host": "pull1", "suite": "kernels", "profile": "smoke",
                                        "status": "complete", "source": "measured"}], prov))
    write_table(out, to_table("kernels", [{"run_id": RUN, "kernel": "moe_w4a16", "impl": "torch", "dtype": "bf16",
                                           "device": "cpu", "time_us_p50": 10.0, "bytes": 1e6, "flops": 1e6,
                                           "source": "measured"}], prov))
    write_table(out, to_table("e2e", [{"run_id": RUN, "config": "k2-mini", "device": "cpu", "concurrency": 1,
                                       "budget": 16, "tokens_per_s": 5.0, "source": "measured"}], prov))
    # a well-formed Arrow file listed in the manifest, but without the kdbench schema
    t = pa.table({"x": [1, 2]})
    with ipc.new_file(str(out / "comm.arrow"), t.schema) as w:
        w.write_table(t)
    write_manifest(out)
    # corrupted after the manifest was written: the sha256 no longer matches
    data = bytearray((out / "e2e.arrow").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (out / "e2e.arrow").write_bytes(bytes(data))


def test_corrupt_and_malformed_files_are_quarantined_and_never_ingested(sandbox_factory, tmp_path: Path) -> None:
    sbx = sandbox_factory(names=["pull1"])
    host = sbx.host("pull1")
    remote_dir = Path(host.work_dir) / "runs" / RUN / "out"  # the sandbox host's disk is this machine's
    remote_dir.mkdir(parents=True)
    _results(remote_dir)
    with Remote(host, sbx.hosts_dir) as r:
        pulled = pull(r, str(remote_dir), tmp_path / "staging", "pull1", RUN)
    assert pulled.accepted == ["kernels.arrow", "runs.arrow"]
    assert set(pulled.quarantined) == {"comm.arrow", "e2e.arrow"}
    assert "sha256" in pulled.quarantined["e2e.arrow"]
    assert "schema version" in pulled.quarantined["comm.arrow"]

    store = Store(str(tmp_path / "artifacts"))
    where = quarantine(store, "pull1", RUN, pulled)
    for name in ("comm.arrow", "e2e.arrow"):
        assert (Path(where) / name).is_file()
        assert pulled.quarantined[name] in (Path(where) / f"{name}.reason").read_text()
    store.ingest("pull1", RUN, pulled.accepted_dir)
    assert set(store.load("pull1", RUN)) == {"runs", "kernels"}
    assert store.dataset("e2e").to_table().num_rows == 0


@pytest.mark.parametrize("written", [True, False])
def test_suite_the_controller_saw_stop_is_never_recorded_complete(tmp_path: Path, written: bool) -> None:
    """A suite killed after it wrote "complete" (a timeout racing its exit) and one killed before it
    wrote anything both end up `partial` in runs.arrow, so the run index calls the run partial."""
    from engine.table_files import read_table

    from flows.transport.pull import Pulled, record_unfinished

    accepted = []
    if written:
        write_table(tmp_path, to_table("runs", [{"run_id": RUN, "host": "pull1", "suite": "kernels",
                                                 "profile": "full", "status": "complete", "source": "measured"}],
                                       {"run_id": RUN, "host": "pull1"}))
        accepted.append("runs.arrow")
    pulled = Pulled(accepted_dir=tmp_path, accepted=accepted, quarantined={})
    record_unfinished(pulled, RUN, "pull1", "full", {"kernels": "timeout"}, None)
    rows = read_table(tmp_path / "runs.arrow").to_pylist()
    assert [(r["suite"], r["status"]) for r in rows] == [("kernels", "partial")]
    assert "timeout" in rows[0]["note"]
    assert pulled.accepted == ["runs.arrow"]
    store = Store(str(tmp_path / "artifacts"))
    store.ingest("pull1", RUN, tmp_path)
    assert [r.status for r in store.runs("pull1")] == ["partial"]
