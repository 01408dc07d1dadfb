"""Model configurations: Kimi K2's per-layer dimensions (`k2`) and a small CPU twin (`k2-mini`).

Both share one structure (layer 0 dense, the rest MoE with INT4 routed experts plus one bf16
shared expert, MLA attention), so every code path the GPU runs is exercised on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ModelConfig:
    """Per-layer dimensions of the target model and its block drafter."""

    name: str
    hidden: int
    layers: int
    heads: int
    q_lora: int
    kv_lora: int
    rope_dim: int
    nope_dim: int
    v_dim: int
    experts: int
    top_k: int
    moe_inter: int
    shared_experts: int
    dense_inter: int
    dense_layers: int  # the first `dense_layers` layers use a dense FFN (K2: 1)
    vocab: int
    routed_scale: float  # K2's routed_scaling_factor
    rope_theta: float
    norm_eps: float
    # block drafter (DFlash-shaped): one bidirectional transformer layer over [bonus + L masks]
    draft_len: int  # L: positions drafted per forward
    draft_topk: int  # k: candidates per position fed to the tree builder
    draft_heads: int
    draft_head_dim: int
    draft_inter: int

    @property
    def qk_dim(self) -> int:
        return self.nope_dim + self.rope_dim


K2 = ModelConfig(
    name="k2", hidden=7168, layers=61, heads=64, q_lora=1536, kv_lora=512, rope_dim=64,
    nope_dim=128, v_dim=128, experts=384, top_k=8, moe_inter=2048, shared_experts=1,
    dense_inter=18432, dense_layers=1, vocab=163840, routed_scale=2.827, rope_theta=50000.0,
    norm_eps=1e-6, draft_len=16, draft_topk=8, draft_heads=32, draft_head_dim=128, draft_inter=12288,
)

K2_MINI = ModelConfig(
    name="k2-mini", hidden=128, layers=3, heads=4, q_lora=64, kv_lora=64, rope_dim=16,
    nope_dim=32, v_dim=32, experts=16, top_k=4, moe_inter=64, shared_experts=1,
    dense_inter=256, dense_layers=1, vocab=512, routed_scale=2.827, rope_theta=10000.0,
    norm_eps=1e-6, draft_len=8, draft_topk=4, draft_heads=4, draft_head_dim=32, draft_inter=256,
)

CONFIGS = {c.name: c for c in (K2, K2_MINI)}
# The TP degree of the shard shapes the kernel suite, the build check and the MoE config sweep time
# beside the full ones: one rank of an 8-GPU box (each expert's intermediate and the heads / 8).
SHARD_TP = 8


def make_config(name: str, layers: int | None = None, vocab: int | None = None) -> ModelConfig:
    """The named config, optionally with fewer layers or a smaller lm-head vocab (recorded by callers)."""
    if name not in CONFIGS:
        raise ValueError(f"unknown config {name!r}; choose from {sorted(CONFIGS)}")
    cfg = CONFIGS[name]
    if layers is not None:
        if layers < 1:
            raise ValueError(f"layers must be >= 1, got {layers}")
        cfg = replace(cfg, layers=layers)
    if vocab is not None:
        cfg = replace(cfg, vocab=vocab)
    return cfg
