"""The artifacts store on a real S3 API: a moto server on loopback, reached through an s3:// URI root.

Proves the promise in flows/store/store.py that the root may be any pyarrow filesystem URI: ingest, the run
manifests, load, dataset and refusal of bad files all go through the S3 filesystem, never a local path;
and that controllers ingesting at the same moment (a fleet run) lose no run.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import pyarrow.compute as pc
import pyarrow.fs as pafs
import pytest
from prefect.logging import disable_run_logger
from typer.testing import CliRunner

from engine.schema import SchemaError
from engine.table_files import read_table
from flows import REPO
from flows.cli.app import app
from flows.pipelines.settings import Settings
from flows.pipelines.tasks import ingest
from flows.store.layout import StoreError
from flows.store.migrate import LOCK, migrate
from flows.store.store import Store
from flows.transport.pull import Pulled, quarantine
from support.runs import write_run

pytestmark = pytest.mark.integration

BUCKET = "kdbench-test"
RUN = "sbx-s3-1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_up(proc: subprocess.Popen, port: int, timeout_s: float = 15.0) -> None:
    """Poll the server directly (no proxy from the environment) until it answers."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"moto server exited with status {proc.returncode} before answering")
        try:
            opener.open(f"http://127.0.0.1:{port}/moto-api/", timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"moto server did not answer on 127.0.0.1:{port} within {timeout_s:.0f} s")


@pytest.fixture
def s3_root(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A real S3 endpoint (moto server subprocess) with one bucket; yields the store URI root.

    Dummy credentials and region live only in this test's environment; EC2 metadata lookups are
    disabled so the AWS SDK never leaves loopback. The server is always stopped by pid.
    """
    for var, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1",
                       "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(var, value)
    for var in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(var, raising=False)
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_up(proc, port)
        endpoint = f"127.0.0.1:{port}"
        pafs.S3FileSystem(endpoint_override=endpoint, scheme="http", region="us-east-1",
                          allow_bucket_creation=True).create_dir(BUCKET)
        yield f"s3://{BUCKET}/team?endpoint_override={endpoint}&scheme=http"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real run directory: the engine's CPU smoke of the kernels suite."""
    out = tmp_path_factory.mktemp("bench") / "out"
    subprocess.run([sys.executable, "-m", "engine.bench", "--suite", "kernels", "--profile", "smoke",
                    "--host", "sbx", "--out", str(out), "--run-id", RUN, "--device", "cpu"],
                   cwd=REPO, check=True, capture_output=True, timeout=120)
    return out


def test_s3_root_round_trip(s3_root: str, bench_run: Path, tmp_path: Path) -> None:
    store = Store(s3_root)
    assert isinstance(store.fs, pafs.S3FileSystem) and store.base == f"{BUCKET}/team"
    assert store.runs() == [] and store.dataset("kernels").to_table().num_rows == 0
    store.ingest("sbx", RUN, bench_run)
    # the objects are in the bucket under the table-first Hive layout, not on the local disk
    names = {i.path.removeprefix(f"{BUCKET}/team/") for i in store.fs.get_file_info(
        pafs.FileSelector(f"{BUCKET}/team", recursive=True)) if i.type == pafs.FileType.File}
    assert names == {f"runs/host=sbx/run={RUN}/part-0.parquet", f"kernels/host=sbx/run={RUN}/part-0.parquet",
                     f"_manifests/host=sbx/run={RUN}.json"}
    assert not Path(f"{BUCKET}/team").exists()

    other = write_run(tmp_path / "h200", host="h200", run_id="h200-1", started_at="2000-01-01T00:00:00Z")
    store.ingest("h200", "h200-1", other)
    reopened = Store(s3_root)  # a second controller sees the same runs
    # in the order they were stored: the host's own (earlier) started_at does not reorder them
    assert [(r.host, r.run_id) for r in reopened.runs()] == [("sbx", RUN), ("h200", "h200-1")]
    [info] = reopened.runs("sbx")
    assert (info.source, info.status, info.suites) == ("measured", "complete", ["kernels"])

    tables = reopened.load("sbx", RUN)
    assert set(tables) == {"runs", "kernels"}
    for name, table in tables.items():
        assert table.equals(read_table(bench_run / f"{name}.arrow"), check_metadata=True)
    kern = reopened.dataset("kernels").to_table()
    mine = kern.filter(pc.equal(kern.column("run"), RUN))
    assert set(mine.column("host").to_pylist()) == {"sbx"}
    expected = read_table(bench_run / "kernels.arrow")
    assert mine.select(expected.schema.names).sort_by("kernel").equals(expected.sort_by("kernel"))
    assert set(kern.column("run").to_pylist()) == {RUN, "h200-1"}


def test_s3_root_refuses_bad_files(s3_root: str, bench_run: Path, tmp_path: Path) -> None:
    store = Store(s3_root)
    bad = tmp_path / "bad"
    shutil.copytree(bench_run, bad)
    (bad / "kernels.arrow").write_bytes(b"not arrow")
    with pytest.raises(SchemaError, match="kernels.arrow"):
        store.ingest("sbx", RUN, bad)
    assert store.runs() == []
    assert store.fs.get_file_info(f"{store.base}/kernels/host=sbx").type == pafs.FileType.NotFound

    # a file damaged in the bucket after ingest is refused on the way out too
    store.ingest("sbx", RUN, bench_run)
    with store.fs.open_output_stream(f"{store.base}/kernels/host=sbx/run={RUN}/part-0.parquet") as f:
        f.write(b"damaged")
    with pytest.raises(SchemaError, match="kernels/host=sbx"):
        store.load("sbx", RUN)


def test_s3_root_from_settings_and_quarantine(s3_root: str, bench_run: Path, monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    """KDBENCH_ARTIFACTS reaches Store unchanged, and the flow's quarantine writes into the bucket."""
    monkeypatch.setenv("KDBENCH_ARTIFACTS", s3_root)
    settings = Settings.from_env()
    assert settings.artifacts == s3_root and settings.env()["KDBENCH_ARTIFACTS"] == s3_root
    store = Store(settings.artifacts)
    staging = tmp_path / "staging"  # laid out as flows.transport.pull.pull leaves it
    shutil.copytree(bench_run, staging / "accepted")
    (staging / "quarantine").mkdir()
    (staging / "quarantine" / "e2e.arrow").write_bytes(b"junk")
    pulled = Pulled(accepted_dir=staging / "accepted", accepted=["kernels.arrow", "runs.arrow"],
                    quarantined={"e2e.arrow": "sha256 mismatch"})
    where = quarantine(store, "sbx", RUN, pulled)
    assert where == f"{store.base}/quarantine/host=sbx/run={RUN}"
    with store.fs.open_input_stream(f"{where}/e2e.arrow") as f:
        assert f.read() == b"junk"
    with store.fs.open_input_stream(f"{where}/e2e.arrow.reason") as f:
        assert f.read() == b"sha256 mismatch\n"
    store.ingest("sbx", RUN, pulled.accepted_dir)
    assert [r.run_id for r in store.runs()] == [RUN]
    assert store.dataset("e2e").to_table().num_rows == 0


def test_concurrent_ingests_lose_no_run(s3_root: str, tmp_path: Path) -> None:
    """A fleet run: eight controllers ingest into one bucket at the same moment, through the flow's
    ingest step. With the old shared index (read-modify-write, no lock on S3) lines went missing and
    the flow's lookup of its own run raised StopIteration; per-run manifests leave nothing to lose."""
    runs = [(f"f{i}", f"f{i}-run") for i in range(8)]
    for i, (host, run_id) in enumerate(runs):
        write_run(tmp_path / run_id, host=host, run_id=run_id, started_at=f"2026-11-0{i + 1}T00:00:00Z")
    barrier = threading.Barrier(len(runs))

    def one(host: str, run_id: str) -> str | None:
        pulled = Pulled(accepted_dir=tmp_path / run_id, accepted=["runs.arrow"], quarantined={})
        store = Store(s3_root)  # each controller its own client
        barrier.wait(timeout=60)
        info = ingest.fn(store, host, run_id, pulled)
        return info.run_id if info else None

    with disable_run_logger(), ThreadPoolExecutor(len(runs)) as pool:
        returned = list(pool.map(lambda hr: one(*hr), runs))
    assert returned == [r for _, r in runs]  # each ingest returns its own run
    store = Store(s3_root)
    assert sorted((r.host, r.run_id) for r in store.runs()) == sorted(runs)
    assert {store.run(h, r).status for h, r in runs} == {"complete"}
    assert set(store.dataset("runs").to_table().column("run").to_pylist()) == {r for _, r in runs}


def test_s3_store_in_the_old_layout_migrates(s3_root: str, bench_run: Path) -> None:
    """`kdbench store migrate` on a bucket: layout-1 objects become the table-first layout."""
    store = Store(s3_root)
    old = f"runs/host=sbx/run={RUN}"
    for f in sorted(bench_run.glob("*.arrow")):
        store.write_bytes(f"{old}/{f.name}", f.read_bytes())
    store.write_bytes(f"{old}/stray.txt", b"kept\n")
    store.write_bytes("runs/_index.jsonl", f'{{"host": "sbx", "run_id": "{RUN}"}}\n'.encode())
    with pytest.raises(StoreError, match="store migrate"):
        store.runs()
    report = migrate(store)
    assert report.runs == [f"sbx/{RUN}"] and list(report.set_aside) == [f"_unmigrated/host=sbx/run={RUN}/stray.txt"]
    assert [r.run_id for r in store.runs()] == [RUN]
    for name, table in store.load("sbx", RUN).items():
        assert table.equals(read_table(bench_run / f"{name}.arrow"), check_metadata=True)
    left = {i.path.removeprefix(f"{store.base}/") for i in store.files_under("runs")}
    assert left == {f"{old}/part-0.parquet"}
    assert store.read_bytes(f"_unmigrated/host=sbx/run={RUN}/stray.txt") == b"kept\n"


def test_import_writes_into_the_bucket(s3_root: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """N13: `kdbench import --artifacts s3://...` (or with KDBENCH_ARTIFACTS) wrote a local folder named
    `s3:` and reported success; it takes the URI as every other command does."""
    monkeypatch.chdir(tmp_path)
    shipped = REPO / "artifacts" / "reference" / "pro6000-published"
    res = CliRunner().invoke(app, ["import", str(shipped / "source.json"), "--name", shipped.name, "--artifacts", s3_root])
    assert res.exit_code == 0, res.output
    monkeypatch.setenv("KDBENCH_ARTIFACTS", s3_root)
    res = CliRunner().invoke(app, ["import", str(shipped / "source.json"), "--name", "pub2"])
    assert res.exit_code == 0, res.output
    assert not any(tmp_path.iterdir()), list(tmp_path.iterdir())  # no local `s3:` folder, nothing local at all
    store = Store(s3_root)
    assert store.references() == [shipped.name, "pub2"]
    for name, table in store.reference(shipped.name).items():  # what the import wrote locally, byte for byte
        assert table.equals(read_table(shipped / f"{name}.arrow"), check_metadata=True)


def test_s3_migrations_never_run_two_at_once(s3_root: str, bench_run: Path) -> None:
    """N2 on S3: two migrations started together both rewrote runs; a marker object lets one go on.
    A killed migration's marker refuses the next one until --break-lock."""
    store = Store(s3_root)
    for f in sorted(bench_run.glob("*.arrow")):
        store.write_bytes(f"runs/host=sbx/run={RUN}/{f.name}", f.read_bytes())
    store.write_bytes("runs/_index.jsonl", f'{{"host": "sbx", "run_id": "{RUN}"}}\n'.encode())
    barrier = threading.Barrier(2)

    def one() -> str:
        s = Store(s3_root)
        barrier.wait(timeout=30)
        try:
            return f"migrated {migrate(s).runs}"
        except StoreError as e:
            return f"refused: {e}"

    with ThreadPoolExecutor(2) as pool:
        outcomes = sorted(pool.map(lambda _: one(), range(2)))
    assert outcomes[0] == f"migrated ['sbx/{RUN}']" and outcomes[1].startswith("refused: "), outcomes
    assert "another `kdbench store migrate`" in outcomes[1]
    assert not store.exists(store.full(LOCK))  # the one that ran took its marker away
    assert [r.run_id for r in store.runs()] == [RUN]

    store.write_bytes(LOCK, b'{"token": "killed", "since": "2026-12-01T00:00:00+00:00"}')
    res = CliRunner().invoke(app, ["store", "migrate", "--artifacts", s3_root])
    assert res.exit_code == 2 and "--break-lock" in res.output and "2026-12-01" in res.output
    res = CliRunner().invoke(app, ["store", "migrate", "--artifacts", s3_root, "--break-lock"])
    assert res.exit_code == 0 and "migrated 0 run(s)" in res.output, res.output
