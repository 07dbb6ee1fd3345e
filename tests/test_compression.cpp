// Communication compression's arithmetic (ops/quantize.h): blockwise int8 within half a
// quantization step, and error feedback that loses nothing over steps.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "loom/ops/quantize.h"
#include "test_util.h"

using loom::testing::contains;
using loom::testing::error_of;
namespace ops = loom::ops;

namespace {

constexpr double kU = 5.960464477539063e-08;  // 2^-24, fp32's unit roundoff

// Blocks of very different magnitudes, one all zero, one holding a single value.
at::Tensor varied_blocks(int64_t blocks, int64_t block, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto x = at::randn({blocks, block}, gen);
  x *= at::pow(10.0, at::arange(blocks, at::kFloat).remainder(7) - 3).unsqueeze(1);
  x[1].zero_();
  x[2].zero_();
  x[2][5] = -3.5f;
  return x.view({-1});
}

}  // namespace

// Every value comes back within half its block's step (scale / 2) plus the fp32 roundings of
// the scale, the division and the product (a few u of the block's largest magnitude); the
// largest magnitude maps to +-127, zeros to 0, and the codes stay in [-127, 127].
TEST(QuantizeInt8, RoundTripIsWithinHalfAStepOfEveryBlock) {
  const int64_t block = ops::kInt8Block, blocks = 20;
  const auto x = varied_blocks(blocks, block, 3);
  const auto q = ops::quantize_int8(x);
  ASSERT_EQ(q.codes.scalar_type(), at::kChar);
  ASSERT_EQ(q.scales.numel(), blocks);
  const auto back = ops::dequantize_int8(q.codes, q.scales);
  const auto amax = x.view({blocks, block}).abs().amax(1);
  EXPECT_TRUE(at::allclose(q.scales, amax / 127.0f, 0, 0));
  EXPECT_LE(q.codes.abs().max().item<int>(), 127);
  double worst = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    const double scale = q.scales[b].item<double>(), m = amax[b].item<double>();
    const double bound = scale / 2 + 4 * kU * m;
    const double err =
        (x.view({blocks, block})[b] - back.view({blocks, block})[b]).abs().max().item<double>();
    EXPECT_LE(err, bound) << "block " << b;
    if (m > 0) {
      worst = std::max(worst, err / bound);
      EXPECT_EQ(q.codes.view({blocks, block})[b].abs().max().item<int>(), 127) << "block " << b;
    }
  }
  EXPECT_EQ(q.codes.view({blocks, block})[1].abs().sum().item<int64_t>(), 0);
  EXPECT_EQ(q.codes.view({blocks, block})[2][5].item<int>(), -127);
  EXPECT_GT(worst, 0.5) << "the bound is far looser than the rounding: is it the right one?";
}

// Error feedback: after T calls the dequantized results plus the error still carried equal the
// sum of the inputs, up to fp32's roundings (x + e and the error's subtraction each call: a few
// u of the magnitudes), far below one quantization step, which a lost error would show.
TEST(QuantizeInt8, ErrorFeedbackLosesNothingOverSteps) {
  const int64_t n = 8 * ops::kInt8Block, steps = 25;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  auto error = at::zeros({n});
  auto sum_in = at::zeros({n}, at::kDouble), sum_out = at::zeros({n}, at::kDouble);
  double largest = 0;
  for (int64_t t = 0; t < steps; ++t) {
    const auto x = at::randn({n}, gen) * (1.0 + static_cast<double>(t % 3));
    largest = std::max(largest, x.abs().max().item<double>());
    const auto q = ops::quantize_int8_with_feedback(x, error);
    sum_in += x.to(at::kDouble);
    sum_out += ops::dequantize_int8(q.codes, q.scales).to(at::kDouble);
  }
  const double lost = (sum_in - sum_out - error.to(at::kDouble)).abs().max().item<double>();
  EXPECT_LE(lost, static_cast<double>(steps) * 8 * kU * largest);
  // The carried error stays within half a step.
  EXPECT_LE(error.abs().max().item<double>(), 2 * largest / 254.0);
  EXPECT_GT(error.abs().max().item<double>(), 0);
}

// A NaN or an infinity is not quantized away: its block's scale, and so every value it
// dequantizes to, stays non-finite (the trainer's non-finite check must still see it).
TEST(QuantizeInt8, NonFiniteValuesStayNonFinite) {
  auto x = at::randn({3 * ops::kInt8Block});
  x[5] = std::nanf("");
  x[ops::kInt8Block + 7] = std::numeric_limits<float>::infinity();
  const auto q = ops::quantize_int8(x);
  const auto back = ops::dequantize_int8(q.codes, q.scales);
  EXPECT_TRUE(std::isnan(q.scales[0].item<float>()));
  EXPECT_FALSE(std::isfinite(q.scales[1].item<float>()));
  EXPECT_TRUE(std::isfinite(q.scales[2].item<float>()));
  EXPECT_FALSE(at::isfinite(back[5]).item<bool>());
  EXPECT_FALSE(at::isfinite(back[ops::kInt8Block + 7]).item<bool>());
  // With error feedback the non-finite blocks' errors are reset to 0, the finite one's kept.
  auto error = at::zeros_like(x);
  ops::quantize_int8_with_feedback(x, error);
  EXPECT_EQ(error.narrow(0, 0, 2 * ops::kInt8Block).abs().max().item<float>(), 0.0f);
  EXPECT_GT(error.narrow(0, 2 * ops::kInt8Block, ops::kInt8Block).abs().max().item<float>(), 0.0f);
}

TEST(QuantizeInt8, BadInputIsNamed) {
  EXPECT_TRUE(contains(error_of([] { ops::quantize_int8(at::zeros({300})); }),
                       "300 values do not split into blocks of 256"));
  EXPECT_TRUE(contains(error_of([] { ops::quantize_int8(at::zeros({256}, at::kDouble)); }),
                       "takes a float32 1-D tensor, got Double"));
  auto error = at::zeros({256});
  EXPECT_TRUE(contains(error_of([&] { ops::quantize_int8_with_feedback(at::zeros({512}), error); }),
                       "the error is Float of 256 values on cpu, the input 512 values"));
}
