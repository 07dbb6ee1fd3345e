#pragma once
// The arithmetic of loom's CPU attention (ops/cpu_attention.h) for one (batch, head): small
// matrix products on register tiles, the softmax and its backward, written with GCC vector
// extensions (16 floats) and compiled inside one entry point per x86 level in cpu_attention.cpp
// (every function here is force-inlined into it, so each level gets its own instructions).
//
// Why not at::bmm / PyTorch's CPU flash kernel: at sequence lengths of a few hundred the
// products are 64 x 128 x 64 and smaller, where a BLAS call's set-up costs about as much as its
// arithmetic; a whole head's keys and values fit in L2, so the head is done in one visit with
// the full softmax row in hand (no online rescaling), and causal attention skips every tile of
// 4-8 query rows x 16 keys above the diagonal. At T = 128 that is about PyTorch's speed without
// a mask and 1.4-1.6x it with the causal mask (loom-bench-attention --device cpu,
// docs/benchmarks.md).
//
// Layout per head (all padded with zeros to a multiple of 16 rows or columns):
//   qp [tp x d] queries, kt [d x sp] keys transposed (the B operand of S = q k^T), vp / kp [sp x d]
//   values / keys, vt [d x sp] values transposed (dP = dO v^T).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_math.h"

#define LOOM_FORCE_INLINE inline __attribute__((always_inline))

namespace loom::ops::cpu::attention {

typedef float V16 __attribute__((vector_size(64)));
typedef float V16Unaligned __attribute__((vector_size(64), aligned(4), may_alias));
typedef int32_t I16 __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;
// Query rows per backward block: the block's probabilities and their gradients, [kBlock x sp],
// are read again (transposed) for dK and dV.
constexpr int64_t kBlock = 64;

inline int64_t round_up(int64_t n, int64_t m) {
  return (n + m - 1) / m * m;
}

LOOM_FORCE_INLINE V16 load(const float* p) {
  return *reinterpret_cast<const V16Unaligned*>(p);
}
LOOM_FORCE_INLINE void store(float* p, V16 v) {
  *reinterpret_cast<V16Unaligned*>(p) = v;
}
LOOM_FORCE_INLINE V16 splat(float x) {
  return V16{} + x;
}
LOOM_FORCE_INLINE I16 lanes_from(int64_t first) {
  const I16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  return lane + static_cast<int32_t>(first);
}
LOOM_FORCE_INLINE float sum_lanes(V16 v) {
  float s = 0;
  for (int l = 0; l < kLanes; ++l) s += v[l];
  return s;
}
LOOM_FORCE_INLINE float max_lanes(V16 v) {
  float m = v[0];
  for (int l = 1; l < kLanes; ++l) m = std::max(m, v[l]);
  return m;
}

// 2^t for t <= 0 (exp2_bounded's algorithm, 16 lanes): below -126 the result is 2^-126, which
// the softmax rows it feeds (whose largest term is 1) cannot tell from 0.
LOOM_FORCE_INLINE V16 exp2_nonpositive(V16 t) {
  t = t < -126.0f ? splat(-126.0f) : t;
  const float rounder = 12582912.0f;  // 1.5 * 2^23
  const V16 n = (t + rounder) - rounder;
  const V16 p = exp2_fraction_fp32(t - n);
  const I16 bits = (__builtin_convertvector(n, I16) + 127) << 23;
  return p * (V16)bits;
}

// A matrix operand read element by element: A[r, k] = data[r * row + k * col]. Transposed
// operands (P^T, dS^T in backward) are the same memory with the strides swapped.
struct Operand {
  const float* data;
  int64_t row, col = 1;
};

// C[R x 16 NV] = (or += with Accumulate) sum over k in [k0, k1) of A[r, k] * B[k, :].
// The R x NV accumulators stay in registers: 16 zmm at R = NV = 4.
template <int R, int NV, bool Accumulate>
LOOM_FORCE_INLINE void tile(Operand a, const float* b, int64_t ldb, float* c, int64_t ldc,
                            int64_t k0, int64_t k1) {
  V16 acc[R][NV];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) acc[r][v] = Accumulate ? load(c + r * ldc + kLanes * v) : V16{};
  for (int64_t k = k0; k < k1; ++k) {
    V16 row[NV];
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) row[v] = load(b + k * ldb + kLanes * v);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const float x = a.data[r * a.row + k * a.col];
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) acc[r][v] += x * row[v];
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) store(c + r * ldc + kLanes * v, acc[r][v]);
}

// R rows of C[:, 0..n) (n a multiple of 16) = A B over k in [k0, k1), in column chunks of up
// to 16 NVMax.
template <int R, int NVMax, bool Accumulate>
LOOM_FORCE_INLINE void row_tile(Operand a, const float* b, int64_t ldb, float* c, int64_t ldc,
                                int64_t n, int64_t k0, int64_t k1) {
  constexpr int64_t wide = kLanes * NVMax;
  int64_t j = 0;
  for (; j + wide <= n; j += wide) tile<R, NVMax, Accumulate>(a, b + j, ldb, c + j, ldc, k0, k1);
  if constexpr (NVMax > 2)
    for (; j + 2 * kLanes <= n; j += 2 * kLanes)
      tile<R, 2, Accumulate>(a, b + j, ldb, c + j, ldc, k0, k1);
  for (; j < n; j += kLanes) tile<R, 1, Accumulate>(a, b + j, ldb, c + j, ldc, k0, k1);
}

// One head's sizes: t queries, s keys, head_dim d (a multiple of 16); tp, sp padded to 16.
struct Head {
  int64_t t, s, d, tp, sp;
  bool causal;
  float scale;
  // A document mask (causal only): this batch row's first key of each query, non-decreasing
  // (ops::attention's first_key). Null: none.
  const int32_t* first_key = nullptr;
  // Keys query row i attends to: [begin(i), valid(i)); none for the padding rows.
  int64_t begin(int64_t i) const { return first_key != nullptr && i < t ? first_key[i] : 0; }
  int64_t valid(int64_t i) const { return i >= t ? 0 : (causal ? std::min(s, i + 1) : s); }
  // Columns of the score tile of rows [r0, r1): the keys any of them attends to, padded;
  // from first_column(r0) (row r0 has the smallest first key), rounded down to a vector. A tile
  // of padding rows only takes the last row's, so that columns never move back.
  int64_t columns(int64_t r1) const { return causal ? std::min(sp, round_up(r1, kLanes)) : sp; }
  int64_t first_column(int64_t r0) const {
    return first_key == nullptr || t == 0 ? 0 : first_key[std::min(r0, t - 1)] / kLanes * kLanes;
  }
};

// One row of d floats (a multiple of 16): inline vector moves, where a memcpy call per row of
// 32 floats cost more than the copy.
LOOM_FORCE_INLINE void copy_row(float* dst, const float* src, int64_t d) {
  for (int64_t x = 0; x < d; x += kLanes) store(dst + x, load(src + x));
}
// Rows of d floats between two strides.
LOOM_FORCE_INLINE void copy_rows(float* dst, int64_t dst_stride, const float* src,
                                 int64_t src_stride, int64_t rows, int64_t d) {
  for (int64_t i = 0; i < rows; ++i) copy_row(dst + i * dst_stride, src + i * src_stride, d);
}

// One head's rows of q, k or v: row i at data + i * stride, contiguous within the row, plus a
// bias added to every row (the projection's, when its GEMM left it out) or none.
struct Rows {
  const float* data;
  int64_t stride;
  const float* bias = nullptr;
};

// rows x d from a strided source into a dense [rows_padded x d] buffer, zeros below.
LOOM_FORCE_INLINE void pack_rows(Rows src, int64_t rows, int64_t rows_padded, int64_t d,
                                 float* dst) {
  if (src.bias == nullptr) {
    copy_rows(dst, d, src.data, src.stride, rows, d);
  } else {
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t x = 0; x < d; x += kLanes)
        store(dst + i * d + x, load(src.data + i * src.stride + x) + load(src.bias + x));
  }
  std::fill(dst + rows * d, dst + rows_padded * d, 0.0f);
}
// The transpose: dst [d x rows_padded], zeros right of rows.
LOOM_FORCE_INLINE void pack_transposed(Rows src, int64_t rows, int64_t rows_padded, int64_t d,
                                       float* dst) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t c = 0; c < d; ++c)
      dst[c * rows_padded + i] = src.bias == nullptr ? src.data[i * src.stride + c]
                                                     : src.data[i * src.stride + c] + src.bias[c];
  for (int64_t c = 0; c < d; ++c)
    std::fill(dst + c * rows_padded + rows, dst + (c + 1) * rows_padded, 0.0f);
}
// Adds the column sums of rows x d (dense) to sums[d]: a bias's gradient, rows in order.
LOOM_FORCE_INLINE void add_column_sums(const float* src, int64_t rows, int64_t d, float* sums) {
  for (int64_t x = 0; x < d; x += kLanes) {
    V16 acc = load(sums + x);
    for (int64_t i = 0; i < rows; ++i) acc += load(src + i * d + x);
    store(sums + x, acc);
  }
}

// x where lanes j..j+15 lie inside the columns [lo, hi), `fill` elsewhere. Two selects, not
// one on `(a) & (b)`, which GCC compiles to a branch per lane.
LOOM_FORCE_INLINE V16 keep_columns(V16 x, int64_t j, int64_t lo, int64_t hi, V16 fill) {
  const I16 lane = lanes_from(j);
  x = lane < static_cast<int32_t>(hi) ? x : fill;
  return lane >= static_cast<int32_t>(lo) ? x : fill;
}

// Row i of the scores (n columns, scaled by `scale` here) -> its softmax probabilities in
// place, zeros outside the keys [lo, hi) it attends to; returns the log-sum-exp (natural log) of
// the scaled scores.
LOOM_FORCE_INLINE float softmax_row(float* row, int64_t n, int64_t lo, int64_t hi, float scale) {
  constexpr float kLog2e = 1.44269504088896340736f;
  if (hi <= lo) {
    std::fill(row, row + n, 0.0f);
    return 0.0f;
  }
  V16 max = splat(-INFINITY);
  for (int64_t j = 0; j < n; j += kLanes) {
    const V16 x = keep_columns(load(row + j), j, lo, hi, splat(-INFINITY));
    max = x > max ? x : max;
  }
  const float m = max_lanes(max), c = scale * kLog2e, mc = m * c;
  V16 sum{};
  for (int64_t j = 0; j < n; j += kLanes) {
    V16 e = exp2_nonpositive(load(row + j) * c - mc);
    e = keep_columns(e, j, lo, hi, V16{});
    store(row + j, e);
    sum += e;
  }
  const float total = sum_lanes(sum), inverse = 1.0f / total;
  for (int64_t j = 0; j < n; j += kLanes) store(row + j, load(row + j) * inverse);
  return m * scale + std::log(total);
}

struct ForwardScratch {
  float *qp, *kt, *vp, *scores, *out;  // [tp x d], [d x sp], [sp x d], [R x sp], [R x d]
};

// Output rows (stride o_stride) and the log-sum-exp of one head.
template <int R, int NVMax>
LOOM_FORCE_INLINE void forward_head(const Head& h, Rows q, Rows k, Rows v, float* o,
                                    int64_t o_stride, float* lse, const ForwardScratch& w) {
  const int64_t d = h.d;
  pack_rows(q, h.t, h.tp, d, w.qp);
  pack_transposed(k, h.s, h.sp, d, w.kt);
  pack_rows(v, h.s, h.sp, d, w.vp);
  for (int64_t r0 = 0; r0 < h.tp && r0 < h.t; r0 += R) {
    // Columns [j0, n): the keys before j0 are masked for every row of the tile.
    const int64_t n = h.columns(r0 + R), j0 = std::min(h.first_column(r0), n);
    row_tile<R, NVMax, false>({w.qp + r0 * d, d}, w.kt + j0, h.sp, w.scores + j0, h.sp, n - j0, 0,
                              d);
    for (int r = 0; r < R; ++r) {
      const int64_t i = r0 + r;
      const float row_lse =
          softmax_row(w.scores + r * h.sp + j0, n - j0, h.begin(i) - j0, h.valid(i) - j0, h.scale);
      if (i < h.t) lse[i] = row_lse;
    }
    row_tile<R, NVMax, false>({w.scores, h.sp}, w.vp, d, w.out, d, d, j0, n);
    copy_rows(o + r0 * o_stride, o_stride, w.out, d, std::min<int64_t>(R, h.t - r0), d);
  }
}

struct BackwardScratch {
  float *qp, *dop;      // [tp x d] this query head's queries and output gradient
  float *kp, *kt, *vt;  // [sp x d], [d x sp], [d x sp]
  float *dk, *dv;       // [sp x d] accumulated over the group's query heads
  float *p, *ds;        // [kBlock x sp] probabilities and score gradients of a block
  float *dq, *delta;    // [R x d], [tp] rowsum(dO * O)
};

// Packs a key/value head for backward and clears its gradient accumulators.
LOOM_FORCE_INLINE void begin_kv_head(const Head& h, Rows k, Rows v, const BackwardScratch& w) {
  pack_rows(k, h.s, h.sp, h.d, w.kp);
  pack_transposed(k, h.s, h.sp, h.d, w.kt);
  pack_transposed(v, h.s, h.sp, h.d, w.vt);
  std::fill(w.dk, w.dk + h.sp * h.d, 0.0f);
  std::fill(w.dv, w.dv + h.sp * h.d, 0.0f);
}

// One query head's share of the backward: its dq rows (written at dq_stride; their column sums
// added to dq_sum unless null) and its terms of dk and dv (accumulated in the scratch). With
// P = softmax(scale q k^T):
//   dP = dO v^T, dS = P * (dP - rowsum(dO * O)) * scale, dq = dS k, dk += dS^T q, dv += P^T dO.
template <int R, int NVMax>
LOOM_FORCE_INLINE void backward_query_head(const Head& h, Rows q, const float* o, int64_t o_stride,
                                           Rows d_o, const float* lse, float* dq, int64_t dq_stride,
                                           float* dq_sum, const BackwardScratch& w) {
  constexpr float kLog2e = 1.44269504088896340736f;
  const int64_t d = h.d, sp = h.sp;
  const float c = h.scale * kLog2e;
  pack_rows(q, h.t, h.tp, d, w.qp);
  pack_rows(d_o, h.t, h.tp, d, w.dop);
  for (int64_t i = 0; i < h.tp; ++i) {
    V16 acc{};
    if (i < h.t)
      for (int64_t x = 0; x < d; x += kLanes)
        acc += load(w.dop + i * d + x) * load(o + i * o_stride + x);
    w.delta[i] = sum_lanes(acc);
  }
  for (int64_t i0 = 0; i0 < h.t; i0 += kBlock) {
    // The block's columns [j_block, n_block); each row tile's [j0, n) within them.
    const int64_t rows = std::min(kBlock, h.tp - i0), n_block = h.columns(i0 + rows);
    const int64_t j_block = std::min(h.first_column(i0), n_block);
    for (int64_t r0 = i0; r0 < i0 + rows; r0 += R) {
      const int64_t n = h.columns(r0 + R), j0 = std::min(h.first_column(r0), n);
      float* p = w.p + (r0 - i0) * sp;
      float* ds = w.ds + (r0 - i0) * sp;
      row_tile<R, NVMax, false>({w.qp + r0 * d, d}, w.kt + j0, sp, p + j0, sp, n - j0, 0, d);
      row_tile<R, NVMax, false>({w.dop + r0 * d, d}, w.vt + j0, sp, ds + j0, sp, n - j0, 0, d);
      for (int r = 0; r < R; ++r) {
        const int64_t i = r0 + r, lo = h.begin(i), valid = h.valid(i);
        const float shift = i < h.t ? lse[i] * kLog2e : 0.0f, delta = w.delta[i];
        float *p_row = p + r * sp, *ds_row = ds + r * sp;
        for (int64_t j = j0; j < n; j += kLanes) {
          V16 prob = exp2_nonpositive(load(p_row + j) * c - shift);
          prob = keep_columns(prob, j, lo, valid, V16{});
          store(p_row + j, prob);
          store(ds_row + j, prob * (load(ds_row + j) - delta) * h.scale);
        }
        std::fill(p_row + j_block, p_row + j0, 0.0f);
        std::fill(ds_row + j_block, ds_row + j0, 0.0f);
        std::fill(p_row + n, p_row + n_block, 0.0f);
        std::fill(ds_row + n, ds_row + n_block, 0.0f);
      }
      row_tile<R, NVMax, false>({ds, sp}, w.kp, d, w.dq, d, d, j0, n);
      const int64_t valid_rows = std::min<int64_t>(R, h.t - r0);
      copy_rows(dq + r0 * dq_stride, dq_stride, w.dq, d, valid_rows, d);
      if (dq_sum != nullptr) add_column_sums(w.dq, valid_rows, d, dq_sum);
    }
    for (int64_t j0 = j_block; j0 < n_block; j0 += R) {
      // Causal: key j has weight only from queries i >= j.
      const int64_t k0 = h.causal ? std::clamp(j0 - i0, int64_t{0}, rows) : 0;
      // P^T and dS^T: row r of the tile is column j0 + r of the block.
      row_tile<R, NVMax, true>({w.p + j0, 1, sp}, w.dop + i0 * d, d, w.dv + j0 * d, d, d, k0, rows);
      row_tile<R, NVMax, true>({w.ds + j0, 1, sp}, w.qp + i0 * d, d, w.dk + j0 * d, d, d, k0, rows);
    }
  }
}

}  // namespace loom::ops::cpu::attention
