#include "loom/ops/quantize.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "loom/core/error.h"

namespace loom::ops {

namespace {

void check_blocks(const at::Tensor& x, int64_t block, const char* what) {
  LOOM_CHECK(block >= 1, "{}: block size {} must be >= 1", what, block);
  LOOM_CHECK(x.dim() == 1 && x.scalar_type() == at::kFloat,
             "{}: takes a float32 1-D tensor, got {} of {} dims", what,
             c10::toString(x.scalar_type()), x.dim());
  LOOM_CHECK(x.numel() % block == 0, "{}: {} values do not split into blocks of {}", what,
             x.numel(), block);
}

}  // namespace

Int8Blocks quantize_int8(const at::Tensor& x, int64_t block) {
  check_blocks(x, block, "quantize_int8");
  const auto blocks = x.view({-1, block});
  auto scales = blocks.abs().amax(1) / 127.0f;
  // A zero block divides by 1 instead of 0: its codes are 0 whatever the divisor.
  const auto divisor = at::where(scales > 0, scales, at::ones_like(scales));
  auto codes = at::round(blocks / divisor.unsqueeze(1)).clamp_(-127, 127).to(at::kChar);
  return {codes.view({-1}), scales};
}

at::Tensor dequantize_int8(const at::Tensor& codes, const at::Tensor& scales, int64_t block) {
  LOOM_CHECK(block >= 1 && codes.size(-1) % block == 0 && scales.size(-1) * block == codes.size(-1),
             "dequantize_int8: {} codes and {} scales do not match blocks of {}", codes.size(-1),
             scales.size(-1), block);
  auto sizes = codes.sizes().vec();
  sizes.back() /= block;
  sizes.push_back(block);
  return (codes.to(at::kFloat).view(sizes) * scales.unsqueeze(-1)).view(codes.sizes());
}

Int8Blocks quantize_int8_with_feedback(const at::Tensor& x, at::Tensor& error, int64_t block) {
  check_blocks(x, block, "quantize_int8_with_feedback");
  LOOM_CHECK(error.sizes() == x.sizes() && error.scalar_type() == at::kFloat,
             "quantize_int8_with_feedback: the error is {} of {} values, the input {} values of "
             "float32; they must agree",
             c10::toString(error.scalar_type()), error.numel(), x.numel());
  const auto v = x + error;
  auto q = quantize_int8(v, block);
  error.copy_(v - dequantize_int8(q.codes, q.scales, block));
  return q;
}

}  // namespace loom::ops
