#pragma once
// Dropout that does not depend on how a tensor is split. Megatron forks a separate generator
// per tensor-parallel rank for dropout inside TP regions, so its masks (and results) change
// with tp. loom instead draws the mask of the whole logical tensor from the group's generator
// (TpGroup::generator()) and keeps this rank's slice: the tp ranks of one data-parallel replica
// seed that generator alike and make the same draws, so their generators stay in lockstep, each
// rank applies exactly the slice the single-process model would, and training with dropout is
// the same at every tp (and with or without sequence parallelism). The cost: every rank draws
// the whole mask (on the CPU), and attention with dropout runs the math path with an explicit
// [b, h, s, s] mask. Pretraining recipes use dropout 0, where none of this runs.
#include <ATen/core/Tensor.h>

#include "loom/parallel/tensor/tp_group.h"

namespace loom::parallel::tensor {

// Bernoulli keep-mask (scaled by 1 / (1 - p)) for this rank's slice, of shape `local_shape`,
// of a tensor split along `dim` across the group (dim < 0 or tp = 1: the slice is the whole
// tensor). Undefined when p == 0 (nothing is drawn).
at::Tensor sharded_dropout_mask(at::IntArrayRef local_shape, const at::TensorOptions& options,
                                double p, TpGroup& tp, int64_t dim);

// x * mask when training with p > 0; x unchanged otherwise.
at::Tensor sharded_dropout(const at::Tensor& x, double p, bool training, TpGroup& tp, int64_t dim);

}  // namespace loom::parallel::tensor
