// Part of moe_w4a16.cu, included inside its anonymous namespace after the layout constants (STEP,
// AROW, XREC, STRIP_W, STRIP_S) and moe_w4a16_ptx.cuh: a ring stage's shared-memory layout and the
// GEMM pass every MOE_KERNEL instantiates. Not a standalone header.
#pragma once

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
  const int e = __ldcg(bexp + blockIdx.y);
  if (e >= E) return;  // unused block of the table: the whole CTA leaves before any barrier
  const int mstart = __ldcg(bms + blockIdx.y);
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
  const int n0 = blockIdx.x * BN * span;  // the CTA's span tiles of BN rows, one after the other
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
