#pragma once
// A linear layer and the cross-entropy of its output in chunks of rows, so that the logits of a
// large vocabulary never exist whole: for each chunk, logits = hidden · weightᵀ, the fused
// cross-entropy's stats pass over them, and (when a gradient is wanted) its grad pass in place
// over them, then the chunk's two backward products — d hidden = grad · weight, d weight +=
// gradᵀ · hidden — before the next chunk reuses the memory. The gradients are therefore computed
// in the forward (no product is repeated) and held until backward scales them by the upstream
// gradient: d weight in the accumulation dtype (fp32; fp64 for fp64) across chunks, d hidden in
// the product's dtype. Memory beyond the inputs: one chunk's logits, plus the two gradients.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

#include "loom/ops/cross_entropy.h"

namespace loom::ops {

struct LinearCrossEntropyOptions {
  // Rows of logits computed at a time (> 0).
  int64_t chunk_rows = 4096;
  // As FusedCrossEntropyOptions: this rank's columns of the vocabulary, padding past `valid`,
  // ignored targets, z-loss, and the reductions over the ranks that hold the other columns
  // (called once per chunk).
  int64_t col_offset = 0;
  int64_t valid = -1;
  int64_t ignore_index = -100;
  double z_loss = 0;
  RowReductions reduce;
  // When set, receives each row's cross-entropy (the z-loss left out; 0 for an ignored row) as a
  // [rows] tensor in the accumulation dtype, without gradient.
  at::Tensor* row_losses = nullptr;
};

// --loss-chunk-rows: "auto" -> kAutoChunkRows, "off" or "0" -> 0 (whole logits), a positive
// integer -> itself; loom::Error naming anything else and the valid forms.
constexpr int64_t kAutoChunkRows = -1;
int64_t parse_chunk_rows(const std::string& value);

// The dtype the products run in: autocast's (bf16) when autocast is on for hidden's device and
// neither input is fp64, else the inputs' promoted dtype.
at::ScalarType linear_cross_entropy_dtype(const at::Tensor& hidden, const at::Tensor& weight);

// Mean cross-entropy (plus z-loss) of hidden [..., d] · weightᵀ (weight [V_local, d], no bias)
// against targets [...] (int64 ids or ignore_index), as a scalar in the accumulation dtype,
// with autograd through hidden and weight. Equal to fused_cross_entropy(hidden · weightᵀ, ...)
// up to the order of d weight's sums over chunks. Runs the cross-entropy kernels on CUDA (fp32,
// fp16, bf16 products) and their host reference on the CPU (also fp64). loom::Error for shapes,
// devices or dtypes that do not fit, naming them.
at::Tensor linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight,
                                const at::Tensor& targets,
                                const LinearCrossEntropyOptions& options = {});

}  // namespace loom::ops
