#pragma once
// The fused attention backward kernels: Delta and lse in base 2 (flash_bwd_preprocess_kernel),
// dK, dV and the dQ accumulator (flash_bwd_kernel), dQ from it (flash_bwd_convert_dq_kernel); the
// design is described at the top of flash_attention.cu, which launches them. Device code,
// included there only.
#include "attention/flash_attention_tiles.cuh"

namespace loom::kernels::flash {

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
  const int32_t* first_key;  // [batch, q_len] document mask, or null (AttentionProblem)
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
  // Document mask: this batch row's first keys; query tiles past the last one whose first keys
  // reach this key tile are skipped.
  const int32_t* fk = a.first_key == nullptr ? nullptr : a.first_key + int64_t(b) * a.q_len;
  const int m_end = bwd_end_q_tile(fk, a.q_len, n_block, kBlockM);
  const int per_head = m_end > m_first ? m_end - m_first : 0;
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
    const bool doc_mask = bwd_tile_needs_doc_mask(fk, m_block, kBlockM, n_block, a.q_len);
#pragma unroll
    for (int j = 0; j < kSTiles; ++j) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int qc = acc_col(lane, j, i);
        float p = exp2f(fmaf(s[j][i], a.scale_log2, -lse2[qc]));
        if (mask || doc_mask) {
          const int key = n0 + key_row0 + acc_row(lane, i);
          if (key >= a.kv_len || (a.causal && key > m0 + qc)) p = 0.f;
          // Queries past q_len (lse2 = +inf) already have P = 0: their first key is not read.
          if (doc_mask && m0 + qc < a.q_len && key < fk[m0 + qc]) p = 0.f;
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

}  // namespace loom::kernels::flash
