// Part of moe_w4a16.cu, included inside its anonymous namespace: the inline PTX and bit tricks the
// kernels are built from (programmatic dependent launch, cp.async, ldmatrix, the m16n8k16 MMA, the
// nibble-pair dequant, bf16 conversions). Not a standalone header.
#pragma once

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
