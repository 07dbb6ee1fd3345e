#pragma once
// What the fused attention kernels (flash_attention.cu) build on: the mma.sync accumulator
// layout, element conversions, fragment loads from shared memory (ldmatrix), tile copies between
// global and shared memory (cp.async) and the float2 atomic add. Device code, included by
// flash_attention_forward.cuh and flash_attention_backward.cuh only; the kernel-emulation tests
// inline it with them (tests/kernel_emulation/transform.py). The instructions' layouts are
// written out beside their wrappers (common/ptx.h), and the ones each helper builds on them beside
// the helper below; the kernels' design is at the top of flash_attention.cu.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "attention/flash_attention_config.h"
#include "common/ptx.h"

namespace loom::kernels::flash {

constexpr int kFwdWarps = kFwdBlockM / 16;  // one warp per 16 query rows
constexpr int kFwdThreads = kFwdWarps * 32;
constexpr int kBwdWarps = kBwdBlockN / 16;  // one warp per 16 keys
constexpr int kBwdThreads = kBwdWarps * 32;
constexpr int kPreRowsPerBlock = 8;  // preprocess / convert kernels: one warp per row
constexpr int kBwdLenPad = 64;       // Delta and lse2 rows are padded to a multiple of this
constexpr float kLog2e = 1.4426950408889634f;
static_assert(kBwdLenPad % bwd_block_m(64) == 0 && kBwdLenPad % bwd_block_m(128) == 0);

// Where accumulator element c[i] of n8 tile j sits, relative to the tile origin: row g + 8 (i / 2),
// column 8 j + 2 t + (i % 2).
__device__ __forceinline__ int acc_row(int lane, int i) {
  return (lane >> 2) + (i >> 1) * 8;
}
__device__ __forceinline__ int acc_col(int lane, int j, int i) {
  return j * 8 + (lane & 3) * 2 + (i & 1);
}

// ---- Element conversions -----------------------------------------------------------------------

__device__ __forceinline__ float to_float(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
__device__ __forceinline__ float to_float(__half x) {
  return __half2float(x);
}
template <typename E>
__device__ __forceinline__ E from_float(float x) {
  if constexpr (std::is_same_v<E, __nv_bfloat16>) {
    return __float2bfloat16_rn(x);
  } else {
    return __float2half_rn(x);
  }
}
// Two floats as two 16-bit elements in one register: lo in the low 16 bits (the lower address).
template <typename E>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<E, __nv_bfloat16>) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}

// The A fragment of the 16x16 block made of accumulator n8 tiles lo and hi (see mma_16816).
template <typename E>
__device__ __forceinline__ void acc_to_a(uint32_t (&a)[4], const float (&lo)[4],
                                         const float (&hi)[4]) {
  a[0] = pack2<E>(lo[0], lo[1]);
  a[1] = pack2<E>(lo[2], lo[3]);
  a[2] = pack2<E>(hi[0], hi[1]);
  a[3] = pack2<E>(hi[2], hi[3]);
}

// ---- Fragment loads from shared memory ---------------------------------------------------------
// Each helper derives the 8x8 matrix M_j that lane L points at (row L % 8 of matrix j = L / 8) so
// that register j is the fragment register the mma layout above asks for. Row strides are in
// elements; every row start and every column offset used is a multiple of 8 elements (16 bytes).

// A[i][k] = tile[row0 + i][col0 + k] (row-major A, e.g. Q for S = Q K^T).
// a[0]: M_0 = rows 0-7, k 0-7; a[1]: M_1 = rows 8-15, k 0-7; a[2]: rows 0-7, k 8-15; a[3]: rows
// 8-15, k 8-15. No .trans: a[j] = M_j[g][2t..2t+1] = A[g + 8 (j % 2)][2t + 8 (j / 2) ..].
template <typename E>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const E* tile, int stride, int row0,
                                       int col0, int lane) {
  const int j = lane >> 3, r = lane & 7;
  ldmatrix_x4(a, tile + (row0 + (j & 1) * 8 + r) * stride + col0 + (j >> 1) * 8);
}

// A[i][k] = tile[k0 + k][m0 + i] (the tile holds A transposed, e.g. dS^T for dQ = dS K).
// M_j = tile rows k0 + 8 (j / 2) + (0..7), columns m0 + 8 (j % 2) + (0..7); .trans:
// a[j] = M_j[2t..2t+1][g] = A[g + 8 (j % 2)][2t + 8 (j / 2) ..], the same registers as load_a.
template <typename E>
__device__ __forceinline__ void load_a_trans(uint32_t (&a)[4], const E* tile, int stride, int m0,
                                             int k0, int lane) {
  const int j = lane >> 3, r = lane & 7;
  ldmatrix_x4_trans(a, tile + (k0 + (j >> 1) * 8 + r) * stride + m0 + (j & 1) * 8);
}

// B operands of two adjacent n8 tiles (n0..n0+7 and n0+8..n0+15) over k0..k0+15, from a tile that
// holds B transposed: B[k][n] = tile[n0 + n][k0 + k] (e.g. K for S = Q K^T, one key per row).
// M_j = tile rows n0 + 8 (j / 2) + (0..7), columns k0 + 8 (j % 2) + (0..7); no .trans:
// b[j] = M_j[g][2t..2t+1] = B[2t + 8 (j % 2) ..][g + 8 (j / 2)].
// So {b[0], b[1]} feed n-tile n0 and {b[2], b[3]} feed n-tile n0 + 8.
template <typename E>
__device__ __forceinline__ void load_b_nk(uint32_t (&b)[4], const E* tile, int stride, int n0,
                                          int k0, int lane) {
  const int j = lane >> 3, r = lane & 7;
  ldmatrix_x4(b, tile + (n0 + (j >> 1) * 8 + r) * stride + k0 + (j & 1) * 8);
}

// The same two B operands from a row-major B tile: B[k][n] = tile[k0 + k][n0 + n] (e.g. V for
// O = P V, one key per row). M_j = tile rows k0 + 8 (j % 2) + (0..7), columns n0 + 8 (j / 2) +
// (0..7); .trans: b[j] = M_j[2t..2t+1][g] = B[2t + 8 (j % 2) ..][g + 8 (j / 2)], as load_b_nk.
template <typename E>
__device__ __forceinline__ void load_b_kn(uint32_t (&b)[4], const E* tile, int stride, int k0,
                                          int n0, int lane) {
  const int j = lane >> 3, r = lane & 7;
  ldmatrix_x4_trans(b, tile + (k0 + (j & 1) * 8 + r) * stride + n0 + (j >> 1) * 8);
}

// ---- Tile copies between global and shared memory ----------------------------------------------

// Rows [row0, row0 + kRows) of a matrix with `rows` rows of kCols elements (row stride `stride`)
// into a shared tile with row stride kSmemStride; rows past the end are zero-filled. vec: the
// matrix is 16-byte aligned (base and strides), so cp.async copies 16 bytes at a time; otherwise
// plain element loads (synchronous; the caller's barrier covers both).
template <int kRows, int kCols, int kSmemStride, int kThreads, typename E>
__device__ __forceinline__ void load_tile(E* smem, const E* gmem, int64_t stride, int row0,
                                          int rows, bool vec, int tid) {
  constexpr int kChunksPerRow = kCols / 8;
  constexpr int kChunks = kRows * kChunksPerRow;
  static_assert(kChunks % kThreads == 0, "tile copy: chunks must divide evenly among threads");
#pragma unroll
  for (int it = 0; it < kChunks / kThreads; ++it) {
    const int c = it * kThreads + tid;
    const int r = c / kChunksPerRow;
    const int col = (c % kChunksPerRow) * 8;
    E* dst = smem + r * kSmemStride + col;
    const bool valid = row0 + r < rows;
    const E* src = valid ? gmem + (row0 + r) * stride + col : gmem;
    if (vec) {  // uniform over the block: no divergence
      cp_async_16(dst, src, valid);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) dst[e] = valid ? src[e] : from_float<E>(0.f);
    }
  }
}

// One warp writes the 16 rows of a shared tile (row stride kSmemStride) starting at `smem` to
// global rows row0..row0+15 (row stride `stride`), skipping rows at or past `rows`.
template <int kCols, int kSmemStride, typename E>
__device__ __forceinline__ void store_warp_rows(const E* smem, E* gmem, int64_t stride, int row0,
                                                int rows, bool vec, int lane) {
  constexpr int kChunksPerRow = kCols / 8;
  constexpr int kChunks = 16 * kChunksPerRow;
  static_assert(kChunks % 32 == 0);
#pragma unroll
  for (int it = 0; it < kChunks / 32; ++it) {
    const int c = it * 32 + lane;
    const int r = c / kChunksPerRow;
    const int col = (c % kChunksPerRow) * 8;
    if (row0 + r >= rows) continue;
    const E* src = smem + r * kSmemStride + col;
    E* dst = gmem + (row0 + r) * stride + col;
    if (vec) {
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) dst[e] = src[e];
    }
  }
}

// This warp's 16 x kCols fp32 accumulator (n8 tiles acc[kCols / 8]) times `scale`, as elements,
// into 16 rows of a shared tile starting at `smem`.
template <int kCols, int kSmemStride, typename E>
__device__ __forceinline__ void stage_acc(E* smem, const float (&acc)[kCols / 8][4], float scale,
                                          int lane) {
#pragma unroll
  for (int j = 0; j < kCols / 8; ++j) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = acc_row(lane, 2 * half), col = acc_col(lane, j, 0);
      *reinterpret_cast<uint32_t*>(smem + row * kSmemStride + col) =
          pack2<E>(acc[j][2 * half] * scale, acc[j][2 * half + 1] * scale);
    }
  }
}

__device__ __forceinline__ void atomic_add2(float* p, float x, float y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(p), make_float2(x, y));  // one vector red on Hopper
#else
  atomicAdd(p, x);
  atomicAdd(p + 1, y);
#endif
}

}  // namespace loom::kernels::flash
