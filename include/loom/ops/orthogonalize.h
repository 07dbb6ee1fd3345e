#pragma once
// Orthonormal columns for PowerSGD (parallel/data/powersgd_hook.h): a batch of small row-major
// matrices P (rows x rank) packed in one float32 buffer, each replaced in place by an orthonormal
// basis of its column span, by modified Gram-Schmidt. CUDA tensors run loom's kernel
// (kernels/compression/orthogonalize.cu, one CUDA block per matrix), CPU tensors its host
// reference: the same operations in the same order, the same values (the order is written out
// in kernels/compression/orthogonalize.h). A column that is zero stays zero and is not divided;
// a NaN or an infinity spreads to the later columns of its matrix.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace loom::ops {

// The largest rank the kernel orthogonalizes (32 columns).
int64_t max_orthogonalize_rank();

// data: contiguous float32 1-D; matrix m holds rows[m] x rank values from offsets[m], inside
// data and not overlapping another; rank in [1, max_orthogonalize_rank()]. loom::Error naming
// the value otherwise.
void orthogonalize_columns_(at::Tensor& data, const std::vector<int64_t>& offsets,
                            const std::vector<int64_t>& rows, int64_t rank);

}  // namespace loom::ops
