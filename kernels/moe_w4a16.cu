// W4A16 MoE grouped GEMM on mma.sync tensor cores, reading K2's own INT4 layout (no repack).
//
// Same contract as kernels/moe_gemm.py's split-K pass: one CTA computes, for one block of <= TN
// token-expert slots routed to expert e (align()'s table), BN = WARPS * R * 16 output rows over one
// KS chunk of K, and writes fp32 partials part[split, slot, n]. Each warp owns R strips of 16 rows.
//
// Why no weight repack: the MMA sums over K, so any K order works as long as A (weights) and B
// (activations) agree. In a K step of 256 (32 words a row), thread (g, t) of a warp (g = lane / 4,
// t = lane % 4) takes words 4t .. 4t+3 and 16+4t .. 16+4t+3 of rows g and g+8 (two 16-byte loads
// a row, four lanes covering 64 contiguous bytes: whole sectors), i.e. scale groups t and 4 + t;
// each word feeds two m16n8k16 MMAs (nibbles 0-3, 4-7), whose B fragments are then the 8
// activations of that word's K range of token g, in natural order.
// Weights, scales and activations stream through a STAGES-deep cp.async ring in shared memory.
// Dequant per word: one shift, four (prmt, lop3 to bf16 128 + q + 8, fma -136, fma * scale).
// No atomics; the partials are combined in a fixed order by the caller: bit-identical outputs.
#include <cstdint>

namespace {

constexpr int STEP = 256;       // K per pipeline step
constexpr int AROW = 512 + 64;  // bytes per token row of a stage's activations (padded: no bank conflicts)

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// word v (two's-complement nibbles, element 8w + j in nibble j) and its scale as (s, s) ->
// q[i] = bf16x2 (element 2i, element 2i + 1) * s, exact before the final rounding.
__device__ __forceinline__ void dequant(uint32_t v, uint32_t s2, uint32_t (&q)[4]) {
  const uint32_t u = v >> 4;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    uint32_t d = __byte_perm(v, u, 0x0400 + 0x0101 * i);  // byte 0 = v.byte i, byte 2 = u.byte i
    asm("lop3.b32 %0, %0, 0x000F000F, 0x43084308, 0x6A;\n" : "+r"(d));  // (d & 0xF) ^ 8 | 0x4300
    asm("fma.rn.bf16x2 %0, %0, %1, %2;\n" : "+r"(d) : "r"(0x3F803F80u), "r"(0xC308C308u));  // - 136
    asm("fma.rn.bf16x2 %0, %0, %1, %2;\n" : "+r"(d) : "r"(s2), "r"(0x80008000u));  // * scale
    q[i] = d;
  }
}

__device__ __forceinline__ void mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                    uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Shared-memory stage: weights [STRIPS][row g | g+8][half][lane] uint4, scales [STRIPS][2][lane]
// u32, activations [TN][AROW bytes] with chunk c (8 elements) of a row at ((c % 8) * 4 + c / 8).
template <int NT, int WARPS, int R>
struct Stage {
  static constexpr int TN = 8 * NT, STRIPS = WARPS * R;
  static constexpr int W_BYTES = STRIPS * 2 * 2 * 32 * 16;
  static constexpr int S_BYTES = STRIPS * 2 * 32 * 4;
  static constexpr int BYTES = W_BYTES + S_BYTES + TN * AROW;
};

template <int NT, int WARPS, int R, int STAGES>
__device__ __forceinline__ void moe_gemm(const uint16_t* __restrict__ a, const uint32_t* __restrict__ wq,
                                         const uint16_t* __restrict__ ws, float* __restrict__ part,
                                         const float* __restrict__ tw, const int* __restrict__ slots,
                                         const int* __restrict__ seg, const int* __restrict__ cnt,
                                         const int* __restrict__ bexp, const int* __restrict__ bms, int S,
                                         int N, int K, int KS, int a_rows_per_slot, int E, int weighted) {
  using St = Stage<NT, WARPS, R>;
  constexpr int TN = St::TN;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int slot_of[TN];
  __shared__ long long arow_of[TN];

  const int e = bexp[blockIdx.x];
  if (e >= E) return;  // unused block of the table: the whole CTA leaves before any barrier
  const int mstart = bms[blockIdx.x];
  const int nvalid = min(TN, cnt[e] - mstart);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  if (tid < TN) {
    const int s = tid < nvalid ? slots[seg[e] + mstart + tid] : -1;
    slot_of[tid] = s;
    arow_of[tid] = s >= 0 ? (long long)(s / a_rows_per_slot) * K : 0;
  }
  __syncthreads();

  const int n0 = blockIdx.y * (St::STRIPS * 16);
  const int kbeg = blockIdx.z * KS;
  const int steps = KS / STEP;
  const long long ldw = K / 8, lds = K / 32;

  // Every address a thread copies from or to is fixed for the CTA but for the step's K offset
  // (weights + 32 words a step, scales + 4 words, activations + STEP elements): computed once, so
  // the copy phase of a step is its cp.async instructions and a few adds.
  constexpr int ACH = TN / WARPS;  // activation chunks (16 bytes) each thread copies a step
  static_assert(TN % WARPS == 0, "TN must be a multiple of WARPS");
  const uint32_t* wsrc[R][2];
  const uint32_t* ssrc[R][2];
  uint32_t wdst[R][2], sdst[R][2];
  const uint16_t* asrc[ACH];
  uint32_t adst[ACH];
  const uint32_t sm0 = smem_addr(smem);
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int strip = warp * R + r;
      const long long row = (long long)e * N + n0 + strip * 16 + g + 8 * hr;
      wsrc[r][hr] = wq + row * ldw + kbeg / 8 + 4 * t;
      // lane (g, t) copies scale groups 2t, 2t + 1 of its row; readers take groups t and 4 + t
      ssrc[r][hr] = reinterpret_cast<const uint32_t*>(ws + row * lds + kbeg / 32 + 2 * t);
      wdst[r][hr] = sm0 + ((strip * 2 + hr) * 2 * 32 + lane) * 16;
      sdst[r][hr] = sm0 + St::W_BYTES + ((strip * 2 + hr) * 32 + lane) * 4;
    }
#pragma unroll
  for (int i = 0; i < ACH; ++i) {
    const int c = tid + i * WARPS * 32, tok = c >> 5, ch = c & 31;  // chunk ch: the activations of word ch
    asrc[i] = tok < nvalid ? a + arow_of[tok] + kbeg + ch * 8 : nullptr;  // padded tokens: left stale,
    adst[i] = sm0 + St::W_BYTES + St::S_BYTES + tok * AROW +          // their outputs are never stored
              (((ch & 3) + 4 * (ch >> 4)) * 4 + ((ch >> 2) & 3)) * 16;
  }

  auto load = [&](int stage, int step) {
    const uint32_t off = stage * St::BYTES;
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const uint32_t* src = wsrc[r][hr] + step * (STEP / 8);
        cp16(wdst[r][hr] + off, src);
        cp16(wdst[r][hr] + off + 32 * 16, src + 16);
        cp4(sdst[r][hr] + off, ssrc[r][hr] + step * (STEP / 64));
      }
#pragma unroll
    for (int i = 0; i < ACH; ++i)
      if (asrc[i] != nullptr) cp16(adst[i] + off, asrc[i] + step * STEP);
  };

  float acc[R][NT][4];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[r][n][i] = 0.f;

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < steps) load(s, s);
    cp_commit();
  }
  for (int step = 0; step < steps; ++step) {
    cp_wait<STAGES - 2>();
    __syncthreads();  // this step's stage is complete for all threads; the previous stage is free
    if (step + STAGES - 1 < steps) load((step + STAGES - 1) % STAGES, step + STAGES - 1);
    cp_commit();
    const unsigned char* base = smem + (step % STAGES) * St::BYTES;
    const uint4* wsm = reinterpret_cast<const uint4*>(base);
    const uint32_t* ssm = reinterpret_cast<const uint32_t*>(base + St::W_BYTES);
    const unsigned char* asm_ = base + St::W_BYTES + St::S_BYTES;
    uint4 w[R][2][2];
    uint32_t sc[R][2][2];  // (s, s) of group t (words 0-3 of the thread) and 4 + t (words 4-7)
    const uint32_t half = (t & 1) ? 0x3232 : 0x1010;
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int strip = warp * R + r;
        w[r][hr][0] = wsm[((strip * 2 + hr) * 2 + 0) * 32 + lane];
        w[r][hr][1] = wsm[((strip * 2 + hr) * 2 + 1) * 32 + lane];
        const uint32_t* srow = ssm + (strip * 2 + hr) * 32 + g * 4;
        sc[r][hr][0] = __byte_perm(srow[t >> 1], 0, half);
        sc[r][hr][1] = __byte_perm(srow[2 + (t >> 1)], 0, half);
      }
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
      uint4 x[NT];
#pragma unroll
      for (int n = 0; n < NT; ++n)
        x[n] = *reinterpret_cast<const uint4*>(asm_ + (n * 8 + g) * AROW + (jj * 4 + t) * 16);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        uint32_t qa[4], qb[4];
        const uint4& wa = w[r][0][jj >> 2];
        const uint4& wb = w[r][1][jj >> 2];
        const uint32_t va = (jj & 3) == 0 ? wa.x : (jj & 3) == 1 ? wa.y : (jj & 3) == 2 ? wa.z : wa.w;
        const uint32_t vb = (jj & 3) == 0 ? wb.x : (jj & 3) == 1 ? wb.y : (jj & 3) == 2 ? wb.z : wb.w;
        dequant(va, sc[r][0][jj >> 2], qa);
        dequant(vb, sc[r][1][jj >> 2], qb);
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          mma(acc[r][n], qa[0], qb[0], qa[1], qb[1], x[n].x, x[n].y);
          mma(acc[r][n], qa[2], qb[2], qa[3], qb[3], x[n].z, x[n].w);
        }
      }
    }
  }
  cp_wait<0>();

  // c0, c1: row g, tokens 2t, 2t + 1; c2, c3: row g + 8
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int col = n * 8 + 2 * t + j;
      if (col >= nvalid) continue;
      const int slot = slot_of[col];
      const float wgt = weighted ? tw[slot] : 1.f;
      float* out = part + ((long long)blockIdx.z * S + slot) * N + n0 + g;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int row = (warp * R + r) * 16;
        out[row] = acc[r][n][j] * wgt;
        out[row + 8] = acc[r][n][2 + j] * wgt;
      }
    }
}

}  // namespace

// Block table of the slots grouped by expert, as kernels/moe_gemm.py's align() makes it: sorted
// slots (stable: slot order within an expert), per-expert start and count, per-block expert (E for
// unused blocks) and first row. One CTA of 1024 threads, E <= 1024; counts by shared atomics
// (order-free), placement by one warp in slot order (deterministic).
extern "C" __global__ void __launch_bounds__(1024)
    moe_align(const long long* __restrict__ ids, int S, int E, int BM, int ub, int* __restrict__ slots,
              int* __restrict__ seg, int* __restrict__ cnt, int* __restrict__ bexp, int* __restrict__ bms) {
  __shared__ int counts[1024], cursor[1024];
  __shared__ int wsum[32][2];
  __shared__ int total;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  counts[tid] = 0;
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
  if (warp == 0) {
    for (int base = 0; base < S; base += 32) {
      const int s = base + lane;
      const long long x = s < S ? ids[s] : -1;
      const bool ok = x >= 0 && x < E;
      const unsigned peers = __match_any_sync(~0u, ok ? (int)x : -1);
      const int leader = __ffs(peers) - 1;
      int first = 0;
      if (ok && lane == leader) first = cursor[x], cursor[x] = first + __popc(peers);
      first = __shfl_sync(~0u, first, leader);
      if (ok) slots[first + __popc(peers & ((1u << lane) - 1))] = s;
      __syncwarp();
    }
  }
}

#define MOE_KERNEL(NT, WARPS, R, STAGES)                                                                    \
  extern "C" __global__ void __launch_bounds__(WARPS * 32) moe_w4a16_nt##NT##_w##WARPS##_r##R##_s##STAGES( \
      const uint16_t* a, const uint32_t* wq, const uint16_t* ws, float* part, const float* tw,            \
      const int* slots, const int* seg, const int* cnt, const int* bexp, const int* bms, int S, int N,     \
      int K, int KS, int a_rows_per_slot, int E, int weighted) {                                           \
    moe_gemm<NT, WARPS, R, STAGES>(a, wq, ws, part, tw, slots, seg, cnt, bexp, bms, S, N, K, KS,           \
                                   a_rows_per_slot, E, weighted);                                          \
  }

// The configs kernels/moe_cuda.py may pick (KERNELS there lists the same names).
MOE_KERNEL(1, 4, 1, 4)
MOE_KERNEL(1, 4, 2, 4)
MOE_KERNEL(1, 8, 1, 4)
MOE_KERNEL(1, 8, 2, 4)
MOE_KERNEL(2, 4, 1, 4)
MOE_KERNEL(2, 4, 2, 4)
MOE_KERNEL(2, 8, 1, 4)
MOE_KERNEL(2, 8, 2, 4)
MOE_KERNEL(2, 4, 4, 4)
MOE_KERNEL(4, 4, 2, 4)
MOE_KERNEL(4, 8, 1, 4)
MOE_KERNEL(4, 8, 2, 3)
MOE_KERNEL(4, 4, 4, 3)
