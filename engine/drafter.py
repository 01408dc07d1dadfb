"""A DFlash-shaped block drafter: one forward emits distributions for L future positions.

Input: the target's last hidden state (projected) added to the bonus token's embedding, followed
by L mask slots; one bidirectional transformer layer; the target's own final norm + full-vocab lm
head over the L slots (the drafter runs whole on every tensor-parallel rank). Its cost is real (attention, MLP and a full-vocab head over L positions per sequence).

Random weights accept almost nothing, so the drafter can be *steered*: given the target's known
greedy continuation (`hints`), each position places the true next token at rank R of its
distribution, R ~ Geometric(level) (P(R = r) = level * (1 - level)^r), or outside the top-k when
R >= k, and its top-k log-probs are calibrated to the same law (log(level * (1 - level)^r) at
rank r), as a drafter whose top-1 is right with probability `level` would report. `level` is
synthetic acceptance and is always labelled as such; the tree and the verify see ordinary inputs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from engine import gpu_busy
from engine.config import ModelConfig
from engine.model import Init, TargetModel, rms_norm, swiglu


class BlockDrafter:
    """One-layer bidirectional block drafter sharing the target's embedding and lm head."""

    def __init__(self, target: TargetModel, seed: int = 1):
        cfg: ModelConfig = target.cfg
        self.cfg, self.target = cfg, target
        ini = Init(seed, target.device, target.dtype)
        h, nd = cfg.hidden, cfg.draft_heads * cfg.draft_head_dim
        self.fc = ini.linear(h, h)
        self.slots = ini.normal(cfg.draft_len + 1, h, std=1.0)  # bonus slot + L mask slots
        self.norm1, self.norm2 = ini.ones(h), ini.ones(h)
        self.qkv, self.o = ini.linear(3 * nd, h), ini.linear(h, nd)
        self.w13, self.w2 = ini.linear(2 * cfg.draft_inter, h), ini.linear(h, cfg.draft_inter)
        self.seed = seed
        self.gen = torch.Generator(device=target.device)
        self.reset()

    def reset(self) -> None:
        """Restart the steering draws: every decode of a point steers alike (the same trees, steps)."""
        self.gen.manual_seed(self.seed)

    def logits(self, feat: Tensor, bonus: Tensor) -> Tensor:
        """[Bt, H] target feature + [Bt] bonus tokens -> [Bt, L, V] float32 logits."""
        cfg, tg = self.cfg, self.target
        bt = bonus.shape[0]
        x = self.slots.unsqueeze(0).expand(bt, -1, -1).clone()
        x[:, 0] += tg.embed[bonus] + F.linear(feat, self.fc)
        hn = rms_norm(x, self.norm1, cfg.norm_eps)
        q, k, v = F.linear(hn, self.qkv).view(bt, -1, 3, cfg.draft_heads, cfg.draft_head_dim).unbind(2)
        with gpu_busy.section("attention"):
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               scale=1.0 / math.sqrt(cfg.draft_head_dim))
        x = x + F.linear(a.transpose(1, 2).reshape(bt, -1, cfg.draft_heads * cfg.draft_head_dim), self.o)
        x = x + swiglu(rms_norm(x, self.norm2, cfg.norm_eps), self.w13, self.w2)
        x_n = rms_norm(x[:, 1:], tg.final_norm, cfg.norm_eps)
        with gpu_busy.section("lm_head"):
            logits = F.linear(x_n, tg.draft_head)
        return logits.float()

    def noise(self, hints: Tensor) -> Tensor:
        """Uniform draws for steer's ranks, one per hint (drawn outside any captured graph)."""
        return torch.rand(hints.shape, generator=self.gen, device=hints.device)

    def steer(self, logits: Tensor, hints: Tensor, level: float, u: Tensor | None = None) -> None:
        """In place: put hints[b, i] (>= 0) at a Geometric(level) rank of logits[b, i] (see module doc);
        u: uniform draws from noise() (drawn here when None)."""
        if level <= 0.0:
            return
        k = self.cfg.draft_topk
        valid = hints >= 0
        idx = hints.clamp(min=0).unsqueeze(-1)
        own = logits.gather(-1, idx).squeeze(-1)
        others = logits.scatter(-1, idx, float("-inf")).topk(k, dim=-1).values  # [Bt, L, k]
        if level >= 1.0:
            rank = torch.zeros_like(hints)
        else:
            u = self.noise(hints) if u is None else u
            rank = torch.floor(torch.log1p(-u) / math.log1p(-level)).to(torch.int64).clamp(max=k)
        slots = torch.cat([others[..., :1] + 1.0, (others[..., :-1] + others[..., 1:]) / 2,
                           others[..., -1:] - 1.0], -1)  # value landing at rank 0, 1, .., k-1, outside
        new = torch.where(valid, slots.gather(-1, rank.unsqueeze(-1)).squeeze(-1), own)
        logits.scatter_(-1, idx, new.unsqueeze(-1))

    def draft(self, feat: Tensor, bonus: Tensor, hints: Tensor | None = None,
              level: float = 0.0, u: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Top-k log-probs and tokens per position, [Bt, L, k] each, sorted descending."""
        logits = self.logits(feat, bonus)
        if hints is not None:
            self.steer(logits, hints, level, u)
        lp, tok = torch.log_softmax(logits, -1).topk(self.cfg.draft_topk, dim=-1)
        if hints is not None and level > 0.0:
            a = min(level, 0.999)
            r = torch.arange(self.cfg.draft_topk, device=lp.device, dtype=torch.float32)
            lp = (math.log(a) + r * math.log1p(-a)).expand_as(lp).contiguous()
        return lp, tok
