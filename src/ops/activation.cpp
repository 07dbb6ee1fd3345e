#include "loom/ops/activation.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/autograd.h>

#include <algorithm>
#include <cstdint>
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
  t = t < -C::exp2_limit ? -C::exp2_limit : t;
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

// gelu(h + b) over rows of `features`: the biased input is written to `pre` (what backward
// reads) and the activation to `y`, in one pass.
template <typename T>
LOOM_CPU_CLONES void bias_gelu_forward_row(const T* __restrict h, const T* __restrict b,
                                           T* __restrict pre, T* __restrict y, int64_t features) {
  for (int64_t j = 0; j < features; ++j) {
    const T x = h[j] + b[j];
    T clamped;
    pre[j] = x;
    y[j] = x * sigmoid_two_u(x, clamped);
  }
}

std::vector<at::Tensor> run_bias_forward(const at::Tensor& h, const at::Tensor& bias) {
  RECORD_FUNCTION("loom::bias_gelu_tanh", std::vector<c10::IValue>({h, bias}));
  auto pre = at::empty_like(h, at::MemoryFormat::Contiguous);
  auto y = at::empty_like(h, at::MemoryFormat::Contiguous);
  const int64_t features = bias.numel(), rows = h.numel() / features;
  AT_DISPATCH_FLOATING_TYPES(h.scalar_type(), "loom::bias_gelu_tanh", [&] {
    const auto* in = h.const_data_ptr<scalar_t>();
    const auto* b = bias.const_data_ptr<scalar_t>();
    auto* p = pre.mutable_data_ptr<scalar_t>();
    auto* o = y.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, rows, std::max<int64_t>(1, kGrain / features), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        bias_gelu_forward_row<scalar_t>(in + r * features, b, p + r * features, o + r * features,
                                        features);
    });
  });
  return {y, pre};
}

struct BiasGeluTanhFunction : public torch::autograd::Function<BiasGeluTanhFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& h,
                            const at::Tensor& bias) {
    auto outputs = run_bias_forward(h, bias);
    ctx->save_for_backward({outputs[1], bias});
    return outputs[0];
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& pre = saved[0];
    if (at::GradMode::is_enabled()) {  // twice differentiable through ATen's formula
      auto g = at::gelu_backward(grads[0], pre, "tanh");
      return {g, g.reshape({-1, saved[1].numel()}).sum(0)};
    }
    // The bias gradient is ATen's column sum, as at::linear's backward takes it: a sum fused
    // into this pass had to split columns among threads to stay independent of their number,
    // and ran at half the speed of the row-split pass plus ATen's sum.
    auto grad_pre = run_backward(grads[0], pre);
    auto grad_bias = grad_pre.reshape({-1, saved[1].numel()}).sum(0);
    return {grad_pre, grad_bias};
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

bool gelu_tanh_uses_loom_kernel(const at::Tensor& x) {
  return cpu::kernels_enabled() && x.device().is_cpu() && x.layout() == at::kStrided &&
         x.is_contiguous() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble);
}

at::Tensor gelu_tanh(const at::Tensor& x) {
  if (!gelu_tanh_uses_loom_kernel(x)) return at::gelu(x, "tanh");
  return GeluTanhFunction::apply(x);
}

at::Tensor bias_gelu_tanh(const at::Tensor& h, const at::Tensor& bias) {
  LOOM_CHECK(bias.dim() == 1 && h.dim() >= 1 && h.size(-1) == bias.size(0),
             "bias_gelu_tanh: bias {} must be 1-D and match the last dimension of the input {}",
             bias.sizes(), h.sizes());
  if (!gelu_tanh_uses_loom_kernel(h) || !bias.is_contiguous() ||
      bias.scalar_type() != h.scalar_type() || bias.device() != h.device())
    return at::gelu(h + bias.to(h.scalar_type()), "tanh");  // bf16 under autocast stays bf16
  return BiasGeluTanhFunction::apply(h, bias);
}

}  // namespace loom::ops
