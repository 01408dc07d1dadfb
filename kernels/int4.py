"""K2's routed-expert weight format: symmetric INT4, group 32 along K, bf16 scales.

Eight nibbles per int32 word: nibble j (bits 4j..4j+3) of word w holds element 8*w + j, as a
two's-complement value in [-8, 7]. One bf16 scale (absmax / 7) per 32 consecutive elements of K.
"""

from __future__ import annotations

import torch
from torch import Tensor

GROUP = 32
PACK = 8


def quantize_w4(w: Tensor) -> tuple[Tensor, Tensor]:
    """[E, N, K] float -> (packed [E, N, K//8] int32, scales [E, N, K//32] bf16).

    The codes are rounded against the bf16-rounded scale, so dequantize(quantize(w)) is the
    closest grid point of the grid the kernels actually use.
    """
    if w.dim() != 3 or w.shape[-1] % GROUP:
        raise ValueError(f"quantize_w4 wants [E, N, K] with K % {GROUP} == 0, got {tuple(w.shape)}")
    e, n, k = w.shape
    g = w.float().reshape(e, n, k // GROUP, GROUP)
    scale = (g.abs().amax(-1) / 7.0).to(torch.bfloat16)
    sf = scale.float().unsqueeze(-1)
    q = torch.where(sf > 0, torch.round(g / torch.where(sf > 0, sf, 1.0)), 0.0).clamp_(-8, 7)
    nib = (q.to(torch.int64) & 0xF).reshape(e, n, k // PACK, PACK)
    shifts = torch.arange(0, 4 * PACK, 4, device=w.device, dtype=torch.int64)
    word = (nib << shifts).sum(-1)
    word = torch.where(word >= 2**31, word - 2**32, word)  # reinterpret as two's-complement int32
    return word.to(torch.int32), scale


def unpack_w4(q: Tensor) -> Tensor:
    """[..., K//8] int32 -> [..., K] int8 codes in [-8, 7]."""
    shifts = torch.arange(0, 4 * PACK, 4, device=q.device, dtype=torch.int32)
    nib = (q.unsqueeze(-1) >> shifts) & 0xF
    nib = torch.where(nib >= 8, nib - 16, nib)
    return nib.reshape(*q.shape[:-1], q.shape[-1] * PACK).to(torch.int8)


def dequantize_w4(q: Tensor, s: Tensor) -> Tensor:
    """(packed [E, N, K//8] int32, scales [E, N, K//32] bf16) -> [E, N, K] float32."""
    codes = unpack_w4(q).float()
    k = codes.shape[-1]
    if s.shape[-1] * GROUP != k:
        raise ValueError(f"scales {tuple(s.shape)} do not match K={k} (group {GROUP})")
    return (codes.reshape(*codes.shape[:-1], k // GROUP, GROUP) * s.float().unsqueeze(-1)).reshape(codes.shape)
