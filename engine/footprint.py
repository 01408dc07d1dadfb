"""Device bytes an e2e point needs, known before it allocates anything big: the weights it holds,
the latent cache at its capacity and the largest forward's temporaries, against what is free.

The working set is an upper estimate (every large tensor one layer of a forward makes, counted as
if all were alive at once); engine.preflight_longctx prints it beside the measured CUDA peak.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from engine.config import ModelConfig
from engine.decode import Decoder, chunk_len

# Query rows x splits the Triton MLA kernel's split partials cover at most (kernels.mla_tree_attention
# plans ~2 waves of programs; an estimate need not import Triton).
MLA_PARTIAL_ROWS = 528


def tensors_bytes(*holders: object) -> int:
    """Bytes of the distinct storages of every tensor held by these objects (their attributes, and
    lists / dicts of tensors one level down: a model's layers), each storage once."""
    seen: dict[tuple[str, int], int] = {}

    def add(t: Tensor) -> None:
        st = t.untyped_storage()
        seen[(str(t.device), st.data_ptr())] = st.nbytes()

    for h in holders:
        for v in vars(h).values():
            items = v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else [v]
            for x in items:
                for t in (x.values() if isinstance(x, dict) else [x]):
                    if isinstance(t, Tensor):
                        add(t)
    return sum(seen.values())


def cache_bytes(cfg: ModelConfig, batch: int, capacity: int, elem: int) -> int:
    """engine.model.LatentCache at `capacity` rows a sequence: ckv and kpe of every layer."""
    return cfg.layers * batch * capacity * (cfg.kv_lora + cfg.rope_dim) * elem


def forward_bytes(cfg: ModelConfig, tp: int, batch: int, tokens: int, capacity: int, elem: int,
                  scores: bool) -> int:
    """Temporaries of one forward of `tokens` positions a sequence over caches of `capacity` rows.

    scores: attention through the torch reference, which materialises [Bt, heads, T, S] scores and
    probabilities in float32 (and the mask); the Triton kernel keeps only split partials."""
    m, hh, h = batch * tokens, cfg.heads // tp, cfg.hidden
    inter, shared = cfg.moe_inter // tp, cfg.moe_inter * cfg.shared_experts // tp
    per_token = (elem * (8 * h + hh * (cfg.qk_dim + 2 * cfg.kv_lora + cfg.v_dim) + cfg.q_lora
                         + cfg.kv_lora + cfg.rope_dim + 3 * max(shared, cfg.dense_inter // tp) + cfg.vocab // tp)
                 + 4 * (cfg.experts + 3 * hh * cfg.rope_dim)                        # routing, rope in float32
                 + cfg.top_k * (4 * 2 * inter + elem * inter + 4 * h + 12))        # MoE slots: gate_up, act, down
    mask = 2 * batch * tokens * tokens                                              # bool, and its int8 copy
    if scores:
        attn = 4 * 3 * m * hh * capacity + 2 * 4 * batch * capacity * (cfg.kv_lora + cfg.rope_dim)
    else:
        attn = 4 * MLA_PARTIAL_ROWS * hh * (cfg.kv_lora + 1)
    dequant = 4 * 3 * h * inter if scores else 0                                    # the torch MoE's one expert
    return m * per_token + mask + attn + dequant


@dataclass(frozen=True)
class Need:
    """What a point holds on its device: weights (already resident), cache and working set."""

    weights: int
    cache: int
    work: int

    @property
    def total(self) -> int:
        return self.weights + self.cache + self.work

    @property
    def beside_weights(self) -> int:
        return self.cache + self.work

    def reason(self, free: int, rows: str) -> str:
        """Why the point does not fit: what it needs, in words, against what is free."""
        gb = 1e9
        return (f"needs {self.total / gb:.1f} GB: weights {self.weights / gb:.1f} + latent cache "
                f"{self.cache / gb:.1f} ({rows}) + working set {self.work / gb:.1f}; "
                f"{free / gb:.1f} GB free beside the weights")


def free_bytes(device: torch.device) -> int:
    """Bytes a point may still allocate: CUDA's free memory once the allocator's cache is returned;
    on the CPU the kernel's MemAvailable (free pages when it is not readable)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def point_need(dec: Decoder, prompts: list[list[int]], rows: int, budget: int) -> Need:
    """An e2e point's bytes: the weights its model and drafter hold, its cache at `rows`, and the
    larger of a prefill chunk's and a verify's working set."""
    m, bt = dec.model, len(prompts)
    el = torch.finfo(m.dtype).bits // 8
    chunk = min(max(map(len, prompts)), chunk_len(bt, dec.prefill_tokens))
    scores = m.device.type != "cuda"
    work = max(forward_bytes(m.cfg, m.tp, bt, t, rows, el, scores) for t in (chunk, budget + 1))
    return Need(tensors_bytes(m, dec.drafter), cache_bytes(m.cfg, bt, rows, el), work)
