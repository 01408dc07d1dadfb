"""The INT4 dequant and dot steps the MoE's split-K passes inline (Triton device functions and their PTX).

Two layouts of the activations meet K2's packed words (8 nibbles an int32, one bf16 scale per 32):
the FMA path's pair-planes (int32 words of two activations, `load_pairs`, `word_dot` or the packed
bf16x2 PTX `ASM_W4_DOT`) and the tensor-core path's plane-major rows (`load_planes`, `plane_dots`:
plane j of a step holds elements 8w + j, so each plane is one MMA operand with no interleave).
"""

from __future__ import annotations

import triton
import triton.language as tl

# word (two's-complement nibbles) . four bf16x2 activation pairs -> one bf16x2 partial (two sums of
# four products): each pair of nibbles dequantized to exact bf16 q (as in _ASM_W4_PAIR), then one bf16x2 FMA
# with the pair-plane of the activation (the FMA path's layout): 18 instructions for 8 weights.
ASM_W4_DOT = tl.constexpr("""{
.reg .b32 t, u, d, acc, one, m136;
mov.b32 one, 0x3F803F80;
mov.b32 m136, 0xC308C308;
mov.b32 acc, 0;
xor.b32 t, $1, 0x88888888;
shr.u32 u, t, 4;
""" + "".join(f"""prmt.b32 d, t, u, 0x0{4 + p}0{p};
lop3.b32 d, d, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 d, d, one, m136;
fma.rn.bf16x2 acc, d, ${2 + p}, acc;
""" for p in range(4)) + "mov.b32 $0, acc;\n}")


# two words a, b (K-adjacent in the MMA operand) + their bf16 scales (one register) -> plane j (j = 0..7)
# as one bf16x2 register (nibble j of a, nibble j of b): prmt takes byte j // 2 of each word (shifted
# by 4 for odd j), one lop3 does (d & 0xF) ^ 8 | 0x4300 = bf16 128 + q + 8, then FMA -136 and FMA by
# the scales: 34 instructions for 16 weights, and no repacking for the MMA's register operand.
_ASM_W4_PAIR = tl.constexpr("""{
.reg .b32 ua, ub, d, one, m136, nz;
mov.b32 one, 0x3F803F80;
mov.b32 m136, 0xC308C308;
mov.b32 nz, 0x80008000;
shr.u32 ua, $8, 4;
shr.u32 ub, $9, 4;
""" + "".join(f"""prmt.b32 d, {"$8" if j % 2 == 0 else "ua"}, {"$9" if j % 2 == 0 else "ub"}, {hex((j // 2) * 0x11 + (4 + j // 2) * 0x1100)};
lop3.b32 d, d, 0x000F000F, 0x43084308, 0x6A;
fma.rn.bf16x2 d, d, one, m136;
fma.rn.bf16x2 ${j}, d, $10, nz;
""" for j in range(8)) + "}")


@triton.jit
def _nibble(words, j: tl.constexpr):
    """Element j of each word as fp32 without an int-to-float conversion: (q ^ 8) sits under the
    exponent of 2^23, so bitcast(nib ^ 0x4B000008) = 2^23 + q + 8 exactly."""
    return (((words >> (4 * j)) & 0xF) ^ 0x4B000008).to(tl.float32, bitcast=True) - 8388616.0


@triton.jit
def _planes(words, scales, dtype: tl.constexpr, ASM: tl.constexpr):
    """[BN, W] words + per-word scales -> 8 planes [BN, W]: plane j holds elements 8w + j, scaled.
    ASM: the pair-packed PTX dequant (bf16 on the GPU); else fp32 math (the interpreter)."""
    if ASM:
        v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
            _ASM_W4_PAIR, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r", [words, scales.to(tl.bfloat16)],
            dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16,
                   tl.bfloat16), is_pure=True, pack=2)
    else:
        sf = scales.to(tl.float32)
        v0 = (_nibble(words, 0) * sf).to(dtype)
        v1 = (_nibble(words, 1) * sf).to(dtype)
        v2 = (_nibble(words, 2) * sf).to(dtype)
        v3 = (_nibble(words, 3) * sf).to(dtype)
        v4 = (_nibble(words, 4) * sf).to(dtype)
        v5 = (_nibble(words, 5) * sf).to(dtype)
        v6 = (_nibble(words, 6) * sf).to(dtype)
        v7 = (_nibble(words, 7) * sf).to(dtype)
    return v0, v1, v2, v3, v4, v5, v6, v7


@triton.jit
def load_planes(ap, k0, xm, W: tl.constexpr):
    """The eight activation planes of the step at k0 on plane-major rows (moe_gemm._plane_major): plane j
    (elements 8w + j of the step) is the contiguous run at ap + k0 + j W, ap = w."""
    return (tl.load(ap + k0 + 0 * W, mask=xm, other=0.0), tl.load(ap + k0 + 1 * W, mask=xm, other=0.0),
            tl.load(ap + k0 + 2 * W, mask=xm, other=0.0), tl.load(ap + k0 + 3 * W, mask=xm, other=0.0),
            tl.load(ap + k0 + 4 * W, mask=xm, other=0.0), tl.load(ap + k0 + 5 * W, mask=xm, other=0.0),
            tl.load(ap + k0 + 6 * W, mask=xm, other=0.0), tl.load(ap + k0 + 7 * W, mask=xm, other=0.0))


@triton.jit
def plane_dots(words, scales, x0, x1, x2, x3, x4, x5, x6, x7, acc, dtype: tl.constexpr, ASM: tl.constexpr):
    """acc += W . x with K permuted plane-major: sum_j plane_j . x[8w + j]; no interleave needed."""
    v0, v1, v2, v3, v4, v5, v6, v7 = _planes(words, scales, dtype, ASM)
    acc = tl.dot(v0, x0, acc)
    acc = tl.dot(v1, x1, acc)
    acc = tl.dot(v2, x2, acc)
    acc = tl.dot(v3, x3, acc)
    acc = tl.dot(v4, x4, acc)
    acc = tl.dot(v5, x5, acc)
    acc = tl.dot(v6, x6, acc)
    acc = tl.dot(v7, x7, acc)
    return acc


@triton.jit
def unpack_pair(v, BF16: tl.constexpr):
    """int32 holding two 16-bit activations -> (low, high) as fp32 (exact)."""
    if BF16:
        lo = (v << 16).to(tl.float32, bitcast=True)
        hi = (v & -65536).to(tl.float32, bitcast=True)
    else:
        lo = v.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (v >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def load_pairs(xp, k0, W: tl.constexpr):
    """The four pair-planes (int32 words of two activations) of the FMA path's step at k0."""
    return (tl.load(xp + k0 // 2), tl.load(xp + k0 // 2 + W), tl.load(xp + k0 // 2 + 2 * W),
            tl.load(xp + k0 // 2 + 3 * W))


@triton.jit
def _lane(src, j: tl.constexpr, magic):
    """2^(4j) * q of the biased nibble at bits 4j..4j+3 (j <= 3) of src: masked under 2^23's
    exponent, no shift (2^23 + 2^(4j) (q + 8) is exact), minus the constant. `magic` (0x4B000000)
    comes in as a kernel argument so that mask-and-or is one LOP3 (it takes one immediate)."""
    return ((src & (15 << (4 * j))) | magic).to(tl.float32, bitcast=True) - (8388608.0 + 8.0 * 16**j)


@triton.jit
def word_dot(words, x0, x1, x2, x3, x4, x5, x6, x7, magic):
    """sum_j q_j * x_j over the 8 nibbles of each word: one xor and one shift a word, a mask, a
    subtraction and an FMA a nibble, Horner steps of 2^-4 between nibble pairs (j, j + 4)."""
    lo = words ^ -2004318072  # 0x88888888: two's complement -> q + 8
    hi = lo >> 16
    t = _lane(lo, 3, magic) * x3
    t += _lane(hi, 3, magic) * x7
    t = t * 0.0625
    t += _lane(lo, 2, magic) * x2
    t += _lane(hi, 2, magic) * x6
    t = t * 0.0625
    t += _lane(lo, 1, magic) * x1
    t += _lane(hi, 1, magic) * x5
    t = t * 0.0625
    t += _lane(lo, 0, magic) * x0
    t += _lane(hi, 0, magic) * x4
    return t


