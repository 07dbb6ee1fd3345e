#pragma once
// GELU with the tanh approximation (GPT-2's "gelu_new"), as an autograd op:
//   gelu(x) = 0.5 x (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)
//
// On contiguous fp32/fp64 CPU tensors it runs loom's own kernels: the identity
// 0.5 (1 + tanh(u)) = sigmoid(2u) turns the activation into x / (1 + exp(-2u)), and exp is a
// short polynomial in 2^f (f in [-0.5, 0.5]) scaled by the exponent bits, which the compiler
// vectorises for every x86 level (src/ops/cpu_vectorize.h); the backward pass recomputes
// sigmoid(2u) from the saved input in the same single pass. Everything else (CUDA, bf16 under
// autocast; every tensor with LOOM_CPU_KERNELS=0) calls at::gelu(x, "tanh"), which is also what
// the tests hold the kernels to, through an fp64 run (tests/test_cpu_kernels.cpp states the
// bound).
#include <ATen/core/Tensor.h>

namespace loom::ops {

// gelu(x, tanh approximation), differentiable.
at::Tensor gelu_tanh(const at::Tensor& x);

// True when gelu_tanh(x) runs loom's CPU kernels for `x` (else ATen's gelu).
bool gelu_tanh_uses_loom_kernel(const at::Tensor& x);

}  // namespace loom::ops
