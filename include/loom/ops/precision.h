#pragma once
// The dtype sums, losses and optimizer state are kept in: at least fp32. bf16/fp16 tensors widen
// to fp32 (their sums would lose the small terms); fp32 stays fp32; fp64 stays fp64, so that a
// `--precision fp64` run is fp64 end to end (the correctness instrument in docs/testing.md) and
// no step rounds it back to fp32.
#include <ATen/core/Tensor.h>

namespace loom::ops {

// promote_types(t, fp32): bf16/fp16/fp32 -> fp32, fp64 -> fp64.
at::ScalarType accumulation_dtype(at::ScalarType t);

// `t` in accumulation_dtype(t.scalar_type()) (no copy when it already is).
at::Tensor to_accumulation_dtype(const at::Tensor& t);

// Sum of squares of `t` as a float64 scalar on t's device, summed in the accumulation dtype by
// at::sum (cascaded: ~1e-7 relative in fp32 even over tens of millions of elements, unlike
// at::norm's fp32 reduction, measured 1e-5 off on a 4M-element embedding gradient).
at::Tensor squared_norm(const at::Tensor& t);

}  // namespace loom::ops
