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

#include <cstdint>

namespace loom::ops {

// gelu(x, tanh approximation), differentiable.
at::Tensor gelu_tanh(const at::Tensor& x);

// gelu(h + bias), differentiable in both (twice, through ATen's formula), for a linear layer's
// output computed without its bias: at::linear fills its output with the bias before the GEMM,
// a full pass this op folds into the activation's. Runs loom's kernels when
// bias_gelu_tanh_applies; otherwise at::gelu(h + bias, "tanh"), bias cast to h's dtype.
// Backward recomputes h + bias from the saved h and bias.
at::Tensor bias_gelu_tanh(const at::Tensor& h, const at::Tensor& bias);

// Whether to split a linear layer's bias off into bias_gelu_tanh, decided before its matmul from
// the layer's input: CPU, fp32 or fp64 (input and bias alike), no autocast, kernels on. Where it
// is false (CUDA, bf16 autocast), at::linear with the bias in the GEMM is the better path.
bool bias_gelu_tanh_applies(const at::Tensor& input, const at::Tensor& bias);

// True when gelu_tanh(x) runs loom's CPU kernels for `x` (else ATen's gelu).
bool gelu_tanh_uses_loom_kernel(const at::Tensor& x);

// The number of distinct threads an at::parallel_for over `work` items runs on when called from
// loom's kernel sources: at::parallel_for is inline OpenMP code, so it is 1 if those sources are
// built without OpenMP (a regression tests/test_cpu_kernels.cpp checks), else the intra-op count.
int cpu_kernel_threads(int64_t work);

}  // namespace loom::ops
