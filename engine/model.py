"""The target model: a Kimi-K2-style decoder with random, seeded weights.

MLA attention runs in its absorbed form (q_nope folded through W_UK into the latent space, the
output taken back through W_UV), so the cache holds only the latent `ckv` and the shared rope key
`kpe`. Routed experts are stored in K2's INT4 format and run through `kernels.ops.moe_w4a16`;
attention through `kernels.ops.mla_tree_attention`. One forward serves prefill chunks (no mask
given: causal), plain decode (T = 1) and tree verify (ancestor mask, positions = start + depth).

Tensor parallel: with tp N the model is rank `rank` of an N-way deployment, its weights the slices
engine.tp takes of the full layers it builds; its forward all-reduces after attention and after the
FFN and picks the global argmax over the vocab shards (engine.tp.Comm / DistComm).

Depth on one GPU: the MoE layers may take their weights in rotation from `weight_sets` distinct
sets (each far larger than L2, so every layer still streams its bytes from HBM); every layer keeps
its own KV cache.

Planted successor: random weights alone give near-flat logits over a large vocab, whose argmax
flips with bf16 rounding (a batched verify and a one-token decode round differently), so the
target's greedy continuation would depend on batch shape. Each token t of the hot vocab (the first
vocab / MAX_TP ids: the lm-head shard rank 0 holds at any TP, so a rank alone still follows the
chain) has a successor succ[t] (a seeded permutation of the hot vocab); lm-head row succ[t] gets
PLANT_GAIN * embed[t] / |embed[t]| / sqrt(hidden): the last token's embedding, still present in the
residual stream, lifts its successor by ~PLANT_GAIN * cos(x, embed) above the random rest. The
residual branches' output weights are scaled by 1 / (2 * layers) (`residual_gain`), so all
branches together carry at most about as much as the embedding at any depth and the margin
(>= ~PLANT_GAIN * 0.7 logits) holds at 61 layers. The greedy choice is then stable across batch shapes, dtypes,
reduction orders and TP splits while attention and the experts still compute every logit, and the
target's greedy continuation is the successor chain (`continuation`).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from engine import gpu_busy
from engine import tp as tpar
from engine.config import ModelConfig
from kernels import ops
from kernels.int4 import GROUP, PACK

# Mean square of the synthetic INT4 codes (uniform nibbles, -8 read as 0, see `zero_mean_codes`):
# scales chosen so a routed expert keeps unit gain.
_INT4_MS = sum(q * q for q in range(-7, 8)) / 16
# Logit lift of the planted successor per unit cosine between the final hidden and the token's embedding.
PLANT_GAIN = 20.0
# CUDA memory left free after the weights (KV caches, activations, graph pools, the drafter).
RESERVE_BYTES = 24 << 30


def hot_vocab(cfg: ModelConfig) -> int:
    """Token ids below this carry a planted successor (prompts are drawn from them)."""
    return max(cfg.vocab // tpar.MAX_TP, 1)


def residual_gain(cfg: ModelConfig) -> float:
    """Scale of every residual branch's output weights: the 2 x layers branches together stay within
    about the embedding's size even where they add up coherently (layers sharing a weight set see
    nearly the same input, so their outputs align)."""
    return 1.0 / (2 * cfg.layers)


class Init:
    """Seeded random tensors made directly on the target device (no host copy of 10 GB of experts)."""

    def __init__(self, seed: int, device: torch.device, dtype: torch.dtype):
        self.gen = torch.Generator(device=device)
        self.gen.manual_seed(seed)
        self.device, self.dtype = device, dtype

    def normal(self, *shape: int, std: float) -> Tensor:
        return torch.randn(*shape, generator=self.gen, device=self.device, dtype=self.dtype).mul_(std)

    def linear(self, out_f: int, in_f: int, gain: float = 1.0) -> Tensor:
        return self.normal(out_f, in_f, std=gain / math.sqrt(in_f))

    def ones(self, n: int) -> Tensor:
        return torch.ones(n, device=self.device, dtype=self.dtype)

    def int4(self, e: int, n: int, k: int, gain: float = 1.0) -> tuple[Tensor, Tensor]:
        """Random K2-format experts [E, N, K]: uniform nibbles, per-group bf16 scales near `gain`."""
        q = zero_mean_codes(torch.randint(-2**31, 2**31, (e, n, k // PACK), generator=self.gen,
                                          device=self.device, dtype=torch.int32))
        base = gain / math.sqrt(_INT4_MS * k)
        s = torch.rand(e, n, k // GROUP, generator=self.gen, device=self.device, dtype=torch.float32)
        return q, s.mul_(0.5).add_(0.75).mul_(base).to(torch.bfloat16)


def zero_mean_codes(q: Tensor, chunk: int = 32) -> Tensor:
    """Packed INT4 words [E, N, K/8] with every code -8 (nibble 0b1000) set to 0, in place.

    Uniform nibbles average -0.5, so every random expert carries a common-mode term that its two
    matmuls and SwiGLU amplify; through the residual stream it feeds back layer after layer, and at
    K2's depth it swamps the stream (seen on the H200 at 61 layers: the FFN output grew from 0.7 to
    800 within ten layers of one decode step). Codes -7..7 plus a doubled 0 average zero. Experts
    are done `chunk` at a time to bound the temporaries.
    """
    for qe in q.split(chunk):
        for shift in range(0, 4 * PACK, 4):
            hit = ((qe >> shift) & 0xF) == 8
            qe ^= (hit.to(torch.int32) * 8) << shift
    return q


def rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def rope_angles(positions: Tensor, d: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos, sin [Bt, T, D/2] of rotate-half RoPE at positions [Bt, T] (start + depth in a tree):
    made once per forward, shared by every layer's queries and keys."""
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=positions.device, dtype=torch.float32) / d))
    ang = positions.to(torch.float32).unsqueeze(-1) * inv
    return ang.cos(), ang.sin()


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE of x [Bt, T, ..., D] by rope_angles' tables."""
    d = x.shape[-1]
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
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
    """Kimi-K2-style decoder (rank `rank` of tp); layers < dense_layers use a dense FFN, the rest MoE.

    weight_sets: distinct MoE weight sets the MoE layers take in rotation (None: one per layer,
    fewer on CUDA where memory runs out, keeping RESERVE_BYTES free); `weight_sets` after init is
    the number built. Every tp and rank draws the same full tensors in the same order and slices them.
    """

    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = 0,
                 impl: ops.Impl = "auto", tp: int = 1, rank: int = 0, weight_sets: int | None = None,
                 comm: tpar.Comm | None = None):
        tpar.check(cfg, tp)
        self.cfg, self.device, self.dtype, self.impl = cfg, device, dtype, impl
        self.tp, self.rank, self.comm = tp, rank, comm or tpar.Comm()
        self.heads = cfg.heads // tp
        ini = Init(seed, device, dtype)
        h = cfg.hidden
        self.embed = ini.normal(cfg.vocab, h, std=1.0)
        head = ini.linear(cfg.vocab, h)
        hot = hot_vocab(cfg)
        self.successor = torch.randperm(hot, generator=ini.gen, device=device)
        plant = F.normalize(self.embed[:hot].float(), dim=-1).mul_(PLANT_GAIN / math.sqrt(h))
        head.index_add_(0, self.successor, plant.to(dtype))
        del plant
        self.draft_head = head  # the drafter runs whole on every rank, over the full vocab
        self.lm_head, self.vocab_offset = tpar.shard_vocab(head, tp, rank)
        self.final_norm = ini.ones(h)
        gain = residual_gain(cfg)
        dense = [tpar.shard_layer(self._layer(ini, True, gain), tp, rank) for _ in range(min(cfg.dense_layers, cfg.layers))]
        n_moe = cfg.layers - len(dense)
        want = n_moe if weight_sets is None else min(weight_sets, n_moe)
        sets: list[dict[str, Tensor]] = []
        while len(sets) < want and (weight_sets is not None or not sets or self._room(sets[0], tp)):
            sets.append(tpar.shard_layer(self._layer(ini, False, gain), tp, rank))
        self.weight_sets = len(sets)
        self.layers = dense + [sets[i % len(sets)] for i in range(n_moe)]
        self.sm_scale = 1.0 / math.sqrt(cfg.qk_dim)

    def _layer(self, ini: Init, dense: bool, gain: float) -> dict[str, Tensor]:
        """One full (unsharded) layer's weights, branch outputs scaled by `gain`."""
        cfg, h, nh = self.cfg, self.cfg.hidden, self.cfg.heads
        w_kvb = ini.linear(nh * (cfg.nope_dim + cfg.v_dim), cfg.kv_lora).view(nh, cfg.nope_dim + cfg.v_dim, cfg.kv_lora)
        lw = {
            "attn_norm": ini.ones(h), "ffn_norm": ini.ones(h),
            "q_a": ini.linear(cfg.q_lora, h), "q_norm": ini.ones(cfg.q_lora),
            "q_b": ini.linear(nh * cfg.qk_dim, cfg.q_lora),
            "kv_a": ini.linear(cfg.kv_lora + cfg.rope_dim, h), "kv_norm": ini.ones(cfg.kv_lora),
            "w_uk": w_kvb[:, : cfg.nope_dim].contiguous(),  # [nh, nope, kv_lora]
            "w_uv": w_kvb[:, cfg.nope_dim:].contiguous(),  # [nh, v, kv_lora]
            "o": ini.linear(h, nh * cfg.v_dim, gain),
        }
        if dense:
            lw["w13"], lw["w2"] = ini.linear(2 * cfg.dense_inter, h), ini.linear(h, cfg.dense_inter, gain)
        else:
            lw["gate"] = ini.linear(cfg.experts, h).float()  # routing runs in float32
            lw["w13_q"], lw["w13_s"] = ini.int4(cfg.experts, 2 * cfg.moe_inter, h)
            lw["w2_q"], lw["w2_s"] = ini.int4(cfg.experts, h, cfg.moe_inter, gain)
            si = cfg.moe_inter * cfg.shared_experts
            lw["sh_w13"], lw["sh_w2"] = ini.linear(2 * si, h), ini.linear(h, si, gain)
        return lw

    def _room(self, shard: dict[str, Tensor], tp: int) -> bool:
        """Whether CUDA memory holds one more set (at tp > 1 its full build and its shard) and the reserve."""
        if self.device.type != "cuda":
            return True
        nbytes = sum(t.numel() * t.element_size() for t in shard.values())
        free, _ = torch.cuda.mem_get_info(self.device)
        return free > RESERVE_BYTES + nbytes * (tp + 1 if tp > 1 else 1)

    def truncated(self, layers: int) -> "TargetModel":
        """The same model cut to its first `layers` layers (shared weights; a depth series)."""
        if not 1 <= layers <= self.cfg.layers:
            raise ValueError(f"layers must be within 1..{self.cfg.layers}, got {layers}")
        view = copy.copy(self)
        view.cfg = replace(self.cfg, layers=layers)
        view.layers = self.layers[:layers]
        return view

    def continuation(self, tok: Tensor, n: int) -> Tensor:
        """The target's greedy n tokens after each token of tok [Bt] -> [Bt, n]: the successor chain
        (see module doc). A token outside the hot vocab, which only a lost margin gives, gets a
        wrong chain: it shows as lower acceptance, never as wrong output."""
        hot = self.successor.numel()
        out = []
        for _ in range(n):
            tok = self.successor[tok % hot]
            out.append(tok)
        return torch.stack(out, 1)

    def pick(self, logits: Tensor) -> Tensor:
        """Greedy tokens (global ids) from this rank's logits [..., V / tp]."""
        return self.comm.argmax(logits, self.vocab_offset)

    def route(self, x: Tensor, lw: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """K2-style sigmoid routing: top-k experts, weights renormalised and scaled."""
        scores = torch.sigmoid(F.linear(x.float(), lw["gate"]))
        w, ids = scores.topk(self.cfg.top_k, dim=-1)
        return ids, (w / w.sum(-1, keepdim=True) * self.cfg.routed_scale).float()

    def _attention(self, x: Tensor, lw: dict[str, Tensor], li: int, angles: tuple[Tensor, Tensor],
                   cache: LatentCache, rows: Tensor, tree_mask: Tensor) -> Tensor:
        cfg = self.cfg
        bt, t, _ = x.shape
        q = F.linear(rms_norm(F.linear(x, lw["q_a"]), lw["q_norm"], cfg.norm_eps), lw["q_b"])
        q = q.view(bt, t, self.heads, cfg.qk_dim)
        q_nope, q_pe = q[..., : cfg.nope_dim], rope(q[..., cfg.nope_dim:], *angles)
        kv = F.linear(x, lw["kv_a"])
        ckv = rms_norm(kv[..., : cfg.kv_lora], lw["kv_norm"], cfg.norm_eps)
        kpe = rope(kv[..., cfg.kv_lora:], *angles)
        # write the new rows at lens .. lens+T-1 of this layer's cache
        cache.ckv[li].scatter_(1, rows.unsqueeze(-1).expand(bt, t, cfg.kv_lora), ckv)
        cache.kpe[li].scatter_(1, rows.unsqueeze(-1).expand(bt, t, cfg.rope_dim), kpe)
        q_lat = torch.einsum("bthd,hdc->bthc", q_nope, lw["w_uk"])
        with gpu_busy.section("attention"):
            o_lat = ops.mla_tree_attention(q_lat, q_pe, cache.ckv[li], cache.kpe[li], cache.lens, tree_mask,
                                           self.sm_scale, impl=self.impl)
        o = torch.einsum("bthc,hvc->bthv", o_lat, lw["w_uv"])
        return F.linear(o.reshape(bt, t, self.heads * cfg.v_dim), lw["o"])

    def _ffn(self, x: Tensor, lw: dict[str, Tensor]) -> Tensor:
        if "w13" in lw:
            return swiglu(x, lw["w13"], lw["w2"])
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        ids, w = self.route(flat, lw)
        with gpu_busy.section("moe"):
            routed = ops.moe_w4a16(flat, lw["w13_q"], lw["w13_s"], lw["w2_q"], lw["w2_s"], ids, w, impl=self.impl)
        return (routed + swiglu(flat, lw["sh_w13"], lw["sh_w2"])).view(shape)

    def forward(self, tokens: Tensor, positions: Tensor, cache: LatentCache, tree_mask: Tensor | None,
                pick: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """tokens/positions [Bt, T] sit at cache rows lens .. lens+T-1 (the cache's lens is not moved).

        tree_mask [Bt, T, T]: which of the T new tokens each one sees (besides every cached row); None:
        a chunk of prompt, each token seeing the chunk's tokens up to itself (one causal mask, made here).
        Returns (logits [Bt, T, V / tp]: this rank's vocab shard, hidden [Bt, T, H]) with hidden the last layer's output before
        the final norm, which the drafter conditions on; with `pick` ([Bt] row per sequence, e.g.
        each prompt's last token in a padded prefill) only that row: [Bt, 1, V] and [Bt, 1, H].
        """
        bt, t = tokens.shape
        if tree_mask is None:
            tree_mask = torch.ones(t, t, dtype=torch.bool, device=tokens.device).tril().expand(bt, t, t)
        x = self.embed[tokens]
        rows = cache.lens.unsqueeze(1) + torch.arange(t, device=tokens.device)
        angles = rope_angles(positions, self.cfg.rope_dim, self.cfg.rope_theta)
        for li, lw in enumerate(self.layers):
            x = x + self.comm.all_reduce(self._attention(rms_norm(x, lw["attn_norm"], self.cfg.norm_eps), lw, li,
                                                         angles, cache, rows, tree_mask))
            x = x + self.comm.all_reduce(self._ffn(rms_norm(x, lw["ffn_norm"], self.cfg.norm_eps), lw))
        if pick is not None:
            x = x.gather(1, pick.view(-1, 1, 1).expand(-1, 1, x.shape[-1]))
        x_n = rms_norm(x, self.final_norm, self.cfg.norm_eps)
        with gpu_busy.section("lm_head"):
            return F.linear(x_n, self.lm_head), x
