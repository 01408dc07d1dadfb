// W4A16 MoE grouped GEMM on mma.sync tensor cores, reading K2's own INT4 layout (no repack).
//
// Same contract as the Triton split-K pass (kernels/moe_gemm_kernels.py): one CTA computes, for one
// block of <= TN token-expert slots routed to expert e (the table of kernels/moe_gemm.py's align()),
// span tiles of BN = WARPS * R * 16 output rows over one KS chunk of K, and writes partials
// part[split, slot, n]: fp32 for gate_up, bf16 for the weighted down pass (its per-slot outputs: half
// the bytes fp32 would be, which moe_sum reads back; kernels/NOTES.md v13). Each warp owns R strips
// of 16 rows of a tile. A stage holds the activations of TA <= TN tokens: at decode sizes
// (M <= TA, so no expert has more than TA tokens; the caller checks) the rest of the block's 8
// MMA columns read token 0's and are never stored, and the shared memory saved deepens the ring.
//
// Why no weight repack: the MMA sums over K, so any K order works as long as A (weights) and B
// (activations) agree. A K step of 256 is 8 scale groups of 32 (4 words a row each). For group G,
// thread (g, t) of a warp (g = lane / 4, t = lane % 4) takes word 4G + t of rows g and g + 8
// (ldmatrix hands each lane its word of the 16-byte group chunk), so the two m16n8k16 MMAs of a
// group see only that group's K and its scale can be applied once to their fp32 sum.
// Dequant without a subtraction or a multiply: lop3 turns nibble pair (j, j + 4) of a word
// (shifted by 4j) into bf16 (136 + q_j, 136 + q_(j+4)) exactly, so the MMAs sum (136 + q) x; the
// offset is removed with the activations' group sums X (emit_word): out = sum_G s_G (A_G -
// 136 X_G), the second term by one more MMA a step over the scales and X split into two bf16s.
// That costs an fp32 FMA per output and group, and registers for the per-group sums and the
// offset term. SC kernels scale the weights before the MMA instead: q s rounded once to bf16 (an
// exact subtraction of 136, then one multiply a pair; the Triton kernel's numerics), and the MMAs
// sum straight into the accumulators. More dequant work, but no FMAs, no offset term and no group
// sums, so far fewer registers where many slots share a warp; a larger norm error, well inside
// 1e-2 (kernels/NOTES.md v12 has the registers, times and errors).
// The activations come permuted within each word, (0, 4, 1, 5, 2, 6, 3, 7), to match the pairs.
// Weights, scales, activations and group sums stream through a STAGES-deep cp.async ring of H K
// steps a stage, running on from one tile to the next.
// No atomics; the partials are combined in a fixed order (moe_sum): bit-identical outputs.
//
// The five launches of a MoE call (moe_align, gate_up, moe_silu_prep, down, moe_sum) are
// programmatic dependent launches on sm_90 on: each kernel lets the next one's CTAs start once all
// of its own have started (launch_dependents) and waits for the one before it to finish
// (griddepcontrol.wait) before it reads what that one wrote. The down pass reads its block table
// (written by moe_align, three launches back, finished before gate_up's wait returned) and copies
// its first weight stages before it waits, so they stream while the SiLU kernel drains.
#include <cstdint>

namespace {

// The shared-memory layout is the host's (kernels/moe_configs.py: StageLayout, the bytes it allocates):
// kernels/moe_cuda.py builds this file after a prelude (cuda_prelude) defining its units below and
// MOE_KERNELS, one MOE_KERNEL line a kernel with its stage's byte counts.
#if !defined(MOE_STEP) || !defined(MOE_AROW) || !defined(MOE_XREC) || !defined(MOE_STRIP_WEIGHTS) || \
    !defined(MOE_STRIP_SCALES) || !defined(MOE_KERNELS)
#error "moe_w4a16.cu is built through kernels/moe_cuda.py, whose prelude gives its layout"
#endif
constexpr int STEP = MOE_STEP;  // K per pipeline step
constexpr int AROW = MOE_AROW;  // bytes per token row of a stage's activations (padded: no bank conflicts)
constexpr int XREC = MOE_XREC;  // bytes of one token's group sums a step: 8 x (hi, lo) bf16
constexpr int STRIP_W = MOE_STRIP_WEIGHTS;  // bytes of one strip's weights a step
constexpr int STRIP_S = MOE_STRIP_SCALES;   // bytes of one strip's scales a step
static_assert(STEP == 256 && STRIP_W == 16 * 8 * 16 && STRIP_S == 16 * 16 && XREC == 8 * 4 && AROW >= 2 * STEP,
              "the GEMM's addressing reads a K step as 8 groups of 32, a strip as 16 rows x 8 16-byte "
              "chunks with its 16 x 8 bf16 scales, and a token's sums as 8 (hi, lo) pairs");

// The inline PTX the kernels are built from, then the GEMM pass (a stage's layout, moe_gemm).
#include "moe_w4a16_ptx.cuh"
#include "moe_w4a16_gemm.cuh"

// The activations as moe_gemm reads them, one 8-element word v (natural order) of row `row`, word
// w of K / 8: xp gets the word's elements in the order (0, 4, 1, 5, 2, 6, 3, 7) (the pairs the
// dequant makes), and per row and K step of 256 the 8 group sums X (fp32 sums of 32 elements) go
// to xs as 16 bf16, (hi(X_2i), hi(X_2i+1), lo(X_2i), lo(X_2i+1)) for i = 0..3 with hi = bf16(X),
// lo = bf16(X - hi): the B fragment of the offset MMA. A group's 4 words are 4 adjacent lanes of
// one warp, all 32 lanes live (K % 256 == 0, whole rows per warp).
__device__ __forceinline__ void emit_word(uint4 v, long long row, int w, int K, uint16_t* __restrict__ xp,
                                          uint16_t* __restrict__ xs) {
  uint4 p;
  p.x = __byte_perm(v.x, v.z, 0x5410);
  p.y = __byte_perm(v.x, v.z, 0x7632);
  p.z = __byte_perm(v.y, v.w, 0x5410);
  p.w = __byte_perm(v.y, v.w, 0x7632);
  *reinterpret_cast<uint4*>(xp + row * K + w * 8) = p;
  float sum = bf16_lo(v.x) + bf16_hi(v.x) + bf16_lo(v.y) + bf16_hi(v.y) + bf16_lo(v.z) + bf16_hi(v.z) +
              bf16_lo(v.w) + bf16_hi(v.w);
  sum += __shfl_xor_sync(~0u, sum, 1);
  sum += __shfl_xor_sync(~0u, sum, 2);
  if ((w & 3) == 0) {
    const int grp = (w >> 2) & 7;  // group within the step
    const uint16_t hi = bf16_rn(sum);
    uint16_t* rec = xs + row * (K / 16) + (w >> 5) * 16 + 4 * (grp >> 1) + (grp & 1);
    rec[0] = hi;
    rec[2] = bf16_rn(sum - __uint_as_float(static_cast<uint32_t>(hi) << 16));
  }
}

}  // namespace

// h = silu(gate) * up from the gate_up partials part[split, slot, 2I] (summed over the splits in
// order), rounded to bf16 and written as the down pass reads it (emit_word). A thread per word of
// h, 256 threads a CTA over the slots' words in order.
extern "C" __global__ void __launch_bounds__(256)
    moe_silu_prep(const float* __restrict__ part, int splits, int S, int I, uint16_t* __restrict__ hp,
                  uint16_t* __restrict__ hs) {
  grid_launch_dependents();  // the down pass may start now: it waits before it reads h
  grid_wait();
  const long long f = blockIdx.x * 256LL + threadIdx.x, words = I / 8;
  if (f >= S * words) return;  // I % 256 == 0: whole warps leave
  const long long row = f / words;
  const int w = static_cast<int>(f - row * words);
  float g[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, u[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (int sp = 0; sp < splits; ++sp) {
    const float* base = part + (sp * (long long)S + row) * (2 * I) + w * 8;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float4 a = *reinterpret_cast<const float4*>(base + 4 * h);
      const float4 b = *reinterpret_cast<const float4*>(base + I + 4 * h);
      g[4 * h] += a.x, g[4 * h + 1] += a.y, g[4 * h + 2] += a.z, g[4 * h + 3] += a.w;
      u[4 * h] += b.x, u[4 * h + 1] += b.y, u[4 * h + 2] += b.z, u[4 * h + 3] += b.w;
    }
  }
  uint32_t o[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float h0 = g[2 * i] / (1.f + expf(-g[2 * i])) * u[2 * i];
    const float h1 = g[2 * i + 1] / (1.f + expf(-g[2 * i + 1])) * u[2 * i + 1];
    o[i] = bf16_rn(h0) | static_cast<uint32_t>(bf16_rn(h1)) << 16;
  }
  emit_word(make_uint4(o[0], o[1], o[2], o[3]), row, w, I, hp, hs);
}

// out[m, n] = bf16 of the down partials part[split, m * topk + j, n] (bf16) summed in fp32 over the
// splits, then over j, in that fixed order. A thread per 4 outputs, 256 threads a CTA.
extern "C" __global__ void __launch_bounds__(256)
    moe_sum(const uint16_t* __restrict__ part, int splits, int S, int M, int N, int topk, uint16_t* __restrict__ out) {
  grid_wait();
  const long long f = blockIdx.x * 256LL + threadIdx.x, quads = N / 4;
  if (f >= M * quads) return;
  const long long m = f / quads;
  const int c = static_cast<int>(f - m * quads) * 4;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int sp = 0; sp < splits; ++sp)
    for (int j = 0; j < topk; ++j) {
      const uint2 v = *reinterpret_cast<const uint2*>(part + (sp * (long long)S + m * topk + j) * N + c);
      acc.x += bf16_lo(v.x), acc.y += bf16_hi(v.x), acc.z += bf16_lo(v.y), acc.w += bf16_hi(v.y);
    }
  *reinterpret_cast<uint2*>(out + m * N + c) =
      make_uint2(bf16_rn(acc.x) | static_cast<uint32_t>(bf16_rn(acc.y)) << 16,
                 bf16_rn(acc.z) | static_cast<uint32_t>(bf16_rn(acc.w)) << 16);
}

// Block table of the slots grouped by expert, as kernels/moe_gemm.py's align() makes it: sorted
// slots (stable: slot order within an expert), per-expert start and count, per-block expert (E for
// unused blocks) and first row. CTA 0 (1024 threads, E <= 1024) makes it: counts by shared atomics
// (order-free), then placement 1024 slots at a time, a thread each: a slot goes after its expert's
// slots of earlier tiles (the cursor), of lower warps of its tile (per-warp counts) and of lower
// lanes of its warp (match_any), so the order is the slots' own and the result deterministic (every
// GEMM CTA waits for this table: one warp placing 32 slots at a time was slow, kernels/NOTES.md
// v14). CTAs 1.. meanwhile prepare `rows` rows of activations x for the GEMM (emit_word), a thread
// per word: one launch for both.
extern "C" __global__ void __launch_bounds__(1024)
    moe_align(const long long* __restrict__ ids, int S, int E, int BM, int ub, int* __restrict__ slots,
              int* __restrict__ seg, int* __restrict__ cnt, int* __restrict__ bexp, int* __restrict__ bms,
              const uint16_t* __restrict__ x, int rows, int K, uint16_t* __restrict__ xp, uint16_t* __restrict__ xs) {
  grid_launch_dependents();
  grid_wait();
  if (blockIdx.x > 0) {
    const long long f = (blockIdx.x - 1) * 1024LL + threadIdx.x, words = K / 8;
    if (f >= rows * words) return;  // K % 256 == 0: whole warps leave
    const long long row = f / words;
    const int w = static_cast<int>(f - row * words);
    emit_word(*reinterpret_cast<const uint4*>(x + row * K + w * 8), row, w, K, xp, xs);
    return;
  }
  __shared__ int counts[1024], cursor[1024];
  __shared__ int wsum[32][2];
  __shared__ int total;
  // per expert, the slots each warp of a tile has of it (<= 32: a byte a warp, 4 a word), rows
  // padded to 9 words so the expert threads' reads of their rows are conflict-free
  __shared__ uint32_t wcnt[1024][9];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  counts[tid] = 0;
#pragma unroll
  for (int k = 0; k < 8; ++k) wcnt[tid][k] = 0;
  __syncthreads();
  for (int s = tid; s < S; s += 1024) {
    const long long x = ids[s];
    if (x >= 0 && x < E) atomicAdd(&counts[x], 1);
  }
  __syncthreads();
  const int c = tid < E ? counts[tid] : 0, nb = (c + BM - 1) / BM;
  int ic = c, inb = nb;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(~0u, ic, o), z = __shfl_up_sync(~0u, inb, o);
    if (lane >= o) ic += y, inb += z;
  }
  if (lane == 31) wsum[warp][0] = ic, wsum[warp][1] = inb;
  __syncthreads();
  if (warp == 0) {
    const int a0 = wsum[lane][0], b0 = wsum[lane][1];
    int ia = a0, ib = b0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(~0u, ia, o), z = __shfl_up_sync(~0u, ib, o);
      if (lane >= o) ia += y, ib += z;
    }
    wsum[lane][0] = ia - a0, wsum[lane][1] = ib - b0;
  }
  __syncthreads();
  const int start = wsum[warp][0] + ic - c, bstart = wsum[warp][1] + inb - nb;
  if (tid < E) {
    seg[tid] = start, cnt[tid] = c, cursor[tid] = start;
    for (int j = 0; j < nb; ++j) bexp[bstart + j] = tid, bms[bstart + j] = j * BM;
    if (tid == E - 1) total = bstart + nb;
  }
  __syncthreads();
  for (int b = total + tid; b < ub; b += 1024) bexp[b] = E, bms[b] = 0;
  long long next = tid < S ? ids[tid] : -1;
  for (int base = 0; base < S; base += 1024) {
    const int s = base + tid;
    const long long x = next;
    next = s + 1024 < S ? ids[s + 1024] : -1;  // the next tile's id, in flight meanwhile
    const bool ok = s < S && x >= 0 && x < E;
    const unsigned peers = __match_any_sync(~0u, ok ? (int)x : -1);
    const int rank = __popc(peers & ((1u << lane) - 1));
    if (ok && rank == 0) reinterpret_cast<unsigned char*>(wcnt[x])[warp] = static_cast<unsigned char>(__popc(peers));
    __syncthreads();
    if (ok) {
      int at = cursor[x] + rank;  // + the counts of warps below this one: whole words, then the bytes of a part
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const int n = min(4, max(0, warp - 4 * k));
        if (n > 0) at += __dp4a(wcnt[x][k] & (n == 4 ? ~0u : (1u << (8 * n)) - 1), 0x01010101u, 0u);
      }
      slots[at] = s;
    }
    if (base + 1024 >= S) break;  // the last tile: nothing reads the counts again
    __syncthreads();  // every slot of the tile has read the cursors and counts
    if (tid < E) {
      int n = 0;
#pragma unroll
      for (int k = 0; k < 8; ++k) n += __dp4a(wcnt[tid][k], 0x01010101u, 0u), wcnt[tid][k] = 0;
      cursor[tid] += n;
    }
    __syncthreads();
  }
}

#define MOE_KERNEL(NT, WARPS, R, STAGES, H, TA, SC, W, S, A, X)                                             \
  extern "C" __global__ void __launch_bounds__(WARPS * 32)                                                   \
      moe_w4a16_nt##NT##_w##WARPS##_r##R##_s##STAGES##_h##H##_a##TA##_sc##SC(                               \
      const uint16_t* a, const uint16_t* xs, const uint32_t* wq, const uint16_t* ws, void* part,          \
      const float* tw, const int* slots, const int* seg, const int* cnt, const int* bexp, const int* bms,  \
      int S_, int N, int K, int KS, int span, int a_rows_per_slot, int E, int weighted, int early) {       \
    moe_gemm<NT, WARPS, R, STAGES, H, TA, SC, Stage<NT, WARPS, R, H, TA, W, S, A, X>>(                      \
        a, xs, wq, ws, part, tw, slots, seg, cnt, bexp, bms, S_, N, K, KS, span, a_rows_per_slot, E, weighted, \
        early);                                                                                             \
  }

// The kernels the host asks for, each with its stage layout (kernels/moe_configs.py's cuda_prelude:
// the tables' picks, and in the config sweep's build its candidates too).
MOE_KERNELS
