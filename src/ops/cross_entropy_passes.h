#pragma once
// The fused cross-entropy's two passes over rows of logits (kernels/loss/cross_entropy.h: the
// CUDA kernels on a GPU, their host reference on the CPU) and the per-row arithmetic between
// them, shared by the loss over whole logits (cross_entropy.cpp) and the chunked linear + loss
// (linear_cross_entropy.cpp). Internal to src/ops.
#include <ATen/core/Tensor.h>

#include <cstdint>

#include "loom/ops/cross_entropy.h"
#include "loss/cross_entropy.h"

namespace loom::ops::detail {

// The kernels' description of logits2d ([rows, ld] contiguous) against targets ([rows] int64
// contiguous): columns [0, valid) are vocabulary ids [col_offset, col_offset + valid). A
// description the kernels refuse is a loom::Error naming the field.
kernels::CrossEntropyRows describe_rows(const at::Tensor& logits2d, const at::Tensor& targets,
                                        int64_t col_offset, int64_t valid, int64_t ignore_index);

// The stats pass: per row max, sum of exp(x - max), target logit, target found, as [4, rows] in
// the accumulation dtype (ops/precision.h).
at::Tensor row_stats(const kernels::CrossEntropyRows& rows, const at::Tensor& logits2d);

// What the stats of every shard of each row give (after `reduce`, when set): the row's
// log-sum-exp, its cross-entropy lse - target logit, and its loss (the cross-entropy + z_loss
// lse^2); both NaN where no shard holds the target, 0 where the target is ignore_index.
struct RowLosses {
  at::Tensor lse;            // [rows], contiguous
  at::Tensor cross_entropy;  // [rows]
  at::Tensor per_row;        // [rows]
  at::Tensor counted;        // [rows] bool: target != ignore_index
};
RowLosses row_losses(const at::Tensor& stats, const at::Tensor& targets,
                     const RowReductions& reduce, int64_t ignore_index, double z_loss);

// The grad pass: writes d loss / d logits = (softmax (1 + 2 z lse) - onehot) * scale[0] into
// grad ([rows, ld] in the logits' dtype; may be the logits themselves).
void row_grads(const kernels::CrossEntropyRows& rows, const at::Tensor& lse,
               const at::Tensor& scale, double z_loss, at::Tensor& grad);

// Whether the kernels take logits of this dtype on CUDA (fp32, fp16, bf16).
bool kernel_dtype(at::ScalarType t);

}  // namespace loom::ops::detail
