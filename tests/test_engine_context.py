"""The e2e suite's context axis on the CPU (k2-mini): long prompts, points that do not fit in memory
or in the axis's time budget recorded as skipped, the time prediction behind that budget, and the
GPU preflight of the longest points run at k2-mini size."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine import bench, preflight_longctx
from engine.bench_e2e import PROFILES, ContextAxis, E2EBench, predict_seconds
from engine.rows import E2ERow

CPU = torch.device("cpu")


def _bench(axis: ContextAxis, memory_limit: int | None = None) -> E2EBench:
    """A CPU smoke profile reduced to the context axis (the short sweep's one point left out)."""
    prof = replace(PROFILES[("cpu", "smoke")], tps=(axis.tp,), context=axis)
    return E2EBench(prof, CPU, memory_limit=memory_limit)


def _context_rows(eb: E2EBench) -> list[E2ERow]:
    return [fn() for label, fn in eb.points() if "context=" in label]


def test_a_point_that_does_not_fit_is_recorded_as_skipped_with_the_bytes_it_needed() -> None:
    axis = ContextAxis(((32, (1,)), (256, (1,))), tp=1, max_new=8)
    free = _context_rows(_bench(axis))
    assert [(r.context, r.status) for r in free] == [(32, "ok"), (256, "ok")]
    small, large = (r.memory_bytes for r in free)
    assert 0 < small < large
    limited = _context_rows(_bench(axis, memory_limit=round((small + large) / 2)))
    assert [r.status for r in limited] == ["ok", "skipped"]
    skipped = limited[1]
    assert skipped.memory_bytes == large and skipped.context == 256 and skipped.concurrency == 1
    assert skipped.skip_reason.startswith("needs ") and "latent cache" in skipped.skip_reason
    assert skipped.tokens_per_s is None and skipped.ttft_ms is None  # no figure is made up
    assert limited[0].tokens_per_s > 0 and limited[0].ttft_ms > 0


def test_a_point_predicted_past_the_axis_time_budget_is_skipped_after_three_measured() -> None:
    axis = ContextAxis(((8, (1,)), (16, (1,)), (24, (1,)), (32, (1,))), tp=1, max_new=8, seconds=0.0)
    rows = _context_rows(_bench(axis))
    assert [(r.context, r.status) for r in rows] == [(8, "ok"), (16, "ok"), (24, "ok"), (32, "skipped")]
    assert "predicted to take" in rows[3].skip_reason and "3 measured context points" in rows[3].skip_reason
    assert rows[3].memory_bytes > 0


def test_context_points_run_from_the_least_attention_work_to_the_most() -> None:
    axis = PROFILES[("cuda", "full")].context
    assert axis.order()[:2] == [(1024, 1), (1024, 16)]
    assert axis.order()[-2:] == [(32768, 16), (131072, 1)]
    assert {n for n, _ in axis.order()} == {1024, 8192, 32768, 65536, 131072} and axis.tp == 8


def test_predicted_time_follows_per_token_and_attention_work() -> None:
    f, a, b = 0.5, 2e-5, 3e-9

    def t(c: int, n: int) -> float:
        return f + a * c * n + b * c * n * n

    done = [(c, n, t(c, n)) for c, n in ((1, 1024), (16, 1024), (1, 8192), (16, 8192))]
    assert predict_seconds(done[:2], 1, 32768) is None  # too few points to fit three terms
    assert predict_seconds(done, 16, 32768) == pytest.approx(t(16, 32768), rel=1e-6)
    assert predict_seconds(done, 1, 131072) == pytest.approx(t(1, 131072), rel=1e-6)
    # a term that would fit negative (times falling with length) is dropped, never extrapolated down
    shrinking = [(1, 1024, 3.0), (1, 2048, 2.0), (1, 4096, 1.0)]
    assert predict_seconds(shrinking, 1, 65536) >= 0


def test_the_cli_moves_the_context_axis_with_tp_and_accept() -> None:
    a = bench.parse(["--suite", "e2e", "--profile", "full", "--host", "h", "--out", "o", "--tp", "1",
                     "--accept", "0.9"])
    prof = bench.e2e_profile(a, CPU)
    assert prof.tps == (1,) and prof.context.tp == 1 and prof.context.level == 0.9


def test_the_gpu_preflight_runs_on_the_cpu_and_checks_exactness(tmp_path: Path, capsys) -> None:
    """The lead's preflight command, at k2-mini size: every point ran, memory checked, the chunked
    prefill gave the one-forward prefill's tokens, and each point's line says TTFT and step."""
    rc = preflight_longctx.main(["--config", "k2-mini", "--tp", "2", "--layers", "2", "--points", "64x1,32x2",
                                 "--exact", "40", "--prefill-tokens", "16", "--max-new", "8", "--device", "cpu",
                                 "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    summary = json.loads((tmp_path / "preflight.json").read_text())
    assert summary["ok"] and summary["exactness"]["ok"] and summary["exactness"]["lengths"] == [40, 30]
    assert [(p["context"], p["concurrency"], p["status"]) for p in summary["points"]] == [(64, 1, "ok"), (32, 2, "ok")]
    assert all(p["ttft_s"] > 0 and p["step_ms"] > 0 and p["need_gb"] > 0 for p in summary["points"])
    assert "     64 x 1  TTFT " in out and "exactness at [40, 30] tokens: first tokens equal, greedy equal" in out
