// Fused attention, FlashAttention-2 style (Dao, 2023), for sm_80 and newer.
//
// Forward (flash_fwd_kernel): one block per (query tile of kFwdBlockM rows, query head, batch);
// each of its 8 warps owns 16 query rows. The block keeps its Q tile in registers (as mma
// fragments) and streams K and V through shared memory kFwdBlockN keys at a time, two stages deep
// (cp.async: the next tile loads while this one is computed). Per tile: S = Q K^T on tensor cores,
// the mask, the online softmax (running max m, running sum l, accumulator rescaled by
// exp(m_old - m_new)), O += P V. At the end O /= l once and lse = scale * m + log(l) is saved.
//
// Backward: (1) flash_bwd_preprocess_kernel: Delta = rowsum(dO * O), lse in base 2, and a zeroed
// fp32 dq accumulator, all in the caller's workspace. (2) flash_bwd_kernel: one block per (key
// tile of kBwdBlockN keys, key/value head, batch); each of its 4 warps owns 16 keys. The block
// keeps K and V in shared memory and visits every query tile of every query head of its group
// (GQA), so dK and dV accumulate in registers over the whole group and are written once, with no
// workspace and no atomics. Per query tile it recomputes S^T = K Q^T and P^T = exp(scale S^T -
// lse), then dV += P^T dO, dP^T = V dO^T, dS^T = P^T * (dP^T - Delta), dK += dS^T Q, and dQ += dS K
// through fp32 atomicAdd into the workspace accumulator (dS goes through shared memory for that
// product, which is partitioned by query rows). (3) flash_bwd_convert_dq_kernel: dq = scale *
// accumulator, converted to the element type, written with dq's strides.
//
// Tensor cores: raw `mma.sync.aligned.m16n8k16` (bf16/fp16 in, fp32 accumulate) fed by `ldmatrix`,
// rather than nvcuda::wmma. wmma fragments have an unspecified element layout, so the per-row
// softmax (and the masks) could not be applied in registers: S would go to shared memory and back
// for every tile. The mma.sync layouts are fixed by the PTX ISA, and the accumulator layout of one
// product is exactly the A-operand layout of the next (P of S = Q K^T feeds P V; dS^T feeds dS^T
// Q), which is what lets S, P, dP and dS live in registers. The instructions' layouts are written
// out beside their wrappers (common/ptx.h); the ones this kernel builds on them are below, next
// to the only functions that depend on them (load_a, load_a_trans, load_b_nk, load_b_kn, the
// accumulator index helpers); everything else goes through those functions.
//
// Masked scores are -inf before the softmax. A row whose keys are all masked (only with kv_len 0)
// keeps m = -inf and l = 0; the update then uses 0 in place of m (no inf - inf), so P = 0, O = 0
// and lse = -inf, and the backward (lse2 = +inf) gives that row P = 0 and no gradient.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <utility>

#include "attention/flash_attention.h"
#include "common/kernel_image.h"
#include "common/ptx.h"

namespace loom::kernels {

namespace {

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

// ---- Forward -----------------------------------------------------------------------------------

template <typename E>
struct FwdArgs {
  const E* q;
  const E* k;
  const E* v;
  E* o;
  float* lse;
  AttentionStrides qs, ks, vs, os;
  int q_heads, group, q_len, kv_len;
  float scale, scale_log2;
  bool causal, vec;
};

template <int kHeadDim>
struct FwdSmem {
  static constexpr int kStride = kHeadDim + 8;  // +16 bytes: ldmatrix rows hit distinct banks
  // Q tile, then K and V tiles, two stages each.
  static constexpr size_t kBytes = size_t(kFwdBlockM + 4 * kFwdBlockN) * kStride * 2;
};

// Blocks per SM the register budget must allow: head_dim 64 fits two 8-warp blocks (<= 128
// registers a thread); head_dim 128 keeps O (64 floats) and Q (32 registers) in registers, so one.
constexpr int fwd_min_blocks(int head_dim) {
  return head_dim <= 64 ? 2 : 1;
}

template <typename E, int kHeadDim>
__global__ void __launch_bounds__(kFwdThreads, fwd_min_blocks(kHeadDim))
    flash_fwd_kernel(const FwdArgs<E> a) {
  constexpr int kStride = FwdSmem<kHeadDim>::kStride;
  constexpr int kKSteps = kHeadDim / 16;   // k16 steps of S = Q K^T
  constexpr int kSTiles = kFwdBlockN / 8;  // n8 tiles of a warp's S (16 x kFwdBlockN)
  constexpr int kOTiles = kHeadDim / 8;    // n8 tiles of a warp's O (16 x kHeadDim)
  extern __shared__ __align__(16) unsigned char smem_raw[];
  E* sQ = reinterpret_cast<E*>(smem_raw);
  E* sK = sQ + kFwdBlockM * kStride;
  E* sV = sK + 2 * kFwdBlockN * kStride;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int m_block = gridDim.x - 1 - blockIdx.x;  // the longest causal rows start first
  const int h = blockIdx.y, b = blockIdx.z, kvh = h / a.group;
  const int m0 = m_block * kFwdBlockM;
  const int warp_row0 = m0 + warp * 16;  // first query row of this warp
  const E* q = a.q + b * a.qs.batch + h * a.qs.head;
  const E* k = a.k + b * a.ks.batch + kvh * a.ks.head;
  const E* v = a.v + b * a.vs.batch + kvh * a.vs.head;
  const int n_tiles = fwd_num_kv_tiles(m_block, a.q_len, a.kv_len, a.causal);

  if (n_tiles > 0) {
    load_tile<kFwdBlockM, kHeadDim, kStride, kFwdThreads>(sQ, q, a.qs.seq, m0, a.q_len, a.vec, tid);
    load_tile<kFwdBlockN, kHeadDim, kStride, kFwdThreads>(sK, k, a.ks.seq, 0, a.kv_len, a.vec, tid);
    load_tile<kFwdBlockN, kHeadDim, kStride, kFwdThreads>(sV, v, a.vs.seq, 0, a.kv_len, a.vec, tid);
  }
  cp_async_commit();

  float acc_o[kOTiles][4] = {};
  // Rows g and g + 8 of this warp's 16: running max of the raw scores (m), running sum of
  // exp(scale (s - m)) over this thread's columns (l; summed over the quad at the end).
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};
  uint32_t q_frag[kKSteps][4];

  for (int n_block = 0; n_block < n_tiles; ++n_block) {
    const int stage = n_block & 1;
    if (n_block + 1 < n_tiles) {
      const int next0 = (n_block + 1) * kFwdBlockN;
      E* sKn = sK + (stage ^ 1) * kFwdBlockN * kStride;
      E* sVn = sV + (stage ^ 1) * kFwdBlockN * kStride;
      load_tile<kFwdBlockN, kHeadDim, kStride, kFwdThreads>(sKn, k, a.ks.seq, next0, a.kv_len,
                                                            a.vec, tid);
      load_tile<kFwdBlockN, kHeadDim, kStride, kFwdThreads>(sVn, v, a.vs.seq, next0, a.kv_len,
                                                            a.vec, tid);
      cp_async_commit();
      cp_async_wait<1>();  // this tile (and Q) landed; the next one may still be in flight
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if (n_block == 0) {
#pragma unroll
      for (int kk = 0; kk < kKSteps; ++kk)
        load_a(q_frag[kk], sQ, kStride, warp * 16, kk * 16, lane);
    }
    const E* sKs = sK + stage * kFwdBlockN * kStride;
    const E* sVs = sV + stage * kFwdBlockN * kStride;

    // S = Q K^T for this warp's 16 rows and the tile's kFwdBlockN keys.
    float s[kSTiles][4] = {};
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
#pragma unroll
      for (int jp = 0; jp < kSTiles / 2; ++jp) {
        uint32_t kb[4];
        load_b_nk(kb, sKs, kStride, jp * 16, kk * 16, lane);
        mma_16816<E>(s[2 * jp], q_frag[kk], kb[0], kb[1]);
        mma_16816<E>(s[2 * jp + 1], q_frag[kk], kb[2], kb[3]);
      }
    }

    const int n0 = n_block * kFwdBlockN;
    if (fwd_tile_needs_mask(m_block, n_block, a.kv_len, a.causal)) {
#pragma unroll
      for (int j = 0; j < kSTiles; ++j) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int key = n0 + acc_col(lane, j, i);
          const int row = warp_row0 + acc_row(lane, i);
          if (key >= a.kv_len || (a.causal && key > row)) s[j][i] = -INFINITY;
        }
      }
    }

    // Online softmax. The four threads of a quad (same g) hold the 16 x kFwdBlockN tile's rows
    // g and g + 8 between them: reduce the tile max over the quad.
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < kSTiles; ++j) {
      tile_max[0] = fmaxf(tile_max[0], fmaxf(s[j][0], s[j][1]));
      tile_max[1] = fmaxf(tile_max[1], fmaxf(s[j][2], s[j][3]));
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
      const float m_new = fmaxf(row_max[r], tile_max[r]);
      // exp(scale (x - m)) = exp2(x scale log2(e) - m scale log2(e)); 0 in place of an all-masked
      // m.
      const float m_scaled = m_new == -INFINITY ? 0.f : m_new * a.scale_log2;
      const float alpha = exp2f(row_max[r] * a.scale_log2 - m_scaled);  // 0 when m_old = -inf
      row_max[r] = m_new;
      row_sum[r] *= alpha;
#pragma unroll
      for (int j = 0; j < kOTiles; ++j) {
        acc_o[j][2 * r] *= alpha;
        acc_o[j][2 * r + 1] *= alpha;
      }
#pragma unroll
      for (int j = 0; j < kSTiles; ++j) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const float p = exp2f(fmaf(s[j][2 * r + c], a.scale_log2, -m_scaled));
          s[j][2 * r + c] = p;
          row_sum[r] += p;
        }
      }
    }

    // O += P V: P (the S accumulator, as elements) is the A operand, 16 keys per k step.
#pragma unroll
    for (int kk = 0; kk < kFwdBlockN / 16; ++kk) {
      uint32_t pa[4];
      acc_to_a<E>(pa, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
      for (int dp = 0; dp < kHeadDim / 16; ++dp) {
        uint32_t vb[4];
        load_b_kn(vb, sVs, kStride, kk * 16, dp * 16, lane);
        mma_16816<E>(acc_o[2 * dp], pa, vb[0], vb[1]);
        mma_16816<E>(acc_o[2 * dp + 1], pa, vb[2], vb[3]);
      }
    }
    __syncthreads();  // every warp is done with this stage before the next iteration refills it
  }
  cp_async_wait<0>();
  __syncthreads();  // no copy may still be landing in sQ, which the epilogue reuses

  // O /= l once; lse = scale * m + log(l). Each warp stages its own 16 rows of O in sQ (rows no
  // other warp reads) and writes them out 16 bytes at a time.
  float lse[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 1);
    row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 2);
    const float inv = row_sum[r] > 0.f ? 1.f / row_sum[r] : 0.f;
    lse[r] = row_sum[r] > 0.f ? row_max[r] * a.scale + logf(row_sum[r]) : -INFINITY;
#pragma unroll
    for (int j = 0; j < kOTiles; ++j) {
      acc_o[j][2 * r] *= inv;
      acc_o[j][2 * r + 1] *= inv;
    }
  }
  E* sO = sQ + warp * 16 * kStride;
  stage_acc<kHeadDim, kStride>(sO, acc_o, 1.f, lane);
  __syncwarp();
  E* o = a.o + b * a.os.batch + h * a.os.head;
  store_warp_rows<kHeadDim, kStride>(sO, o, a.os.seq, warp_row0, a.q_len, a.vec, lane);
  if ((lane & 3) == 0) {
    float* lse_row = a.lse + (int64_t(b) * a.q_heads + h) * a.q_len;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = warp_row0 + acc_row(lane, 2 * r);
      if (row < a.q_len) lse_row[row] = lse[r];
    }
  }
}

// ---- Backward ----------------------------------------------------------------------------------

template <typename E>
struct PreArgs {
  const E* o;
  const E* d_o;
  const float* lse;
  AttentionStrides os, dos;
  float* delta;     // [batch * q_heads, q_len_padded]
  float* lse2;      // [batch * q_heads, q_len_padded]
  float* dq_accum;  // [batch * q_heads, q_len, head_dim]
  int q_heads, q_len, q_len_padded, head_dim;
  int64_t rows;  // batch * q_heads * q_len_padded
};

// One warp per (batch, head, row < q_len_padded): Delta = sum(dO * O) over the row, lse in base 2
// (+inf for padding rows and for rows with lse = -inf, so that exp2(s - lse2) = 0), and the row of
// the dq accumulator set to zero.
template <typename E>
__global__ void __launch_bounds__(kPreRowsPerBlock * 32)
    flash_bwd_preprocess_kernel(const PreArgs<E> a) {
  const int lane = threadIdx.x % 32;
  const int64_t row = int64_t(blockIdx.x) * kPreRowsPerBlock + threadIdx.x / 32;
  if (row >= a.rows) return;
  const int64_t bh = row / a.q_len_padded;
  const int i = int(row % a.q_len_padded);
  if (i >= a.q_len) {
    if (lane == 0) {
      a.delta[row] = 0.f;
      a.lse2[row] = INFINITY;
    }
    return;
  }
  const int64_t b = bh / a.q_heads, h = bh % a.q_heads;
  const E* o = a.o + b * a.os.batch + h * a.os.head + i * a.os.seq;
  const E* d_o = a.d_o + b * a.dos.batch + h * a.dos.head + i * a.dos.seq;
  float sum = 0.f;
  for (int d = lane; d < a.head_dim; d += 32) sum += to_float(o[d]) * to_float(d_o[d]);
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  float* dq = a.dq_accum + (bh * a.q_len + i) * a.head_dim;
  for (int d = lane; d < a.head_dim; d += 32) dq[d] = 0.f;
  if (lane == 0) {
    const float l = a.lse[bh * a.q_len + i];
    a.delta[row] = sum;
    a.lse2[row] = l == -INFINITY ? INFINITY : l * kLog2e;
  }
}

template <typename E>
struct BwdArgs {
  const E* q;
  const E* k;
  const E* v;
  const E* d_o;
  E* dk;
  E* dv;
  float* dq_accum;
  const float* lse2;
  const float* delta;
  AttentionStrides qs, ks, vs, dos, dks, dvs;
  int q_heads, group, q_len, kv_len, q_len_padded;
  float scale, scale_log2;
  bool causal, vec;
};

template <int kHeadDim>
struct BwdSmem {
  static constexpr int kBlockM = bwd_block_m(kHeadDim);
  static constexpr int kStride = kHeadDim + 8;
  static constexpr int kStrideS = kBlockM + 8;
  // lse2 and Delta [2 stages][kBlockM] fp32; K, V [kBwdBlockN][kStride]; Q, dO
  // [2][kBlockM][kStride]; dS^T [kBwdBlockN][kStrideS].
  static constexpr size_t kBytes =
      size_t(4 * kBlockM) * 4 +
      size_t(2 * kBwdBlockN * kStride + 4 * kBlockM * kStride + kBwdBlockN * kStrideS) * 2;
};

template <typename E, int kHeadDim>
__global__ void __launch_bounds__(kBwdThreads) flash_bwd_kernel(const BwdArgs<E> a) {
  using Smem = BwdSmem<kHeadDim>;
  constexpr int kBlockM = Smem::kBlockM;
  constexpr int kStride = Smem::kStride;
  constexpr int kStrideS = Smem::kStrideS;
  constexpr int kKSteps = kHeadDim / 16;  // k16 steps of S^T = K Q^T and dP^T = V dO^T
  constexpr int kSTiles = kBlockM / 8;    // n8 tiles of a warp's S^T (16 keys x kBlockM queries)
  constexpr int kDTiles = kHeadDim / 8;   // n8 tiles of a warp's dK and dV (16 x kHeadDim)
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* sLse = reinterpret_cast<float*>(smem_raw);
  float* sDelta = sLse + 2 * kBlockM;
  E* sK = reinterpret_cast<E*>(sDelta + 2 * kBlockM);
  E* sV = sK + kBwdBlockN * kStride;
  E* sQ = sV + kBwdBlockN * kStride;
  E* sdO = sQ + 2 * kBlockM * kStride;
  E* sdS = sdO + 2 * kBlockM * kStride;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int n_block = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int n0 = n_block * kBwdBlockN;
  const int key_row0 = warp * 16;  // this warp's keys within the tile
  const E* k = a.k + b * a.ks.batch + kvh * a.ks.head;
  const E* v = a.v + b * a.vs.batch + kvh * a.vs.head;
  const int m_first = bwd_first_q_tile(n_block, kBlockM, a.causal);
  const int m_tiles = attention_ceil_div(a.q_len, kBlockM);
  const int per_head = m_tiles > m_first ? m_tiles - m_first : 0;
  const int n_iter = a.group * per_head;  // (query head of the group, query tile) pairs

  load_tile<kBwdBlockN, kHeadDim, kStride, kBwdThreads>(sK, k, a.ks.seq, n0, a.kv_len, a.vec, tid);
  load_tile<kBwdBlockN, kHeadDim, kStride, kBwdThreads>(sV, v, a.vs.seq, n0, a.kv_len, a.vec, tid);
  // Q, dO, lse2 and Delta of iteration `it` into `stage`.
  auto load_q_tile = [&](int it, int stage) {
    const int h = kvh * a.group + it / per_head;
    const int m0 = (m_first + it % per_head) * kBlockM;
    const int64_t bh = int64_t(b) * a.q_heads + h;
    load_tile<kBlockM, kHeadDim, kStride, kBwdThreads>(sQ + stage * kBlockM * kStride,
                                                       a.q + b * a.qs.batch + h * a.qs.head,
                                                       a.qs.seq, m0, a.q_len, a.vec, tid);
    load_tile<kBlockM, kHeadDim, kStride, kBwdThreads>(sdO + stage * kBlockM * kStride,
                                                       a.d_o + b * a.dos.batch + h * a.dos.head,
                                                       a.dos.seq, m0, a.q_len, a.vec, tid);
    // Padded to q_len_padded rows (lse2 = +inf, Delta = 0 past q_len): whole 16-byte chunks.
    if (tid < kBlockM / 4) {
      const int64_t off = bh * a.q_len_padded + m0 + 4 * tid;
      cp_async_16(sLse + stage * kBlockM + 4 * tid, a.lse2 + off, true);
      cp_async_16(sDelta + stage * kBlockM + 4 * tid, a.delta + off, true);
    }
  };
  if (n_iter > 0) load_q_tile(0, 0);
  cp_async_commit();

  float acc_dk[kDTiles][4] = {};
  float acc_dv[kDTiles][4] = {};

  for (int it = 0; it < n_iter; ++it) {
    const int stage = it & 1;
    if (it + 1 < n_iter) {
      load_q_tile(it + 1, stage ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const int h = kvh * a.group + it / per_head;
    const int m_block = m_first + it % per_head;
    const int m0 = m_block * kBlockM;
    const E* sQs = sQ + stage * kBlockM * kStride;
    const E* sdOs = sdO + stage * kBlockM * kStride;
    const float* lse2 = sLse + stage * kBlockM;
    const float* delta = sDelta + stage * kBlockM;

    // S^T = K Q^T: this warp's 16 keys (rows) x the tile's kBlockM queries (columns).
    float s[kSTiles][4] = {};
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
      uint32_t ka[4];
      load_a(ka, sK, kStride, key_row0, kk * 16, lane);
#pragma unroll
      for (int jp = 0; jp < kSTiles / 2; ++jp) {
        uint32_t qb[4];
        load_b_nk(qb, sQs, kStride, jp * 16, kk * 16, lane);
        mma_16816<E>(s[2 * jp], ka, qb[0], qb[1]);
        mma_16816<E>(s[2 * jp + 1], ka, qb[2], qb[3]);
      }
    }

    // P^T = exp(scale S^T - lse) = exp2(S^T scale log2(e) - lse2), 0 where masked.
    const bool mask = bwd_tile_needs_mask(m_block, kBlockM, n_block, a.kv_len, a.causal);
#pragma unroll
    for (int j = 0; j < kSTiles; ++j) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int qc = acc_col(lane, j, i);
        float p = exp2f(fmaf(s[j][i], a.scale_log2, -lse2[qc]));
        if (mask) {
          const int key = n0 + key_row0 + acc_row(lane, i);
          if (key >= a.kv_len || (a.causal && key > m0 + qc)) p = 0.f;
        }
        s[j][i] = p;
      }
    }

    // dV += P^T dO (k = queries).
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) {
      uint32_t pa[4];
      acc_to_a<E>(pa, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
      for (int dp = 0; dp < kHeadDim / 16; ++dp) {
        uint32_t ob[4];
        load_b_kn(ob, sdOs, kStride, kk * 16, dp * 16, lane);
        mma_16816<E>(acc_dv[2 * dp], pa, ob[0], ob[1]);
        mma_16816<E>(acc_dv[2 * dp + 1], pa, ob[2], ob[3]);
      }
    }

    // dP^T = V dO^T, then dS^T = P^T * (dP^T - Delta) in place.
    float ds[kSTiles][4] = {};
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
      uint32_t va[4];
      load_a(va, sV, kStride, key_row0, kk * 16, lane);
#pragma unroll
      for (int jp = 0; jp < kSTiles / 2; ++jp) {
        uint32_t ob[4];
        load_b_nk(ob, sdOs, kStride, jp * 16, kk * 16, lane);
        mma_16816<E>(ds[2 * jp], va, ob[0], ob[1]);
        mma_16816<E>(ds[2 * jp + 1], va, ob[2], ob[3]);
      }
    }
#pragma unroll
    for (int j = 0; j < kSTiles; ++j) {
#pragma unroll
      for (int i = 0; i < 4; ++i) ds[j][i] = s[j][i] * (ds[j][i] - delta[acc_col(lane, j, i)]);
    }

    // dK += dS^T Q (k = queries; the factor `scale` is applied once, at the end).
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) {
      uint32_t da[4];
      acc_to_a<E>(da, ds[2 * kk], ds[2 * kk + 1]);
#pragma unroll
      for (int dp = 0; dp < kHeadDim / 16; ++dp) {
        uint32_t qb[4];
        load_b_kn(qb, sQs, kStride, kk * 16, dp * 16, lane);
        mma_16816<E>(acc_dk[2 * dp], da, qb[0], qb[1]);
        mma_16816<E>(acc_dk[2 * dp + 1], da, qb[2], qb[3]);
      }
    }

    // dS^T (keys x queries) to shared memory: dQ = dS K needs all the block's keys per query row.
    stage_acc<kBlockM, kStrideS>(sdS + key_row0 * kStrideS, ds, 1.f, lane);
    __syncthreads();

    // dQ += dS K: warps split the kBlockM x kHeadDim product into 16-row x kDPerWarp pieces and add
    // them (unscaled) into the fp32 accumulator.
    {
      constexpr int kMGroups = kBlockM / 16;
      constexpr int kDGroups = kBwdWarps / kMGroups;
      constexpr int kDPerWarp = kHeadDim / kDGroups;
      static_assert(kMGroups * kDGroups == kBwdWarps && kDPerWarp % 16 == 0);
      const int mq = (warp % kMGroups) * 16;
      const int d0 = (warp / kMGroups) * kDPerWarp;
      uint32_t dsa[kBwdBlockN / 16][4];
#pragma unroll
      for (int kk = 0; kk < kBwdBlockN / 16; ++kk)
        load_a_trans(dsa[kk], sdS, kStrideS, mq, kk * 16, lane);
      float* dq = a.dq_accum + ((int64_t(b) * a.q_heads + h) * a.q_len + m0) * kHeadDim;
#pragma unroll
      for (int dc = 0; dc < kDPerWarp / 16; ++dc) {
        float acc[2][4] = {};
#pragma unroll
        for (int kk = 0; kk < kBwdBlockN / 16; ++kk) {
          uint32_t kb[4];
          load_b_kn(kb, sK, kStride, kk * 16, d0 + dc * 16, lane);
          mma_16816<E>(acc[0], dsa[kk], kb[0], kb[1]);
          mma_16816<E>(acc[1], dsa[kk], kb[2], kb[3]);
        }
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int row = mq + acc_row(lane, 2 * half);
            const int col = d0 + dc * 16 + acc_col(lane, jj, 0);
            if (m0 + row < a.q_len)
              atomic_add2(dq + row * kHeadDim + col, acc[jj][2 * half], acc[jj][2 * half + 1]);
          }
        }
      }
    }
    __syncthreads();  // sdS and this stage are free for the next iteration
  }
  cp_async_wait<0>();
  __syncthreads();  // no copy may still be landing in sK / sV, and no warp still reads them

  // dK = scale * (sum of dS^T Q), dV: each warp stages its own 16 rows in sK / sV and writes them.
  E* sdK = sK + key_row0 * kStride;
  E* sdV = sV + key_row0 * kStride;
  stage_acc<kHeadDim, kStride>(sdK, acc_dk, a.scale, lane);
  stage_acc<kHeadDim, kStride>(sdV, acc_dv, 1.f, lane);
  __syncwarp();
  E* dk = a.dk + b * a.dks.batch + kvh * a.dks.head;
  E* dv = a.dv + b * a.dvs.batch + kvh * a.dvs.head;
  store_warp_rows<kHeadDim, kStride>(sdK, dk, a.dks.seq, n0 + key_row0, a.kv_len, a.vec, lane);
  store_warp_rows<kHeadDim, kStride>(sdV, dv, a.dvs.seq, n0 + key_row0, a.kv_len, a.vec, lane);
}

template <typename E>
struct ConvertArgs {
  const float* dq_accum;  // [batch * q_heads, q_len, head_dim]
  E* dq;
  AttentionStrides dqs;
  int q_heads, q_len, head_dim;
  float scale;
  int64_t rows;  // batch * q_heads * q_len
};

// dq = scale * accumulator, one warp per row.
template <typename E>
__global__ void __launch_bounds__(kPreRowsPerBlock * 32)
    flash_bwd_convert_dq_kernel(const ConvertArgs<E> a) {
  const int lane = threadIdx.x % 32;
  const int64_t row = int64_t(blockIdx.x) * kPreRowsPerBlock + threadIdx.x / 32;
  if (row >= a.rows) return;
  const int64_t bh = row / a.q_len;
  const int64_t i = row % a.q_len;
  const int64_t b = bh / a.q_heads, h = bh % a.q_heads;
  E* dq = a.dq + b * a.dqs.batch + h * a.dqs.head + i * a.dqs.seq;
  const float* acc = a.dq_accum + row * a.head_dim;
  for (int d = lane; d < a.head_dim; d += 32) dq[d] = from_float<E>(acc[d] * a.scale);
}

// ---- Host side ---------------------------------------------------------------------------------

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}
bool strides_aligned(const AttentionStrides& s) {
  return s.batch % 8 == 0 && s.head % 8 == 0 && s.seq % 8 == 0;
}

Status last_launch(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return Status::cuda_error(std::string("flash_attention: launching the ") + what +
                              " kernel failed: " + cudaGetErrorString(e));
  return Status::success();
}

template <typename Kernel>
Status allow_smem(Kernel kernel, size_t bytes, const char* what) {
  const cudaError_t e =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
  if (e != cudaSuccess)
    return Status::cuda_error(
        std::string("flash_attention: the ") + what + " kernel needs " + std::to_string(bytes) +
        " bytes of shared memory per block, which the device refused: " + cudaGetErrorString(e));
  return Status::success();
}

// Checks shared by forward and backward; `need` names the pointers the call reads or writes.
Status check_params(const FlashAttentionParams& p,
                    std::initializer_list<std::pair<const void*, const char*>> need) {
  Status s = check_attention_problem(p, /*for_kernel=*/true);
  if (!s.ok()) return s;
  if (p.dtype != AttentionDtype::kBFloat16 && p.dtype != AttentionDtype::kFloat16)
    return Status::invalid_argument("flash_attention: dtype " + std::to_string(int(p.dtype)) +
                                    " is not supported (supported: bf16, fp16)");
  if (p.batch > 65535 || p.q_heads > 65535)
    return Status::invalid_argument("flash_attention: batch (" + std::to_string(p.batch) +
                                    ") and q_heads (" + std::to_string(p.q_heads) +
                                    ") must be <= 65535 (CUDA grid limit)");
  for (const auto& [ptr, name] : need)
    if (ptr == nullptr)
      return Status::invalid_argument(std::string("flash_attention: pointer ") + name + " is null");
  return Status::success();
}

int64_t padded_len(int q_len) {
  return (int64_t(q_len) + kBwdLenPad - 1) / kBwdLenPad * kBwdLenPad;
}
size_t align256(size_t n) {
  return (n + 255) / 256 * 256;
}
struct WorkspaceLayout {
  size_t dq_accum = 0, delta = 0, lse2 = 0, total = 0;  // byte offsets
};
WorkspaceLayout workspace_layout(const AttentionProblem& p) {
  const size_t bh = size_t(p.batch) * size_t(p.q_heads);
  WorkspaceLayout w;
  w.dq_accum = 0;
  w.delta = align256(bh * size_t(p.q_len) * size_t(p.head_dim) * sizeof(float));
  w.lse2 = w.delta + align256(bh * size_t(padded_len(p.q_len)) * sizeof(float));
  w.total = w.lse2 + align256(bh * size_t(padded_len(p.q_len)) * sizeof(float));
  return w;
}

template <typename E, int kHeadDim>
Status run_forward(const FlashAttentionParams& p, cudaStream_t stream) {
  FwdArgs<E> a{};
  a.q = static_cast<const E*>(p.q);
  a.k = static_cast<const E*>(p.k);
  a.v = static_cast<const E*>(p.v);
  a.o = static_cast<E*>(p.o);
  a.lse = p.lse;
  a.qs = p.q_strides;
  a.ks = p.k_strides;
  a.vs = p.v_strides;
  a.os = p.o_strides;
  a.q_heads = p.q_heads;
  a.group = p.q_heads / p.kv_heads;
  a.q_len = p.q_len;
  a.kv_len = p.kv_len;
  a.scale = p.scale;
  a.scale_log2 = p.scale * kLog2e;
  a.causal = p.causal;
  a.vec = aligned16(p.q) && aligned16(p.k) && aligned16(p.v) && aligned16(p.o) &&
          strides_aligned(p.q_strides) && strides_aligned(p.k_strides) &&
          strides_aligned(p.v_strides) && strides_aligned(p.o_strides);
  constexpr size_t smem = FwdSmem<kHeadDim>::kBytes;
  auto kernel = flash_fwd_kernel<E, kHeadDim>;
  Status s = allow_smem(kernel, smem, "forward");
  if (!s.ok()) return s;
  const dim3 grid(attention_ceil_div(p.q_len, kFwdBlockM), p.q_heads, p.batch);
  kernel<<<grid, kFwdThreads, smem, stream>>>(a);
  return last_launch("forward");
}

template <typename E, int kHeadDim>
Status run_backward(const FlashAttentionParams& p, char* workspace, cudaStream_t stream) {
  const WorkspaceLayout w = workspace_layout(p);
  float* dq_accum = reinterpret_cast<float*>(workspace + w.dq_accum);
  float* delta = reinterpret_cast<float*>(workspace + w.delta);
  float* lse2 = reinterpret_cast<float*>(workspace + w.lse2);
  const int64_t bh = int64_t(p.batch) * p.q_heads;
  const int q_len_padded = int(padded_len(p.q_len));

  PreArgs<E> pre{};
  pre.o = static_cast<const E*>(p.o);
  pre.d_o = static_cast<const E*>(p.d_o);
  pre.lse = p.lse;
  pre.os = p.o_strides;
  pre.dos = p.d_o_strides;
  pre.delta = delta;
  pre.lse2 = lse2;
  pre.dq_accum = dq_accum;
  pre.q_heads = p.q_heads;
  pre.q_len = p.q_len;
  pre.q_len_padded = q_len_padded;
  pre.head_dim = kHeadDim;
  pre.rows = bh * q_len_padded;
  if (pre.rows > 0) {
    const int64_t blocks = (pre.rows + kPreRowsPerBlock - 1) / kPreRowsPerBlock;
    flash_bwd_preprocess_kernel<E><<<unsigned(blocks), kPreRowsPerBlock * 32, 0, stream>>>(pre);
    Status s = last_launch("backward preprocess");
    if (!s.ok()) return s;
  }

  if (p.kv_len > 0) {
    BwdArgs<E> a{};
    a.q = static_cast<const E*>(p.q);
    a.k = static_cast<const E*>(p.k);
    a.v = static_cast<const E*>(p.v);
    a.d_o = static_cast<const E*>(p.d_o);
    a.dk = static_cast<E*>(p.dk);
    a.dv = static_cast<E*>(p.dv);
    a.dq_accum = dq_accum;
    a.lse2 = lse2;
    a.delta = delta;
    a.qs = p.q_strides;
    a.ks = p.k_strides;
    a.vs = p.v_strides;
    a.dos = p.d_o_strides;
    a.dks = p.dk_strides;
    a.dvs = p.dv_strides;
    a.q_heads = p.q_heads;
    a.group = p.q_heads / p.kv_heads;
    a.q_len = p.q_len;
    a.kv_len = p.kv_len;
    a.q_len_padded = q_len_padded;
    a.scale = p.scale;
    a.scale_log2 = p.scale * kLog2e;
    a.causal = p.causal;
    a.vec = aligned16(p.q) && aligned16(p.k) && aligned16(p.v) && aligned16(p.d_o) &&
            aligned16(p.dk) && aligned16(p.dv) && strides_aligned(p.q_strides) &&
            strides_aligned(p.k_strides) && strides_aligned(p.v_strides) &&
            strides_aligned(p.d_o_strides) && strides_aligned(p.dk_strides) &&
            strides_aligned(p.dv_strides);
    constexpr size_t smem = BwdSmem<kHeadDim>::kBytes;
    auto kernel = flash_bwd_kernel<E, kHeadDim>;
    Status s = allow_smem(kernel, smem, "backward");
    if (!s.ok()) return s;
    const dim3 grid(attention_ceil_div(p.kv_len, kBwdBlockN), p.kv_heads, p.batch);
    kernel<<<grid, kBwdThreads, smem, stream>>>(a);
    s = last_launch("backward");
    if (!s.ok()) return s;
  }

  ConvertArgs<E> c{};
  c.dq_accum = dq_accum;
  c.dq = static_cast<E*>(p.dq);
  c.dqs = p.dq_strides;
  c.q_heads = p.q_heads;
  c.q_len = p.q_len;
  c.head_dim = kHeadDim;
  c.scale = p.scale;
  c.rows = bh * p.q_len;
  if (c.rows > 0) {
    const int64_t blocks = (c.rows + kPreRowsPerBlock - 1) / kPreRowsPerBlock;
    flash_bwd_convert_dq_kernel<E><<<unsigned(blocks), kPreRowsPerBlock * 32, 0, stream>>>(c);
    return last_launch("backward dq conversion");
  }
  return Status::success();
}

Status forward_for_dtype(const FlashAttentionParams& p, cudaStream_t stream) {
  const bool bf16 = p.dtype == AttentionDtype::kBFloat16;
  if (p.head_dim == 64)
    return bf16 ? run_forward<__nv_bfloat16, 64>(p, stream) : run_forward<__half, 64>(p, stream);
  return bf16 ? run_forward<__nv_bfloat16, 128>(p, stream) : run_forward<__half, 128>(p, stream);
}

Status backward_for_dtype(const FlashAttentionParams& p, char* ws, cudaStream_t stream) {
  const bool bf16 = p.dtype == AttentionDtype::kBFloat16;
  if (p.head_dim == 64)
    return bf16 ? run_backward<__nv_bfloat16, 64>(p, ws, stream)
                : run_backward<__half, 64>(p, ws, stream);
  return bf16 ? run_backward<__nv_bfloat16, 128>(p, ws, stream)
              : run_backward<__half, 128>(p, ws, stream);
}

}  // namespace

Status flash_attention_forward(const FlashAttentionParams& p, cudaStream_t stream) {
  Status s = check_params(p, {});
  if (!s.ok()) return s;
  if (p.batch == 0 || p.q_len == 0) return Status::success();
  s = check_params(p, {{p.q, "q"}, {p.o, "o"}, {p.lse, "lse"}});
  if (!s.ok()) return s;
  if (p.kv_len > 0) {
    s = check_params(p, {{p.k, "k"}, {p.v, "v"}});
    if (!s.ok()) return s;
  }
  return forward_for_dtype(p, stream);  // head_dim is 64 or 128 (checked)
}

Status flash_attention_device_check(int device) {
  return kernel_image_check(flash_fwd_kernel<__nv_bfloat16, 64>, device, "flash_attention");
}

size_t flash_attention_backward_workspace_bytes(const AttentionProblem& problem) {
  if (problem.batch <= 0 || problem.q_heads <= 0 || problem.q_len <= 0 || problem.head_dim <= 0)
    return 0;
  return workspace_layout(problem).total;
}

Status flash_attention_backward(const FlashAttentionParams& p, void* workspace,
                                size_t workspace_bytes, cudaStream_t stream) {
  Status s = check_params(p, {});
  if (!s.ok()) return s;
  if (p.batch == 0 || (p.q_len == 0 && p.kv_len == 0)) return Status::success();
  if (p.q_len > 0) {
    s = check_params(p, {{p.q, "q"}, {p.o, "o"}, {p.lse, "lse"}, {p.d_o, "d_o"}, {p.dq, "dq"}});
    if (!s.ok()) return s;
  }
  if (p.kv_len > 0) {
    s = check_params(p, {{p.k, "k"}, {p.v, "v"}, {p.dk, "dk"}, {p.dv, "dv"}});
    if (!s.ok()) return s;
  }
  const size_t need = flash_attention_backward_workspace_bytes(p);
  if (workspace_bytes < need || (need > 0 && workspace == nullptr))
    return Status::invalid_argument(
        "flash_attention: the backward needs " + std::to_string(need) +
        " bytes of workspace (flash_attention_backward_workspace_bytes); got " +
        std::to_string(workspace == nullptr ? 0 : workspace_bytes));
  if (!aligned16(workspace))
    return Status::invalid_argument("flash_attention: workspace must be 16-byte aligned");
  return backward_for_dtype(p, static_cast<char*>(workspace), stream);
}

}  // namespace loom::kernels
