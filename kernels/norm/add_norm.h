#pragma once
// Fused residual add + LayerNorm / RMSNorm over rows of width `width`, forward and backward, on
// an fp32 residual stream with 16-bit (or fp32) branch outputs and normed activations:
//
//   forward:   sum = residual + branch           (fp32; skipped when there is no branch)
//              normed = norm(sum) * weight (+ bias), in the io dtype (bf16 under autocast: what
//              the next matrix product reads, so no cast follows)
//              per row: mean (LayerNorm) and rstd = 1 / sqrt(var + eps), kept for backward;
//   backward:  grad_input = grad_sum + d norm(sum) / d sum applied to grad_normed (fp32: the
//              residual's gradient; also the branch's, rounded to the io dtype into grad_branch),
//              in place over grad_sum when the caller passes the same pointer;
//   weights:   per slice of rows, the partial sums over its rows of grad_normed * xhat (the
//              weight's gradient) and of grad_normed (the bias's); the caller adds the slices.
//
// LayerNorm: xhat = (sum - mean) * rstd, var = mean((sum - mean)^2) (two passes, no Welford);
// RMSNorm: xhat = sum * rstd, var = mean(sum^2), mean reported as 0, and weight * xhat (no bias).
//
// Row kernels give each row to one warp (8 rows a CUDA block of 256 threads): lane l holds
// columns l, l + 32, l + 64, ... and folds them in column order; a row's sums are combined by a
// butterfly over the lanes. The weight kernel gives each column to one thread, which folds its
// slice's rows in row order. The host references follow the same partitions and orders, so on the
// CPU (the kernel emulation) they agree with the kernels bit for bit. Accumulation is fp32 (fp64
// for fp64 rows: host references only).
#include <cstdint>

#include "common/element_dtype.h"
#include "common/status.h"

struct CUstream_st;
typedef struct CUstream_st* cudaStream_t;

namespace loom::kernels {

enum class NormKind { kLayerNorm, kRmsNorm };

constexpr int kAddNormThreads = 256;  // 8 warps: 8 rows at a time per CUDA block

// Shapes and element type. The residual, sum, weight, bias, statistics and grad_input are in
// the accumulation type Acc (float; double when io is kFloat64); branch, normed, grad_normed and
// grad_branch in `io`.
struct NormRows {
  NormKind kind = NormKind::kLayerNorm;
  ElementDtype io = ElementDtype::kFloat32;
  int64_t rows = 0;
  int64_t width = 0;  // elements per row (contiguous rows)
};

template <typename Acc>
struct AddNormForwardArgs {
  const Acc* residual;  // [rows, width]
  const void* branch;   // [rows, width] in io, or null: normalise the residual alone
  const Acc* weight;    // [width]
  const Acc* bias;      // [width] or null (LayerNorm only)
  Acc eps;
  Acc* sum;      // [rows, width]: residual + branch; may be null when branch is (nothing to add)
  void* normed;  // [rows, width] in io
  Acc* mean;     // [rows] (0 for RMSNorm)
  Acc* rstd;     // [rows]
};

template <typename Acc>
struct AddNormBackwardArgs {
  const Acc* sum;           // [rows, width]: the norm's input, as forward wrote it
  const Acc* weight;        // [width]
  const Acc* mean;          // [rows]
  const Acc* rstd;          // [rows]
  const void* grad_normed;  // [rows, width] in io
  const Acc* grad_sum;      // [rows, width], or null: 0 (may equal grad_input)
  Acc* grad_input;          // [rows, width]
  void* grad_branch;        // [rows, width] in io, or null: not wanted
};

template <typename Acc>
struct NormWeightGradArgs {
  const Acc* sum;  // as in AddNormBackwardArgs
  const Acc* mean;
  const Acc* rstd;
  const void* grad_normed;
  int64_t slices;       // >= 1: rows [s * per, (s + 1) * per), per = ceil(rows / slices)
  Acc* weight_partial;  // [slices, width]
  Acc* bias_partial;    // [slices, width], or null: no bias
};

// Shapes and dtypes, then each call's pointers: an invalid-argument Status naming the field and
// what is valid. The entry points below run these first.
Status norm_rows_check(const NormRows& rows);
template <typename Acc>
Status add_norm_forward_check(const NormRows& rows, const AddNormForwardArgs<Acc>& args);
template <typename Acc>
Status add_norm_backward_check(const NormRows& rows, const AddNormBackwardArgs<Acc>& args);
template <typename Acc>
Status norm_weight_grad_check(const NormRows& rows, const NormWeightGradArgs<Acc>& args);

// The host references, rows [row_begin, row_end) (slices [begin, end) for the weights). Acc is
// float for fp32/fp16/bf16 io and double for fp64 (a mismatch is refused).
template <typename Acc>
Status add_norm_forward_host(const NormRows& rows, const AddNormForwardArgs<Acc>& args,
                             int64_t row_begin, int64_t row_end);
template <typename Acc>
Status add_norm_backward_host(const NormRows& rows, const AddNormBackwardArgs<Acc>& args,
                              int64_t row_begin, int64_t row_end);
template <typename Acc>
Status norm_weight_grad_host(const NormRows& rows, const NormWeightGradArgs<Acc>& args,
                             int64_t slice_begin, int64_t slice_end);

// The CUDA kernels (fp32, fp16 and bf16 io; device pointers). Row kernels loop over rows past
// max_blocks CUDA blocks (> 0; tests use a small cap to make them loop; <= 0: 65535).
Status add_norm_forward_apply(const NormRows& rows, const AddNormForwardArgs<float>& args,
                              cudaStream_t stream, int64_t max_blocks = 0);
Status add_norm_backward_apply(const NormRows& rows, const AddNormBackwardArgs<float>& args,
                               cudaStream_t stream, int64_t max_blocks = 0);
Status norm_weight_grad_apply(const NormRows& rows, const NormWeightGradArgs<float>& args,
                              cudaStream_t stream);

}  // namespace loom::kernels
