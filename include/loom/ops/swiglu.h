#pragma once
// SwiGLU, the activation of Llama's MLP, as one op: out = silu(gate) * up, with
// silu(g) = g / (1 + exp(-g)). loom's fused kernels (kernels/activation/swiglu.h) on CUDA read
// gate and up once and write out once forward, and read gate, up and the output's gradient once
// and write both gradients once backward (PyTorch's silu, product and their backwards are six
// kernels over full tensors); on the CPU the fused op runs their host reference; the math path is
// at::silu(gate) * up.
#include <ATen/core/Tensor.h>

#include <string>

#include "loom/ops/fused_choice.h"

namespace loom::ops {

// Which implementation computes the models' gated activations (fused_choice.h): --swiglu.
using ActivationBackend = FusedChoice;
// parse_fused_choice(name, "activation backend").
ActivationBackend parse_activation_backend(const std::string& name);

// Whether `backend` computes silu(gate) * up with the fused algorithm. kAuto: CUDA tensors the
// kernels take (gate and up of one shape and one dtype: fp32, fp16 or bf16). kFused on inputs it
// cannot take (mixed dtypes or shapes, fp64 on CUDA, a device other than CPU and CUDA) is a
// loom::Error naming them.
bool uses_fused_swiglu(ActivationBackend backend, const at::Tensor& gate, const at::Tensor& up);

// The fused op with autograd through gate and up: the kernels on CUDA, the host reference on the
// CPU (fp64 included), whatever a backend says (choosing is the caller's: swiglu).
at::Tensor fused_swiglu(const at::Tensor& gate, const at::Tensor& up);

// at::silu(gate) * up, as the unfused models compute it.
at::Tensor math_swiglu(const at::Tensor& gate, const at::Tensor& up);

// fused_swiglu or math_swiglu, as `backend` and the inputs decide (uses_fused_swiglu).
at::Tensor swiglu(ActivationBackend backend, const at::Tensor& gate, const at::Tensor& up);

}  // namespace loom::ops
