"""The target model: a Kimi-K2-style decoder with random, seeded weights.

MLA attention runs in its absorbed form (q_nope folded through W_UK into the latent space, the
output taken back through W_UV), so the cache holds only the latent `ckv` and the shared rope key
`kpe`. Routed experts are stored in K2's INT4 format and run through `kernels.ops.moe_w4a16`;
attention through `kernels.ops.mla_tree_attention`. One forward serves prefill (causal mask),
plain decode (T = 1) and tree verify (ancestor mask, positions = start + depth).

Planted successor: random weights alone give near-flat logits over a large vocab, whose argmax
flips with bf16 rounding (a batched verify and a one-token decode round differently), so the
target's greedy continuation would depend on batch shape. Each lm-head row succ[t] (succ a seeded
permutation) therefore gets PLANT_GAIN * embed[t] / |embed[t]| / sqrt(hidden): the last token's
embedding, still present in the residual stream, lifts its successor by ~PLANT_GAIN * cos(x, embed)
(several logits at K2 dims) above the random rest. The greedy choice is then stable across batch
shapes and dtypes while attention and the experts still compute every logit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.config import ModelConfig
from kernels import ops
from kernels.int4 import GROUP, PACK

# Mean square of a uniform INT4 code in [-8, 7]: scales chosen so a routed expert keeps unit gain.
_INT4_MS = sum(q * q for q in range(-8, 8)) / 16
# Logit lift of the planted successor per unit cosine between the final hidden and the token's embedding.
PLANT_GAIN = 20.0


class Init:
    """Seeded random tensors made directly on the target device (no host copy of 10 GB of experts)."""

    def __init__(self, seed: int, device: torch.device, dtype: torch.dtype):
        self.gen = torch.Generator(device=device)
        self.gen.manual_seed(seed)
        self.device, self.dtype = device, dtype

    def normal(self, *shape: int, std: float) -> Tensor:
        return torch.randn(*shape, generator=self.gen, device=self.device, dtype=self.dtype).mul_(std)

    def linear(self, out_f: int, in_f: int) -> Tensor:
        return self.normal(out_f, in_f, std=1.0 / math.sqrt(in_f))

    def ones(self, n: int) -> Tensor:
        return torch.ones(n, device=self.device, dtype=self.dtype)

    def int4(self, e: int, n: int, k: int) -> tuple[Tensor, Tensor]:
        """Random K2-format experts [E, N, K]: uniform nibbles, per-group bf16 scales near unit gain."""
        q = torch.randint(-2**31, 2**31, (e, n, k // PACK), generator=self.gen, device=self.device,
                          dtype=torch.int32)
        base = 1.0 / math.sqrt(_INT4_MS * k)
        s = torch.rand(e, n, k // GROUP, generator=self.gen, device=self.device, dtype=torch.float32)
        return q, s.mul_(0.5).add_(0.75).mul_(base).to(torch.bfloat16)


def rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def rope(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """Rotate-half RoPE; x [Bt, T, ..., D], positions [Bt, T] (start + depth in a tree)."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = positions.to(torch.float32).unsqueeze(-1) * inv  # [Bt, T, D/2]
    while ang.dim() < x.dim():
        ang = ang.unsqueeze(-2)
    cos, sin = ang.cos(), ang.sin()
    xf = x.float()
    x1, x2 = xf[..., : d // 2], xf[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)


def swiglu(x: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    gu = F.linear(x, w13)
    g, u = gu.chunk(2, -1)
    return F.linear(F.silu(g) * u, w2)


@dataclass
class LatentCache:
    """Per-layer latent KV for a batch: ckv [layers, Bt, S, kv_lora], kpe [layers, Bt, S, rope]."""

    ckv: Tensor
    kpe: Tensor
    lens: Tensor  # [Bt] int64: committed rows per sequence

    @classmethod
    def empty(cls, cfg: ModelConfig, batch: int, capacity: int, device: torch.device,
              dtype: torch.dtype) -> "LatentCache":
        z = dict(device=device, dtype=dtype)
        return cls(torch.zeros(cfg.layers, batch, capacity, cfg.kv_lora, **z),
                   torch.zeros(cfg.layers, batch, capacity, cfg.rope_dim, **z),
                   torch.zeros(batch, dtype=torch.int64, device=device))

    def compact(self, path: Tensor, accept_len: Tensor, active: Tensor) -> None:
        """Keep the accepted path: rows lens + path[j] move to lens + j, all on the device.

        Padded path entries (-1) copy the root row into slots past the new length, which the next
        verify overwrites before anything reads them. Finished sequences (active False) stay put.
        """
        nl, bt, _, _ = self.ckv.shape
        w = path.shape[1]
        base = self.lens.unsqueeze(1)
        src = base + path.clamp(min=0)
        dst = base + torch.arange(w, device=path.device)
        for buf in (self.ckv, self.kpe):
            d = buf.shape[-1]
            si = src.view(1, bt, w, 1).expand(nl, bt, w, d)
            di = dst.view(1, bt, w, 1).expand(nl, bt, w, d)
            buf.scatter_(2, di, buf.gather(2, si))
        self.lens += (accept_len + 1) * active


class TargetModel:
    """Kimi-K2-style decoder; layers < dense_layers use a dense FFN, the rest MoE."""

    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = 0,
                 impl: ops.Impl = "auto"):
        self.cfg, self.device, self.dtype, self.impl = cfg, device, dtype, impl
        ini = Init(seed, device, dtype)
        h, nh = cfg.hidden, cfg.heads
        self.embed = ini.normal(cfg.vocab, h, std=1.0)
        self.layers: list[dict[str, Tensor]] = []
        for i in range(cfg.layers):
            w_kvb = ini.linear(nh * (cfg.nope_dim + cfg.v_dim), cfg.kv_lora).view(nh, cfg.nope_dim + cfg.v_dim, cfg.kv_lora)
            lw = {
                "attn_norm": ini.ones(h), "ffn_norm": ini.ones(h),
                "q_a": ini.linear(cfg.q_lora, h), "q_norm": ini.ones(cfg.q_lora),
                "q_b": ini.linear(nh * cfg.qk_dim, cfg.q_lora),
                "kv_a": ini.linear(cfg.kv_lora + cfg.rope_dim, h), "kv_norm": ini.ones(cfg.kv_lora),
                "w_uk": w_kvb[:, : cfg.nope_dim].contiguous(),  # [nh, nope, kv_lora]
                "w_uv": w_kvb[:, cfg.nope_dim:].contiguous(),  # [nh, v, kv_lora]
                "o": ini.linear(h, nh * cfg.v_dim),
            }
            if i < cfg.dense_layers:
                lw["w13"], lw["w2"] = ini.linear(2 * cfg.dense_inter, h), ini.linear(h, cfg.dense_inter)
            else:
                lw["gate"] = ini.linear(cfg.experts, h)
                lw["w13_q"], lw["w13_s"] = ini.int4(cfg.experts, 2 * cfg.moe_inter, h)
                lw["w2_q"], lw["w2_s"] = ini.int4(cfg.experts, h, cfg.moe_inter)
                si = cfg.moe_inter * cfg.shared_experts
                lw["sh_w13"], lw["sh_w2"] = ini.linear(2 * si, h), ini.linear(h, si)
            self.layers.append(lw)
        self.final_norm = ini.ones(h)
        self.lm_head = ini.linear(cfg.vocab, h)
        self.successor = torch.randperm(cfg.vocab, generator=ini.gen, device=device)
        plant = F.normalize(self.embed.float(), dim=-1).mul_(PLANT_GAIN / math.sqrt(h))
        self.lm_head.index_add_(0, self.successor, plant.to(dtype))
        del plant
        self.sm_scale = 1.0 / math.sqrt(cfg.qk_dim)

    def route(self, x: Tensor, lw: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """K2-style sigmoid routing: top-k experts, weights renormalised and scaled."""
        scores = torch.sigmoid(F.linear(x.float(), lw["gate"].float()))
        w, ids = scores.topk(self.cfg.top_k, dim=-1)
        return ids, (w / w.sum(-1, keepdim=True) * self.cfg.routed_scale).float()

    def _attention(self, x: Tensor, lw: dict[str, Tensor], li: int, positions: Tensor,
                   cache: LatentCache, rows: Tensor, tree_mask: Tensor) -> Tensor:
        cfg = self.cfg
        bt, t, _ = x.shape
        q = F.linear(rms_norm(F.linear(x, lw["q_a"]), lw["q_norm"], cfg.norm_eps), lw["q_b"])
        q = q.view(bt, t, cfg.heads, cfg.qk_dim)
        q_nope, q_pe = q[..., : cfg.nope_dim], rope(q[..., cfg.nope_dim:], positions, cfg.rope_theta)
        kv = F.linear(x, lw["kv_a"])
        ckv = rms_norm(kv[..., : cfg.kv_lora], lw["kv_norm"], cfg.norm_eps)
        kpe = rope(kv[..., cfg.kv_lora:], positions, cfg.rope_theta)
        # write the new rows at lens .. lens+T-1 of this layer's cache
        cache.ckv[li].scatter_(1, rows.unsqueeze(-1).expand(bt, t, cfg.kv_lora), ckv)
        cache.kpe[li].scatter_(1, rows.unsqueeze(-1).expand(bt, t, cfg.rope_dim), kpe)
        q_lat = torch.einsum("bthd,hdc->bthc", q_nope, lw["w_uk"])
        o_lat = ops.mla_tree_attention(q_lat, q_pe, cache.ckv[li], cache.kpe[li], cache.lens, tree_mask,
                                       self.sm_scale, impl=self.impl)
        o = torch.einsum("bthc,hvc->bthv", o_lat, lw["w_uv"])
        return F.linear(o.reshape(bt, t, cfg.heads * cfg.v_dim), lw["o"])

    def _ffn(self, x: Tensor, lw: dict[str, Tensor]) -> Tensor:
        if "w13" in lw:
            return swiglu(x, lw["w13"], lw["w2"])
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        ids, w = self.route(flat, lw)
        routed = ops.moe_w4a16(flat, lw["w13_q"], lw["w13_s"], lw["w2_q"], lw["w2_s"], ids, w, impl=self.impl)
        return (routed + swiglu(flat, lw["sh_w13"], lw["sh_w2"])).view(shape)

    def forward(self, tokens: Tensor, positions: Tensor, cache: LatentCache, tree_mask: Tensor,
                pick: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """tokens/positions [Bt, T] sit at cache rows lens .. lens+T-1 (the cache's lens is not moved).

        Returns (logits [Bt, T, V], hidden [Bt, T, H]) with hidden the last layer's output before
        the final norm, which the drafter conditions on; with `pick` ([Bt] row per sequence, e.g.
        each prompt's last token in a padded prefill) only that row: [Bt, 1, V] and [Bt, 1, H].
        """
        x = self.embed[tokens]
        rows = cache.lens.unsqueeze(1) + torch.arange(tokens.shape[1], device=tokens.device)
        for li, lw in enumerate(self.layers):
            x = x + self._attention(rms_norm(x, lw["attn_norm"], self.cfg.norm_eps), lw, li, positions,
                                    cache, rows, tree_mask)
            x = x + self._ffn(rms_norm(x, lw["ffn_norm"], self.cfg.norm_eps), lw)
        if pick is not None:
            x = x.gather(1, pick.view(-1, 1, 1).expand(-1, 1, x.shape[-1]))
        return F.linear(rms_norm(x, self.final_norm, self.cfg.norm_eps), self.lm_head), x
