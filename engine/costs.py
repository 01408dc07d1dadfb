"""Bytes and flops of each benchmarked kernel and of a decoder layer's dense weights, by shape.

One definition for the kernel suite (which records them beside each time), for `kdbench import`
(which fills them in for outside figures of a kernel kdbench knows) and for the backtests (which
compose an e2e step from kernel points plus the dense weights a step streams). Pure arithmetic:
no torch, so the controller imports it without a device.
"""

from __future__ import annotations

from engine.config import ModelConfig

BF16 = 2


def expected_experts(e: int, k: int, m: int) -> float:
    """Unique experts M tokens touch with top-k of E, routed uniformly at random."""
    return e * (1 - (1 - k / e) ** m)


def int4_expert_bytes(cfg: ModelConfig, tp: int = 1) -> float:
    """One routed expert's INT4 codes plus a bf16 scale per 32 weights (on one rank of TP-tp)."""
    weights = 3 * cfg.hidden * cfg.moe_inter / tp
    return weights / 2 + weights / 32 * BF16


def moe_cost(cfg: ModelConfig, m: int, unique: float, act_bytes: int = BF16, tp: int = 1) -> tuple[float, float]:
    """(bytes, flops) of the routed-expert GEMMs for M tokens touching `unique` experts."""
    h, i, k = cfg.hidden, cfg.moe_inter / tp, cfg.top_k
    nbytes = unique * int4_expert_bytes(cfg, tp) + 2 * m * h * act_bytes + m * k * (8 + 4)
    return nbytes, 2.0 * m * k * 3 * h * i


def mla_cost(cfg: ModelConfig, batch: int, budget: int, context: int, el: int = BF16,
             tp: int = 1) -> tuple[float, float]:
    """(bytes, flops) of tree-verify MLA attention: the whole latent cache, heads / tp, the tree block dense."""
    n, hh, dl, dr = budget + 1, cfg.heads // tp, cfg.kv_lora, cfg.rope_dim
    s = context + n
    nbytes = batch * (s * (dl + dr) * el + n * hh * (2 * dl + dr) * el + n * n)
    return nbytes, 2.0 * batch * n * hh * s * (2 * dl + dr)


def build_tree_cost(cfg: ModelConfig, batch: int, budget: int) -> tuple[float, float]:
    n = budget + 1
    return float(batch * cfg.draft_len * cfg.draft_topk * 12 + batch * n * 28 + batch * n * n), float(batch * budget)


def tree_accept_cost(cfg: ModelConfig, batch: int, budget: int) -> tuple[float, float]:
    n = budget + 1
    return float(batch * n * 8 * 3 + batch * (cfg.draft_len + 3) * 8), float(batch * n)


def attention_weight_bytes(cfg: ModelConfig, tp: int = 1) -> float:
    """bf16 MLA projections of one layer (q_a, q_b, kv_a, kv_b, o); q_a and kv_a are replicated."""
    h, hh = cfg.hidden, cfg.heads / tp
    q_a = h * cfg.q_lora
    q_b = cfg.q_lora * hh * cfg.qk_dim
    kv_a = h * (cfg.kv_lora + cfg.rope_dim)
    kv_b = cfg.kv_lora * hh * (cfg.nope_dim + cfg.v_dim)
    o = hh * cfg.v_dim * h
    return BF16 * (q_a + q_b + kv_a + kv_b + o)


def dense_step_bytes(cfg: ModelConfig, layers: int, vocab: int | None = None, tp: int = 1) -> float:
    """bf16 weights a verify forward streams besides the routed experts: attention projections of every
    layer, the dense FFN of the first layers, the shared experts of the rest, and the lm-head."""
    dense = min(cfg.dense_layers, layers)
    moe = layers - dense
    ffn = dense * 3 * cfg.hidden * cfg.dense_inter / tp + moe * cfg.shared_experts * 3 * cfg.hidden * cfg.moe_inter / tp
    head = (vocab or cfg.vocab) / tp * cfg.hidden
    return layers * attention_weight_bytes(cfg, tp) + BF16 * (ffn + head)
