#include "loom/ops/precision.h"

#include <ATen/ATen.h>

namespace loom::ops {

at::ScalarType accumulation_dtype(at::ScalarType t) {
  return at::promote_types(t, at::kFloat);
}

at::Tensor to_accumulation_dtype(const at::Tensor& t) {
  return t.to(accumulation_dtype(t.scalar_type()));
}

at::Tensor squared_norm(const at::Tensor& t) {
  return to_accumulation_dtype(t).pow(2).sum().to(at::kDouble);
}

at::Tensor squared_norms(const std::vector<at::Tensor>& tensors) {
  return squared_norms(tensors, !tensors.empty() && tensors.front().is_cuda());
}

at::Tensor squared_norms(const std::vector<at::Tensor>& tensors, bool multi_tensor) {
  if (tensors.empty()) return at::zeros({0}, at::kDouble);
  std::vector<at::Tensor> out;
  if (multi_tensor) {
    std::vector<at::Tensor> widened;
    for (const auto& t : tensors) widened.push_back(to_accumulation_dtype(t));
    for (const auto& norm : at::_foreach_norm(widened, 2)) out.push_back(norm.to(at::kDouble));
    return at::stack(out).pow(2);
  }
  for (const auto& t : tensors) out.push_back(squared_norm(t));
  return at::stack(out);
}

}  // namespace loom::ops
