#include "attention/flash_attention_host.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace loom::kernels {

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// Row `row` of head `head` of batch `b` in a [batch, heads, seq, head_dim] tensor.
template <typename T>
T* row_ptr(T* base, const AttentionStrides& s, int b, int head, int row) {
  return base + b * s.batch + head * s.head + row * s.seq;
}

float dot(const float* x, const float* y, int n) {
  float sum = 0.f;
  for (int d = 0; d < n; ++d) sum += x[d] * y[d];
  return sum;
}

Status check_pointers(std::initializer_list<std::pair<const void*, const char*>> need) {
  for (const auto& [ptr, name] : need)
    if (ptr == nullptr)
      return Status::invalid_argument(std::string("flash_attention (host): pointer ") + name +
                                      " is null");
  return Status::success();
}

}  // namespace

Status flash_attention_forward_host(const FlashAttentionHostParams& p,
                                    FlashAttentionHostStats* stats) {
  Status s = check_attention_problem(p, /*for_kernel=*/false);
  if (!s.ok()) return s;
  if (p.batch == 0 || p.q_len == 0) return Status::success();
  s = check_pointers({{p.q, "q"}, {p.o, "o"}, {p.lse, "lse"}});
  if (s.ok() && p.kv_len > 0) s = check_pointers({{p.k, "k"}, {p.v, "v"}});
  if (!s.ok()) return s;

  const int D = p.head_dim, group = p.q_heads / p.kv_heads;
  const int m_tiles = attention_ceil_div(p.q_len, kFwdBlockM);
  std::vector<float> m(kFwdBlockM), l(kFwdBlockM), acc(size_t(kFwdBlockM) * D), scores(kFwdBlockN);
  for (int b = 0; b < p.batch; ++b) {
    const int32_t* fk = p.first_key == nullptr ? nullptr : p.first_key + int64_t(b) * p.q_len;
    for (int h = 0; h < p.q_heads; ++h) {
      const int kvh = h / group;
      for (int m_block = 0; m_block < m_tiles; ++m_block) {
        const int m0 = m_block * kFwdBlockM;
        const int rows = std::min(kFwdBlockM, p.q_len - m0);
        std::fill(m.begin(), m.end(), -kInf);  // running max of scale * q.k
        std::fill(l.begin(), l.end(), 0.f);    // running sum of exp(scale * q.k - m)
        std::fill(acc.begin(), acc.end(), 0.f);
        const int n_tiles = fwd_num_kv_tiles(m_block, p.q_len, p.kv_len, p.causal);
        for (int n_block = fwd_first_kv_tile(fk, m_block); n_block < n_tiles; ++n_block) {
          if (stats) ++stats->tiles;
          const int n0 = n_block * kFwdBlockN;
          const int cols = std::min(kFwdBlockN, p.kv_len - n0);
          const bool mask = fwd_tile_needs_mask(m_block, n_block, p.kv_len, p.causal);
          const bool doc_mask = fwd_tile_needs_doc_mask(fk, m_block, n_block, p.q_len);
          for (int r = 0; r < rows; ++r) {
            const int row = m0 + r;
            const float* q = row_ptr(p.q, p.q_strides, b, h, row);
            // S for this row and tile; masked keys are -inf (keys past kv_len are not visited).
            float tile_max = -kInf;
            for (int c = 0; c < cols; ++c) {
              const int key = n0 + c;
              float x = -kInf;
              if (!(mask && p.causal && key > row) && !(doc_mask && key < fk[row]))
                x = dot(q, row_ptr(p.k, p.k_strides, b, kvh, key), D) * p.scale;
              scores[c] = x;
              tile_max = std::max(tile_max, x);
            }
            // Online softmax: rescale what was accumulated by exp(m_old - m_new). A row with only
            // masked scores so far uses 0 in place of m (no inf - inf): its P and alpha are 0.
            const float m_new = std::max(m[r], tile_max);
            const float m_use = m_new == -kInf ? 0.f : m_new;
            const float alpha = std::exp(m[r] - m_use);
            m[r] = m_new;
            l[r] *= alpha;
            float* a = acc.data() + size_t(r) * D;
            for (int d = 0; d < D; ++d) a[d] *= alpha;
            for (int c = 0; c < cols; ++c) {
              const float pr = std::exp(scores[c] - m_use);
              l[r] += pr;
              const float* v = row_ptr(p.v, p.v_strides, b, kvh, n0 + c);
              for (int d = 0; d < D; ++d) a[d] += pr * v[d];
            }
          }
        }
        // O /= l once; lse = m + log(l). No key at all: O = 0, lse = -inf.
        for (int r = 0; r < rows; ++r) {
          const int row = m0 + r;
          const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
          float* o = row_ptr(p.o, p.o_strides, b, h, row);
          for (int d = 0; d < D; ++d) o[d] = acc[size_t(r) * D + d] * inv;
          p.lse[(int64_t(b) * p.q_heads + h) * p.q_len + row] =
              l[r] > 0.f ? m[r] + std::log(l[r]) : -kInf;
        }
      }
    }
  }
  return Status::success();
}

Status flash_attention_backward_host(const FlashAttentionHostParams& p,
                                     FlashAttentionHostStats* stats) {
  Status s = check_attention_problem(p, /*for_kernel=*/false);
  if (!s.ok()) return s;
  if (p.batch == 0 || (p.q_len == 0 && p.kv_len == 0)) return Status::success();
  if (p.q_len > 0)
    s = check_pointers({{p.q, "q"}, {p.o, "o"}, {p.lse, "lse"}, {p.d_o, "d_o"}, {p.dq, "dq"}});
  if (s.ok() && p.kv_len > 0)
    s = check_pointers({{p.k, "k"}, {p.v, "v"}, {p.dk, "dk"}, {p.dv, "dv"}});
  if (!s.ok()) return s;

  const int D = p.head_dim, group = p.q_heads / p.kv_heads;
  const int block_m = bwd_block_m(D);
  const int64_t bh_rows = int64_t(p.batch) * p.q_heads * p.q_len;
  // Delta = rowsum(dO * O); the dq accumulator (unscaled, like the kernel's workspace).
  std::vector<float> delta(bh_rows);
  std::vector<float> dq_acc(bh_rows * D, 0.f);
  auto flat_row = [&](int b, int h, int row) {
    return (int64_t(b) * p.q_heads + h) * p.q_len + row;
  };
  for (int b = 0; b < p.batch; ++b)
    for (int h = 0; h < p.q_heads; ++h)
      for (int i = 0; i < p.q_len; ++i)
        delta[flat_row(b, h, i)] =
            dot(row_ptr(p.d_o, p.d_o_strides, b, h, i), row_ptr(p.o, p.o_strides, b, h, i), D);

  const int n_tiles = attention_ceil_div(p.kv_len, kBwdBlockN);
  const int m_tiles = attention_ceil_div(p.q_len, block_m);
  std::vector<float> dk_acc(size_t(kBwdBlockN) * D), dv_acc(size_t(kBwdBlockN) * D);
  for (int b = 0; b < p.batch; ++b) {
    const int32_t* fk = p.first_key == nullptr ? nullptr : p.first_key + int64_t(b) * p.q_len;
    for (int kvh = 0; kvh < p.kv_heads; ++kvh) {
      for (int n_block = 0; n_block < n_tiles; ++n_block) {
        const int n0 = n_block * kBwdBlockN;
        const int cols = std::min(kBwdBlockN, p.kv_len - n0);
        std::fill(dk_acc.begin(), dk_acc.end(), 0.f);
        std::fill(dv_acc.begin(), dv_acc.end(), 0.f);
        const int m_end = std::min(m_tiles, bwd_end_q_tile(fk, p.q_len, n_block, block_m));
        for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
          for (int m_block = bwd_first_q_tile(n_block, block_m, p.causal); m_block < m_end;
               ++m_block) {
            if (stats) ++stats->tiles;
            const int m0 = m_block * block_m;
            const int rows = std::min(block_m, p.q_len - m0);
            const bool mask = bwd_tile_needs_mask(m_block, block_m, n_block, p.kv_len, p.causal);
            const bool doc_mask = bwd_tile_needs_doc_mask(fk, m_block, block_m, n_block, p.q_len);
            for (int r = 0; r < rows; ++r) {
              const int query = m0 + r;
              const float* q = row_ptr(p.q, p.q_strides, b, h, query);
              const float* d_o = row_ptr(p.d_o, p.d_o_strides, b, h, query);
              const float lse = p.lse[flat_row(b, h, query)];
              const float dlt = delta[flat_row(b, h, query)];
              float* dq = dq_acc.data() + flat_row(b, h, query) * D;
              for (int c = 0; c < cols; ++c) {
                const int key = n0 + c;
                if (mask && p.causal && key > query) continue;  // P = 0, dS = 0
                if (doc_mask && key < fk[query]) continue;
                const float* k = row_ptr(p.k, p.k_strides, b, kvh, key);
                const float* v = row_ptr(p.v, p.v_strides, b, kvh, key);
                // P = exp(scale S - lse), recomputed; lse = -inf (no key) gives P = 0.
                const float pr = lse == -kInf ? 0.f : std::exp(dot(q, k, D) * p.scale - lse);
                const float dp = dot(d_o, v, D);   // dP = dO V^T
                const float ds = pr * (dp - dlt);  // dS = P (dP - Delta)
                float* dv = dv_acc.data() + size_t(c) * D;
                float* dk = dk_acc.data() + size_t(c) * D;
                for (int d = 0; d < D; ++d) {
                  dv[d] += pr * d_o[d];  // dV += P^T dO
                  dq[d] += ds * k[d];    // dQ += dS K
                  dk[d] += ds * q[d];    // dK += dS^T Q
                }
              }
            }
          }
        }
        for (int c = 0; c < cols; ++c) {
          float* dk = row_ptr(p.dk, p.dk_strides, b, kvh, n0 + c);
          float* dv = row_ptr(p.dv, p.dv_strides, b, kvh, n0 + c);
          for (int d = 0; d < D; ++d) {
            dk[d] = dk_acc[size_t(c) * D + d] * p.scale;
            dv[d] = dv_acc[size_t(c) * D + d];
          }
        }
      }
    }
  }
  for (int b = 0; b < p.batch; ++b)
    for (int h = 0; h < p.q_heads; ++h)
      for (int i = 0; i < p.q_len; ++i) {
        float* dq = row_ptr(p.dq, p.dq_strides, b, h, i);
        const float* acc = dq_acc.data() + flat_row(b, h, i) * D;
        for (int d = 0; d < D; ++d) dq[d] = acc[d] * p.scale;
      }
  return Status::success();
}

}  // namespace loom::kernels
