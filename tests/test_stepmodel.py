"""The step model (flows.analysis.stepmodel) on a synthetic k2-mini reference built by hand: it composes measured
steps back, finds the in-step factors, labels what it interpolates and extrapolates, checks memory,
and its kernel models and carrier follow their formulas."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from support import stepmodel as synth
from engine.config import K2, make_config
from engine.rows import AcceptShape, MlaShape, MoeShape, TreeShape, table_rows
from flows.analysis.carrier import HARMONIC, LITTLE, SHARE, Side, how, memory_gbps, others
from flows.analysis.families import shape_at
from flows.analysis.kernelfit import along, fit_family
from flows.analysis.reference import load_reference, machine_of
from flows.analysis.stepmemory import RESERVE_BYTES, cache_bytes, memory, weight_bytes
from flows.analysis.stepmodel import Query, answer, build, in_step_factor, per_layer_at, per_layer_lines, query_of
from flows.inventory.hosts import Inventory
from flows.store.store import Store


@pytest.fixture()
def ref(tmp_path: Path, inv: Inventory):
    synth.mini_run(tmp_path / "art" / "reference" / "h200")
    return load_reference(Store(str(tmp_path / "art")), inv, "h200")


def test_the_composed_step_reproduces_every_measured_row(ref) -> None:
    model = build(ref.tables, ref.machine, ref.machine)
    assert model.cal.split and model.cal.rows == len(synth.E2E)
    for fam, factor in synth.FACTORS.items():           # each family's in-step / suite factor, found
        assert {round(v, 9) for _, v in model.cal.factors[fam]} == {factor}
    for r in table_rows(ref.tables["e2e"], "e2e"):
        s = answer(model, query_of(r))
        assert s.step_ms == pytest.approx(r.step_ms_p50, rel=1e-9)
        for fam in ("moe", "attention", "dense", "lm_head", "tree", "gpu_other"):
            assert s.ms[fam] == pytest.approx(getattr(r, f"{fam}_ms"), rel=1e-9, abs=1e-12)
        assert s.ms["host"] == pytest.approx(r.outside_ms, rel=1e-9)
        assert s.extrapolated == () and s.carries == ("composition",)


def test_a_composed_step_answers_from_the_other_families_not_its_own_row(ref) -> None:
    # calibrating without a configuration's rows still lands on them: the families follow the kernel
    # models and the factors and gpu_other lines the other rows
    rows = table_rows(ref.tables["e2e"], "e2e")
    held = [r for r in rows if (r.tp, r.concurrency, r.budget) == (2, 4, 16)]
    model = build(ref.tables, ref.machine, ref.machine, [r for r in rows if r not in held])
    for r in held:
        assert answer(model, query_of(r)).step_ms == pytest.approx(r.step_ms_p50, rel=1e-9)


def test_leaving_the_measured_shapes_is_labelled(ref) -> None:
    model = build(ref.tables, ref.machine, ref.machine)
    inside = answer(model, Query(1, 4, 16, 512, 2.5))          # M = 68 between 64 and 128, context 512
    assert "moe M" in inside.interpolated and "attention context" in inside.interpolated
    assert not {"moe M", "attention context"} & set(inside.extrapolated)
    assert "moe in-step factor context" in inside.extrapolated    # the factor was measured at contexts <= 256
    far = answer(model, Query(1, 64, 16, 8192, 2.5))          # M = 1088 > 512, context 8192 > 1024
    assert {"moe M", "attention context", "attention batch"} <= set(far.extrapolated)
    assert {"size:moe", "size:attention"} <= set(far.carries)
    wide = answer(model, Query(4, 4, 16, 256, 2.5))           # TP-4: no rows, no points at that degree
    assert "tp" in wide.carries and any("re-sharded from TP-2" in n for n in wide.notes)
    # beyond the sweep the kernel model still follows its fit: the MoE grows with M, never flat
    assert far.ms["moe"] > answer(model, Query(1, 16, 16, 1024, 2.5)).ms["moe"]


def test_a_degree_measured_at_one_token_count_takes_the_token_trend_of_another() -> None:
    # TP-8 measured at 17 and 272 tokens; TP-1 at 272 only: TP-1 at 17 follows TP-8's trend from 272 to 17
    samples = [({"tp": 8, "tokens": 17, "context": 512}, 0.9), ({"tp": 8, "tokens": 272, "context": 512}, 1.1),
               ({"tp": 1, "tokens": 272, "context": 512}, 1.2)]
    got = in_step_factor(samples, {"tp": 1, "tokens": 17, "context": 512})
    assert got.value == pytest.approx(1.2 * 0.9 / 1.1)
    assert "tokens" in got.extrapolated                         # borrowed, not measured: still said
    assert in_step_factor(samples, {"tp": 1, "tokens": 272, "context": 512}).value == pytest.approx(1.2)
    assert in_step_factor(samples, {"tp": 8, "tokens": 17, "context": 512}).value == pytest.approx(0.9)
    # beyond every degree's tokens there is no trend to borrow: the edge is held, as before
    far = in_step_factor(samples, {"tp": 1, "tokens": 4096, "context": 512})
    assert far.value == pytest.approx(1.2 * 1.1 / 1.1) and "tokens" in far.extrapolated
    # between degrees: each degree's value, then linear in log tp
    mid = in_step_factor(samples, {"tp": 2, "tokens": 17, "context": 512})
    assert 1.2 * 0.9 / 1.1 > mid.value > 0.9 and "tp" in mid.interpolated


def test_gpu_other_at_a_degree_measured_at_one_token_count_grows_as_the_nearest_degree_does() -> None:
    # per layer: TP-8 0.10 ms at 17 tokens, 0.15 at 272; TP-1 0.30 at 272 only. TP-1 takes TP-8's growth
    # relative to its level (x 2): 0.20 at 17. Scaling TP-8's slope by the degrees (x 8) gave a line
    # through zero at 17 tokens, where the kernels' measured time is far from zero.
    lines = per_layer_lines([({"tp": 8, "tokens": 17}, 0.10), ({"tp": 8, "tokens": 272}, 0.15),
                             ({"tp": 1, "tokens": 272}, 0.30)])
    assert per_layer_at(lines, 1, 17).value == pytest.approx(0.20)
    assert per_layer_at(lines, 1, 272).value == pytest.approx(0.30)
    assert per_layer_at(lines, 8, 17).value == pytest.approx(0.10)


def test_an_in_step_factor_follows_the_step_depth_before_its_context() -> None:
    # at 308 tokens of context only shallow steps were measured; full-depth steps at 1024 and up: a
    # full-depth query at 308 takes the full-depth factor (per-step ops weigh more in a shallow step)
    samples = [({"tp": 8, "tokens": 17, "layers": 2, "context": 308}, 1.10),
               ({"tp": 8, "tokens": 17, "layers": 10, "context": 308}, 1.02),
               ({"tp": 8, "tokens": 17, "layers": 61, "context": 1024}, 0.93),
               ({"tp": 8, "tokens": 17, "layers": 61, "context": 8192}, 0.95)]
    got = in_step_factor(samples, {"tp": 8, "tokens": 17, "layers": 61, "context": 308})
    assert got.value == pytest.approx(0.93) and "context" in got.extrapolated
    assert in_step_factor(samples, {"tp": 8, "tokens": 17, "layers": 2, "context": 308}).value == pytest.approx(1.10)


def test_tokens_per_s_and_the_memory_check_by_hand(ref, inv: Inventory) -> None:
    model = build(ref.tables, ref.machine, ref.machine)
    s = answer(model, Query(2, 4, 16, 256, 2.5, layers=3))
    assert s.tokens_per_s == pytest.approx(4 * 3.5 / (s.step_ms + s.ms["comm"]) * 1e3)
    assert s.ms["comm"] > 0 and answer(model, Query(1, 4, 16, 256, 2.5)).ms["comm"] == 0
    cfg = make_config("k2-mini")
    # the latent cache: (512 + 64) x 2 bytes a token a layer, for the context and the tree's B + 1 tokens
    assert cache_bytes(K2, 1, 32768, 16, 61) == pytest.approx(576 * 2 * 61 * (32768 + 17))
    assert s.memory.parts["cache"] == pytest.approx(cache_bytes(cfg, 4, 256, 16, 3))
    assert s.memory.parts["weights"] == pytest.approx(weight_bytes(cfg, 2, 3)) and s.memory.fits
    assert s.memory.parts["working"] > RESERVE_BYTES
    # one TP-8 rank of K2 holds ~80 GB of weights: it fits an H200 at 8k context, not 64 sequences at 128k
    h200 = inv.specs["h200-sxm"]
    assert 70e9 < weight_bytes(K2, 8, 61) < 90e9
    assert memory(K2, Query(8, 16, 16, 8192, 4.0), h200).fits
    big = memory(K2, Query(8, 64, 16, 131072, 4.0), h200)
    assert not big.fits and big.why_not().startswith("does not fit: needs") and "cache" in big.why_not()
    assert big.why_not().endswith("the GPU has 141 GiB")
    # the spec's "80 GB" is 80 GiB (85.9e9 bytes): one TP-8 rank at C = 1 fits, with little to spare
    one = memory(K2, Query(8, 1, 16, 1024, 4.0), inv.specs["h100-sxm"])
    assert one.capacity == 80 * 2**30 and 80e9 < one.need < one.capacity and one.fits
    assert one.tight().startswith("tight: ") and one.tight().endswith(" GiB to spare")
    assert memory(K2, Query(8, 1, 16, 1024, 4.0), h200).tight() == "" and big.tight() == ""


def test_the_kernel_model_extrapolates_along_its_roofline(ref) -> None:
    pts = [k for k in table_rows(ref.tables["kernels"], "kernels") if k.kernel == "moe_w4a16"]
    model = fit_family("moe_w4a16", [p for p in pts if p.M <= 64], synth.BW, synth.TF)
    for p in (p for p in pts if p.M > 64):        # held out: the fit on the smaller sizes finds them
        got, how = model.time_us((p.tp,), MoeShape.of(p), p.bytes, p.flops)
        assert got.value == pytest.approx(p.time_us_p50, rel=1e-6) and got.extrapolated == ("M",) and how == ""
    fit = model.classes[(1,)].fit
    assert fit.latency_us == pytest.approx(synth.MOE[1][0]) and 1e-6 / fit.us_per_flop == pytest.approx(synth.MOE_TF)


def test_a_step_runs_each_family_at_its_shape_record_of_one_rank() -> None:
    """K2 at TP-8 (DESIGN.md): gate_up N = 512 a rank, 8 of the 64 heads; the tree kernels are whole."""
    assert shape_at("moe_w4a16", K2, 8, tokens=16) == MoeShape(16, 512, 7168, 384, 8)
    # a rank's intermediate is whole, as engine.bench_kernels records it (an import at TP-3 wrote 1365 rows)
    assert shape_at("moe_w4a16", K2, 3, tokens=1).gate_up_rows == 2 * 682
    mla = shape_at("mla_tree_attention", K2, 8, batch=2, budget=32, context=8192)
    assert mla == MlaShape(2, 32, 8192, 8, 576) and along(mla) == {"batch": 2, "budget": 32, "context": 8192}
    assert shape_at("build_tree", K2, 1, batch=2, budget=32) == TreeShape(2, 32, K2.draft_len, K2.draft_topk)
    assert shape_at("tree_accept", K2, 1, batch=2, budget=32) == AcceptShape(2, 32)
    assert along(MoeShape(16, 512, 7168, 384, 8)) == {"M": 16}   # the axes by the columns the labels name


def test_little_law_carries_bytes_in_flight_not_a_share_of_bandwidth(inv: Inventory) -> None:
    h200, pro, b300 = (inv.specs[n] for n in ("h200-sxm", "rtx-pro-6000-server", "b300-sxm"))
    ref = Side.of(h200, 4200.0, 790.0)
    # 2 TB/s achieved on 132 SMs: 188 SMs with the same bytes in flight would move 2.85 TB/s, more than the
    # PRO 6000's copy ceiling of 1.4 TB/s, so it reaches that ceiling; a fixed share would give 0.67 TB/s
    assert memory_gbps(2000.0, ref, Side.of(pro, 1400.0, 400.0), LITTLE) == pytest.approx(1400.0)
    # a B300 (160 SMs, 7 TB/s copy) needs more bytes in flight per SM than the kernel keeps: 2.42 TB/s
    assert memory_gbps(2000.0, ref, Side.of(b300, 7000.0, 1800.0), LITTLE) == pytest.approx(2000.0 * 160 / 132)
    # without an SM count on a spec sheet, the share of the copy ceiling carries, whatever form is asked
    no_sms = Side(7000.0, 1800.0, None, None)
    assert how(ref, no_sms) == SHARE and others(ref, no_sms) == ()
    assert memory_gbps(2000.0, ref, no_sms) == pytest.approx(2000.0 / 4200.0 * 7000.0)
    # a known latency on both sides scales it too
    slow = dataclasses.replace(Side.of(b300, 7000.0, 1800.0), latency_ns=800.0)
    assert memory_gbps(2000.0, dataclasses.replace(ref, latency_ns=600.0), slow, LITTLE) == \
        pytest.approx(2000.0 * 160 / 132 * 600 / 800)


def test_the_harmonic_carrier_moves_with_the_copy_ceiling_where_the_sms_are_the_same(inv: Inventory) -> None:
    """An H100 and an H200 are one die with 132 SMs: Little's law gave the same bytes/s on both (the
    H100 -> H200 backtest came out as slow as the H100), while the H200 moves more with the same kernel. The
    harmonic carrier splits a point's time into bytes / copy + bytes / in-flight rate and carries only the
    second by the SMs, so the first follows the target's copy ceiling."""
    h100, h200, pro = (inv.specs[n] for n in ("h100-sxm", "h200-sxm", "rtx-pro-6000-server"))
    ref, tgt = Side.of(h100, 3000.0, 700.0), Side.of(h200, 4200.0, 700.0)
    assert how(ref, tgt) == HARMONIC
    wait = 1 / 2800.0 - 1 / 3000.0          # 1 / the in-flight rate on the H100
    assert memory_gbps(2800.0, ref, tgt) == pytest.approx(1 / (1 / 4200.0 + wait))   # 3.82 TB/s
    assert memory_gbps(2800.0, ref, tgt, LITTLE) == pytest.approx(2800.0)            # Little: unmoved
    assert memory_gbps(2800.0, ref, ref) == pytest.approx(2800.0)                    # a machine onto itself
    assert memory_gbps(3100.0, ref, tgt) == pytest.approx(4200.0)   # at (or past) copy: the target's copy
    # the in-flight rate scales with the SMs: 188 against 132
    to_pro = Side.of(pro, 1400.0, 400.0)
    assert memory_gbps(2800.0, ref, to_pro) == pytest.approx(1 / (1 / 1400.0 + wait * 132 / 188))
    # with no latency on either side the form is a guess: a band must hold the other candidates' figures
    assert others(ref, tgt) == (LITTLE, SHARE)
    assert others(dataclasses.replace(ref, latency_ns=600.0), dataclasses.replace(tgt, latency_ns=600.0)) == ()
    with pytest.raises(ValueError):
        memory_gbps(2800.0, ref, tgt, "fixed")


def test_cross_host_answers_carry_and_say_so(ref, inv: Inventory) -> None:
    model = build(ref.tables, ref.machine, machine_of(inv, "b300"))
    here = answer(build(ref.tables, ref.machine, ref.machine), Query(2, 4, 16, 256, 2.5))
    there = answer(model, Query(2, 4, 16, 256, 2.5))
    assert "cross-host" in there.carries and "cross-host" not in here.carries
    assert there.ms["moe"] < here.ms["moe"]                 # more bandwidth and SMs: the MoE runs faster
    assert there.ms["tree"] == pytest.approx(here.ms["tree"])   # latency-bound tree kernels stay as measured
    assert there.ms["host"] == pytest.approx(here.ms["host"])


def _lm_head_points(bw: float, tf: float) -> list:
    """A synthetic lm-head sweep: the weights read at every M (bytes nearly constant), the math growing with M,
    time the sum of the two at 95 % of copy and 80 % of the matmul ceiling."""
    from engine.rows import KernelRow

    weights = 2.35e9
    return [KernelRow(kernel="dense_gemm", impl="torch", dtype="bfloat16", op="lm_head", M=m, N=163840, K=7168,
                      bytes=weights + m * 7168 * 2.0, flops=2.0 * m * 163840 * 7168,
                      time_us_p50=(weights + m * 7168 * 2.0) / (0.95 * bw * 1e3)
                      + 2.0 * m * 163840 * 7168 / (0.8 * tf * 1e6))
            for m in (1, 16, 64, 256, 1024, 4096)]


def test_a_weight_stream_stays_in_the_bandwidth_term_where_the_bytes_barely_vary(inv: Inventory) -> None:
    """A dense GEMM reads its weights at every M: bytes nearly constant, so least squares may put the whole
    stream in the latency, which the carrier keeps as is (the H200 -> H100 backtest had the lm-head's
    518 us carried unchanged onto a machine with 0.7x the bandwidth). Its memory-bound points' bytes move at
    the copy bandwidth, so the stream carries with the bandwidth."""
    from flows.analysis.kernelfit import Carry

    bw, tf = 4200.0, 790.0
    pts = _lm_head_points(bw, tf)
    cls = fit_family("dense_gemm", pts, bw, tf).classes[("lm_head", 1)]
    assert 1e-3 / cls.fit.us_per_byte == pytest.approx(bw)
    h200, h100 = inv.specs["h200-sxm"], inv.specs["h100-sxm"]
    slower = Carry(Side.of(h200, bw, tf), Side.of(h100, 0.7 * bw, tf)).fit(cls.fit)
    at_one = pts[0].bytes, pts[0].flops
    assert slower.us(*at_one) == pytest.approx(cls.fit.us(*at_one) / 0.7, rel=0.03)


def test_a_compute_bound_point_carries_by_the_compute_ceiling_alone(inv: Inventory) -> None:
    """The additive fit keeps a byte term at a compute-bound point; carried by the memory carrier it made a
    large-M dense GEMM faster on a machine of more bandwidth and the same math (the H100 -> H200 compute-bound
    dense rows came out too fast). A point the fit calls compute-bound moves with the compute ceilings alone;
    a memory-bound one still moves with the copy ceiling."""
    from flows.analysis.families import shape_of
    from flows.analysis.kernelfit import Carry

    bw, tf = 3000.0, 790.0
    pts = _lm_head_points(bw, tf)
    model = fit_family("dense_gemm", pts, bw, tf)
    h100, h200 = inv.specs["h100-sxm"], inv.specs["h200-sxm"]
    more_bw = lambda dtype: Carry(Side.of(h100, bw, tf), Side.of(h200, 1.4 * bw, tf))  # noqa: E731
    more_tf = lambda dtype: Carry(Side.of(h100, bw, tf), Side.of(h200, bw, 2 * tf))  # noqa: E731

    def at(p, carry=None) -> float:
        got = model.time_us(("lm_head", 1), shape_of(p), p.bytes, p.flops, carry)
        assert got is not None
        return got[0].value

    small, large = pts[0], pts[-1]
    assert at(large, more_bw) == pytest.approx(at(large), rel=1e-9)    # compute-bound: the math did not move
    assert at(small, more_bw) < at(small) / 1.3                        # memory-bound: it moves with copy
    lat = model.classes[("lm_head", 1)].fit.latency_us                 # type: ignore[union-attr]
    assert at(large, more_tf) == pytest.approx(lat + (at(large) - lat) / 2, rel=1e-9)
