"""The Triton MoE's pass configs: the named record, its tables by shape class and M bucket, and the pick.

Pure Python (no torch, no Triton), so the CUDA MoE and the config sweep share the shape classes
without loading the kernels.
"""

from __future__ import annotations

from typing import NamedTuple

# (BM, BN, BK, KS, num_warps, num_stages, DOT) per kernel, by the largest M of the bucket.
# BM slots per block, BN weight rows, BK of K per step, KS of K per program.
# DOT 0: FMA GEMV, one slot per block (BM must be 1); the activation is pre-permuted so that its
#   int32 pairs line up with the weight words (same [BN, BK/8] layout: no shared-memory shuffles);
#   DOT 4: the same with the next step's words, scales and activations loaded one step ahead;
#   DOT 8 (+ 4): the same with packed bf16x2 FMAs in PTX (bf16 on the GPU; plain FMA elsewhere).
# DOT 1: plane dots on the tensor cores, slots padded to 16 (BM >= 16): the words dequantized by the
#   pair-packed PTX (two K-adjacent words a call, each plane straight into the bf16x2 register of
#   the MMA operand) against plane-major activations (moe_gemm._plane_major: each plane a contiguous
#   run, so the pipeliner copies them asynchronously). Runs 11-13 of NOTES.md call it DOT 49.
class SplitConfig(NamedTuple):
    """One pass's config (the fields as the comment above names them), read by name."""

    bm: int
    bn: int
    bk: int
    ks: int
    warps: int
    stages: int
    dot: int

    @property
    def tensor_cores(self) -> bool:
        """DOT 1 (plane dots on the tensor cores) rather than an FMA GEMV."""
        return bool(self.dot & 3)


_C = SplitConfig  # keeps the tables below one line a bucket
SPLIT_MAX_SLOTS = 32  # M * top-k up to this goes split-K (M <= 4 at K2's top-8)
SHARD_INTER = 1024  # experts with a smaller intermediate (K2 at TP >= 2) take the "shard" tables


def shape_class(inter: int) -> str:
    """Config table of an expert shape: "full" (K2: 2048) or "shard" (a TP rank's slice, 256 at TP-8)."""
    return "full" if inter >= SHARD_INTER else "shard"


# By shape class, then the largest M of the bucket (M above the last bucket takes the last).
# H200 sweeps (NOTES.md, runs 4, 6-8, 11-13): packed bf16x2 FMAs (+ the next step's loads in flight at
# M = 1); at the shard, short K chunks (KS 1024: 7 gate_up splits) so that M = 1 has enough programs.
SPLIT_CONFIGS: dict[str, dict[int, dict[str, SplitConfig]]] = {
    "full": {1: {"gate_up": _C(1, 64, 256, 7168, 4, 3, 12), "down": _C(1, 64, 256, 7168, 4, 3, 12)},
             4: {"gate_up": _C(1, 64, 256, 3584, 4, 3, 8), "down": _C(1, 64, 256, 3584, 4, 3, 8)}},
    "shard": {2: {"gate_up": _C(1, 64, 256, 1024, 4, 3, 12), "down": _C(1, 64, 256, 1024, 4, 3, 12)},
              4: {"gate_up": _C(1, 64, 256, 3584, 4, 3, 8), "down": _C(1, 64, 256, 3584, 4, 3, 8)}},
}


def _bucket(table: dict[int, dict[str, SplitConfig]], m: int) -> dict[str, SplitConfig]:
    return table[min((b for b in table if b >= m), default=max(table))]


def split_config(m: int, inter: int) -> dict[str, SplitConfig]:
    """The split-K config of the smallest M bucket that holds m, for experts of intermediate `inter`."""
    return _bucket(SPLIT_CONFIGS[shape_class(inter)], m)


# Grouped split-K (above SPLIT_MAX_SLOTS): the same kernel with its blocks from moe_gemm.align() (BM
# slots of one expert, so each weight tile is dequantized once per block). H200 sweeps (NOTES.md, runs
# 5, 8, 11-13): the packed FMA up to M = 32; above, the plane dots on tensor cores (DOT 1: plane-major
# activations, pair-packed dequant; KS = all of K), BM 32 once most experts hold > 16 slots.
GROUPED_CONFIGS: dict[str, dict[int, dict[str, SplitConfig]]] = {
    "full": {32: {"gate_up": _C(1, 64, 256, 3584, 4, 3, 8), "down": _C(1, 64, 256, 3584, 4, 3, 8)},
             256: {"gate_up": _C(16, 64, 256, 7168, 4, 3, 1), "down": _C(16, 64, 256, 7168, 4, 3, 1)},
             512: {"gate_up": _C(16, 64, 256, 7168, 2, 3, 1), "down": _C(16, 64, 256, 7168, 2, 3, 1)},
             1024: {"gate_up": _C(32, 128, 128, 7168, 4, 3, 1), "down": _C(32, 128, 128, 7168, 4, 3, 1)}},
    "shard": {32: {"gate_up": _C(1, 64, 256, 3584, 4, 3, 8), "down": _C(1, 64, 256, 3584, 4, 3, 8)},
              512: {"gate_up": _C(16, 64, 256, 7168, 4, 3, 1), "down": _C(16, 64, 256, 7168, 4, 3, 1)},
              1024: {"gate_up": _C(32, 64, 256, 7168, 4, 3, 1), "down": _C(32, 64, 256, 7168, 4, 3, 1)}},
}


def grouped_config(m: int, inter: int) -> dict[str, SplitConfig]:
    """The grouped config of the smallest M bucket that holds m, for experts of intermediate `inter`."""
    return _bucket(GROUPED_CONFIGS[shape_class(inter)], m)

