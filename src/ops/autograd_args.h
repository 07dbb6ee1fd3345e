#pragma once
// An optional tensor that takes no gradient (a document mask's first keys), as an argument of a
// torch::autograd::Function: not a tensor argument — apply() cannot take an undefined tensor,
// and a defined one would ask for a gradient slot — and kept in the context's saved data for
// backward. Internal to src/ops.
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

namespace loom::ops::detail {

struct NoGradTensor {
  at::Tensor value;  // undefined: none
  c10::IValue to_ivalue() const { return value.defined() ? c10::IValue(value) : c10::IValue(); }
  static at::Tensor from(const c10::IValue& saved) {
    return saved.isTensor() ? saved.toTensor() : at::Tensor();
  }
};

}  // namespace loom::ops::detail
