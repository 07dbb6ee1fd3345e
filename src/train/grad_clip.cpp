#include "loom/train/grad_clip.h"

#include <ATen/ATen.h>
#include <torch/torch.h>

#include <cmath>

namespace loom::train {

double clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm) {
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> norms;
  for (const auto& p : params)
    if (p.grad().defined()) norms.push_back(p.grad().to(at::kFloat).norm());
  if (norms.empty()) return 0.0;
  const double total = at::stack(norms).norm().item<double>();
  if (max_norm > 0 && total > max_norm) {
    const double scale = max_norm / (total + 1e-6);
    for (const auto& p : params)
      if (p.grad().defined()) p.grad().mul_(scale);
  }
  return total;
}

}  // namespace loom::train
