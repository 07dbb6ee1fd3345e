#include "loom/ops/adamw.h"

#include <ATen/ATen.h>

#include <cmath>

#include "loom/core/error.h"

namespace loom::ops {

void check_adamw_options(const AdamWOptions& options) {
  LOOM_CHECK(options.beta1 >= 0 && options.beta1 < 1, "AdamW: beta1 = {} must be in [0, 1)",
             options.beta1);
  LOOM_CHECK(options.beta2 >= 0 && options.beta2 < 1, "AdamW: beta2 = {} must be in [0, 1)",
             options.beta2);
  LOOM_CHECK(options.eps > 0, "AdamW: eps = {} must be > 0", options.eps);
  LOOM_CHECK(options.weight_decay >= 0, "AdamW: weight_decay = {} must be >= 0",
             options.weight_decay);
}

void adamw_decay_(const at::Tensor& weight, double lr, const AdamWOptions& options) {
  if (options.weight_decay > 0) weight.mul_(1.0 - lr * options.weight_decay);
}

void adamw_update_(const at::Tensor& weight, const at::Tensor& grad, const at::Tensor& exp_avg,
                   const at::Tensor& exp_avg_sq, double lr, int64_t step,
                   const AdamWOptions& options) {
  const double b1 = options.beta1, b2 = options.beta2;
  const double bias1 = 1.0 - std::pow(b1, static_cast<double>(step));
  const double bias2 = 1.0 - std::pow(b2, static_cast<double>(step));
  exp_avg.lerp_(grad, 1.0 - b1);
  exp_avg_sq.mul_(b2).addcmul_(grad, grad, 1.0 - b2);
  auto denom = (exp_avg_sq / bias2).sqrt_().add_(options.eps);
  weight.addcdiv_(exp_avg, denom, -lr / bias1);
}

}  // namespace loom::ops
