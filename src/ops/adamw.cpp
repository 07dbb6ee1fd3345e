#include "loom/ops/adamw.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <cmath>
#include <optional>

#include "cpu_vectorize.h"
#include "loom/core/error.h"
#include "loom/core/format.h"

namespace loom::ops {

namespace {

// The update of adamw_update_ (the header's formulas, in that order) as one pass over the four
// buffers: each element's moments and weight are read once and written once. kFrozen: the
// second moment is read, not updated (AdamWOptions::freeze_variance_after).
template <typename T, bool kFrozen>
LOOM_CPU_CLONES void adamw_kernel(T* __restrict weight, const T* __restrict grad,
                                  T* __restrict exp_avg, T* __restrict exp_avg_sq, int64_t n,
                                  T decay, T one_minus_beta1, T beta2, T one_minus_beta2,
                                  T inv_sqrt_bias2, T eps, T step_size, T grad_scale) {
  for (int64_t i = 0; i < n; ++i) {
    const T w = weight[i] * decay;     // exactly weight[i] when decay == 1
    const T g = grad[i] * grad_scale;  // exactly grad[i] when grad_scale == 1
    const T m = exp_avg[i] + one_minus_beta1 * (g - exp_avg[i]);
    const T v = kFrozen ? exp_avg_sq[i] : beta2 * exp_avg_sq[i] + one_minus_beta2 * (g * g);
    exp_avg[i] = m;
    if constexpr (!kFrozen) exp_avg_sq[i] = v;
    // sqrt(v) / sqrt(bias2) as a product: one division per element, not two.
    weight[i] = w + step_size * (m / (std::sqrt(v) * inv_sqrt_bias2 + eps));
  }
}

bool fused_adamw_applies(const std::vector<const at::Tensor*>& tensors) {
  if (!cpu::kernels_enabled()) return false;
  const auto dtype = tensors.front()->scalar_type();
  if (dtype != at::kFloat && dtype != at::kDouble) return false;
  for (const auto* t : tensors)
    if (!t->device().is_cpu() || t->scalar_type() != dtype || !t->is_contiguous() ||
        t->numel() != tensors.front()->numel())
      return false;
  return true;
}

}  // namespace

void check_adamw_options(const AdamWOptions& options) {
  LOOM_CHECK(options.beta1 >= 0 && options.beta1 < 1, "AdamW: beta1 = {} must be in [0, 1)",
             options.beta1);
  LOOM_CHECK(options.beta2 >= 0 && options.beta2 < 1, "AdamW: beta2 = {} must be in [0, 1)",
             options.beta2);
  LOOM_CHECK(options.eps > 0, "AdamW: eps = {} must be > 0", options.eps);
  LOOM_CHECK(options.weight_decay >= 0, "AdamW: weight_decay = {} must be >= 0",
             options.weight_decay);
  LOOM_CHECK(options.freeze_variance_after >= 0,
             "AdamW: freeze_variance_after = {} must be >= 0 (0: the variance is never frozen)",
             options.freeze_variance_after);
}

void adamw_decay_(const at::Tensor& weight, double lr, const AdamWOptions& options) {
  if (options.weight_decay > 0) weight.mul_(1.0 - lr * options.weight_decay);
}

namespace {

// adamw_update_ with the gradient multiplied by `grad_scale` (a 0-dim tensor, or undefined: 1)
// rounded to its dtype, as a _foreach_mul_ before the update would.
void update_one_(const at::Tensor& weight, const at::Tensor& grad, const at::Tensor& exp_avg,
                 const at::Tensor& exp_avg_sq, double lr, int64_t step, const AdamWOptions& options,
                 bool decay, const at::Tensor& grad_scale) {
  const double b1 = options.beta1, b2 = options.beta2;
  const int64_t freeze = options.freeze_variance_after;
  const bool frozen = freeze > 0 && step > freeze;
  const double bias1 = 1.0 - std::pow(b1, static_cast<double>(step));
  const double bias2 = 1.0 - std::pow(b2, static_cast<double>(frozen ? freeze : step));
  if (fused_adamw_applies({&weight, &grad, &exp_avg, &exp_avg_sq})) {
    RECORD_FUNCTION("loom::adamw_update_", std::vector<c10::IValue>({weight}));
    AT_DISPATCH_FLOATING_TYPES(weight.scalar_type(), "loom::adamw_update_", [&] {
      using T = scalar_t;
      // The factor adamw_decay_ multiplies by, rounded to T as ATen's mul_ rounds its scalar.
      const T decay_factor =
          decay && options.weight_decay > 0 ? T(1.0 - lr * options.weight_decay) : T(1);
      const T scale = grad_scale.defined() ? grad_scale.to(weight.scalar_type()).item<T>() : T(1);
      auto* w = weight.mutable_data_ptr<T>();
      const auto* g = grad.const_data_ptr<T>();
      auto* m = exp_avg.mutable_data_ptr<T>();
      auto* v = exp_avg_sq.mutable_data_ptr<T>();
      at::parallel_for(0, weight.numel(), 16384, [&](int64_t begin, int64_t end) {
        auto* kernel = frozen ? adamw_kernel<T, true> : adamw_kernel<T, false>;
        kernel(w + begin, g + begin, m + begin, v + begin, end - begin, decay_factor, T(1.0 - b1),
               T(b2), T(1.0 - b2), T(1.0 / std::sqrt(bias2)), T(options.eps), T(-lr / bias1),
               scale);
      });
    });
    // Written through raw pointers: bump the versions as ATen's in-place ops would, so that a
    // graph still holding one of these tensors fails loudly instead of reading new values.
    for (const auto* t : {&weight, &exp_avg, &exp_avg_sq}) t->unsafeGetTensorImpl()->bump_version();
    return;
  }
  // Elsewhere (CUDA) the same formulas as ATen ops.
  if (grad_scale.defined()) grad.mul_(grad_scale.to(grad.device(), grad.scalar_type()));
  if (decay) adamw_decay_(weight, lr, options);
  exp_avg.lerp_(grad, 1.0 - b1);
  if (!frozen) exp_avg_sq.mul_(b2).addcmul_(grad, grad, 1.0 - b2);
  auto denom = (exp_avg_sq / bias2).sqrt_().add_(options.eps);
  weight.addcdiv_(exp_avg, denom, -lr / bias1);
}

}  // namespace

void adamw_update_(const at::Tensor& weight, const at::Tensor& grad, const at::Tensor& exp_avg,
                   const at::Tensor& exp_avg_sq, double lr, int64_t step,
                   const AdamWOptions& options, bool decay) {
  update_one_(weight, grad, exp_avg, exp_avg_sq, lr, step, options, decay, at::Tensor());
}

AdamWBackend parse_adamw_backend(const std::string& name) {
  return parse_fused_choice(name, "AdamW backend");
}

void adamw_update_(const AdamWTensors& tensors, double lr, int64_t step,
                   const AdamWOptions& options) {
  const size_t n = tensors.weights.size();
  LOOM_CHECK(tensors.grads.size() == n && tensors.exp_avgs.size() == n &&
                 tensors.exp_avg_sqs.size() == n && tensors.decay.size() == n,
             "adamw_update_: {} weights but {} gradients, {} first moments, {} second moments and "
             "{} decay flags",
             n, tensors.grads.size(), tensors.exp_avgs.size(), tensors.exp_avg_sqs.size(),
             tensors.decay.size());
  const auto backend = tensors.backend;
  const int64_t freeze = options.freeze_variance_after;
  LOOM_CHECK(backend != AdamWBackend::kFused || freeze == 0,
             "--adamw fused: PyTorch's fused AdamW cannot hold the second moment frozen "
             "(freeze_variance_after = {}, which a communication hook sets); use --adamw auto or "
             "math",
             freeze);
  const bool frozen = freeze > 0 && step > freeze;
  // The lists of one device and dtype, updated together.
  struct Group {
    std::vector<at::Tensor> weights, grads, exp_avgs, exp_avg_sqs;
    std::vector<bool> decay;
    bool all_contiguous = true;
  };
  std::vector<std::pair<std::pair<at::Device, at::ScalarType>, Group>> groups;
  for (size_t i = 0; i < n; ++i) {
    const auto& w = tensors.weights[i];
    const auto& grad = tensors.grads[i];
    if (backend != AdamWBackend::kFused &&
        fused_adamw_applies({&w, &grad, &tensors.exp_avgs[i], &tensors.exp_avg_sqs[i]})) {
      update_one_(w, grad, tensors.exp_avgs[i], tensors.exp_avg_sqs[i], lr, step, options,
                  tensors.decay[i], tensors.grad_scale);
      continue;
    }
    const std::pair<at::Device, at::ScalarType> key{w.device(), w.scalar_type()};
    auto it =
        std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == key; });
    if (it == groups.end()) it = groups.insert(groups.end(), {key, Group{}});
    auto& g = it->second;
    for (const auto* t : {&w, &grad, &tensors.exp_avgs[i], &tensors.exp_avg_sqs[i]}) {
      LOOM_CHECK(t->device() == w.device() && t->scalar_type() == w.scalar_type() &&
                     t->sizes() == w.sizes(),
                 "adamw_update_: tensor {} mixes devices, dtypes or shapes (weight {} {} {}; "
                 "gradient or moment {} {} {})",
                 i, w.device().str(), c10::toString(w.scalar_type()), w.sizes(), t->device().str(),
                 c10::toString(t->scalar_type()), t->sizes());
      g.all_contiguous = g.all_contiguous && t->is_contiguous();
    }
    g.weights.push_back(w);
    g.grads.push_back(grad);
    g.exp_avgs.push_back(tensors.exp_avgs[i]);
    g.exp_avg_sqs.push_back(tensors.exp_avg_sqs[i]);
    g.decay.push_back(tensors.decay[i]);
  }
  if (groups.empty()) return;
  const double b1 = options.beta1, b2 = options.beta2;
  const double bias1 = 1.0 - std::pow(b1, static_cast<double>(step));
  const double bias2 = 1.0 - std::pow(b2, static_cast<double>(frozen ? freeze : step));
  for (auto& [key, g] : groups) {
    const auto& device = key.first;
    const bool torch_fused =
        backend == AdamWBackend::kFused ||
        (backend == AdamWBackend::kAuto && device.is_cuda() && !frozen && g.all_contiguous);
    if (torch_fused) {
      RECORD_FUNCTION("loom::adamw_update_(torch fused)", std::vector<c10::IValue>());
      LOOM_CHECK(g.all_contiguous,
                 "--adamw fused: PyTorch's fused AdamW needs contiguous weights, gradients and "
                 "moments; a {} tensor on {} is strided (use --adamw auto or math)",
                 c10::toString(key.second), device.str());
      // The kernel reads the step count (fp32) per tensor and divides the gradients by
      // grad_scale (fp32): one step tensor serves the whole list, and the factor goes in as its
      // reciprocal. fp64 lists (a correctness run) are multiplied by the factor in fp64 first:
      // its fp32 reciprocal would move them by 2^-24.
      const auto fp32 = at::TensorOptions(at::kFloat).device(device);
      const auto step_count = at::full({}, static_cast<double>(step), fp32);
      std::optional<at::Tensor> divisor;
      if (tensors.grad_scale.defined() && key.second == at::kDouble)
        at::_foreach_mul_(g.grads, tensors.grad_scale.to(device, at::kDouble));
      else if (tensors.grad_scale.defined())
        divisor = at::reciprocal(tensors.grad_scale.to(device, at::kFloat));
      for (const bool decayed : {true, false}) {
        std::vector<at::Tensor> w, gr, m, v, steps;
        for (size_t i = 0; i < g.weights.size(); ++i) {
          if (g.decay[i] != decayed) continue;
          w.push_back(g.weights[i]);
          gr.push_back(g.grads[i]);
          m.push_back(g.exp_avgs[i]);
          v.push_back(g.exp_avg_sqs[i]);
          steps.push_back(step_count);
        }
        if (w.empty()) continue;
        at::_fused_adamw_(w, gr, m, v, {}, steps, lr, b1, b2, decayed ? options.weight_decay : 0.0,
                          options.eps, /*amsgrad=*/false, /*maximize=*/false, divisor,
                          std::nullopt);
      }
      continue;
    }
    // adamw_update_'s ATen path, one op over each list.
    if (tensors.grad_scale.defined())
      at::_foreach_mul_(g.grads, tensors.grad_scale.to(device, key.second));
    std::vector<at::Tensor> decayed;
    for (size_t i = 0; i < g.weights.size(); ++i)
      if (g.decay[i]) decayed.push_back(g.weights[i]);
    if (options.weight_decay > 0 && !decayed.empty())
      at::_foreach_mul_(decayed, 1.0 - lr * options.weight_decay);
    at::_foreach_lerp_(g.exp_avgs, g.grads, 1.0 - b1);
    if (!frozen) {
      at::_foreach_mul_(g.exp_avg_sqs, b2);
      at::_foreach_addcmul_(g.exp_avg_sqs, g.grads, g.grads, 1.0 - b2);
    }
    auto denom = at::_foreach_div(g.exp_avg_sqs, bias2);
    at::_foreach_sqrt_(denom);
    at::_foreach_add_(denom, options.eps);
    at::_foreach_addcdiv_(g.weights, g.exp_avgs, denom, -lr / bias1);
  }
}

}  // namespace loom::ops
