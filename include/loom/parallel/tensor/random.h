#pragma once
// Dropout that does not depend on how a tensor is split. Megatron forks a separate generator per
// tensor-parallel rank for dropout inside TP regions, so its masks (and results) change with tp.
// loom's masks are counter-based (ops/dropout.h): each element's draw is a function of the run's
// seed, the step, the dropout site and the element's coordinates in the logical (unsplit)
// tensor, its sample numbered across the global batch. A rank computes only its own slice, and
// that slice is exactly what one process would apply there: training with dropout is the same at
// every tp, with or without sequence parallelism, at every data-parallel size and gradient
// accumulation, and on the CPU and the GPU. The position (seed, step, first sample) comes from
// the group's DropoutStream, which the runtime sets before each micro-batch.
#include <ATen/core/Tensor.h>

#include "loom/parallel/tensor/tp_group.h"

namespace loom::parallel::tensor {

// The keep-mask (1 / (1 - p) or 0) of dropout `site` for this rank's slice, of shape
// `local_shape`, of a tensor split along `dim` across the group (dim < 0 or tp = 1: the slice is
// the whole tensor); dimension 0 holds the micro-batch's samples. Undefined when p == 0.
at::Tensor sharded_dropout_mask(at::IntArrayRef local_shape, const at::TensorOptions& options,
                                double p, const TpGroup& tp, int64_t dim, uint32_t site);

// Dropout of x with that mask when training with p > 0 (an autograd op that saves no mask);
// x unchanged otherwise.
at::Tensor sharded_dropout(const at::Tensor& x, double p, bool training, const TpGroup& tp,
                           int64_t dim, uint32_t site);

}  // namespace loom::parallel::tensor
