"""The comm suite times through engine.timing's one harness: a real single-rank gloo process group on the
CPU stands in for the GPUs' NCCL group (the collectives, the barrier and the row are the same code)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from engine import bench_comm, timing
from engine.rows import set_columns


def test_before_runs_ahead_of_each_timed_call_and_never_in_the_warmup() -> None:
    seen: list[str] = []
    t = timing.time_op(lambda: seen.append("call"), torch.device("cpu"), repeats=3, warmup=1,
                       before=lambda: seen.append("before"))
    assert seen == ["call"] + ["before", "call"] * 3 and t.repeats == 3


@pytest.fixture()
def one_rank(tmp_path: Path) -> Any:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_each_comm_point_is_timed_by_time_op_with_the_ranks_aligned_before_each_repeat(
        one_rank: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    timed: list[tuple[int, dict[str, Any], timing.Timing]] = []
    barriers: list[int] = []
    real_time_op, real_barrier = timing.time_op, dist.barrier

    def spy(fn: Any, device: torch.device, repeats: int, **kw: Any) -> timing.Timing:
        t = real_time_op(fn, device, repeats, **kw)
        timed.append((repeats, kw, t))
        return t

    def barrier() -> None:
        barriers.append(1)
        real_barrier()

    monkeypatch.setattr(bench_comm, "time_op", spy)
    monkeypatch.setattr(dist, "barrier", barrier)
    for op in bench_comm.OPS:
        nbytes = 1 << 16
        row = bench_comm.point(op, nbytes, 1, torch.device("cpu"))
        repeats, kw, t = timed[-1]
        # eager (a collective is not captured), no L2 flush, three warm-up calls, a barrier before each repeat
        assert (repeats, kw["warmup"], kw["graph"], kw["flush"]) == (20, 3, False, False)
        assert len(barriers) == 20 * len(timed)
        # the row: the same columns as before the harness, the median and the rates from it
        assert set(set_columns(row)) == {"op", "world_size", "bytes", "time_us_p50", "algbw_gbps", "busbw_gbps",
                                         "status"}
        assert (row.op, row.world_size, row.bytes, row.status) == (op, 1, nbytes, "ok")
        assert row.time_us_p50 == t.p50_us > 0
        assert row.algbw_gbps == pytest.approx(nbytes / (t.p50_us * 1e-6) / 1e9)
        assert row.busbw_gbps == pytest.approx(row.algbw_gbps * bench_comm.bus_factor(op, 1))
    assert bench_comm.bus_factor("all_reduce", 8) == pytest.approx(1.75)
    assert bench_comm.bus_factor("all_gather", 8) == pytest.approx(0.875)
