#pragma once
// The references flash_attention_emulated checks the fused-attention kernel against, on contiguous
// inputs in double precision: naive attention (a full softmax), and "minimal rounding" attention,
// which rounds exactly what a tensor-core FlashAttention must round and nothing else. Written by
// the loom authors.
//
// Why the second one: a bf16 kernel is never exact, so "how far from fp64" alone cannot say
// whether a kernel rounds more than its design needs. Any FlashAttention on mma.sync (or wgmma)
// must give P and dS to the tensor cores as 16-bit elements, must take the forward's output in
// that type back as the backward's input (Delta = rowsum(dO * O) uses it), and must write 16-bit
// outputs; its sums and softmax statistics can stay in fp32, whose roundings are 2^16 times finer
// than bf16's (2^13 than fp16's). minimal_rounding_attention does exactly those 16-bit roundings,
// in fp64 otherwise. A kernel whose error against exact attention is about that reference's (ratio
// near 1) rounds no more than it must; one more 16-bit rounding (say of dQ's partial sum per key
// tile) adds to the error budget and raises the ratio (flash_attention_emulated.cpp states the
// bound).
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace attention_reference {

enum class Layout {
  kContiguous,  // [B, H, S, D]
  kSeqMajor,    // [B, S, H, D] viewed as [B, H, S, D], as after a transpose
  kPadded,      // [B, H, S, D] with gaps (multiples of 8 elements) after rows, heads, batches
  kPacked,      // one third of a projection's packed [B, S, 3, H, D] (q, k, v; dq, dk, dv as
                // loom's packed attention gradient writes them): the other thirds are padding
};

struct Config {
  int batch, q_heads, kv_heads, q_len, kv_len, head_dim;
  bool causal, bf16;
  Layout layout;
  bool misaligned;
  float amplitude;  // of q and k: larger scores exercise the online softmax's rescaling
  // Document mask (causal only): 0 none, else documents of lengths spread around this one, cut
  // differently in each batch row (document_first_keys).
  int doc_len;
};

// The first key of every query (AttentionProblem::first_key), [batch * q_len], for c.doc_len > 0:
// documents of lengths in [doc_len / 2 + 1, doc_len * 3 / 2], their boundaries falling anywhere
// in a tile; empty without a document mask.
inline std::vector<int32_t> document_first_keys(const Config& c) {
  if (c.doc_len <= 0) return {};
  std::vector<int32_t> first(size_t(c.batch) * c.q_len);
  for (int b = 0; b < c.batch; ++b)
    for (int start = 0; start < c.q_len;) {
      const int len = c.doc_len / 2 + 1 + (start * 7 + b * 13) % c.doc_len;
      for (int i = start; i < std::min(c.q_len, start + len); ++i)
        first[size_t(b) * c.q_len + i] = start;
      start += len;
    }
  return first;
}

struct Gradients {
  std::vector<float> dq, dk, dv;
};

// o, lse, dq, dk and dv in double precision.
struct AttentionValues {
  std::vector<double> o, lse, dq, dk, dv;
};

// Attention and its gradients in double precision, where `round` (double -> double) stands for a
// rounding to the kernel's 16-bit element type: applied to P before P V and P^T dO, to dS before
// dS K and dS^T Q, to o before Delta = rowsum(dO * o) (the backward's input), and to every output
// (see the top of this file). With the identity it is exact attention. `delta_o`, if given, is
// the o that Delta is computed from instead (the kernel's, as the kernel's backward does).
template <typename Round>
AttentionValues minimal_rounding_attention(const Config& c, const std::vector<float>& q,
                                           const std::vector<float>& k, const std::vector<float>& v,
                                           const std::vector<float>& d_o, Round round,
                                           const std::vector<float>* delta_o = nullptr) {
  const int D = c.head_dim, group = c.q_heads / c.kv_heads;
  const double scale = 1.0 / std::sqrt(double(D));
  AttentionValues r{std::vector<double>(q.size(), 0.0),
                    std::vector<double>(size_t(c.batch) * c.q_heads * c.q_len, -INFINITY),
                    std::vector<double>(q.size(), 0.0), std::vector<double>(k.size(), 0.0),
                    std::vector<double>(v.size(), 0.0)};
  std::vector<double> p(static_cast<size_t>(c.kv_len)), o(static_cast<size_t>(D)),
      dq(static_cast<size_t>(D));
  const std::vector<int32_t> first_key = document_first_keys(c);
  for (int b = 0; b < c.batch; ++b)
    for (int h = 0; h < c.q_heads; ++h)
      for (int i = 0; i < c.q_len; ++i) {
        const size_t row = (size_t(b) * c.q_heads + h) * c.q_len + i;
        const size_t kv0 = (size_t(b) * c.kv_heads + h / group) * c.kv_len;
        const float* qi = &q[row * D];
        const float* doi = &d_o[row * D];
        const int keys = c.causal ? std::min(i + 1, c.kv_len) : c.kv_len;
        if (keys == 0) continue;  // o = 0, lse = -inf and no gradient
        // Keys [first, keys): a document mask drops the keys of earlier documents.
        const int first = first_key.empty() ? 0 : first_key[size_t(b) * c.q_len + i];
        double max = -INFINITY, sum = 0;
        for (int j = first; j < keys; ++j) {
          double s = 0;
          for (int x = 0; x < D; ++x) s += double(qi[x]) * k[(kv0 + j) * D + x];
          p[j] = s * scale;
          max = std::max(max, p[j]);
        }
        for (int j = first; j < keys; ++j) {
          p[j] = std::exp(p[j] - max);
          sum += p[j];  // the normalizer sums unrounded P, as the kernel's fp32 row sum does
        }
        r.lse[row] = max + std::log(sum);
        std::fill(o.begin(), o.end(), 0.0);
        for (int j = first; j < keys; ++j) {
          const double pj = round(p[j]);
          for (int x = 0; x < D; ++x) o[x] += pj * v[(kv0 + j) * D + x];
        }
        double delta = 0;
        for (int x = 0; x < D; ++x) {
          o[x] = round(o[x] / sum);
          r.o[row * D + x] = o[x];
          delta += double(doi[x]) * (delta_o ? double((*delta_o)[row * D + x]) : o[x]);
        }
        std::fill(dq.begin(), dq.end(), 0.0);
        for (int j = first; j < keys; ++j) {
          const size_t kj = (kv0 + j) * D;
          const double pj = p[j] / sum;
          double dp = 0;
          for (int x = 0; x < D; ++x) dp += double(doi[x]) * v[kj + x];
          const double ds = round(pj * (dp - delta));
          const double pj_element = round(pj);
          for (int x = 0; x < D; ++x) {
            r.dv[kj + x] += pj_element * doi[x];
            r.dk[kj + x] += ds * scale * qi[x];
            dq[x] += ds * scale * k[kj + x];
          }
        }
        for (int x = 0; x < D; ++x) r.dq[row * D + x] = dq[x];
      }
  for (auto* out : {&r.o, &r.dq, &r.dk, &r.dv})
    for (double& x : *out) x = round(x);
  return r;
}

// Exact attention (a full softmax, in double precision) as floats, the backward's Delta from
// `kernel_o` as the kernel's backward computes it.
struct NaiveAttention {
  std::vector<float> o, lse;
  Gradients grad;
};

inline NaiveAttention naive_attention(const Config& c, const std::vector<float>& q,
                                      const std::vector<float>& k, const std::vector<float>& v,
                                      const std::vector<float>& d_o,
                                      const std::vector<float>& kernel_o) {
  const auto exact = minimal_rounding_attention(
      c, q, k, v, d_o, [](double x) { return x; }, &kernel_o);
  const auto floats = [](const std::vector<double>& x) {
    return std::vector<float>(x.begin(), x.end());
  };
  return {
      floats(exact.o), floats(exact.lse), {floats(exact.dq), floats(exact.dk), floats(exact.dv)}};
}

// ||got - want|| / ||want|| over all elements (0 when want is all zeros).
template <typename T>
double rms_error(const std::vector<T>& got, const std::vector<double>& want) {
  double error = 0, norm = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    error += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    norm += want[i] * want[i];
  }
  return norm > 0 ? std::sqrt(error / norm) : 0.0;
}

// max |got - want| / max |want|; *non_finite counts the elements of `got` that are not finite.
inline double relative_error(const std::vector<float>& got, const std::vector<float>& want,
                             int* non_finite) {
  double max_error = 0, max_want = 1e-6;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) {
      ++*non_finite;
      continue;
    }
    max_error = std::max(max_error, double(std::fabs(got[i] - want[i])));
    max_want = std::max(max_want, double(std::fabs(want[i])));
  }
  return max_error / max_want;
}

// max |got - want| over rows; -inf matches -inf (rows with no key), anything else not finite
// counts in *non_finite.
inline double lse_error(const std::vector<float>& got, const std::vector<float>& want,
                        int* non_finite) {
  double max_error = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isinf(want[i]) && got[i] == want[i]) continue;
    if (!std::isfinite(got[i])) {
      ++*non_finite;
      continue;
    }
    max_error = std::max(max_error, double(std::fabs(got[i] - want[i])));
  }
  return max_error;
}

}  // namespace attention_reference
