"""engine.bench_mla's --plans on the CPU: which plans it times and how it reports the pick's regret."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from engine import bench_mla
from kernels.mla_tree_attention import PLAN_COSTS, pick_config, split_plan

SMS = 132


def test_plans_is_off_unless_asked() -> None:
    assert not bench_mla.parser().parse_args(["--out", "x"]).plans
    a = bench_mla.parser().parse_args(["--out", "x", "--plans", "--check", "none", "--kernels", "none"])
    assert a.plans and a.check == "none" and a.kernels == "none"


def test_plan_points_time_the_shipped_pick_among_the_planners_candidates() -> None:
    """v7's sweep shapes first, then every grid shape of under PLAN_WAVES waves of row tiles (no
    planner splits more than that); each plan once, in whole units of the picked kernel (pairs for
    gluon_ws, single blocks for the short launches' gluon), covering the cache."""
    points = bench_mla.plan_points((9, 0), SMS)
    shapes = [p[0] for p in points]
    assert shapes[:len(bench_mla.PLAN_SHAPES)] == bench_mla.PLAN_SHAPES and len(set(shapes)) == len(shapes)
    assert (64, 16, 16, 4096) in shapes and (64, 8, 256, 4096) not in shapes  # 272 tiles in, 2,056 out
    assert PLAN_COSTS["gluon_ws"].unit == 2
    for (heads, batch, budget, context), tiles, plans, pick in points:
        blocks = -(-(context + budget + 1) // 64)
        kernel = pick_config((9, 0), torch.bfloat16, batch, (budget + 1) * heads, context + budget + 1).kernel
        unit = PLAN_COSTS[kernel].unit
        assert tiles < bench_mla.PLAN_WAVES * SMS and pick in plans and len(set(plans)) == len(plans)
        for n, per in plans:  # a forced count of n runs this very plan
            assert per % unit == 0 and (n - 1) * per < blocks <= n * per, (heads, batch, budget, context, n, per)
            assert split_plan(blocks, n, unit) == (n, per)
    by = {p[0]: p[2] for p in points}
    assert {(1, 66), (2, 34), (3, 22)} <= set(by[(64, 8, 16, 4096)])  # v7's 2-split surprise and both plans


def test_plan_regret_is_the_picks_time_over_the_best(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = bench_mla.Out(tmp_path, time.time() + 60, {})
    for n, per, us, planned in ((1, 66, 110.0, True), (2, 34, 100.0, False), (3, 22, 120.0, False)):
        out("mla_plans", heads=64, batch=8, budget=16, context=4096, splits=n, per_blocks=per, us_p50=us,
            planned=planned, status="ok")
    out("mla_plans", heads=8, batch=1, budget=16, context=4096, splits=33, per_blocks=2, us_p50=30.0, planned=True, status="ok")
    capsys.readouterr()
    bench_mla.plan_regret(out)
    text = capsys.readouterr().out
    assert "regret 1.100" in text and "regret 1.000" in text and "median 1.050, worst 1.100 over 2 shapes" in text
