"""engine.bench and engine.build as the flows run them: real subprocesses, real Arrow files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine import bench_kernels, comm_model, costs, schema
from engine.rows import CommRow
from flows import REPO


def _bench(out: Path, suite: str, *extra: str, profile: str = "smoke") -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "engine.bench", "--suite", suite, "--profile", profile, "--host", "sb-1",
           "--out", str(out), "--run-id", "run-1", "--payload-hash", "abc123", *extra]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180)


def _events(stdout: str) -> list[dict]:
    return [json.loads(line.removeprefix("KDBENCH ")) for line in stdout.splitlines() if line.startswith("KDBENCH ")]


def _check_manifest(out: Path) -> dict:
    man = json.loads((out / schema.MANIFEST).read_text())
    assert man["schema_version"] == schema.SCHEMA_VERSION
    assert set(man["files"]) == {p.name for p in out.glob("*.arrow")}
    for name, digest in man["files"].items():
        assert schema.sha256_file(out / name) == digest
    return man


@pytest.fixture(scope="module")
def smoke_dir(tmp_path_factory) -> tuple[Path, dict[str, list[dict]]]:
    """All three suites into one directory, as the bench flow does."""
    out = tmp_path_factory.mktemp("bench")
    events = {}
    for suite in ("kernels", "e2e", "comm"):
        r = _bench(out, suite)
        assert r.returncode == 0, r.stderr
        events[suite] = _events(r.stdout)
    return out, events


def test_smoke_writes_valid_tables_and_manifest(smoke_dir):
    out, _ = smoke_dir
    _check_manifest(out)
    tables = {n: schema.read_table(out / f"{n}.arrow") for n in schema.TABLES}
    for name, t in tables.items():
        prov = schema.provenance(t)
        assert set(schema.PROVENANCE_KEYS) <= set(prov), name
        assert (prov["run_id"], prov["host"], prov["payload_hash"], prov["device"]) == ("run-1", "sb-1", "abc123", "cpu")
        assert prov["started_at"] <= prov["ended_at"]
        assert set(t.column("run_id").to_pylist()) == {"run-1"}
    runs = {r["suite"]: r for r in tables["runs"].to_pylist()}
    assert {s: r["status"] for s, r in runs.items()} == {"kernels": "complete", "e2e": "complete", "comm": "skipped"}
    for r in runs.values():
        assert r["copy_gbps"] > 0 and r["matmul_tflops"] > 0 and r["device"] == "cpu"
    assert runs["kernels"]["points"] == tables["kernels"].num_rows


def test_kernel_points_cover_every_op_with_costs(smoke_dir):
    out, _ = smoke_dir
    rows = schema.read_table(out / "kernels.arrow").to_pylist()
    assert {r["kernel"] for r in rows} == {"moe_w4a16", "mla_tree_attention", "build_tree", "tree_accept", "dense_gemm"}
    for r in rows:
        assert r["bytes"] > 0 and r["flops"] > 0 and r["repeats"] > 0
        assert r["time_us_p10"] <= r["time_us_p50"] <= r["time_us_p90"]
        assert r["device"] == "cpu" and r["impl"] == "torch"
    for r in (r for r in rows if r["kernel"] == "moe_w4a16"):
        assert 1 <= r["unique_experts"] <= min(r["E"], r["M"] * r["top_k"])
        e, k, m = r["E"], r["top_k"], r["M"]
        assert r["expected_experts"] == pytest.approx(e * (1 - (1 - k / e) ** m))
    # every dense op of a step at each profiled TP degree, at each M, with its own bytes and flops
    dense: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["kernel"] == "dense_gemm":
            dense.setdefault((r["N"], r["K"], r["batch"], r["dtype"], r["M"]), []).append(r)
    prof = bench_kernels.PROFILES[("cpu", "smoke")]
    for tp in prof.dense_tp:
        for op in costs.dense_ops(prof.cfg, tp):
            for m in prof.dense_m:  # a replicated op is timed once, at the lowest degree
                assert any((r["bytes"], r["flops"]) == costs.dense_op_cost(op, m, 4) and r["tp"] <= tp
                           for r in dense[(op.n, op.k, op.heads, "float32", m)])


def test_e2e_rows_split_each_step(smoke_dir):
    out, _ = smoke_dir
    rows = schema.read_table(out / "e2e.arrow").to_pylist()
    key = ("tp", "layers", "synthetic_accept", "concurrency", "budget", "context")
    assert len({tuple(r[k] for k in key) for r in rows}) == len(rows) >= 2
    assert {r["tp"] for r in rows} == {1, 2}
    for r in rows:
        assert r["status"] == "ok" and r["memory_bytes"] > 0
        assert r["tokens_per_s"] > 0 and r["steps"] > 0 and 0 <= r["accept_len_mean"]
        assert 0 < r["synthetic_accept"] <= 1
        assert r["vocab"] == 512 and r["layers"] == 3 and r["weight_sets"] == 2
        assert min(r[k] for k in ("draft_ms", "tree_build_ms", "verify_ms", "accept_ms")) > 0
        assert r["other_ms"] >= 0
        if r["tp"] == 1:
            assert r["comm_ms"] == 0 and r["comm_source"] == "none"
        else:  # rank 0 alone: two all-reduces a layer of C x (B + 1) tokens, modelled
            assert r["comm_source"] == "modelled"
            want = comm_model.DEFAULT.forward_ms(r["concurrency"] * (r["budget"] + 1), 128, 3, r["tp"])
            assert r["comm_ms"] == pytest.approx(want) and want > 0
        assert r["step_ms_p50"] <= r["step_ms_p99"] and r["itl_ms_p50"] <= r["itl_ms_p99"]
        assert r["ttft_ms"] > 0


def test_e2e_context_axis_rows_carry_their_prompt_length(smoke_dir):
    """The CPU smoke profile's context axis: prompts of exactly 64 and 256 tokens at TP-2, C = 1,
    level 0.8, budget 16, beside the short sweep (prompts of 8-32 tokens)."""
    out, _ = smoke_dir
    rows = schema.read_table(out / "e2e.arrow").to_pylist()
    long = sorted((r for r in rows if r["context"] > 32), key=lambda r: r["context"])
    assert [(r["context"], r["tp"], r["concurrency"], r["budget"], r["synthetic_accept"]) for r in long] == \
        [(64, 2, 1, 16, 0.8), (256, 2, 1, 16, 0.8)]
    assert all(r["ttft_ms"] > 0 and r["tokens_per_s"] > 0 for r in long)
    assert long[0]["memory_bytes"] < long[1]["memory_bytes"]
    assert all(8 <= r["context"] <= 32 for r in rows if r not in long)
    note = schema.read_table(out / "runs.arrow").to_pylist()
    assert "context axis: prompts of exactly 64 (C=1), 256 (C=1) tokens at tp=2" in \
        next(r["note"] for r in note if r["suite"] == "e2e")


def test_comm_skipped_on_cpu_with_reason(smoke_dir):
    out, events = smoke_dir
    rows = schema.read_table(out / "comm.arrow").to_pylist()
    assert len(rows) == 1 and rows[0]["status"] == "skipped" and "GPU" in rows[0]["skip_reason"]
    assert events["comm"][-1] == {"event": "done", "suite": "comm", "status": "skipped", "points": 1}


def test_progress_lines_one_per_point(smoke_dir):
    out, events = smoke_dir
    for suite in ("kernels", "e2e"):
        ev = events[suite]
        points = [e for e in ev if e["event"] == "point"]
        assert [e["i"] for e in points] == list(range(1, len(points) + 1))
        assert {e["n"] for e in points} == {len(points)} and all(e["suite"] == suite for e in points)
        assert ev[-1]["event"] == "done" and ev[-1]["status"] == "complete"
        assert schema.read_table(out / f"{suite}.arrow").num_rows == len(points)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_run_leaves_readable_partial_files(tmp_path, sig):
    """Stop the (slower) full e2e on the CPU after its first point."""
    cmd = [sys.executable, "-m", "engine.bench", "--suite", "e2e", "--profile", "full", "--host", "sb-1",
           "--out", str(tmp_path), "--run-id", "run-k"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        for line in proc.stdout:
            if line.startswith("KDBENCH ") and json.loads(line[8:])["event"] == "point":
                break
            assert time.monotonic() < deadline
        os.kill(proc.pid, sig)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == (-9 if sig == signal.SIGKILL else 143)
    e2e = schema.read_table(tmp_path / "e2e.arrow")
    runs = schema.read_table(tmp_path / "runs.arrow").to_pylist()
    assert e2e.num_rows >= 1
    assert [(r["suite"], r["status"]) for r in runs] == [("e2e", "partial")]
    assert runs[0]["points"] == e2e.num_rows
    _check_manifest(tmp_path)
    if sig == signal.SIGTERM:
        assert "stopped by signal 15" in runs[0]["note"]


def test_a_saved_point_is_announced_when_sigterm_arrives_while_it_is_written(tmp_path, monkeypatch, capsys):
    """The signal waits until the point is both in the files and on stdout (the controller's log)."""
    from engine import results
    w = results.SuiteWriter(tmp_path, "comm", "smoke", {"run_id": "run-s", "host": "sb-1"}, 2)
    w.start()
    capsys.readouterr()
    write = schema.write_table

    def write_then_signal(out: Path, table: object) -> Path:
        path = write(out, table)
        results._on_signal(signal.SIGTERM, None)  # as the handler does when SIGTERM lands here
        return path

    monkeypatch.setattr(schema, "write_table", write_then_signal)
    with pytest.raises(results.Terminated):
        w.add(CommRow(op="all_reduce", world_size=2, bytes=1024, status="ok"))
    assert [(e["event"], e["i"]) for e in _events(capsys.readouterr().out)] == [("point", 1)]
    assert schema.read_table(tmp_path / "comm.arrow").num_rows == 1


def test_build_cpu_checks_references(tmp_path):
    r = subprocess.run([sys.executable, "-m", "engine.build", "--arch", "cpu", "--out", str(tmp_path)],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    body = json.loads((tmp_path / "build.json").read_text())
    assert body["arch_asked"] == "cpu" and body["device_found"]["device"] == "cpu"
    assert body["versions"]["torch"]
    assert set(body["kernels"]) == {"moe_w4a16", "mla_tree_attention", "build_tree", "tree_accept"}
    assert {v["status"] for v in body["kernels"].values()} == {"reference"}


def test_build_compares_the_moe_at_each_kind_of_config_of_both_shape_classes():
    """The CUDA MoE runs other configs (one-token stages, 8- / 16- / 32-slot blocks, weights scaled
    before or after the MMA) by M and by shape class: the GPU build compares one M of each against
    the reference, at the full shapes and at one TP-8 rank's shard, and runs every bench M once."""
    from engine import build
    from engine.bench_kernels import PROFILES

    p = PROFILES[("cuda", "full")]
    shapes = build.moe_shapes(p, {1, 16, 17, 272})
    compared = {(tp, m) for tp, m, c in shapes if c}
    assert compared == {(tp, m) for tp in (1, 8) for m in (1, 16, 128, 512, 4096)}
    assert [(tp, m) for tp, m, _ in shapes] == ([(1, m) for m in sorted({*p.moe_m, 17, 272})]
                                                + [(8, m) for m in sorted(p.moe_tp_m)])
    assert all(tp == 1 for tp, _, _ in build.moe_shapes(PROFILES[("cpu", "full")], set())), "no shard on the CPU"


@pytest.mark.parametrize("argv,needle", [
    (["-m", "engine.build", "--arch", "sm_90"], "no CUDA GPU"),
    (["-m", "engine.bench", "--suite", "kernels", "--profile", "smoke", "--host", "h", "--device", "cuda"], "no CUDA GPU"),
    (["-m", "engine.bench", "--suite", "kernels", "--profile", "smoke", "--host", "../etc"], "--host"),
    (["-m", "engine.bench", "--suite", "nope", "--profile", "smoke", "--host", "h"], "--suite"),
    (["-m", "engine.bench", "--suite", "e2e", "--profile", "smoke", "--host", "h", "--tp", "3"], "--tp: tp 3 does not divide heads"),
    (["-m", "engine.bench", "--suite", "e2e", "--profile", "smoke", "--host", "h", "--tp", "4"], "--tp: tp 4 does not divide moe_inter"),
    (["-m", "engine.bench", "--suite", "e2e", "--profile", "smoke", "--host", "h", "--tp", "16"], "--tp: tp must be within 1..8"),
    (["-m", "engine.bench", "--suite", "e2e", "--profile", "smoke", "--host", "h", "--layers", "99"], "--layers 99: k2-mini has 3"),
    (["-m", "engine.bench", "--suite", "e2e", "--profile", "smoke", "--host", "h", "--vocab", "1001"], "--vocab: tp 2 does not divide vocab 1001"),
    (["-m", "engine.bench", "--suite", "e2e", "--profile", "smoke", "--host", "h", "--comm-model", "{"], "--comm-model: not JSON"),
])
def test_bad_arch_device_or_usage_exit_2(tmp_path, argv, needle):
    r = subprocess.run([sys.executable, *argv, "--out", str(tmp_path / "o")], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert needle in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


def test_moe_shard_rows_carry_tp_and_the_shard_bytes():
    """The kernel suite's TP sweep: one rank's shard of every expert (intermediate / tp), rows tagged."""
    import torch

    from engine.bench_kernels import PROFILES, KernelBench

    kb = KernelBench(PROFILES[("cpu", "smoke")], torch.device("cpu"))
    full, shard = kb.moe(4, "auto"), kb.moe(4, "auto", tp=2)
    assert (full.tp, shard.tp) == (1, 2)
    assert shard.N * 2 == full.N and shard.K == full.K
    assert shard.bytes < full.bytes
    assert PROFILES[("cuda", "full")].moe_tp_m == PROFILES[("cuda", "full")].moe_m  # M = 1..1024 at tp 8
    assert schema.SCHEMAS["kernels"].field("tp").nullable


def test_mla_shard_rows_carry_tp_and_cover_the_flashmla_grid():
    """The MLA sweep at one TP-8 rank (heads / tp, rows tagged, the shard's flops), at every shape of
    the FlashMLA comparison (shared/data/mla-flashmla-h200.csv) at both head counts, out to 128k."""
    import time

    import torch

    from engine.bench_kernels import MIN_REPEATS, PROFILES, KernelBench, budgeted_repeats

    kb = KernelBench(PROFILES[("cpu", "smoke")], torch.device("cpu"))
    full, shard = kb.attention(1, 16, 128, "auto"), kb.attention(1, 16, 128, "auto", tp=2)
    assert (full.tp, shard.tp, full.N, shard.N) == (1, 2, 4, 2)
    assert shard.flops * 2 == full.flops and shard.bytes < full.bytes
    p = PROFILES[("cuda", "full")]
    grid = {(b, n, c) for b in (1, 8, 16) for n in (16, 64, 256) for c in (4096, 16384, 32768, 65536)}
    for pts in (p.attn, p.attn_tp):
        assert grid <= set(pts) and len(set(pts)) == len(pts)
        assert max(c for _, _, c in pts) == 131072
        assert {n for _, n, _ in pts} == {16, 64, 256, 1024} and {b for b, _, _ in pts} == {1, 8, 16}
    assert budgeted_repeats(lambda: time.sleep(0.06), torch.device("cpu"), 50) == MIN_REPEATS
    assert budgeted_repeats(lambda: None, torch.device("cpu"), 50) == 50


def test_the_mla_sweep_reaches_the_e2e_steps_shortest_prompts() -> None:
    """Every e2e step's attention (its batch and budget, prompts from the shortest up) lies inside the
    kernel sweep, at the full heads and at one TP-8 rank's: the in-step factor is measured against
    measured points, not against the kernel fit carried below the sweep."""
    from engine.bench_e2e import PROFILES as E2E
    from engine.bench_kernels import PROFILES

    e2e, kern = E2E[("cuda", "full")], PROFILES[("cuda", "full")]
    for pts in (kern.attn, kern.attn_tp):
        for c in e2e.concurrency:
            for n in e2e.budgets:
                assert min(ctx for b, nn, ctx in pts if (b, nn) == (c, n)) <= e2e.prompt_len[0]


def test_e2e_figures_leave_out_the_eager_step() -> None:
    """The step run eagerly while the CUDA graphs are made is paid once by a server, not every step."""
    from engine.bench_e2e import summarise
    from engine.decode import STAGES, DecodeResult
    res = DecodeResult(tokens=[[0] * 16], ttft_s=[0.5], decode_s=1.2, step_s=[1.0, 0.1, 0.1],
                       stage_s={s: [0.2, 0.02, 0.02] for s in STAGES}, accept_len=[[4], [4], [4]],
                       emitted=[[5], [5], [5]], eager_steps=1)
    row = summarise(res)
    assert row["steps"] == 2 and row["step_ms_p50"] == pytest.approx(100.0)
    assert row["tokens_per_s"] == pytest.approx(10 / 0.2) and row["draft_ms"] == pytest.approx(20.0)
