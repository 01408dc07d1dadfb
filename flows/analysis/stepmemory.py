"""Device memory one rank of a DDTree deployment needs: weights, the latent cache, the step's working set.

- weights of one rank of TP-tp: the routed experts' INT4 shards, every dense op's bf16 shard
  (engine.costs.dense_ops: replicated ops whole), the embedding and the full-vocab head the drafter
  reads (both whole on every rank);
- the MLA latent cache, whole on every rank: (kv_lora + rope) x 2 bytes a token a layer, for C
  sequences of context + the tree's B + 1 tokens;
- the working set of one step: activations and MoE intermediates of C (B + 1) tokens, the target's
  float32 logits shard, the drafter's float32 logits over the full vocab, and a fixed reserve for the
  CUDA context, library workspaces and captured graphs.
A configuration fits when the sum is within the spec sheet's memory, read as binary gigabytes: a GPU
vendor's "80 GB" of device memory is 80 GiB (an H100 SXM's 80 GB is five 16 GiB HBM3 stacks; nvidia-smi
shows 81,559 MiB of them), 7 % more bytes than 80e9.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.config import ModelConfig
from engine.costs import BF16, dense_op_rows, dense_ops, int4_expert_bytes

GIB = 2**30
TIGHT = 0.05                 # a fit with less than this share of the GPU spare is within the model's own error
RESERVE_BYTES = 2e9          # CUDA context, cuBLAS workspaces, graph pools: a round figure, not measured
ACTIVATION_COPIES = 8        # hidden-sized bf16 buffers live at once in a layer (residual, norms, projections)


@dataclass(frozen=True)
class Memory:
    parts: dict[str, float]       # weights, cache, working (bytes)
    capacity: float               # the spec sheet's device memory (bytes: its binary gigabytes)

    @property
    def need(self) -> float:
        return sum(self.parts.values())

    @property
    def fits(self) -> bool:
        return self.need <= self.capacity

    def tight(self) -> str:
        """'' unless it fits with under TIGHT of the GPU to spare; then how much is spare, in GiB."""
        spare = self.capacity - self.need
        return f"tight: {spare / GIB:.1f} GiB to spare" if 0 <= spare < TIGHT * self.capacity else ""

    def why_not(self) -> str:
        """'' when it fits; else what it needs against what there is, in GiB (the unit of the spec's figure)."""
        if self.fits:
            return ""
        big = max(self.parts, key=lambda k: self.parts[k])
        return (f"does not fit: needs {self.need / GIB:,.0f} GiB a GPU ({big} {self.parts[big] / GIB:,.0f} GiB), "
                f"the GPU has {self.capacity / GIB:,.0f} GiB")


def weight_bytes(cfg: ModelConfig, tp: int, layers: int) -> float:
    dense_layers = min(cfg.dense_layers, layers)
    moe_layers = layers - dense_layers
    per = {"layer": layers, "dense_layer": dense_layers, "moe_layer": moe_layers, "step": 1}
    dense = sum(per[op.per] * op.heads * op.n * op.k * (4 if op.dtype == "float32" else BF16)
                for op in dense_ops(cfg, tp) if op.name != "lm_head")   # the head's shard is a slice of the full one
    return moe_layers * cfg.experts * int4_expert_bytes(cfg, tp) + dense + cfg.vocab * cfg.hidden * BF16


def cache_bytes(cfg: ModelConfig, concurrency: int, context: int, budget: int, layers: int) -> float:
    return (cfg.kv_lora + cfg.rope_dim) * BF16 * layers * concurrency * (context + budget + 1)


def working_bytes(cfg: ModelConfig, tp: int, concurrency: int, budget: int) -> float:
    tokens = concurrency * (budget + 1)
    ops = {op.name: op for op in dense_ops(cfg, 1)}
    draft_rows = dense_op_rows(ops["draft_head"], cfg, concurrency, budget)
    acts = tokens * (ACTIVATION_COPIES * cfg.hidden + cfg.top_k * 2 * cfg.moe_inter // tp) * BF16
    return acts + tokens * cfg.vocab // tp * 4 + 2 * draft_rows * cfg.vocab * 4 + RESERVE_BYTES


def memory(cfg: ModelConfig, q: Any, spec: Any) -> Memory:
    """What one rank of query `q` (tp, concurrency, budget, context, layers) needs on a GPU of `spec`."""
    layers = q.layers or cfg.layers
    return Memory({"weights": weight_bytes(cfg, q.tp, layers),
                   "cache": cache_bytes(cfg, q.concurrency, q.context, q.budget, layers),
                   "working": working_bytes(cfg, q.tp, q.concurrency, q.budget)}, spec.memory_gb * GIB)
