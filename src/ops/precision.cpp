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

}  // namespace loom::ops
