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
              "the addressing below reads a K step as 8 groups of 32, a strip as 16 rows x 8 16-byte "
              "chunks with its 16 x 8 bf16 scales, and a token's sums as 8 (hi, lo) pairs");

// Programmatic dependent launch (no-ops when the launch did not ask for it, or before sm_90).
__device__ __forceinline__ void grid_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldmatrix4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// nibbles j, j + 4 of word v (two's complement) -> bf16x2 (136 + q_j, 136 + q_(j+4)), exact
template <int J>
__device__ __forceinline__ uint32_t pair(uint32_t v) {
  uint32_t d = v >> (4 * J);
  asm("lop3.b32 %0, %0, 0x000F000F, 0x43084308, 0x6A;\n" : "+r"(d));  // (d & 0xF000F) ^ 0x43084308
  return d;
}

__device__ __forceinline__ void mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                    uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// pair(v) (136 + q bf16 pair) -> the bf16 pair q s for s2 = (s, s): the subtraction is exact
__device__ __forceinline__ uint32_t scaled(uint32_t x, uint32_t s2) {
  uint32_t q;
  asm("sub.rn.bf16x2 %0, %1, %2;\n" : "=r"(q) : "r"(x), "r"(0x43084308u));  // 0x4308 = bf16 136
  asm("mul.rn.bf16x2 %0, %0, %1;\n" : "+r"(q) : "r"(s2));
  return q;
}
// scale i (0: low, 1: high half) of a bf16 pair, in both halves
__device__ __forceinline__ uint32_t dup(uint32_t v, int i) { return __byte_perm(v, v, i ? 0x7632 : 0x5410); }

__device__ __forceinline__ float bf16_lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t v) { return __uint_as_float(v & 0xFFFF0000u); }
__device__ __forceinline__ uint16_t bf16_rn(float f) {
  const uint32_t u = __float_as_uint(f);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

// Shared-memory stage: H sub-steps of one K step each, a sub-step = weights [STRIPS][16 rows][8
// group chunks, swizzled by row % 8] uint4 (W bytes), scales [STRIPS][16 rows][8] bf16 (S),
// activations [TA][AROW bytes] (natural order, A), group sums [TA][XREC bytes] (X; unread by SC), the
// byte counts the host gives (StageLayout). H > 1 asks for H * 128 contiguous bytes of each weight row
// at once (fewer DRAM page openings per byte).
template <int NT, int WARPS, int R, int H, int TA, int W, int S, int A, int X>
struct Stage {
  static constexpr int TN = 8 * NT, STRIPS = WARPS * R;
  static_assert(TA >= 1 && TA <= TN, "activation rows held: 1 .. 8 NT");
  static_assert(W == STRIPS * STRIP_W && S == STRIPS * STRIP_S && A == TA * AROW && X == TA * XREC,
                "the host's stage layout holds the strips and tokens this kernel addresses");
  static constexpr int W_BYTES = W, S_BYTES = S, A_BYTES = A;
  static constexpr int SUB = W + S + A + X;
  static constexpr int BYTES = H * SUB;
};

template <int NT, int WARPS, int R, int STAGES, int H, int TA, bool SC, typename St>
__device__ __forceinline__ void moe_gemm(const uint16_t* __restrict__ a, const uint16_t* __restrict__ xs,
                                         const uint32_t* __restrict__ wq, const uint16_t* __restrict__ ws,
                                         void* __restrict__ part, const float* __restrict__ tw,
                                         const int* __restrict__ slots, const int* __restrict__ seg,
                                         const int* __restrict__ cnt, const int* __restrict__ bexp,
                                         const int* __restrict__ bms, int S, int N, int K, int KS, int span,
                                         int a_rows_per_slot, int E, int weighted, int early) {
  constexpr int TN = St::TN;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int slot_of[TN];
  __shared__ long long arow_of[TN];

  // early: the table was complete before this launch (see the top), read through L2 (__ldcg: no
  // stale L1 line of an earlier call's table), and the first weight stages go before the wait
  if (!early) grid_wait();
  const int e = __ldcg(bexp + blockIdx.x);
  if (e >= E) return;  // unused block of the table: the whole CTA leaves before any barrier
  const int mstart = __ldcg(bms + blockIdx.x);
  const int nvalid = min(TN, __ldcg(cnt + e) - mstart);
  if (nvalid > TA) __trap();  // the caller's contract (M <= TA) broken: never a silent wrong result
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  if (tid < TN) {
    const int s = tid < nvalid ? __ldcg(slots + __ldcg(seg + e) + mstart + tid) : -1;
    slot_of[tid] = s;
    arow_of[tid] = s >= 0 ? s / a_rows_per_slot : 0;
  }
  __syncthreads();

  constexpr int BN = St::STRIPS * 16;
  const int n0 = blockIdx.y * BN * span;  // the CTA's span tiles of BN rows, one after the other
  const int kbeg = blockIdx.z * KS;
  const int steps = KS / (STEP * H);  // ring stages of H K steps a tile
  const int total = steps * span;     // the ring runs on across tiles: a short K chunk stays pipelined
  // one step a tile: every tile of the span reads the same activations, so each stage's copy is
  // made once, on the stage's first use, and kept
  const bool a_once = steps == 1;
  const long long ldw = K / 8, lds = K / 32, ldx = K / 16;

  // Every address a thread copies from or to is fixed for the CTA but for the step's K offset
  // (weights + 32 words a step, scales + 8, activations + STEP elements, group sums + 16) and the
  // tile's rows: computed once, so the copy phase of a step is its cp.async instructions and a few adds.
  constexpr int ACH = (TA + WARPS - 1) / WARPS;  // activation chunks (16 bytes) a thread copies a step (at most)
  const uint16_t* ssrc[R];
  uint32_t sdst[R];
  uint32_t wld[R][4];  // ldmatrix addresses: rows g | g + 8 x groups 0-3 | 4-7
  const uint16_t* asrc[ACH];
  uint32_t adst[ACH];
  const uint32_t sm0 = smem_addr(smem);
  auto strip_smem = [&](int r) { return sm0 + (warp * R + r) * STRIP_W; };  // strip r's weight tile
  // Weights: lane i copies group chunk i % 8 of rows 4 q + i / 8 (q = 0..3), so each copy
  // instruction reads four whole 128-byte lines (half lines, two instructions a line, fetched
  // slower: kernels/NOTES.md v11). Quad q's chunk lands 512 q bytes into the strip's tile, at an
  // offset within that which depends only on q's parity (the swizzle). The NT = 1 kernels keep a
  // source pointer a row quad; the NT >= 2 ones keep one a strip and step it 4 q rows at each copy
  // (fewer registers held: fewer spills where a kernel needs all 255, kernels/NOTES.md v11).
  constexpr int WQ = NT == 1 ? 4 : 1;
  const uint32_t* wsrc[R][WQ];
  const int lr = lane >> 3, lch = lane & 7;
  const uint32_t wdst[2] = {static_cast<uint32_t>((lr * 8 + (lch ^ lr)) * 16),
                            static_cast<uint32_t>((lr * 8 + (lch ^ (4 + lr))) * 16)};
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int strip = warp * R + r;
    const uint32_t wbase = strip_smem(r);
    const long long row0 = (long long)e * N + n0 + strip * 16;
#pragma unroll
    for (int p = 0; p < WQ; ++p) wsrc[r][p] = wq + (row0 + 4 * p + lr) * ldw + kbeg / 8 + 4 * lch;
    // ldmatrix: lane i gives row (i % 8) of matrix i / 8, i.e. group chunk (4 h + i / 8) of row
    // 8 hr + i % 8; lane (g, t) receives word t of that chunk of row 8 hr + g
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int hr = q >> 1, grp = (q & 1) * 4 + (lane >> 3), row = hr * 8 + (lane & 7);
      wld[r][q] = wbase + (row * 8 + (grp ^ (lane & 7))) * 16;
    }
    ssrc[r] = ws + (row0 + (lane & 15)) * lds + kbeg / 32;  // lanes 0-15 copy a row's 8 scales
    sdst[r] = sm0 + St::W_BYTES + (strip * 16 + (lane & 15)) * 16;
  }
#pragma unroll
  for (int i = 0; i < ACH; ++i) {
    const int c = tid + i * WARPS * 32, tok = c >> 5, ch = c & 31;  // chunk ch: the activations of word ch
    asrc[i] = tok < nvalid ? a + arow_of[tok] * K + kbeg + ch * 8 : nullptr;  // padded tokens: left stale,
    adst[i] = sm0 + St::W_BYTES + St::S_BYTES + tok * AROW + ch * 16;       // their outputs are never stored
  }
  const int xtok = tid >> 1;  // threads 0 .. 2 TA - 1 copy the group sums, 16 bytes each
  const uint16_t* xsrc = !SC && tid < 2 * TA && xtok < nvalid ? xs + arow_of[xtok] * ldx + kbeg / 16 + (tid & 1) * 8
                                                       : nullptr;
  const uint32_t xdst = sm0 + St::W_BYTES + St::S_BYTES + St::A_BYTES + tid * 16;

  auto load_w = [&](uint32_t off, int tile, int step) {  // weights and scales of one K step
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int q = 0; q < 4; ++q)
        cp16(strip_smem(r) + q * 512 + wdst[q & 1] + off,
             wsrc[r][q % WQ] + (tile * BN + 4 * (q - q % WQ)) * ldw + step * (STEP / 8));
      if (lane < 16) cp16(sdst[r] + off, ssrc[r] + tile * BN * lds + step * (STEP / 32));
    }
  };
  auto load_a = [&](uint32_t off, int step) {  // activations and group sums of one K step
#pragma unroll
    for (int i = 0; i < ACH; ++i)
      if (asrc[i] != nullptr) cp16(adst[i] + off, asrc[i] + step * STEP);
    if (xsrc != nullptr) cp16(xdst + off, xsrc + step * (STEP / 16));
  };
  // pipeline step j: tile j / steps, K step j % steps
  auto load = [&](int stage, int j, bool w, bool a) {
    const int tile = j / steps, step = j - tile * steps;
#pragma unroll
    for (int h = 0; h < H; ++h) {
      const uint32_t off = stage * St::BYTES + h * St::SUB;
      if (w) load_w(off, tile, step * H + h);
      if (a && (j < STAGES || !a_once)) load_a(off, step * H + h);
    }
  };

  // the stage row of MMA column group n's token g (columns past TA read row 0 and are never stored)
  auto trow = [&](int n) { return n * 8 + g < TA ? n * 8 + g : 0; };
  float acc[R][NT][4], cor[R][NT][4];
  auto zero = [&] {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[r][n][i] = cor[r][n][i] = 0.f;
  };
  // c0, c1: row g, tokens 2t, 2t + 1; c2, c3: row g + 8
  auto store = [&](int tile) {
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int col = n * 8 + 2 * t + j;
        if (col >= nvalid) continue;
        const int slot = slot_of[col];
        const float wgt = weighted ? tw[slot] : 1.f;
        const long long at = ((long long)blockIdx.z * S + slot) * N + n0 + tile * BN + g;
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const int row = (warp * R + r) * 16;
          const float lo = (SC ? acc[r][n][j] : fmaf(-136.f, cor[r][n][j], acc[r][n][j])) * wgt;
          const float hi = (SC ? acc[r][n][2 + j] : fmaf(-136.f, cor[r][n][2 + j], acc[r][n][2 + j])) * wgt;
          if (weighted) {
            uint16_t* out = static_cast<uint16_t*>(part) + at + row;
            out[0] = bf16_rn(lo), out[8] = bf16_rn(hi);
          } else {
            float* out = static_cast<float*>(part) + at + row;
            out[0] = lo, out[8] = hi;
          }
        }
      }
  };

  zero();
  // prologue: the first STAGES - 1 stages' weights (one commit group, before the wait when
  // early), then each stage's activations as its own group, so the loop's waits count as before
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s)
    if (s < total) load(s, s, true, false);
  cp_commit();
  if (early) grid_wait();
  grid_launch_dependents();
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < total) load(s, s, false, true);
    cp_commit();
  }
  for (int step = 0, tile = 0, ks = 0; step < total; ++step) {
    cp_wait<STAGES - 2>();
    __syncthreads();  // this step's stage is complete for all threads; the previous stage is free
    if (step + STAGES - 1 < total) load((step + STAGES - 1) % STAGES, step + STAGES - 1, true, true);
    cp_commit();
#pragma unroll
    for (int h = 0; h < H; ++h) {
      const uint32_t off = (step % STAGES) * St::BYTES + h * St::SUB;
      const unsigned char* base = smem + off;
      const unsigned char* ssm = base + St::W_BYTES;
      const unsigned char* asm_ = ssm + St::S_BYTES;
      const unsigned char* xsm = asm_ + St::A_BYTES;
      uint32_t w[R][2][8];  // [strip][row g | g + 8][group]: word t of the group
      uint32_t sv[R][2][4];  // the 8 scales of rows g, g + 8, as bf16 pairs
      uint32_t sp[R][2];    // scales of groups 2t, 2t + 1 of rows g, g + 8: A of the offset MMA
#pragma unroll
      for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          uint32_t v[4];
          ldmatrix4(wld[r][q] + off, v);
#pragma unroll
          for (int j = 0; j < 4; ++j) w[r][q >> 1][(q & 1) * 4 + j] = v[j];
        }
        const unsigned char* srow = ssm + (warp * R + r) * STRIP_S + g * 16;
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const uint4 q = *reinterpret_cast<const uint4*>(srow + hr * 128);
          sv[r][hr][0] = q.x, sv[r][hr][1] = q.y, sv[r][hr][2] = q.z, sv[r][hr][3] = q.w;
          sp[r][hr] = *reinterpret_cast<const uint32_t*>(srow + hr * 128 + 4 * t);
        }
      }
#pragma unroll
      for (int n = 0; n < NT && !SC; ++n) {
        const uint2 xr = *reinterpret_cast<const uint2*>(xsm + trow(n) * XREC + 8 * t);  // (hi, lo) pairs
#pragma unroll
        for (int r = 0; r < R; ++r) mma(cor[r][n], sp[r][0], sp[r][1], sp[r][0], sp[r][1], xr.x, xr.y);
      }
#pragma unroll
      for (int G = 0; G < 8; ++G) {
        uint4 x[NT];
#pragma unroll
        for (int n = 0; n < NT; ++n)
          x[n] = *reinterpret_cast<const uint4*>(asm_ + trow(n) * AROW + (4 * G + t) * 16);
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const uint32_t va = w[r][0][G], vb = w[r][1][G];
          if constexpr (SC) {
            const uint32_t sa = dup(sv[r][0][G >> 1], G & 1), sb = dup(sv[r][1][G >> 1], G & 1);
            const uint32_t a0 = scaled(pair<0>(va), sa), a1 = scaled(pair<1>(va), sa),
                           a2 = scaled(pair<2>(va), sa), a3 = scaled(pair<3>(va), sa);
            const uint32_t b0 = scaled(pair<0>(vb), sb), b1 = scaled(pair<1>(vb), sb),
                           b2 = scaled(pair<2>(vb), sb), b3 = scaled(pair<3>(vb), sb);
#pragma unroll
            for (int n = 0; n < NT; ++n) {
              mma(acc[r][n], a0, b0, a1, b1, x[n].x, x[n].y);
              mma(acc[r][n], a2, b2, a3, b3, x[n].z, x[n].w);
            }
          } else {
            const uint32_t a0 = pair<0>(va), a1 = pair<1>(va), a2 = pair<2>(va), a3 = pair<3>(va);
            const uint32_t b0 = pair<0>(vb), b1 = pair<1>(vb), b2 = pair<2>(vb), b3 = pair<3>(vb);
            const uint32_t swa = sv[r][0][G >> 1], swb = sv[r][1][G >> 1];
            const float sa = (G & 1) ? bf16_hi(swa) : bf16_lo(swa), sb = (G & 1) ? bf16_hi(swb) : bf16_lo(swb);
#pragma unroll
            for (int n = 0; n < NT; ++n) {
              float d[4] = {0.f, 0.f, 0.f, 0.f};
              mma(d, a0, b0, a1, b1, x[n].x, x[n].y);
              mma(d, a2, b2, a3, b3, x[n].z, x[n].w);
              acc[r][n][0] = fmaf(sa, d[0], acc[r][n][0]);
              acc[r][n][1] = fmaf(sa, d[1], acc[r][n][1]);
              acc[r][n][2] = fmaf(sb, d[2], acc[r][n][2]);
              acc[r][n][3] = fmaf(sb, d[3], acc[r][n][3]);
            }
          }
        }
      }
    }
    if (++ks == steps) {
      store(tile);
      zero();
      ks = 0, ++tile;
    }
  }
  cp_wait<0>();
}


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
