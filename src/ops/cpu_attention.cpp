#include "loom/ops/cpu_attention.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/autograd.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "cpu_math.h"
#include "loom/core/error.h"

namespace loom::ops {

namespace {

// A view of the problem as N = B * Hkv independent heads, each with R = G * T query rows (the G
// query heads sharing one key/value head, stacked) against S keys.
struct Geometry {
  int64_t n = 0, rows = 0, keys = 0, dim = 0, queries = 0;  // queries: T (a row's position: r % T)
  bool causal = false;
  int64_t chunk = 1;  // heads per chunk
};

Geometry geometry_of(const at::Tensor& q, const at::Tensor& k, bool causal) {
  Geometry g;
  const int64_t group = q.size(1) / k.size(1);
  g.n = k.size(0) * k.size(1);
  g.queries = q.size(2);
  g.rows = group * g.queries;
  g.keys = k.size(2);
  g.dim = q.size(3);
  g.causal = causal;
  const int64_t per_head = std::max<int64_t>(1, g.rows * g.keys * q.element_size());
  g.chunk = std::clamp<int64_t>(kScoreChunkBytes / per_head, 1, std::max<int64_t>(1, g.n));
  return g;
}

// Keys row r may attend to: all of them, or (causal) those at or before its position.
inline int64_t visible_keys(const Geometry& g, int64_t r) {
  return g.causal ? std::min(g.keys, r % g.queries + 1) : g.keys;
}

// One row of scores -> probabilities, in place: p_j = exp(scale (s_j - max)) / sum, 0 beyond the
// visible keys; returns the row's log-sum-exp, scale * max + log(sum).
template <typename T>
LOOM_CPU_CLONES T softmax_row(T* __restrict s, int64_t visible, int64_t keys, T scale) {
  T max = -std::numeric_limits<T>::infinity();
  for (int64_t j = 0; j < visible; ++j) max = s[j] > max ? s[j] : max;
  for (int64_t j = 0; j < visible; ++j) s[j] = cpu::exp_nonpositive(scale * (s[j] - max));
  T sum = 0;
  for (int64_t j = 0; j < visible; ++j) sum += s[j];
  const T inv = T(1) / sum;
  for (int64_t j = 0; j < visible; ++j) s[j] = s[j] * inv;
  for (int64_t j = visible; j < keys; ++j) s[j] = T(0);
  return scale * max + std::log(sum);
}

// Backward's recompute, p_j = exp(scale s_j - lse), and dS = p (dP - D) scale, where
// D = sum_j p_j dP_j = sum_d dO_d O_d (given): both in place, the row's masked tail zeroed.
template <typename T>
LOOM_CPU_CLONES void softmax_grad_row(T* __restrict s, T* __restrict dp, int64_t visible,
                                      int64_t keys, T scale, T lse, T d) {
  for (int64_t j = 0; j < visible; ++j) {
    const T p = cpu::exp_nonpositive(scale * s[j] - lse);
    s[j] = p;
    dp[j] = p * (dp[j] - d) * scale;
  }
  for (int64_t j = visible; j < keys; ++j) s[j] = dp[j] = T(0);
}

// Runs `body(row_index, row_in_chunk)` over a chunk's rows in parallel.
template <typename F>
void for_rows(int64_t rows, const F& body) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) body(r);
  });
}

// [B, Hq, T, D] -> [N, G*T, D] contiguous (a copy only when q is strided, as attention's inputs
// sliced from a fused qkv projection are).
at::Tensor as_rows(const at::Tensor& q, const Geometry& g) {
  return q.reshape({g.n, g.rows, g.dim}).contiguous();
}

struct Saved {
  at::Tensor q, k, v, out, lse;  // [N, R, D], [N, S, D] x2, [N, R, D], [N, R]
};

at::Tensor forward_impl(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                        const Geometry& g, double scale, Saved& saved) {
  RECORD_FUNCTION("loom::attention_gemm", std::vector<c10::IValue>({q_in, k_in, v_in}));
  saved.q = as_rows(q_in, g);
  saved.k = k_in.reshape({g.n, g.keys, g.dim}).contiguous();
  saved.v = v_in.reshape({g.n, g.keys, g.dim}).contiguous();
  saved.out = at::empty({g.n, g.rows, g.dim}, saved.q.options());
  saved.lse = at::empty({g.n, g.rows}, saved.q.options());
  for (int64_t first = 0; first < g.n; first += g.chunk) {
    const int64_t c = std::min(g.chunk, g.n - first);
    auto scores = at::bmm(saved.q.narrow(0, first, c), saved.k.narrow(0, first, c).transpose(1, 2));
    AT_DISPATCH_FLOATING_TYPES(scores.scalar_type(), "loom::attention_gemm", [&] {
      auto* s = scores.mutable_data_ptr<scalar_t>();
      auto* lse = saved.lse.mutable_data_ptr<scalar_t>() + first * g.rows;
      for_rows(c * g.rows, [&](int64_t r) {
        lse[r] = softmax_row<scalar_t>(s + r * g.keys, visible_keys(g, r % g.rows), g.keys,
                                       static_cast<scalar_t>(scale));
      });
    });
    auto out = saved.out.narrow(0, first, c);
    at::bmm_out(out, scores, saved.v.narrow(0, first, c));
  }
  return saved.out.view({q_in.size(0), q_in.size(1), g.queries, g.dim});
}

std::vector<at::Tensor> backward_impl(const at::Tensor& grad_out, const Saved& saved,
                                      const Geometry& g, double scale) {
  RECORD_FUNCTION("loom::attention_gemm_backward", std::vector<c10::IValue>({grad_out}));
  const auto dout = grad_out.reshape({g.n, g.rows, g.dim}).contiguous();
  // D_r = sum_d dO O: the row term of softmax's gradient.
  const auto d_rows = (dout * saved.out).sum(-1);
  auto dq = at::empty_like(saved.q), dk = at::empty_like(saved.k), dv = at::empty_like(saved.v);
  for (int64_t first = 0; first < g.n; first += g.chunk) {
    const int64_t c = std::min(g.chunk, g.n - first);
    const auto q = saved.q.narrow(0, first, c), k = saved.k.narrow(0, first, c);
    const auto v = saved.v.narrow(0, first, c), dout_c = dout.narrow(0, first, c);
    auto probs = at::bmm(q, k.transpose(1, 2));  // scores, then probabilities in place
    auto dscores = at::bmm(dout_c, v.transpose(1, 2));  // dP, then dS in place
    AT_DISPATCH_FLOATING_TYPES(probs.scalar_type(), "loom::attention_gemm_backward", [&] {
      auto* s = probs.mutable_data_ptr<scalar_t>();
      auto* dp = dscores.mutable_data_ptr<scalar_t>();
      const auto* lse = saved.lse.const_data_ptr<scalar_t>() + first * g.rows;
      const auto* d = d_rows.const_data_ptr<scalar_t>() + first * g.rows;
      for_rows(c * g.rows, [&](int64_t r) {
        softmax_grad_row<scalar_t>(s + r * g.keys, dp + r * g.keys, visible_keys(g, r % g.rows),
                                   g.keys, static_cast<scalar_t>(scale), lse[r], d[r]);
      });
    });
    auto dv_c = dv.narrow(0, first, c), dq_c = dq.narrow(0, first, c);
    auto dk_c = dk.narrow(0, first, c);
    at::bmm_out(dv_c, probs.transpose(1, 2), dout_c);
    at::bmm_out(dq_c, dscores, k);
    at::bmm_out(dk_c, dscores.transpose(1, 2), q);
  }
  return {dq, dk, dv};
}

struct CpuAttentionFunction : public torch::autograd::Function<CpuAttentionFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q,
                            const at::Tensor& k, const at::Tensor& v, bool causal, double scale) {
    const auto g = geometry_of(q, k, causal);
    Saved saved;
    auto out = forward_impl(q, k, v, g, scale, saved);
    ctx->save_for_backward({saved.q, saved.k, saved.v, saved.out, saved.lse});
    ctx->saved_data["geometry"] =
        std::vector<int64_t>{g.n, g.rows, g.keys, g.dim, g.queries, g.causal, g.chunk};
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["q_shape"] = q.sizes().vec();
    ctx->saved_data["k_shape"] = k.sizes().vec();
    return out;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    LOOM_CHECK(!at::GradMode::is_enabled(),
               "loom's CPU attention (backend 'gemm') is differentiable once; for a second "
               "derivative use the 'math' backend");
    const auto vars = ctx->get_saved_variables();
    const Saved saved{vars[0], vars[1], vars[2], vars[3], vars[4]};
    const auto q_shape = ctx->saved_data["q_shape"].toIntVector();
    const auto k_shape = ctx->saved_data["k_shape"].toIntVector();
    const auto f = ctx->saved_data["geometry"].toIntVector();
    const Geometry g{f[0], f[1], f[2], f[3], f[4], f[5] != 0, f[6]};
    auto d = backward_impl(grads[0], saved, g, ctx->saved_data["scale"].toDouble());
    return {d[0].view(q_shape), d[1].view(k_shape), d[2].view(k_shape), at::Tensor(),
            at::Tensor()};
  }
};

}  // namespace

bool cpu_attention_supported(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const auto dtype = q.scalar_type();
  return q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() &&
         (dtype == at::kFloat || dtype == at::kDouble) && k.scalar_type() == dtype &&
         v.scalar_type() == dtype;
}

at::Tensor cpu_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         bool causal, double scale) {
  LOOM_CHECK(cpu_attention_supported(q, k, v),
             "attention backend 'gemm' takes fp32 or fp64 CPU tensors of one dtype; got q {} on "
             "{}, k {}, v {}",
             c10::toString(q.scalar_type()), q.device().str(), c10::toString(k.scalar_type()),
             c10::toString(v.scalar_type()));
  LOOM_CHECK(scale > 0, "attention backend 'gemm': scale {} must be > 0", scale);
  return CpuAttentionFunction::apply(q, k, v, causal, scale);
}

}  // namespace loom::ops
