"""Tensor parallelism and depth on k2-mini: shard shapes, every rank together equals the one model,
reproducible decodes at depth, the comm model."""

from __future__ import annotations

import functools
import threading
from dataclasses import replace

import pytest
import torch

from engine import comm_model
from engine import tp as tpar
from engine.bench_e2e import prompts_for
from engine.config import make_config
from engine.decode import Decoder
from engine.drafter import BlockDrafter
from engine.model import TargetModel, residual_gain

CPU = torch.device("cpu")
# k2-mini with an expert intermediate that TP 4 still splits into whole INT4 groups (4 x 32)
CFG = replace(make_config("k2-mini", layers=4), moe_inter=128)


class _Group:
    """N rank threads meeting at each collective; the combination runs in rank order, so every
    rank gets the bit-identical result (as NCCL gives every rank the same sum)."""

    def __init__(self, n: int):
        self.n, self.slots, self.barrier = n, [None] * n, threading.Barrier(n, timeout=120)

    def exchange(self, rank: int, t: torch.Tensor, combine):
        self.slots[rank] = t
        self.barrier.wait()
        out = combine(list(self.slots))
        self.barrier.wait()
        return out


class _ThreadComm(tpar.Comm):
    def __init__(self, group: _Group, rank: int):
        self.group, self.rank = group, rank

    def all_reduce(self, t):
        return self.group.exchange(self.rank, t, lambda xs: functools.reduce(torch.add, xs))

    def all_gather(self, t):
        return self.group.exchange(self.rank, t, torch.stack)


def _run_ranks(cfg, n: int, work):
    """work(decoder) on every rank of a TP-n model at once; returns each rank's result."""
    group = _Group(n)
    out, errors = [None] * n, []

    def rank_main(r: int) -> None:
        try:
            m = TargetModel(cfg, CPU, torch.float32, seed=5, tp=n, rank=r, comm=_ThreadComm(group, r))
            out[r] = work(Decoder(m, BlockDrafter(m, seed=6)))
        except BaseException as e:  # noqa: BLE001 - reported below, the other ranks see a broken barrier
            errors.append(e)
            group.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


@pytest.fixture(scope="module")
def full():
    m = TargetModel(CFG, CPU, torch.float32, seed=5)
    dec = Decoder(m, BlockDrafter(m, seed=6))
    prompts = prompts_for(CFG, 3, (5, 20))
    return dec, prompts, dec.greedy(prompts, 20)


@pytest.mark.parametrize("n", [2, 4])
def test_every_rank_together_decodes_as_the_one_model(full, n):
    dec, prompts, ref = full
    got = _run_ranks(CFG, n, lambda d: (d.greedy(prompts, 20).tokens, d.speculative(prompts, 20, 16, 0.8).tokens))
    for greedy, spec in got:
        assert greedy == ref.tokens
        assert spec == ref.tokens


@pytest.mark.parametrize("n", [2, 4])
def test_shards_have_one_gpus_shapes_and_tile_the_full_weights(n):
    cfg = replace(CFG, layers=2)
    whole = TargetModel(cfg, CPU, torch.float32, seed=2)
    ranks = [TargetModel(cfg, CPU, torch.float32, seed=2, tp=n, rank=r) for r in range(n)]
    h, e, i, nh = cfg.hidden, cfg.experts, cfg.moe_inter, cfg.heads
    dense, moe = ranks[0].layers
    assert ranks[0].heads == nh // n
    assert dense["q_b"].shape == (nh // n * cfg.qk_dim, cfg.q_lora)
    assert dense["w_uk"].shape == (nh // n, cfg.nope_dim, cfg.kv_lora)
    assert dense["o"].shape == (h, nh // n * cfg.v_dim)
    assert dense["w13"].shape == (2 * cfg.dense_inter // n, h) and dense["w2"].shape == (h, cfg.dense_inter // n)
    assert moe["w13_q"].shape == (e, 2 * i // n, h // 8) and moe["w13_s"].shape == (e, 2 * i // n, h // 32)
    assert moe["w2_q"].shape == (e, h, i // n // 8) and moe["w2_s"].shape == (e, h, i // n // 32)
    assert moe["sh_w13"].shape == (2 * i // n, h) and moe["sh_w2"].shape == (h, i // n)
    assert moe["q_a"].shape == (cfg.q_lora, h) and moe["kv_a"].shape == (cfg.kv_lora + cfg.rope_dim, h)
    assert ranks[0].lm_head.shape == (cfg.vocab // n, h)
    assert [r.vocab_offset for r in ranks] == [k * cfg.vocab // n for k in range(n)]
    # the shards are slices of the one model: row-parallel ones concatenate back along their inputs,
    # column-parallel ones (gate and up halves each) along their outputs
    for li in range(2):
        w, parts = whole.layers[li], [r.layers[li] for r in ranks]
        assert torch.equal(torch.cat([p["o"] for p in parts], 1), w["o"])
        assert torch.equal(torch.cat([p["q_b"] for p in parts], 0), w["q_b"])
        assert torch.equal(parts[1]["q_a"], w["q_a"])
        key13, key2, dim = ("w13", "w2", 0) if li == 0 else ("w13_q", "w2_q", 1)
        halves = [p[key13].chunk(2, dim) for p in parts]
        assert torch.equal(torch.cat([g for g, _ in halves] + [u for _, u in halves], dim), w[key13])
        assert torch.equal(torch.cat([p[key2] for p in parts], dim + 1), w[key2])
    assert torch.equal(torch.cat([r.lm_head for r in ranks]), whole.lm_head)


@pytest.mark.parametrize("tp,needle", [(3, "heads"), (16, "1..8"), (0, "1..8")])
def test_tp_that_does_not_split_the_model_is_refused(tp, needle):
    with pytest.raises(ValueError, match=needle):
        tpar.check(CFG, tp)
    with pytest.raises(ValueError, match="moe_inter"):
        tpar.check(make_config("k2-mini"), 4)  # 64 / 4 = 16: not a whole INT4 group


def test_weight_sets_rotate_and_each_layer_keeps_its_cache():
    cfg = replace(CFG, layers=7)
    m = TargetModel(cfg, CPU, torch.float32, seed=1, weight_sets=2)
    assert m.weight_sets == 2 and len(m.layers) == 7
    assert m.layers[1] is m.layers[3] is m.layers[5] and m.layers[2] is m.layers[4] is m.layers[6]
    assert m.layers[1] is not m.layers[2] and "w13" in m.layers[0]
    assert TargetModel(cfg, CPU, torch.float32, seed=1).weight_sets == 6  # CPU default: all distinct


DEEP = make_config("k2-mini", layers=8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_at_depth_is_reproducible_and_lossless(dtype):
    m = TargetModel(DEEP, CPU, dtype, seed=0, weight_sets=3)
    dec = Decoder(m, BlockDrafter(m, seed=1))
    prompts = prompts_for(DEEP, 4, (8, 32))
    ref = dec.greedy(prompts, 32)
    a = dec.speculative(prompts, 32, 16, 0.8)
    b = dec.speculative(prompts, 32, 16, 0.8)
    assert a.tokens == b.tokens == ref.tokens
    assert a.accept_len == b.accept_len  # the same trees: the steering draws restart per decode
    assert sum(x for s in a.accept_len for x in s) / sum(map(len, a.accept_len)) > 2.0


def test_planted_margin_holds_at_61_layers():
    """Greedy follows the successor chain with a wide margin at K2's depth: without the residual
    scaling the embedding's share of the residual stream falls with depth and the margin with it."""
    cfg = replace(make_config("k2-mini"), layers=61, vocab=2048)
    m = TargetModel(cfg, CPU, torch.float32, seed=0, weight_sets=2)
    prompts = prompts_for(cfg, 2, (4, 8))
    dec = Decoder(m)
    res = dec.greedy(prompts, 12)
    for p, toks in zip(prompts, res.tokens):
        assert toks == m.continuation(torch.tensor([p[-1]]), 12)[0].tolist()
    assert residual_gain(cfg) == pytest.approx(1 / 122)


def test_comm_model_fits_alpha_beta_and_counts_two_all_reduces_a_layer():
    alpha, bw = 20.0, 150.0  # us, GB/s
    rows = [{"op": "all_reduce", "world_size": 2, "bytes": b, "time_us_p50": alpha + b / (bw * 1e3)}
            for b in (4096, 1 << 20, 16 << 20, 64 << 20, 1 << 30)]  # 1 GiB lies outside the fit's range
    rows[-1]["time_us_p50"] *= 3
    a, b = comm_model.fit(rows)
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(bw, rel=1e-6)
    cm = comm_model.CommModel(alpha, bw, "test")
    tokens, hidden, layers = 17, 7168, 61
    per = alpha + 2 * 7 / 8 * tokens * hidden * 2 / (bw * 1e3)
    assert cm.forward_ms(tokens, hidden, layers, 8) == pytest.approx((2 * layers * per + alpha) / 1e3)
    assert cm.forward_ms(tokens, hidden, layers, 1) == 0.0


@pytest.mark.parametrize("text,needle", [
    ("{", "not JSON"), ('{"alpha_us": 1, "busbw_gbps": 2}', "exactly"),
    ('{"alpha_us": -1, "busbw_gbps": 2, "source": "x"}', "alpha_us"),
    ('{"alpha_us": 1, "busbw_gbps": 0, "source": "x"}', "busbw_gbps"),
    ('{"alpha_us": 1, "busbw_gbps": 2, "source": "<b>"}', "source"),
])
def test_comm_model_json_is_checked(text, needle):
    with pytest.raises(ValueError, match=needle):
        comm_model.parse(text)
    assert comm_model.parse('{"alpha_us": 9.5, "busbw_gbps": 300, "source": "comm run r1"}').busbw_gbps == 300


def test_a_point_whose_target_leaves_the_planted_chain_fails_loudly():
    """The hints are the successor chain: a target that does not follow it (non-finite values, a lost
    margin) would record rows that accept nothing at any level; the point refuses instead."""
    from engine.bench_e2e import PROFILES, E2EBench

    eb = E2EBench(PROFILES[("cpu", "smoke")], CPU)
    assert eb.point(1, 3, 0.8, 1, 16).accept_len_mean > 2
    model = eb._decoder(1, 3).model
    model.successor = model.successor.roll(1)  # the hints now name other tokens than the target picks
    with pytest.raises(RuntimeError, match="planted successor at 0%"):
        eb.point(1, 3, 0.8, 1, 16)
