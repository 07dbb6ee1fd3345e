#pragma once
// The residual add and the norm after it as one op: the fused kernels (kernels/norm/add_norm.h)
// on CUDA, their host reference on the CPU, or the same math as ATen operations. Forward reads
// the residual stream and the branch once and writes their sum and the normed activation, the
// latter already in the dtype the next matrix product reads (bf16 under autocast: no cast
// follows); backward gives the residual's gradient (the sum's gradient plus the norm's) and the
// branch's in one pass, and the norm's weight and bias gradients from per-slice partial sums.
#include <ATen/core/Tensor.h>

#include <string>

#include "loom/ops/fused_choice.h"

namespace loom::ops {

enum class NormKind { kLayerNorm, kRmsNorm };

// Which implementation computes the models' norms (fused_choice.h).
using NormBackend = FusedChoice;
// parse_fused_choice(name, "norm backend").
NormBackend parse_norm_backend(const std::string& name);

// A norm's parameters: LayerNorm (weight and bias, bias optional) or RMSNorm (weight only).
struct NormParams {
  NormKind kind = NormKind::kLayerNorm;
  at::Tensor weight;  // [width]
  at::Tensor bias;    // [width] or undefined
  double eps = 1e-5;
};

struct AddNormResult {
  at::Tensor sum;     // residual + branch (the residual itself when there is no branch)
  at::Tensor normed;  // norm(sum) * weight (+ bias)
};

// The dtype the fused op writes the normed activation in: the branch's when there is one, else
// autocast's lower dtype when autocast is on for the residual's device type and the residual is
// fp32, else the residual's.
at::ScalarType normed_dtype(const at::Tensor& residual, const at::Tensor& branch);

// Whether `backend` computes this add + norm with the fused algorithm. kAuto: CUDA tensors the
// kernels take (fp32 residual and parameters; fp32, fp16 or bf16 branch). kFused on inputs it
// cannot take (a 16-bit residual, parameters of another dtype, a device other than CPU and CUDA)
// is a loom::Error naming them.
bool uses_fused_norm(NormBackend backend, const at::Tensor& residual, const at::Tensor& branch,
                     const NormParams& params);

// The fused op, with autograd through residual, branch, weight and bias. residual [..., width]
// in fp32 (fp64 on the CPU), branch of its shape or undefined (no add: sum is the residual),
// parameters in the residual's dtype. Runs the kernels on CUDA and the host reference on the CPU
// whatever the backend says (choosing is the caller's: add_norm).
AddNormResult fused_add_norm(const at::Tensor& residual, const at::Tensor& branch,
                             const NormParams& params);

// The same as ATen operations, as the unfused models compute it: the add in the promoted dtype,
// LayerNorm through at::layer_norm, RMSNorm as weight * (x * rsqrt(mean(x^2) + eps)) in the
// accumulation dtype.
AddNormResult math_add_norm(const at::Tensor& residual, const at::Tensor& branch,
                            const NormParams& params);

// fused_add_norm or math_add_norm, as `backend` and the inputs decide (uses_fused_norm).
AddNormResult add_norm(NormBackend backend, const at::Tensor& residual, const at::Tensor& branch,
                       const NormParams& params);

}  // namespace loom::ops
