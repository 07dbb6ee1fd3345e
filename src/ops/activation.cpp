#include "loom/ops/activation.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <ATen/record_function.h>
#include <torch/autograd.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "cpu_math.h"
#include "loom/core/error.h"
#include "loom/core/format.h"

namespace loom::ops {

namespace {

// Elements per parallel_for chunk: large enough that a thread's start-up is noise.
constexpr int64_t kGrain = 32768;

template <typename T>
struct GeluConstants {
  static constexpr T k0 = static_cast<T>(0.79788456080286535588);  // sqrt(2 / pi)
  static constexpr T k1 = static_cast<T>(0.044715);
  static constexpr T minus_two_log2e = static_cast<T>(-2.88539008177792681472);
  // Beyond |x| = 30 the activation is x or 0 to every digit: clamping the cubic there keeps x^3
  // finite (the output still multiplies x itself, so NaN passes through).
  static constexpr T x_limit = 30;
  // 2^t stays a normal number of T's exponent range.
  static constexpr T exp2_limit = sizeof(T) == 4 ? 126 : 1022;
};

// sigmoid(2u) and x clamped, the shared start of the forward and backward passes.
template <typename T>
inline T sigmoid_two_u(T x, T& clamped) {
  using C = GeluConstants<T>;
  clamped = x < -C::x_limit ? -C::x_limit : (x > C::x_limit ? C::x_limit : x);
  const T u = C::k0 * (clamped + C::k1 * clamped * clamped * clamped);
  T t = C::minus_two_log2e * u;  // exp(-2u) = 2^t
  // Past the exponent range sigmoid(2u) is below 2^-126 (fp32): 0, not the clamped 2^-126, so
  // that gelu and its derivative there are 0 rather than x times the floor.
  if (t >= C::exp2_limit) return T(0);
  t = t > -C::exp2_limit ? t : -C::exp2_limit;  // NaN -> the limit: defined bits (x carries NaN)
  return T(1) / (T(1) + cpu::exp2_bounded(t));
}

template <typename T>
LOOM_CPU_CLONES void gelu_forward_kernel(const T* __restrict x, T* __restrict y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    T clamped;
    y[i] = x[i] * sigmoid_two_u(x[i], clamped);
  }
}

// d/dx [x s(x)] with s = sigmoid(2u): s + x * 2u'(x) * s (1 - s), u' = k0 (1 + 3 k1 x^2).
template <typename T>
LOOM_CPU_CLONES void gelu_backward_kernel(const T* __restrict grad, const T* __restrict x,
                                          T* __restrict out, int64_t n) {
  using C = GeluConstants<T>;
  for (int64_t i = 0; i < n; ++i) {
    T c;
    const T s = sigmoid_two_u(x[i], c);
    const T du = T(2) * C::k0 * (T(1) + T(3) * C::k1 * c * c);
    out[i] = grad[i] * (s + c * du * s * (T(1) - s));
  }
}

at::Tensor run_forward(const at::Tensor& x) {
  RECORD_FUNCTION("loom::gelu_tanh", std::vector<c10::IValue>({x}));
  auto y = at::empty_like(x, at::MemoryFormat::Contiguous);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "loom::gelu_tanh", [&] {
    const auto* in = x.const_data_ptr<scalar_t>();
    auto* out = y.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, x.numel(), kGrain, [&](int64_t begin, int64_t end) {
      gelu_forward_kernel<scalar_t>(in + begin, out + begin, end - begin);
    });
  });
  return y;
}

at::Tensor run_backward(const at::Tensor& grad_in, const at::Tensor& x) {
  RECORD_FUNCTION("loom::gelu_tanh_backward", std::vector<c10::IValue>({grad_in, x}));
  const auto grad = grad_in.contiguous();
  auto out = at::empty_like(x, at::MemoryFormat::Contiguous);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "loom::gelu_tanh_backward", [&] {
    const auto* g = grad.const_data_ptr<scalar_t>();
    const auto* in = x.const_data_ptr<scalar_t>();
    auto* o = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, x.numel(), kGrain, [&](int64_t begin, int64_t end) {
      gelu_backward_kernel<scalar_t>(g + begin, in + begin, o + begin, end - begin);
    });
  });
  return out;
}

// gelu(h + b) over a row of `features`, in one pass.
template <typename T>
LOOM_CPU_CLONES void bias_gelu_forward_row(const T* __restrict h, const T* __restrict b,
                                           T* __restrict y, int64_t features) {
  for (int64_t j = 0; j < features; ++j) {
    const T x = h[j] + b[j];
    T clamped;
    y[j] = x * sigmoid_two_u(x, clamped);
  }
}

// Its gradient with respect to h (= with respect to h + b), h + b recomputed on the way.
template <typename T>
LOOM_CPU_CLONES void bias_gelu_backward_row(const T* __restrict grad, const T* __restrict h,
                                            const T* __restrict b, T* __restrict out,
                                            int64_t features) {
  using C = GeluConstants<T>;
  for (int64_t j = 0; j < features; ++j) {
    T c;
    const T s = sigmoid_two_u(h[j] + b[j], c);
    const T du = T(2) * C::k0 * (T(1) + T(3) * C::k1 * c * c);
    out[j] = grad[j] * (s + c * du * s * (T(1) - s));
  }
}

// Runs `row(r)` for every row of an [rows, features] problem on the intra-op threads.
template <typename F>
void for_each_row(int64_t rows, int64_t features, const F& row) {
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrain / features), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) row(r);
  });
}

at::Tensor run_bias_forward(const at::Tensor& h, const at::Tensor& bias) {
  RECORD_FUNCTION("loom::bias_gelu_tanh", std::vector<c10::IValue>({h, bias}));
  auto y = at::empty_like(h, at::MemoryFormat::Contiguous);
  const int64_t features = bias.numel(), rows = h.numel() / features;
  AT_DISPATCH_FLOATING_TYPES(h.scalar_type(), "loom::bias_gelu_tanh", [&] {
    const auto* in = h.const_data_ptr<scalar_t>();
    const auto* b = bias.const_data_ptr<scalar_t>();
    auto* out = y.mutable_data_ptr<scalar_t>();
    for_each_row(rows, features, [&](int64_t r) {
      bias_gelu_forward_row<scalar_t>(in + r * features, b, out + r * features, features);
    });
  });
  return y;
}

at::Tensor run_bias_backward(const at::Tensor& grad_in, const at::Tensor& h,
                             const at::Tensor& bias) {
  RECORD_FUNCTION("loom::bias_gelu_tanh_backward", std::vector<c10::IValue>({grad_in, h}));
  const auto grad = grad_in.contiguous();
  auto out = at::empty_like(h, at::MemoryFormat::Contiguous);
  const int64_t features = bias.numel(), rows = h.numel() / features;
  AT_DISPATCH_FLOATING_TYPES(h.scalar_type(), "loom::bias_gelu_tanh_backward", [&] {
    const auto* g = grad.const_data_ptr<scalar_t>();
    const auto* in = h.const_data_ptr<scalar_t>();
    const auto* b = bias.const_data_ptr<scalar_t>();
    auto* o = out.mutable_data_ptr<scalar_t>();
    for_each_row(rows, features, [&](int64_t r) {
      const int64_t at = r * features;
      bias_gelu_backward_row<scalar_t>(g + at, in + at, b, o + at, features);
    });
  });
  return out;
}

// Saves h and the bias (not h + b): the forward pass writes only the activation, and a second
// derivative can go through h + b as ATen ops.
struct BiasGeluTanhFunction : public torch::autograd::Function<BiasGeluTanhFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& h,
                            const at::Tensor& bias) {
    ctx->save_for_backward({h, bias});
    return run_bias_forward(h, bias);
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& h = saved[0];
    const auto& bias = saved[1];
    // The bias gradient is ATen's column sum, as at::linear's backward takes it (a sum fused
    // into this pass had to split columns among threads to stay independent of their number,
    // and ran at half the speed of the row-split pass plus ATen's sum).
    auto grad_h = at::GradMode::is_enabled()
                      ? at::gelu_backward(grads[0], h + bias, "tanh")  // twice differentiable
                      : run_bias_backward(grads[0], h, bias);
    auto grad_bias = grad_h.reshape({-1, bias.numel()}).sum(0);
    return {grad_h, grad_bias};
  }
};

struct GeluTanhFunction : public torch::autograd::Function<GeluTanhFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x) {
    ctx->save_for_backward({x});
    return run_forward(x);
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto x = ctx->get_saved_variables()[0];
    // Twice differentiable through ATen's formula (double backward is rare and not hot).
    if (at::GradMode::is_enabled()) return {at::gelu_backward(grads[0], x, "tanh")};
    return {run_backward(grads[0], x)};
  }
};

}  // namespace

int cpu_kernel_threads(int64_t work) {
  std::mutex mutex;
  std::set<std::thread::id> seen;
  at::parallel_for(0, work, 1, [&](int64_t, int64_t) {
    std::lock_guard<std::mutex> lock(mutex);
    seen.insert(std::this_thread::get_id());
  });
  return static_cast<int>(seen.size());
}

bool gelu_tanh_uses_loom_kernel(const at::Tensor& x) {
  return cpu::kernels_enabled() && x.device().is_cpu() && x.layout() == at::kStrided &&
         x.is_contiguous() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble);
}

at::Tensor gelu_tanh(const at::Tensor& x) {
  if (!gelu_tanh_uses_loom_kernel(x)) return at::gelu(x, "tanh");
  return GeluTanhFunction::apply(x);
}

bool bias_gelu_tanh_applies(const at::Tensor& input, const at::Tensor& bias) {
  return cpu::kernels_enabled() && input.device().is_cpu() && bias.device().is_cpu() &&
         !at::autocast::is_autocast_enabled(at::kCPU) && bias.dim() == 1 && bias.numel() > 0 &&
         bias.is_contiguous() &&
         (input.scalar_type() == at::kFloat || input.scalar_type() == at::kDouble) &&
         bias.scalar_type() == input.scalar_type();
}

at::Tensor bias_gelu_tanh(const at::Tensor& h, const at::Tensor& bias) {
  LOOM_CHECK(bias.dim() == 1 && h.dim() >= 1 && h.size(-1) == bias.size(0),
             "bias_gelu_tanh: bias {} must be 1-D and match the last dimension of the input {}",
             bias.sizes(), h.sizes());
  if (!bias_gelu_tanh_applies(h, bias) || !gelu_tanh_uses_loom_kernel(h) || h.numel() == 0)
    return at::gelu(h + bias.to(h.scalar_type()), "tanh");
  return BiasGeluTanhFunction::apply(h, bias);
}

}  // namespace loom::ops
