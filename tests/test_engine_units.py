"""Small pure pieces of the engine against plain math: configs, expected experts, percentiles, arch checks."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from engine.costs import expected_experts, prefill_flops
from engine.config import K2, K2_MINI, make_config
from engine.env import UsageError, check_arch, pick_device
from engine.timing import flush_l2, host_us, percentile, time_op


def test_k2_config_has_kimi_k2_per_layer_dims():
    c = K2
    assert (c.hidden, c.heads, c.q_lora, c.kv_lora, c.rope_dim, c.nope_dim, c.v_dim) == (7168, 64, 1536, 512, 64, 128, 128)
    assert (c.experts, c.top_k, c.moe_inter, c.shared_experts, c.vocab, c.layers) == (384, 8, 2048, 1, 163840, 61)
    short = make_config("k2", layers=2, vocab=32768)
    assert (short.layers, short.vocab, short.hidden) == (2, 32768, 7168)
    with pytest.raises(ValueError, match="unknown config"):
        make_config("k3")


def test_expected_experts_matches_k2_table():
    want = {1: 8, 4: 31, 8: 59.5, 16: 110, 32: 188, 64: 284, 128: 358, 256: 382}
    for m, e in want.items():
        assert expected_experts(384, 8, m) == pytest.approx(e, abs=0.6)


def test_prefill_flops_count_each_gemm_once_a_token_and_attention_once_a_pair():
    """k2-mini counted by hand: every layer's projections (q_a 64x128, q_b 192x64, kv_a 80x128, w_uk and
    w_uv 4 x 64x32, o 128x128 = 63,488 MACs), the MoE layers' gate, shared expert and 4 routed experts
    (2,048 + 24,576 + 4 x 24,576), the dense layer's FFN (98,304), the lm-head once (65,536 MACs), and
    causal attention over 3 layers x 4 heads x (48 + 32) dims a pair of tokens."""
    per_token = 2 * (3 * 63_488 + 2 * (2_048 + 24_576 + 4 * 24_576) + 98_304)
    pairs = 64 * 65 // 2
    assert prefill_flops(K2_MINI, 64) == 64 * per_token + 2 * 65_536 + 3 * 4 * 2 * 80 * pairs
    # TP-8 shards the heads and the FFNs, not the replicated q_a / kv_a / gate: more than an eighth
    k2_1, k2_8 = prefill_flops(K2, 8192), prefill_flops(K2, 8192, tp=8)
    assert k2_1 / 8 < k2_8 < k2_1 / 4
    assert 9e9 < (prefill_flops(K2, 2, tp=8) - prefill_flops(K2, 1, tp=8)) < 10e9   # ~9.5 GFLOP a token a rank


def test_percentile_matches_numpy():
    xs = list(np.random.default_rng(0).random(37))
    for q in (0, 10, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_time_op_on_cpu_counts_repeats():
    calls = []
    t = time_op(lambda: calls.append(1), torch.device("cpu"), repeats=7, warmup=2)
    assert len(calls) == 9 and t.repeats == 7 and not t.graph
    assert 0 <= t.p10_us <= t.p50_us <= t.p90_us


def test_host_us_times_calls_back_to_back_per_call(monkeypatch: pytest.MonkeyPatch):
    """The median round's time over its calls: rounds of back-to-back calls after the warm-up."""
    import engine.timing as timing

    clock = iter(range(0, 10_000, 1))  # perf_counter advances 1 s a reading
    calls = []
    monkeypatch.setattr(timing.time, "perf_counter", lambda: float(next(clock)))
    us = host_us(lambda: calls.append(1), torch.device("cpu"), calls=4, rounds=3, warmup=2)
    assert len(calls) == 2 + 4 * 3
    assert us == pytest.approx(1e6 / 4), "one second a round of four calls"


def test_host_us_takes_the_median_of_many_rounds(monkeypatch: pytest.MonkeyPatch):
    """Twenty rounds by default: one slow round in five (a stall while the GPU queue is long) does not
    move the figure."""
    import engine.timing as timing

    rounds_seen = []
    readings = iter([t for r in range(20) for t in (100.0 * r, 100.0 * r + (50 if r % 5 == 0 else 1))])
    clock = lambda: next(readings)  # noqa: E731 - a round's start and end: 1 s, every fifth 50 s
    monkeypatch.setattr(timing.time, "perf_counter", clock)
    us = host_us(lambda: rounds_seen.append(1), torch.device("cpu"), calls=1, warmup=0)
    assert len(rounds_seen) == 20
    assert us == pytest.approx(1e6), "one second a call in four rounds of five"


def test_the_l2_flush_only_reads_its_buffer():
    """A flush that writes (a zeroed buffer) leaves dirty lines that the timed op then pays to write back."""
    scratch = torch.full((1 << 16,), 7, dtype=torch.uint8)
    flush_l2(scratch)
    assert bool((scratch == 7).all())


def test_arch_and_device_checks():
    cpu = {"device": "cpu", "arch_found": "cpu", "gpu_name": None}
    h200 = {"device": "cuda", "arch_found": "sm_90", "gpu_name": "NVIDIA H200"}
    check_arch("cpu", cpu)
    check_arch("sm_90", h200)
    with pytest.raises(UsageError, match="no CUDA GPU"):
        check_arch("sm_100", cpu)
    with pytest.raises(UsageError, match="does not match.*sm_90"):
        check_arch("sm_120", h200)
    with pytest.raises(UsageError, match="does not match"):
        check_arch("cpu", h200)
    assert pick_device("auto", cpu).type == "cpu"
    with pytest.raises(UsageError, match="no CUDA GPU"):
        pick_device("cuda", cpu)


def test_busy_windows_union_kernels_between_marks():
    from engine.gpu_busy import MARK, busy_per_window

    ms = 1_000_000  # ns
    acts = [
        ("hint_kernel", 0, 5 * ms),                # before the first mark: harness work, not counted
        (f"at::cuda::{MARK}(long)", 10 * ms, 10 * ms + 1),
        ("gemm", 11 * ms, 13 * ms),
        ("copy", 12 * ms, 14 * ms),                # overlaps gemm: the union counts 11..14
        ("attn", 20 * ms, 21 * ms),
        (f"at::cuda::{MARK}(long)", 30 * ms, 30 * ms + 1),
        ("hint_kernel", 31 * ms, 40 * ms),         # between steps: not counted
        (f"at::cuda::{MARK}(long)", 50 * ms, 50 * ms + 1),
        ("inner", 52 * ms, 53 * ms),
        ("nested", 52 * ms + 1, 52 * ms + 2),      # inside the previous interval: adds nothing
        (f"at::cuda::{MARK}(long)", 60 * ms, 60 * ms + 1),
    ]
    got = busy_per_window(reversed(acts))  # input order does not matter
    assert got == pytest.approx([0.004, 0.001])


def test_busy_split_by_family_sections_and_gemm_names():
    from engine.gpu_busy import MARK, SECTION_MARK, split_per_window

    ms = 1_000_000  # ns; kernels of one stream run one after another, markers between them
    sec = lambda f, t: (f"{SECTION_MARK}{f}", t - 10, t - 9)  # noqa: E731
    acts = [
        (f"at::cuda::{MARK}(long)", 0, 1),
        ("nvjet_tst_128x64_64x8_bz_TNT", 1 * ms, 2 * ms),           # a GEMM outside any section: dense
        sec("attention", 3 * ms), ("_mla_split", 3 * ms, 5 * ms), ("_mla_combine", 5 * ms, 6 * ms),
        sec("attention", 6 * ms),
        ("triton_poi_fused_rms_norm", 6 * ms, 7 * ms),              # neither a section nor a GEMM: other
        sec("moe", 7 * ms), ("moe_align", 7 * ms, 8 * ms), ("vectorized_elementwise_kernel", 8 * ms, 9 * ms),
        ("sm90_xmma_gemm_bf16bf16", 8 * ms + 5, 10 * ms),          # in a section: its family, whatever its name;
        sec("moe", 10 * ms + 20),                                  # overlapping: only its part past 9 ms counts
        sec("lm_head", 11 * ms), ("cutlass_80_tensorop_gemm", 11 * ms, 13 * ms), sec("lm_head", 13 * ms),
        sec("tree", 14 * ms), ("_tree_fifo", 14 * ms, 15 * ms), sec("tree", 15 * ms),
        (f"at::cuda::{MARK}(long)", 20 * ms, 20 * ms + 1),
        ("cutlass_gemm", 21 * ms, 22 * ms),                        # between steps: not counted
    ]
    (got,) = split_per_window(reversed(acts))
    assert got == pytest.approx({"dense": 0.001, "attention": 0.003, "other": 0.001, "moe": 0.003,
                                 "lm_head": 0.002, "tree": 0.001})


def test_the_model_brackets_each_family_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the sections on, every attention, MoE and lm-head call of a forward and of the drafter
    is bracketed by its family's marker (a CPU forward of k2-mini, the markers recorded)."""
    from engine import gpu_busy
    from engine.config import make_config
    from engine.decode import Decoder
    from engine.drafter import BlockDrafter
    from engine.model import TargetModel

    seen: list[str] = []
    monkeypatch.setattr(gpu_busy, "_markers", {})
    monkeypatch.setattr(gpu_busy, "_section_marker", lambda fam: lambda: seen.append(fam))
    cfg = make_config("k2-mini")
    model = TargetModel(cfg, torch.device("cpu"), torch.float32)
    dec = Decoder(model, BlockDrafter(model))
    with gpu_busy.sections():
        dec.speculative([[1, 2, 3, 4]], 3, 16, 0.8, graphs=False)
    assert seen and all(seen[i] == seen[i + 1] for i in range(0, len(seen), 2))  # each one opened, closed
    opened = seen[::2]
    prefill = ["attention"] + ["attention", "moe"] * (cfg.layers - cfg.dense_layers) + ["lm_head"]
    step = ["attention", "lm_head", "tree"] + prefill[:-1] + ["lm_head", "tree"]
    assert opened[:len(prefill)] == prefill
    assert opened[len(prefill):len(prefill) + len(step)] == step
    seen.clear()
    dec.speculative([[1, 2, 3, 4]], 3, 16, 0.8, graphs=False)  # sections off: no marker launched
    assert seen == []


def test_synthetic_int4_codes_average_zero() -> None:
    """Uniform nibbles average -0.5: a common mode that grows through the residual stream at depth."""
    from engine.model import Init
    from kernels.int4 import unpack_w4
    q, _ = Init(0, torch.device("cpu"), torch.float32).int4(40, 64, 256)
    codes = unpack_w4(q).float()
    assert codes.min() >= -7 and abs(codes.mean()) < 0.02


def test_typed_rows_are_the_schema_columns_and_refuse_any_other() -> None:
    """engine.rows: one row class a table, written out from engine.schema (the same columns and types, each at the
    default a file without it means); an unknown column is an error where the row is made; each kernel
    family's shape lands in the stored columns it always used; the states are the schema's."""
    from dataclasses import fields

    from engine import rows, schema, table_files

    py = {pa.string(): "str", pa.int64(): "int", pa.float64(): "float"}
    for table, cls in rows.ROWS.items():
        assert [f.name for f in fields(cls)] == schema.SCHEMAS[table].names
        assert [f.type for f in fields(cls)] == [f"{py[c.type]} | None" for c in schema.SCHEMAS[table]]
        assert cls.__dataclass_params__.frozen and all(f.kw_only for f in fields(cls))
        defaults = schema.column_defaults(table)
        assert {f.name: f.default for f in fields(cls) if f.default is not None} == \
            {k: v for k, v in defaults.items() if v is not None}
    with pytest.raises(TypeError, match="time_us"):
        rows.KernelRow(kernel="moe_w4a16", time_us=1.0)
    # provenance: the keys a file carries, then the controller's; read ignoring others, written without Nones
    assert tuple(f.name for f in fields(rows.Provenance)) == schema.PROVENANCE_KEYS + schema.ADDED_PROVENANCE_KEYS
    prov = rows.Provenance(run_id="r", host="h", references=["a"])
    table = table_files.to_table("comm", [], prov)
    assert table_files.provenance(table) == {"run_id": "r", "host": "h", "references": ["a"]}
    other = table_files.to_table("comm", [], {"run_id": "r", "other": 1})
    assert rows.Provenance.of(other) == rows.Provenance(run_id="r")
    assert rows.E2ERow().status == "ok" and rows.KernelRow().tp == 1
    assert rows.MoeShape(4, 256, 128, 16, 4).columns() == {"M": 4, "N": 256, "K": 128, "E": 16, "top_k": 4}
    assert rows.MlaShape(2, 16, 1024, 8, 576).columns() == {"batch": 2, "budget": 16, "context": 1024, "N": 8, "K": 576}
    assert rows.TreeShape(1, 64, 16, 8).columns() == {"batch": 1, "budget": 64, "N": 16, "K": 8}
    assert rows.DenseShape("o", 4, 7168, 1024, 1).columns() == {"op": "o", "M": 4, "N": 7168, "K": 1024, "batch": 1}
    for shape in (rows.MoeShape, rows.MlaShape, rows.TreeShape, rows.AcceptShape, rows.DenseShape):
        assert set(shape.COLUMNS.values()) <= set(schema.SCHEMAS["kernels"].names)
    # a kernels row read back as its family's shape: the inverse of columns(), other columns ignored
    for s in (rows.MoeShape(4, 256, 128, 16, 4), rows.MlaShape(2, 16, 1024, 8, 576), rows.TreeShape(1, 64, 16, 8),
              rows.AcceptShape(2, 32), rows.DenseShape("o", 4, 7168, 1024, 1)):
        assert type(s).of(rows.KernelRow(kernel="k", time_us_p50=1.0, tp=8, **s.columns())) == s
    assert schema.STATES["runs"]["status"] == tuple(schema.RunStatus) == ("complete", "partial", "skipped")
    assert schema.STATES["e2e"]["status"] == schema.STATES["comm"]["status"] == tuple(schema.PointStatus)
    table = table_files.to_table("e2e", [rows.E2ERow(run_id="r", config="k2", device="cpu", concurrency=1, budget=16,
                                                source="measured", status=schema.PointStatus.SKIPPED)], {"run_id": "r"})
    assert table.column("status").to_pylist() == ["skipped"] and table.column("tp").to_pylist() == [1]
    assert tuple(schema.CommSource) == ("measured", "modelled", "none")   # the stored words, as before the enum
    table = table_files.to_table("e2e", [rows.E2ERow(run_id="r", config="k2", device="cpu", concurrency=1, budget=16,
                                                source="measured", comm_source=schema.CommSource.MODELLED)],
                            {"run_id": "r"})
    assert table.column("comm_source").to_pylist() == ["modelled"]


def test_a_suite_writer_takes_its_tables_rows_only(tmp_path) -> None:  # noqa: ANN001
    from engine import results
    from engine.rows import CommRow, KernelRow

    w = results.SuiteWriter(tmp_path, "comm", "smoke", {"run_id": "r", "host": "h"}, 1)
    with pytest.raises(TypeError, match="CommRow"):
        w.add({"op": "all_reduce", "world_size": 2, "bytes": 1, "status": "ok"})
    with pytest.raises(TypeError, match="CommRow"):
        w.add(KernelRow(kernel="moe_w4a16"))
    w.add(CommRow(op="all_reduce", world_size=2, bytes=1, status="ok"))
    assert w.rows[0].run_id == "r" and w.rows[0].source == "measured"
