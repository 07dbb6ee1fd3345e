#pragma once
// The AdamW update as one op on fp32 (or fp64) tensors, shared by the replicated optimizer
// (train/) and the ZeRO-sharded one (parallel/zero/): both must apply the same arithmetic, element
// by element, so that a sharded run trains the same model as one process. On contiguous CPU
// tensors adamw_update_ is one vectorised, multi-threaded pass over the four buffers (each value
// read and written once; src/ops/cpu_vectorize.h); elsewhere (CUDA) the same formulas run as
// ATen ops (on the CPU too with LOOM_CPU_KERNELS=0).
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "loom/ops/fused_choice.h"

namespace loom::ops {

struct AdamWOptions {
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
  // From step freeze_variance_after + 1 on, exp_avg_sq stops changing and its bias correction
  // stays at step freeze_variance_after's (0: never frozen). 1-bit Adam's observation (Tang et
  // al. 2021): after a warm-up the second moment barely moves, and holding it fixed makes the
  // update linear in the gradients, so a compressed gradient whose error is fed back later moves
  // the weights by what the true gradients would (docs/compression.md).
  int64_t freeze_variance_after = 0;
};

// Throws loom::Error naming the first hyperparameter out of range.
void check_adamw_options(const AdamWOptions& options);

// Decoupled weight decay on `weight` (fp32 or fp64, in place): weight *= 1 - lr * weight_decay.
void adamw_decay_(const at::Tensor& weight, double lr, const AdamWOptions& options);

// The moment updates and the step for optimizer step number `step` (1-based), all of one dtype
// (fp32, or fp64 for --precision fp64) and in place. With `decay`, adamw_decay_ is applied first
// in the same pass (the same product, rounded the same way: identical to calling adamw_decay_
// before, which is what a caller does when only some elements decay, as ZeRO's flat shards):
//   exp_avg    = lerp(exp_avg, grad, 1 - beta1)
//   exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad^2       (step <= F, or F = 0)
//   weight    -= lr / (1 - beta1^step) * exp_avg / (sqrt(exp_avg_sq / (1 - beta2^s)) + eps)
// where F = options.freeze_variance_after and s = step, or F once step > F > 0 (exp_avg_sq is
// then left as it is).
void adamw_update_(const at::Tensor& weight, const at::Tensor& grad, const at::Tensor& exp_avg,
                   const at::Tensor& exp_avg_sq, double lr, int64_t step,
                   const AdamWOptions& options, bool decay = false);

// Which implementation a list update (below) runs; --adamw takes these names:
//   kAuto   on CUDA, PyTorch's fused multi-tensor kernel (at::_fused_adamw_: one pass over each
//           list with the gradient factor inside) where it applies, else the multi-tensor ATen
//           ops; on the CPU, loom's vectorised pass (contiguous fp32/fp64 tensors) or the ATen
//           ops;
//   kFused  PyTorch's fused kernel on every device (on the CPU its own CPU kernel; what tests
//           compare against the math path);
//   kMath   the header's formulas as ATen ops (`_foreach_` per device and dtype; on the CPU,
//           contiguous tensors through loom's pass, equal to those ops bit for bit).
// The fused kernel cannot hold the second moment frozen (freeze_variance_after): kAuto then
// takes the math path, and kFused is refused with a loom::Error.
using AdamWBackend = FusedChoice;
AdamWBackend parse_adamw_backend(const std::string& name);

// One AdamW step on many tensors at once (a replicated optimizer's parameter list), each as
// adamw_update_ above with its own `decay[i]`. Those the fused CPU pass takes go through it one by
// one; the others (CUDA tensors, strided ones) are updated together per device and dtype, by
// PyTorch's fused kernel or by ATen's multi-tensor (`_foreach_`) ops with the same formulas as
// adamw_update_'s ATen path (about ten launches for the whole list instead of eight per tensor;
// GPT-2 124M spent 25 ms of an 83 ms step in the per-tensor form on an H200, 148 tensors:
// docs/benchmarks-gpu.md).
// `grad_scale` (a 0-dim tensor on the lists' device, or undefined for 1) multiplies every
// gradient inside the update: the gradient clip's factor, applied without a pass of its own.
// What the gradients hold afterwards is unspecified (the fused kernel writes the scaled values
// back); they are not to be read again before they are zeroed.
// On the CPU loom's pass and the math path equal adamw_update_ (with the gradient multiplied by
// grad_scale, rounded to the gradients' dtype, first) bit for bit; PyTorch's fused kernel orders
// the same arithmetic differently (the first moment as b1 m + (1 - b1) g, not a lerp; the decay
// as w - lr wd w; the factor as a division by its fp32 reciprocal, except for fp64 lists, which
// are multiplied by it first): a few roundings apart.
struct AdamWTensors {
  std::vector<at::Tensor> weights, grads, exp_avgs, exp_avg_sqs;
  std::vector<bool> decay;
  at::Tensor grad_scale;
  AdamWBackend backend = AdamWBackend::kAuto;
};
void adamw_update_(const AdamWTensors& tensors, double lr, int64_t step,
                   const AdamWOptions& options);

}  // namespace loom::ops
