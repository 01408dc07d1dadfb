"""Tensor parallelism as a transformation of the one model (the shape of gpt-fast's tp.py).

Rank r of N keeps a slice of each weight the full model built:
- column-parallel (its share of the output rows): q_b, w_uk and w_uv (its heads), the gate and up
  halves of w13 / the routed experts' w13 / the shared expert's sh_w13, the lm-head (vocab / N);
- row-parallel (its share of the input columns): o, w2, the routed experts' w2, sh_w2; their
  outputs are partial sums, all-reduced after attention and after the FFN;
- replicated: the norms, q_a and kv_a (the MLA latent cache is whole on every rank), the router
  gate, the embedding.
The greedy pick over a vocab shard is the global argmax: an all-gather of each rank's (max, index).

`Comm` is the single-process case: rank 0 of an N-way deployment run alone on one GPU does exactly
its own work and its collectives are not run (the bench carries them as a modelled term);
`DistComm` runs them over a torch.distributed process group of N ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from engine.config import ModelConfig
from kernels.int4 import GROUP

# Largest TP degree: the planted successor keeps tokens in the lm-head shard rank 0 holds at this
# degree (engine.model.hot_vocab), so rank 0 alone still decodes the planted chain.
MAX_TP = 8


def check(cfg: ModelConfig, tp: int) -> None:
    """Raise ValueError naming the dimension an N-way split does not divide."""
    if not 1 <= tp <= MAX_TP:
        raise ValueError(f"tp must be within 1..{MAX_TP}, got {tp}")
    need = {"heads": (cfg.heads, 1), "moe_inter": (cfg.moe_inter, GROUP), "dense_inter": (cfg.dense_inter, 1),
            "vocab": (cfg.vocab, 1)}
    for name, (size, unit) in need.items():
        if size % (tp * unit):
            what = f" into multiples of {unit}" if unit > 1 else ""
            raise ValueError(f"tp {tp} does not divide {name} {size}{what}")


def _part(t: Tensor, dim: int, tp: int, rank: int) -> Tensor:
    n = t.shape[dim] // tp
    return t.narrow(dim, rank * n, n)


def _halves(t: Tensor, dim: int, tp: int, rank: int) -> Tensor:
    """[.., 2I, ..] gate and up stacked along dim -> this rank's share of each, stacked again."""
    gate, up = t.chunk(2, dim)
    return torch.cat([_part(gate, dim, tp, rank), _part(up, dim, tp, rank)], dim)


def shard_layer(lw: dict[str, Tensor], tp: int, rank: int) -> dict[str, Tensor]:
    """This rank's slice of one layer's weights (the dict the full model built; tp 1: unchanged)."""
    if tp == 1:
        return lw
    out = dict(lw)
    out["q_b"] = _part(lw["q_b"], 0, tp, rank)  # rows are heads x qk_dim, head-major
    out["w_uk"], out["w_uv"] = _part(lw["w_uk"], 0, tp, rank), _part(lw["w_uv"], 0, tp, rank)
    out["o"] = _part(lw["o"], 1, tp, rank)  # columns are heads x v_dim, head-major
    if "w13" in lw:
        out["w13"], out["w2"] = _halves(lw["w13"], 0, tp, rank), _part(lw["w2"], 1, tp, rank)
    else:
        out["w13_q"], out["w13_s"] = _halves(lw["w13_q"], 1, tp, rank), _halves(lw["w13_s"], 1, tp, rank)
        out["w2_q"], out["w2_s"] = _part(lw["w2_q"], 2, tp, rank), _part(lw["w2_s"], 2, tp, rank)
        out["sh_w13"], out["sh_w2"] = _halves(lw["sh_w13"], 0, tp, rank), _part(lw["sh_w2"], 1, tp, rank)
    # a slice of a full tensor would keep all of it alive: copy the shard out
    return {k: v.contiguous() if v is lw[k] else v.clone(memory_format=torch.contiguous_format)
            for k, v in out.items()}


def shard_vocab(head: Tensor, tp: int, rank: int) -> tuple[Tensor, int]:
    """(this rank's lm-head rows, the vocab id of its first row)."""
    if tp == 1:
        return head, 0
    return _part(head, 0, tp, rank).clone(), rank * (head.shape[0] // tp)


class Comm:
    """Collectives of a rank running alone: nothing to exchange, so it does only its own work."""

    def all_reduce(self, t: Tensor) -> Tensor:
        return t

    def all_gather(self, t: Tensor) -> Tensor:
        """Every rank's t, stacked: [world, ...]."""
        return t.unsqueeze(0)

    def argmax(self, logits: Tensor, offset: int) -> Tensor:
        """Greedy pick over the vocab shards, as global ids: each rank's (max, id) gathered, the
        best kept; ties go to the lower rank, as an unsharded argmax takes the lowest index."""
        idx = logits.argmax(-1, keepdim=True)
        every = self.all_gather(torch.cat([logits.gather(-1, idx).float(), (idx + offset).float()], -1))
        rank = every[..., 0].argmax(0, keepdim=True)
        return every[..., 1].gather(0, rank).squeeze(0).to(torch.int64)


class DistComm(Comm):
    """Collectives over the default torch.distributed process group (NCCL on GPUs)."""

    def __init__(self) -> None:
        self.world = dist.get_world_size()

    def all_reduce(self, t: Tensor) -> Tensor:
        dist.all_reduce(t)
        return t

    def all_gather(self, t: Tensor) -> Tensor:
        out = torch.empty((self.world, *t.shape), dtype=t.dtype, device=t.device)
        dist.all_gather_into_tensor(out, t.contiguous())
        return out
