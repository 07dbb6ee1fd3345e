#pragma once
// Sparse gradients with error feedback, what the top-k and threshold communication hooks send
// (parallel/data/sparse_hook.h; DCT, Deep Gradient Compression): of v = x + error, the values at
// or above a threshold (|v| >= t, v != 0; NaN and infinities always), as indices and values, at
// most `capacity` of them in ascending index order; everything not sent stays in the error for
// the next step. CUDA tensors run loom's kernels (kernels/compression/sparsify.cu), CPU tensors
// their host reference: the same operations in the same order, the same values.
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace loom::ops {

struct SparseSelection {
  at::Tensor indices;    // int32 [capacity]: the selected values' positions, then -1
  at::Tensor values;     // float32 [capacity]: their values, then 0
  int64_t selected = 0;  // how many passed the threshold (those past the capacity stay in error)
};

// x and error: float32 1-D tensors of one length (at most 2^31 - 1) on one device, error
// contiguous and updated in place; capacity >= 0. loom::Error otherwise, naming the values.
SparseSelection select_with_feedback(const at::Tensor& x, at::Tensor& error, double threshold,
                                     int64_t capacity);
// The k-th largest |x + error| (1 <= k <= n), the threshold that selects the k largest (and their
// ties) when it is exact: the value fp32 rounds x + error to, as select_with_feedback does. NaN
// counts as the largest.
double kth_largest_magnitude(const at::Tensor& x, const at::Tensor& error, int64_t k);
// dense[indices[i]] += values[i] in place, skipping indices outside dense (-1 pads a selection).
// dense: contiguous float32 1-D; indices int32 and values float32 of one length on dense's
// device, their indices distinct.
void scatter_add_sparse_(at::Tensor& dense, const at::Tensor& indices, const at::Tensor& values);

}  // namespace loom::ops
