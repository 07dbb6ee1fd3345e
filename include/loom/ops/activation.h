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

// gelu(h + bias), differentiable in both: the bias add and the activation in one pass (so a
// linear layer's output is not first filled with its bias, as at::linear does), the saved sum
// h + bias read by backward's single pass, where the kernels apply (h as for gelu_tanh, bias
// 1-D of h's last size, same dtype); else at::gelu(h + bias, "tanh"), with the bias cast to h's
// dtype (bf16 under autocast stays bf16, as at::linear's bias would). For a linear layer
// followed by GELU: the matmul without its bias, then this.
at::Tensor bias_gelu_tanh(const at::Tensor& h, const at::Tensor& bias);

// True when gelu_tanh(x) runs loom's CPU kernels for `x` (else ATen's gelu).
bool gelu_tanh_uses_loom_kernel(const at::Tensor& x);

}  // namespace loom::ops
