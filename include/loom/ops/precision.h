#pragma once
// The dtype sums, losses and optimizer state are kept in: at least fp32. bf16/fp16 tensors widen
// to fp32 (their sums would lose the small terms); fp32 stays fp32; fp64 stays fp64, so that a
// `--precision fp64` run is fp64 end to end (the correctness instrument in docs/testing.md) and
// no step rounds it back to fp32.
#include <ATen/core/Tensor.h>

#include <vector>

namespace loom::ops {

// promote_types(t, fp32): bf16/fp16/fp32 -> fp32, fp64 -> fp64.
at::ScalarType accumulation_dtype(at::ScalarType t);

// `t` in accumulation_dtype(t.scalar_type()) (no copy when it already is).
at::Tensor to_accumulation_dtype(const at::Tensor& t);

// Sum of squares of `t` as a float64 scalar on t's device, summed in the accumulation dtype by
// at::sum (cascaded: ~1e-7 relative in fp32 even over tens of millions of elements, unlike
// at::norm's fp32 reduction, measured 1e-5 off on a 4M-element embedding gradient).
at::Tensor squared_norm(const at::Tensor& t);

// squared_norm of each tensor, as a float64 tensor of their count on the first one's device.
// With `multi_tensor` (the default on a GPU: one launch for the list, not three per tensor) each
// is the square of ATen's multi-tensor norm in the accumulation dtype, within a few roundings of
// squared_norm's; else squared_norm's own sums. An empty list gives an empty tensor on the host.
at::Tensor squared_norms(const std::vector<at::Tensor>& tensors);
at::Tensor squared_norms(const std::vector<at::Tensor>& tensors, bool multi_tensor);

}  // namespace loom::ops
