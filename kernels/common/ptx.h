#pragma once
// The PTX instructions loom's tensor-core kernels use, as small inline-asm wrappers: cp.async,
// ldmatrix, mma.sync (dense m16n8k16) and mma.sp (2:4 sparse m16n8k32). The fragment layouts
// each one reads and writes are written out beside it, from the PTX ISA; every kernel goes
// through these functions, so they are the only code that depends on those layouts. The
// kernel-emulation tests replace this header with emulated_ptx.h (tests/kernel_emulation), whose
// instructions implement the same layouts independently from the ISA text.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

// mma.sp::ordered_metadata is PTX ISA 8.5, which nvcc 12.5 brought.
#if defined(__CUDACC_VER_MAJOR__) && \
    (__CUDACC_VER_MAJOR__ < 12 || (__CUDACC_VER_MAJOR__ == 12 && __CUDACC_VER_MINOR__ < 5))
#error "loom's sparse tensor-core kernels need nvcc 12.5 or newer (PTX ISA 8.5: mma.sp::ordered_metadata)"
#endif

namespace loom::kernels {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte asynchronous copy global -> shared; fill == false writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool fill) {
  const int src_bytes = fill ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)),
               "l"(__cvta_generic_to_global(gmem)), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// ldmatrix.m8n8.x4.b16: lane L supplies the shared address of row (L % 8) of 8x8 matrix j = L / 8
// (8 contiguous 16-bit elements, 16-byte aligned); matrix j lands in register r[j]. With g = L / 4
// and t = L % 4:
//   no .trans: r[j] = { M_j[g][2t], M_j[g][2t+1] }   (low 16 bits, high 16 bits)
//   .trans:    r[j] = { M_j[2t][g], M_j[2t+1][g] }
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(smem))
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(smem))
               : "memory");
}

// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}: D[16x8] = A[16x16] B[16x8] + C, per warp.
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"), with
// g = lane / 4 and t = lane % 4; each 32-bit register holds two 16-bit elements, the lower column
// (A) or lower row (B) in the low 16 bits:
//   A (row-major 16x16), a[0..3]:  a[0] = A[g][2t..2t+1]     a[1] = A[g+8][2t..2t+1]
//                                  a[2] = A[g][2t+8..2t+9]   a[3] = A[g+8][2t+8..2t+9]
//   B ("col": 16x8, k x n), b0, b1: b0 = B[2t..2t+1][g]      b1 = B[2t+8..2t+9][g]
//   C, D (16x8 fp32), c[0..3]:      c[0] = C[g][2t]  c[1] = C[g][2t+1]
//                                   c[2] = C[g+8][2t]  c[3] = C[g+8][2t+1]
// So for an accumulator tile that spans 16 columns as two n8 tiles c_lo (columns 0-7) and c_hi
// (8-15), {pack(c_lo[0], c_lo[1]), pack(c_lo[2], c_lo[3]), pack(c_hi[0], c_hi[1]),
// pack(c_hi[2], c_hi[3])} is exactly an A fragment of the same 16x16 block (acc_to_a below).
template <typename E>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1) {
  if constexpr (std::is_same_v<E, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    static_assert(std::is_same_v<E, __half>);
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// mma.sp::ordered_metadata.sync.aligned.m16n8k32.row.col.f32.{bf16,f16}: D[16x8] =
// A[16x32] B[32x8] + C per warp, A 2:4 sparse, given as its 16x16 compressed values Ac and
// metadata e; sparsity selector 0. Layouts (PTX ISA, "Matrix Fragments for sparse mma.m16n8k32
// with .f16 and .bf16 types"), g = lane / 4, t = lane % 4:
//   a[0] = Ac[g][2t..2t+1]  a[1] = Ac[g+8][2t..2t+1]  a[2] = Ac[g][2t+8..2t+9]
//   a[3] = Ac[g+8][2t+8..2t+9]: the kept pair of chunk t (a[0], a[1]) and t + 4 (a[2], a[3]),
//   i.e. the dense m16n8k16 A layout of Ac;
//   b[j] = B[2t+8j..2t+8j+1][g] (j = 0..3);
//   e: only lanes with t = 0 and t = 1 (selector 0) supply it: lane t of group g holds columns
//   16 t .. 16 t + 15 of row g in bits 0-15 and of row g + 8 in bits 16-31, a nibble per chunk.
//   C, D as for the dense m16n8k16: c[0..1] = C[g][2t..2t+1], c[2..3] = C[g+8][2t..2t+1].
template <typename E>
__device__ __forceinline__ void mma_sp_16832(float (&c)[4], const uint32_t (&a)[4],
                                             const uint32_t (&b)[4], uint32_t e) {
  if constexpr (std::is_same_v<E, __nv_bfloat16>) {
    asm volatile(
        "mma.sp::ordered_metadata.sync.aligned.m16n8k32.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9, %10, %11}, {%0, %1, %2, %3}, %12, 0x0;\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(b[2]), "r"(b[3]),
          "r"(e));
  } else {
    static_assert(std::is_same_v<E, __half>);
    asm volatile(
        "mma.sp::ordered_metadata.sync.aligned.m16n8k32.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9, %10, %11}, {%0, %1, %2, %3}, %12, 0x0;\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(b[2]), "r"(b[3]),
          "r"(e));
  }
}

}  // namespace loom::kernels
