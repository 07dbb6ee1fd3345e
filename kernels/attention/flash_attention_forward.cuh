#pragma once
// The fused attention forward kernel (flash_fwd_kernel); the design is described at the top of
// flash_attention.cu, which launches it. Device code, included there only.
#include "attention/flash_attention_tiles.cuh"

namespace loom::kernels::flash {

template <typename E>
struct FwdArgs {
  const E* q;
  const E* k;
  const E* v;
  E* o;
  float* lse;
  const int32_t* first_key;  // [batch, q_len] document mask, or null (AttentionProblem)
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

// kDocMask: the instantiation that reads a.first_key (a document mask). A separate one, so that
// attention without a mask keeps the registers it had: at head_dim 64 the budget of two blocks
// per SM (128 registers) has no room for the mask's.
template <typename E, int kHeadDim, bool kDocMask>
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
  // Document mask: this batch row's first keys; the tiles before the first row's are skipped.
  const int32_t* fk = kDocMask ? a.first_key + int64_t(b) * a.q_len : nullptr;
  const int n_first = fwd_first_kv_tile(fk, m_block);

  if (n_tiles > n_first) {
    const int first0 = n_first * kFwdBlockN;
    load_tile<kFwdBlockM, kHeadDim, kStride, kFwdThreads>(sQ, q, a.qs.seq, m0, a.q_len, a.vec, tid);
    load_tile<kFwdBlockN, kHeadDim, kStride, kFwdThreads>(sK, k, a.ks.seq, first0, a.kv_len, a.vec,
                                                          tid);
    load_tile<kFwdBlockN, kHeadDim, kStride, kFwdThreads>(sV, v, a.vs.seq, first0, a.kv_len, a.vec,
                                                          tid);
  }
  cp_async_commit();

  float acc_o[kOTiles][4] = {};
  // Rows g and g + 8 of this warp's 16: running max of the raw scores (m), running sum of
  // exp(scale (s - m)) over this thread's columns (l; summed over the quad at the end).
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};
  uint32_t q_frag[kKSteps][4];

  for (int n_block = n_first; n_block < n_tiles; ++n_block) {
    const int stage = (n_block - n_first) & 1;
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
    if (n_block == n_first) {
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
    if (fwd_tile_needs_mask(m_block, n_block, a.kv_len, a.causal) ||
        fwd_tile_needs_doc_mask(fk, m_block, n_block, a.q_len)) {
#pragma unroll
      for (int j = 0; j < kSTiles; ++j) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int key = n0 + acc_col(lane, j, i);
          const int row = warp_row0 + acc_row(lane, i);
          if (key >= a.kv_len || (a.causal && key > row) ||
              (kDocMask && row < a.q_len && key < fk[row]))
            s[j][i] = -INFINITY;
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

}  // namespace loom::kernels::flash
