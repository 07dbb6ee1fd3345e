// Communication compression's arithmetic: blockwise int8 within half a quantization step
// (ops/quantize.h), sign packing against the plain formula (ops/sign_pack.h), threshold selection
// and scatter-add (ops/sparsify.h) against plain loops, error feedback that loses nothing over
// steps, and the --comm-hook specs and their errors.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>

#include "loom/ops/orthogonalize.h"
#include "loom/ops/quantize.h"
#include "loom/ops/sign_pack.h"
#include "loom/ops/sparsify.h"
#include "loom/parallel/data/comm_hook.h"
#include "loom/parallel/data/powersgd_hook.h"
#include "loom/parallel/data/sparse_hook.h"
#include "loom/parallel/pipeline/activation_codec.h"
#include "loom/train/config.h"
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

// ---- sparse selection (topk / threshold) ---------------------------------------------------

namespace {

// The plain statement of select_with_feedback: walk the values in order, take those passing the
// threshold while there is room.
struct Naive {
  std::vector<int32_t> indices;
  std::vector<float> values, error;
  int64_t selected = 0;
};
Naive naive_select(const at::Tensor& x, const at::Tensor& e, float t, int64_t capacity) {
  Naive out;
  for (int64_t i = 0; i < x.numel(); ++i) {
    const float v = x[i].item<float>() + e[i].item<float>();
    const bool take = !(std::fabs(v) < t) && v != 0.0f;
    out.selected += take;
    if (take && static_cast<int64_t>(out.indices.size()) < capacity) {
      out.indices.push_back(static_cast<int32_t>(i));
      out.values.push_back(v);
      out.error.push_back(0.0f);
    } else {
      out.error.push_back(v);
    }
  }
  return out;
}

bool same_floats(float a, float b) {
  return a == b || (std::isnan(a) && std::isnan(b));
}

}  // namespace

// Over lengths that do and do not fill whole chunks, capacities below, at and above the count,
// with zeros, a NaN and an infinity: indices, values, padding, counts and the error equal the
// plain loop's exactly.
TEST(SparseSelect, EqualsThePlainLoop) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  for (const int64_t n : {1, 255, 256, 1000, 3000}) {
    auto x = at::randn({n}, gen);
    auto e0 = at::randn({n}, gen) * 0.1;
    if (n > 10) {
      x.narrow(0, 3, 4).zero_();
      e0.narrow(0, 3, 4).zero_();
      x[7] = std::numeric_limits<float>::quiet_NaN();
      x[9] = std::numeric_limits<float>::infinity();
    }
    for (const double t : {0.0, 0.5, 1.5, 10.0}) {
      const auto want_all = naive_select(x, e0, static_cast<float>(t), n);
      for (const int64_t capacity : {int64_t(0), want_all.selected / 2, want_all.selected, n}) {
        SCOPED_TRACE(::testing::Message()
                     << "n " << n << ", threshold " << t << ", capacity " << capacity);
        const auto want = naive_select(x, e0, static_cast<float>(t), capacity);
        auto e = e0.clone();
        const auto got = ops::select_with_feedback(x, e, t, capacity);
        EXPECT_EQ(got.selected, want.selected);
        ASSERT_EQ(got.indices.numel(), capacity);
        for (int64_t s = 0; s < capacity; ++s) {
          const bool used = s < static_cast<int64_t>(want.indices.size());
          EXPECT_EQ(got.indices[s].item<int32_t>(), used ? want.indices[size_t(s)] : -1) << s;
          EXPECT_TRUE(same_floats(got.values[s].item<float>(), used ? want.values[size_t(s)] : 0))
              << s;
        }
        for (int64_t i = 0; i < n; ++i)
          ASSERT_TRUE(same_floats(e[i].item<float>(), want.error[size_t(i)])) << i;
      }
    }
  }
}

// The k-th largest magnitude as a threshold selects the k largest |x + e| (values drawn without
// ties), and NaN ranks above every number.
TEST(SparseSelect, KthLargestMagnitudeSelectsTheKLargest) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  const int64_t n = 2000;
  auto x = at::randn({n}, gen);
  auto e = at::randn({n}, gen) * 0.01;
  const auto v = (x + e).abs();
  for (const int64_t k : {1, 20, 1999, 2000}) {
    const double t = ops::kth_largest_magnitude(x, e, k);
    EXPECT_EQ(t, std::get<0>(v.sort(0, /*descending=*/true))[k - 1].item<double>()) << k;
    auto err = e.clone();
    EXPECT_EQ(ops::select_with_feedback(x, err, t, k).selected, k) << k;
  }
  x[17] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(ops::kth_largest_magnitude(x, e, 1)));
  EXPECT_TRUE(contains(error_of([&] { ops::kth_largest_magnitude(x, e, 0); }), "k = 0"));
}

// Scatter-add adds each list into place, skipping the -1 padding, and equals index_add_.
TEST(SparseSelect, ScatterAddEqualsIndexAdd) {
  auto dense = at::zeros({10});
  const auto idx = at::tensor({3, -1, 9, 0, -1}, at::kInt);
  const auto val = at::tensor({1.5f, 7.0f, -2.0f, 0.25f, 7.0f});
  ops::scatter_add_sparse_(dense, idx, val);
  ops::scatter_add_sparse_(dense, at::tensor({3}, at::kInt), at::tensor({1.0f}));
  auto want = at::zeros({10});
  want[3] = 2.5f;
  want[9] = -2.0f;
  want[0] = 0.25f;
  EXPECT_TRUE(at::equal(dense, want));
  EXPECT_TRUE(contains(error_of([&] { ops::scatter_add_sparse_(dense, idx.to(at::kLong), val); }),
                       "int32"));
}

// Error feedback: over steps, what was sent plus what is still carried equals what went in, to
// fp32's rounding of each x + e.
TEST(SparseSelect, ErrorFeedbackLosesNothingOverSteps) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
  const int64_t n = 4096, k = 40, steps = 8;
  auto error = at::zeros({n});
  auto sent = at::zeros({n}, at::kDouble), total = at::zeros({n}, at::kDouble);
  double largest = 0;
  for (int64_t t = 0; t < steps; ++t) {
    const auto x = at::randn({n}, gen);
    total += x.to(at::kDouble);
    largest = std::max(largest, (x + error).abs().max().item<double>());
    const auto s = ops::select_with_feedback(x, error, ops::kth_largest_magnitude(x, error, k), k);
    auto dense = at::zeros({n});
    ops::scatter_add_sparse_(dense, s.indices, s.values);
    EXPECT_EQ((dense != 0).sum().item<int64_t>(), k);
    sent += dense.to(at::kDouble);
  }
  const double lost = (sent + error.to(at::kDouble) - total).abs().max().item<double>();
  EXPECT_LE(lost, steps * kU * largest);
  EXPECT_GT(error.abs().max().item<double>(), 1.0) << "nothing carried";
}

// --comm-hook specs: the options reach the hook, and every bad one is named before any collective.
TEST(CommHookSpec, OptionsAreReadAndBadOnesNamed) {
  namespace pd = loom::parallel::data;
  const auto topk =
      std::dynamic_pointer_cast<pd::SparseCompressHook>(pd::make_comm_hook("topk:ratio=0.005"));
  ASSERT_NE(topk, nullptr);
  EXPECT_EQ(topk->ratio(), 0.005);
  EXPECT_EQ(topk->refresh_every(), 1);
  EXPECT_EQ(topk->capacity(1000), 5);
  EXPECT_EQ(topk->capacity(10), 1);  // at least one value
  const auto threshold =
      std::dynamic_pointer_cast<pd::SparseCompressHook>(pd::make_comm_hook("threshold:every=4"));
  ASSERT_NE(threshold, nullptr);
  EXPECT_EQ(threshold->ratio(), 0.01);
  EXPECT_EQ(threshold->refresh_every(), 4);
  EXPECT_EQ(threshold->name(), "threshold");
  EXPECT_TRUE(contains(error_of([] { pd::make_comm_hook("fp8"); }),
                       "valid: avg, bf16, int8, onebit, powersgd, threshold, topk"));
  EXPECT_TRUE(
      contains(error_of([] { pd::make_comm_hook("topk:ratio=0"); }), "ratio=0 is outside (0, 1]"));
  EXPECT_TRUE(contains(error_of([] { pd::make_comm_hook("topk:ratio=1.5"); }),
                       "ratio=1.5 is outside (0, 1]"));
  EXPECT_TRUE(contains(error_of([] { pd::make_comm_hook("topk:ratio=abc"); }),
                       "ratio=abc is not a number"));
  EXPECT_TRUE(contains(error_of([] { pd::make_comm_hook("threshold:every=0"); }),
                       "every=0 must be at least 1"));
  EXPECT_TRUE(contains(error_of([] { pd::make_comm_hook("topk:every=3"); }),
                       "'topk' has no option 'every'; its options: ratio"));
  EXPECT_TRUE(contains(error_of([] { pd::make_comm_hook("int8:ratio=0.1"); }),
                       "'int8' has no option 'ratio'; its options: none"));
  EXPECT_TRUE(contains(error_of([] { pd::make_comm_hook("topk:ratio"); }), "is not key=value"));
  const auto powersgd =
      std::dynamic_pointer_cast<pd::PowerSgdHook>(pd::make_comm_hook("powersgd:rank=8"));
  ASSERT_NE(powersgd, nullptr);
  EXPECT_EQ(powersgd->rank(), 8);
  EXPECT_EQ(std::dynamic_pointer_cast<pd::PowerSgdHook>(pd::make_comm_hook("powersgd"))->rank(), 4);
  EXPECT_TRUE(powersgd->compresses(64, 64));  // 8 (64 + 64) = 1024 <= 4096 / 2
  EXPECT_FALSE(powersgd->compresses(16, 64));  // 8 (16 + 64) = 640 > 1024 / 2
  EXPECT_TRUE(contains(error_of([] { pd::make_comm_hook("powersgd:rank=0"); }),
                       "rank=0 is outside [1, 32]"));
  EXPECT_TRUE(contains(error_of([] { pd::make_comm_hook("powersgd:rank=33"); }),
                       "rank=33 is outside [1, 32]"));
  EXPECT_TRUE(contains(error_of([] { pd::make_comm_hook("powersgd:rank=two"); }),
                       "rank=two is not an integer"));
  EXPECT_TRUE(contains(error_of([] { pd::make_comm_hook("powersgd:ratio=0.1"); }),
                       "'powersgd' has no option 'ratio'; its options: rank"));
  // The keys of a hook's checkpointed state.
  EXPECT_EQ(pd::bucket_state_key(12, "error"), "b12/error");
  EXPECT_EQ(pd::bucket_of_key("b12/error", "error"), 12);
  EXPECT_EQ(pd::bucket_of_key("b3/warmup_steps", "warmup_steps"), 3);
  for (const char* other :
       {"b12/server_error", "b/error", "bx/error", "b-1/error", "c1/error", "b1/error2", "b1error"})
    EXPECT_EQ(pd::bucket_of_key(other, "error"), std::nullopt) << other;
}

// warmup=N belongs to every hook: the hook is wrapped (keeping its name and options), and a bad
// count is named. onebit takes no option of its own.
TEST(CommHookSpec, WarmupWrapsAnyHook) {
  namespace pd = loom::parallel::data;
  const auto made = pd::make_comm_hook("topk:ratio=0.02,warmup=7");
  const auto warm = std::dynamic_pointer_cast<pd::DenseWarmupHook>(made);
  ASSERT_NE(warm, nullptr);
  EXPECT_EQ(warm->warmup(), 7);
  EXPECT_EQ(warm->name(), "topk");
  EXPECT_TRUE(warm->carries_state());
  const auto* topk = dynamic_cast<pd::SparseCompressHook*>(&warm->inner());
  ASSERT_NE(topk, nullptr);
  EXPECT_EQ(topk->ratio(), 0.02);
  EXPECT_EQ(std::dynamic_pointer_cast<pd::DenseWarmupHook>(pd::make_comm_hook("onebit")), nullptr);
  EXPECT_EQ(pd::make_comm_hook("onebit")->name(), "onebit");
  EXPECT_TRUE(
      contains(error_of([] { pd::make_comm_hook("onebit:warmup=-1"); }), "warmup=-1 must be >= 0"));
  EXPECT_TRUE(contains(error_of([] { pd::make_comm_hook("int8:warmup=x"); }),
                       "warmup=x is not an integer"));
  EXPECT_TRUE(contains(error_of([] { pd::make_comm_hook("onebit:block=64"); }),
                       "'onebit' has no option 'block'; its options: none"));
}

// momentum=B belongs to every hook too: it wraps the hook (around its warm-up, so the warm-up
// averages momenta), the value is checked, and the trainer's config refuses a momentum that is
// not AdamW's beta1.
TEST(CommHookSpec, MomentumWrapsAnyHookAroundItsWarmup) {
  namespace pd = loom::parallel::data;
  const auto made = pd::make_comm_hook("onebit:warmup=5,momentum=0.9");
  const auto momentum = std::dynamic_pointer_cast<pd::MomentumCompressionHook>(made);
  ASSERT_NE(momentum, nullptr);
  EXPECT_EQ(momentum->beta(), 0.9);
  EXPECT_EQ(momentum->name(), "onebit");
  EXPECT_TRUE(momentum->carries_state());
  const auto* warm = dynamic_cast<pd::DenseWarmupHook*>(&momentum->inner());
  ASSERT_NE(warm, nullptr);
  EXPECT_EQ(warm->warmup(), 5);
  EXPECT_TRUE(contains(error_of([] { pd::make_comm_hook("onebit:momentum=1"); }),
                       "momentum=1 is outside [0, 1)"));
  EXPECT_TRUE(contains(error_of([] { pd::make_comm_hook("topk:momentum=-0.5"); }),
                       "momentum=-0.5 is outside [0, 1)"));
  EXPECT_TRUE(contains(error_of([] { pd::make_comm_hook("int8:momentum=high"); }),
                       "momentum=high is not a number"));
  // precondition=0|1 (default 1), with momentum only; the optimizer's beta2 and eps are taken.
  EXPECT_TRUE(momentum->preconditioning().enabled);
  loom::ops::AdamWOptions adamw;
  adamw.beta2 = 0.99;
  adamw.eps = 1e-6;
  const auto off = std::dynamic_pointer_cast<pd::MomentumCompressionHook>(
      pd::make_comm_hook("onebit:momentum=0.9,precondition=0", adamw));
  ASSERT_NE(off, nullptr);
  EXPECT_FALSE(off->preconditioning().enabled);
  EXPECT_EQ(off->preconditioning().beta2, 0.99);
  EXPECT_EQ(off->preconditioning().eps, 1e-6);
  EXPECT_TRUE(contains(error_of([] { pd::make_comm_hook("onebit:momentum=0.9,precondition=2"); }),
                       "precondition=2 must be 0 or 1"));
  EXPECT_TRUE(contains(error_of([] { pd::make_comm_hook("onebit:precondition=1"); }),
                       "precondition= applies to a momentum compression only"));
  EXPECT_FALSE(momentum->preconditioning().unclipped);
  const auto unclipped = std::dynamic_pointer_cast<pd::MomentumCompressionHook>(
      pd::make_comm_hook("onebit:warmup=5,momentum=0.9,unclipped=1"));
  ASSERT_NE(unclipped, nullptr);
  EXPECT_TRUE(unclipped->preconditioning().unclipped);
  EXPECT_TRUE(contains(error_of([] { pd::make_comm_hook("onebit:momentum=0.9,unclipped=3"); }),
                       "unclipped=3 must be 0 or 1"));
  EXPECT_TRUE(contains(
      error_of([] { pd::make_comm_hook("onebit:momentum=0.9,precondition=0,unclipped=1"); }),
      "unclipped=1 exempts the preconditioned steps from clipping; with precondition=0 there "
      "are none"));
  EXPECT_TRUE(contains(error_of([] { pd::make_comm_hook("onebit:unclipped=0"); }),
                       "unclipped= applies to a momentum compression only"));
  EXPECT_NO_THROW(pd::make_comm_hook("onebit:momentum=0.9,precondition=0,unclipped=0"));
  loom::train::TrainConfig config;
  config.data = "unused.bin";  // validate() checks the value, not the file
  config.comm_hook = "onebit:momentum=0.8";
  EXPECT_TRUE(contains(error_of([&] { config.validate(); }),
                       "momentum=0.8 must equal --beta1 0.9"));
  config.beta1 = 0.8;
  config.validate();
}

// Sign packing against the formula written out: per block of 1024 the scale is the mean of |v|
// (v = x + error) within the fp32 roundings of a 1024-term sum (1024 u of the sum, far below
// the 1 % a wrong summation would miss by), each value decodes to +-scale by its sign (zeros and
// -0 to +scale), and the error becomes v minus that (the same one fp32 subtraction).
TEST(SignPack, EqualsTheFormulaWrittenOut) {
  const int64_t block = ops::kSignBlock, blocks = 12;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(17);
  const auto x = varied_blocks(blocks, block, 5);  // block 1 all zero
  auto error = at::randn({blocks * block}, gen) * 1e-3;
  error.narrow(0, block, block).zero_();
  x[block + 9] = -0.0f;
  error[block + 9] = -0.0f;  // v = -0
  const auto v = x + error;  // the one fp32 addition the packing does
  const auto s = ops::pack_signs_with_feedback(x, error);
  ASSERT_EQ(s.words.numel(), blocks * block / 32);
  ASSERT_EQ(s.scales.numel(), blocks);
  const auto back = ops::unpack_signs(s.words, s.scales);
  const auto mean = v.to(at::kDouble).view({blocks, block}).abs().mean(1);
  for (int64_t b = 0; b < blocks; ++b) {
    const double want = mean[b].item<double>(), got = s.scales[b].item<double>();
    EXPECT_LE(std::abs(got - want), 1024 * kU * want) << "block " << b;
  }
  const auto positive = at::logical_not(v < 0);
  const auto scale_of = s.scales.repeat_interleave(block);
  EXPECT_TRUE(at::equal(back, at::where(positive, scale_of, -scale_of)));
  EXPECT_TRUE(at::equal(error, v - back));
  // Bit order: bit l of word j is value 32 j + l.
  const auto bits = (s.words.view({-1, 1}).bitwise_right_shift(at::arange(32, at::kInt)) & 1)
                        .view({-1})
                        .to(at::kBool);
  EXPECT_TRUE(at::equal(bits, positive));
  // An all-zero block (with a -0): scale 0, every bit set.
  EXPECT_EQ(s.scales[1].item<float>(), 0.0f);
  EXPECT_TRUE(
      at::equal(s.words.narrow(0, block / 32, block / 32), at::full({block / 32}, -1, at::kInt)));
}

// Over steps the decoded values sum to the inputs' sum minus the last error, up to the fp32
// roundings of x + e and v - decoded (one u each of the largest |v| per step).
TEST(SignPack, ErrorFeedbackLosesNothingOverSteps) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(23);
  const int64_t n = 4 * ops::kSignBlock, steps = 10;
  auto error = at::zeros({n});
  auto sent = at::zeros({n}, at::kDouble), total = at::zeros({n}, at::kDouble);
  double largest = 0;
  for (int64_t t = 0; t < steps; ++t) {
    const auto x = at::randn({n}, gen) * (1 + t % 3);
    total += x.to(at::kDouble);
    largest = std::max(largest, (x + error).abs().max().item<double>());
    const auto s = ops::pack_signs_with_feedback(x, error);
    sent += ops::unpack_signs(s.words, s.scales).to(at::kDouble);
  }
  const double lost = (sent + error.to(at::kDouble) - total).abs().max().item<double>();
  EXPECT_LE(lost, 2 * steps * kU * largest);
  EXPECT_GT(error.abs().max().item<double>(), 0.5) << "nothing carried";
}

// A NaN or an infinity makes its block's scale non-finite, so it decodes to non-finite values,
// and resets that block's error to 0; other blocks are untouched by it.
TEST(SignPack, NonFiniteValuesStayNonFiniteAndBadInputIsNamed) {
  const int64_t block = ops::kSignBlock;
  for (const float bad :
       {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::infinity()}) {
    auto x = at::ones({3 * block});
    x[block + 4] = bad;
    auto error = at::full({3 * block}, 0.25f);
    const auto s = ops::pack_signs_with_feedback(x, error);
    const auto back = ops::unpack_signs(s.words, s.scales);
    EXPECT_FALSE(at::isfinite(back.narrow(0, block, block)).any().item<bool>());
    EXPECT_TRUE(at::equal(error.narrow(0, block, block), at::zeros({block})));
    EXPECT_TRUE(at::equal(back.narrow(0, 0, block), at::full({block}, 1.25f)));
    EXPECT_TRUE(at::equal(error.narrow(0, 0, block), at::zeros({block})));
  }
  auto e = at::zeros({100});
  EXPECT_TRUE(contains(error_of([&] { ops::pack_signs_with_feedback(at::zeros({100}), e); }),
                       "100 values do not split into blocks of 1024"));
  auto e2 = at::zeros({block});
  EXPECT_TRUE(contains(error_of([&] { ops::pack_signs_with_feedback(at::zeros({2 * block}), e2); }),
                       "the error is Float of 1024 values"));
  EXPECT_TRUE(
      contains(error_of([] { ops::unpack_signs(at::zeros({64}, at::kInt), at::zeros({1})); }),
               "do not match"));
}

// PowerSGD's orthogonalisation (ops/orthogonalize.h; on CPU tensors the kernel's host reference)
// against the textbook modified Gram-Schmidt in fp64, for ranks 1 to 32 and 8 to 3000 rows, the
// matrices packed apart in one buffer. Each column is a unit vector orthogonal to the others and
// equal to the fp64 result within 4 u rows kappa (the dot products' rounding, amplified by the
// matrix's condition number kappa); the values between the matrices are untouched; a zero column
// stays zero and the later columns are orthonormalized without it.
TEST(Orthogonalize, MatchesGramSchmidtInFp64) {
  struct Shape {
    int64_t rows, rank;
  };
  const std::vector<Shape> shapes = {{8, 1}, {100, 2}, {1000, 4}, {300, 8}, {3000, 32}, {64, 32}};
  for (const auto& s : shapes) {
    SCOPED_TRACE(std::to_string(s.rows) + " x " + std::to_string(s.rank));
    auto gen = at::make_generator<at::CPUGeneratorImpl>(uint64_t(s.rows * 97 + s.rank));
    // Two matrices, 5 sentinel values before, between and after them.
    const int64_t size = s.rows * s.rank;
    auto data = at::full({3 * 5 + 2 * size}, 7.25f);
    const std::vector<int64_t> offsets = {5, 10 + size}, rows = {s.rows, s.rows};
    for (const int64_t offset : offsets)
      data.narrow(0, offset, size).copy_(at::randn({size}, gen) * 1e-3);
    if (s.rank >= 3) data.narrow(0, offsets[1], size).view({s.rows, s.rank}).select(1, 1).zero_();
    const auto before = data.clone();
    ops::orthogonalize_columns_(data, offsets, rows, s.rank);
    for (size_t m = 0; m < 2; ++m) {
      const auto input =
          before.narrow(0, offsets[m], size).view({s.rows, s.rank}).to(at::kDouble);
      const auto got = data.narrow(0, offsets[m], size).view({s.rows, s.rank}).to(at::kDouble);
      // fp64 reference
      auto want = input.clone();
      std::vector<int64_t> nonzero;
      for (int64_t i = 0; i < s.rank; ++i) {
        auto col = want.select(1, i);
        const double norm2 = col.dot(col).item<double>();
        if (norm2 == 0) continue;
        nonzero.push_back(i);
        for (int64_t j = i + 1; j < s.rank; ++j) {
          auto other = want.select(1, j);
          other -= col * (col.dot(other).item<double>() / norm2);
        }
        col /= std::sqrt(norm2);
      }
      const auto kept = at::tensor(nonzero, at::kLong);
      const auto sv = at::linalg_svdvals(input.index_select(1, kept));
      const double kappa = (sv[0] / sv[-1]).item<double>();
      const double bound = 4 * kU * double(s.rows) * kappa;
      const double gap = (got - want).abs().max().item<double>();
      EXPECT_LE(gap, bound) << "matrix " << m;
      const auto basis = got.index_select(1, kept);
      const auto gram = at::mm(basis.t(), basis) - at::eye(basis.size(1), at::kDouble);
      const double off = gram.abs().max().item<double>();
      EXPECT_LE(off, bound) << "matrix " << m;
      if (std::getenv("LOOM_TEST_VERBOSE") != nullptr)
        std::printf(
            "%lld x %lld, matrix %zu: kappa %.3g, gap %.3g and |P^T P - I| %.3g of the "
            "bound %.3g\n",
            (long long)s.rows, (long long)s.rank, m, kappa, gap / bound, off / bound, bound);
      if (nonzero.size() < size_t(s.rank)) {
        EXPECT_TRUE(at::equal(got.select(1, 1), at::zeros({s.rows}, at::kDouble)));
      }
    }
    for (const int64_t from : {int64_t(0), offsets[0] + size, offsets[1] + size})
      EXPECT_TRUE(at::equal(data.narrow(0, from, 5), at::full({5}, 7.25f)));
  }
}

TEST(Orthogonalize, BadInputIsNamed) {
  auto data = at::zeros({100});
  EXPECT_TRUE(contains(error_of([&] { ops::orthogonalize_columns_(data, {0}, {10}, 0); }),
                       "rank 0 is outside [1, 32]"));
  EXPECT_TRUE(contains(error_of([&] { ops::orthogonalize_columns_(data, {0}, {10}, 33); }),
                       "rank 33 is outside [1, 32]"));
  EXPECT_TRUE(contains(error_of([&] { ops::orthogonalize_columns_(data, {0, 30}, {10, 10}, 4); }),
                       "overlaps another matrix"));
  EXPECT_TRUE(contains(error_of([&] { ops::orthogonalize_columns_(data, {70}, {10}, 4); }),
                       "outside the buffer of 100 values"));
  EXPECT_TRUE(contains(error_of([&] { ops::orthogonalize_columns_(data, {0}, {1, 2}, 4); }),
                       "1 offsets for 2 row counts"));
  auto half = at::zeros({100}, at::kHalf);
  EXPECT_TRUE(contains(error_of([&] { ops::orthogonalize_columns_(half, {0}, {10}, 4); }),
                       "contiguous float32 1-D"));
}

// --compress-activations' codecs (parallel/pipeline/activation_codec.h), as a pipeline message
// carries them: encoded, copied into the buffers the receiver allocates from the header's sizes,
// dtype and codec, decoded. none returns the same bits; bf16 the bf16 rounding; int8 each value
// within half a step of its block (scale = the block's largest magnitude / 127, ops/quantize.h),
// the tail padded to a whole block. Bytes on the wire as encoded_bytes states; tensors that are
// not floating point (and bf16 ones under bf16) go as they are.
TEST(ActivationCodec, EachCodecRoundTripsWithinItsBoundAndCountsItsBytes) {
  namespace pl = loom::parallel::pipeline;
  auto through_the_wire = [](const at::Tensor& t, pl::ActivationCodec codec) {
    const auto used = pl::codec_for(t.scalar_type(), codec);
    const auto sent = pl::encode_activation(t, codec);
    auto received = pl::activation_parts(t.sizes(), t.scalar_type(), used, t.device());
    EXPECT_EQ(sent.size(), received.size());
    int64_t bytes = 0;
    for (size_t i = 0; i < sent.size() && i < received.size(); ++i) {
      EXPECT_EQ(sent[i].sizes(), received[i].sizes()) << "part " << i;
      EXPECT_EQ(sent[i].scalar_type(), received[i].scalar_type()) << "part " << i;
      received[i].copy_(sent[i]);
      bytes += sent[i].numel() * sent[i].element_size();
    }
    EXPECT_EQ(bytes, pl::encoded_bytes(t.numel(), t.scalar_type(), codec));
    auto out = pl::decode_activation(received, t.sizes(), t.scalar_type(), used);
    EXPECT_EQ(out.sizes(), t.sizes());
    EXPECT_EQ(out.scalar_type(), t.scalar_type());
    return out;
  };
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  // 1500 values: five whole blocks of 256 and a tail of 220, one block much larger than the rest.
  auto x = at::randn({3, 5, 100}, gen);
  x.view({-1}).narrow(0, 256, 256).mul_(1000);
  EXPECT_TRUE(at::equal(through_the_wire(x, pl::ActivationCodec::kNone), x));
  EXPECT_TRUE(at::equal(through_the_wire(x, pl::ActivationCodec::kBf16),
                        x.to(at::kBFloat16).to(at::kFloat)));
  const auto q = through_the_wire(x, pl::ActivationCodec::kInt8);
  EXPECT_EQ(pl::encoded_bytes(1500, at::kFloat, pl::ActivationCodec::kInt8), 1536 + 6 * 4);
  auto padded = at::constant_pad_nd(x.reshape({-1}), {0, 36}, 0.0).view({6, 256});
  auto error = at::constant_pad_nd((q - x).reshape({-1}), {0, 36}, 0.0).view({6, 256});
  auto half_step = std::get<0>(padded.abs().max(1)) / 127 / 2;
  // The bound plus the fp32 roundings of the scale and the division: a few units in the last
  // place of the block's largest value.
  auto slack = std::get<0>(padded.abs().max(1)) * 4 * std::numeric_limits<float>::epsilon();
  EXPECT_TRUE(at::all(std::get<0>(error.abs().max(1)) <= half_step + slack).item<bool>())
      << "worst error per block " << std::get<0>(error.abs().max(1)) << " half steps " << half_step;
  EXPECT_GT((q - x).abs().max().item<double>(), 0) << "int8 lost nothing: the test cannot tell";
  EXPECT_NO_THROW(through_the_wire(x, pl::ActivationCodec::kInt8).requires_grad_(true));
  // Other dtypes: fp64 compressed the same way; bf16 under bf16 and integers sent as they are.
  auto x64 = at::randn({2, 7}, gen).to(at::kDouble);
  EXPECT_TRUE(at::equal(through_the_wire(x64, pl::ActivationCodec::kBf16),
                        x64.to(at::kBFloat16).to(at::kDouble)));
  EXPECT_EQ(pl::encoded_bytes(14, at::kDouble, pl::ActivationCodec::kInt8), 256 + 4);
  auto xb = at::randn({4, 64}, gen).to(at::kBFloat16);
  EXPECT_EQ(pl::codec_for(at::kBFloat16, pl::ActivationCodec::kBf16), pl::ActivationCodec::kNone);
  EXPECT_TRUE(at::equal(through_the_wire(xb, pl::ActivationCodec::kBf16), xb));
  auto ids = at::randint(0, 50, {3, 9}, gen);
  EXPECT_TRUE(at::equal(through_the_wire(ids, pl::ActivationCodec::kInt8), ids));
  EXPECT_EQ(pl::encoded_bytes(27, at::kLong, pl::ActivationCodec::kInt8), 27 * 8);
}

TEST(ActivationCodec, BadNamesAndLayoutsAreRefusedWithTheValidOnes) {
  namespace pl = loom::parallel::pipeline;
  EXPECT_EQ(pl::parse_activation_codec("int8"), pl::ActivationCodec::kInt8);
  const auto bad = error_of([] { pl::parse_activation_codec("fp8"); });
  EXPECT_TRUE(contains(bad, "'fp8'") && contains(bad, "none, bf16 or int8")) << bad;
  loom::train::TrainConfig config;
  config.data = "unused.bin";
  config.compress_activations = "int8";
  const auto no_pipeline = error_of([&] { config.validate(); });
  EXPECT_TRUE(contains(no_pipeline, "--compress-activations int8") &&
              contains(no_pipeline, "--pp > 1"))
      << no_pipeline;
  config.pp = 2;
  config.validate();
  config.compress_activations = "int4";
  EXPECT_TRUE(contains(error_of([&] { config.validate(); }), "none, bf16 or int8"));
}
