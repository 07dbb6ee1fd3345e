#pragma once
// What the 2:4 tests on the CPU (test_kernels.cpp) and the GPU (test_gpu.cpp) share: random 2:4
// weights, and the error bound of the product y = x W^T against its fp64 value.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>

namespace loom::testing {

// [out, in] in `dtype`, 2:4 along the rows: each 4-wide chunk keeps 0, 1 or 2 (mostly 2) random
// elements of N(0, 1).
inline at::Tensor random_24_weight(int64_t out, int64_t in, at::ScalarType dtype) {
  const auto w = at::randn({out, in / 4, 4});
  const auto order = std::get<1>(at::rand({out, in / 4, 4}).sort(-1));
  const auto kept = at::randint(0, 4, {out, in / 4, 1}).clamp_max(2);  // 0, 1, 2, 2
  return (w * (order < kept)).reshape({out, in}).to(dtype);
}

// Per element of y: one rounding to the element type (at most u = 2^-8 of the rounded value in
// bf16, 2^-11 in fp16) of an fp32 sum s whose own error E is at most `fp32_roundings` roundings
// of the running sum, each 2^-24 of sum |w x|, plus the fp64 sums (2^-53 per term):
// |y - exact| <= u |exact| + (1 + u) E, here with 1% on each term. `exact` and `magnitude` are
// x W^T and |x| |W|^T in fp64.
inline at::Tensor sparse24_bound(const at::Tensor& exact, const at::Tensor& magnitude,
                                 at::ScalarType dtype, int64_t fp32_roundings, int64_t in) {
  const double unit = dtype == at::kBFloat16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
  return unit * 1.01 * exact.abs() +
         1.01 * (double(fp32_roundings) * std::ldexp(1.0, -24) + double(in) * std::ldexp(1.0, -53)) *
             magnitude +
         1e-30;
}

// got (any device) against the fp64 product a b, optionally masked by `keep`, with 2 k fp32
// roundings of sums of k terms (a GPU's tensor cores: their own order, possibly truncating);
// prints the measured worst error / bound.
inline void expect_product_within_bound(const at::Tensor& got, const at::Tensor& a,
                                        const at::Tensor& b, int64_t k, const char* what,
                                        at::ScalarType dtype = at::kBFloat16,
                                        const at::Tensor& keep = {}) {
  auto exact = at::matmul(a, b);
  if (keep.defined()) exact = exact * keep;
  const auto bound = sparse24_bound(exact, at::matmul(a.abs(), b.abs()), dtype, 2 * k, k);
  const auto ratio = ((got.cpu().to(at::kDouble) - exact).abs() / bound).max().item<double>();
  EXPECT_LE(ratio, 1.0) << what;
  std::printf("%s: worst error / bound %.3f\n", what, ratio);
}

}  // namespace loom::testing
