// The fused cross-entropy (ops/cross_entropy.h) on the CPU, where it runs the kernels' host
// reference: against plain ATen math in fp64 (loss and gradient, with ignored targets, padding
// columns, z-loss), in fp32/fp16/bf16 against fp64 math within the error of its fp32 sums, the
// gradient written over the logits, NaN for a target no column holds, the errors; and whole
// GPT-2 / Llama models whose loss runs fused against the same models on the math path (fp64,
// loss and every gradient), with and without vocabulary padding and z-loss.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>

#include "loom/core/error.h"
#include "loom/models/causal_lm.h"
#include "loom/ops/cross_entropy.h"
#include "loom/ops/cuda.h"
#include "loom/parallel/tensor/cross_entropy.h"
#include "loom/parallel/tensor/tp_group.h"
#include "model_test_util.h"
#include "test_util.h"

namespace {

using loom::testing::contains;
using loom::testing::error_of;
using loom::testing::max_rel_diff;
namespace ops = loom::ops;
namespace models = loom::models;

at::Tensor randn(std::vector<int64_t> shape, uint64_t seed, at::ScalarType dtype = at::kDouble) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(seed);
  return (at::randn(shape, g, at::kDouble) * 3).to(dtype);
}

// Targets over [0, vocab), with a few rows set to ignore_index.
at::Tensor make_targets(std::vector<int64_t> shape, int64_t vocab, uint64_t seed) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto t = at::randint(0, vocab, shape, g, at::kLong);
  t.view({-1})[1] = -100;
  t.view({-1})[4] = -100;
  return t;
}

// The plain math: mean over the counted rows of logsumexp - x[target] + z logsumexp^2.
at::Tensor plain_loss(const at::Tensor& logits, const at::Tensor& targets, double z_loss) {
  auto x = logits.reshape({-1, logits.size(-1)});
  auto t = targets.reshape({-1});
  auto loss = at::cross_entropy_loss(x, t);  // ignore_index -100 by default
  if (z_loss == 0) return loss;
  const auto counted = t != -100;
  const auto lse = at::logsumexp(x, 1);
  return loss + z_loss * (lse.square() * counted).sum() / counted.sum();
}

// Loss and gradient of `fused` (true: ops::fused_cross_entropy, else plain_loss) at these logits.
std::pair<at::Tensor, at::Tensor> loss_and_grad(const at::Tensor& logits, const at::Tensor& targets,
                                                const ops::FusedCrossEntropyOptions& o,
                                                bool fused) {
  auto x = logits.clone().requires_grad_();
  auto loss = fused ? ops::fused_cross_entropy(x, targets, o) : plain_loss(x, targets, o.z_loss);
  loss.backward();
  return {loss.detach(), x.grad()};
}

// fp64 sums of a few hundred terms: within ~1e-14 relative; bound 1e-12.
constexpr double kFp64Bound = 1e-12;

TEST(FusedCrossEntropy, Fp64EqualsPlainMathWithIgnoredTargetsAndZLoss) {
  for (const int64_t vocab : {37, 300, 1000})
    for (const double z : {0.0, 1e-2}) {
      const auto logits = randn({3, 5, vocab}, 1 + vocab);
      const auto targets = make_targets({3, 5}, vocab, 2);
      ops::FusedCrossEntropyOptions o;
      o.z_loss = z;
      const auto [want_loss, want_grad] = loss_and_grad(logits, targets, o, false);
      const auto [loss, grad] = loss_and_grad(logits, targets, o, true);
      EXPECT_EQ(loss.scalar_type(), at::kDouble);
      EXPECT_LE(std::fabs(loss.item<double>() - want_loss.item<double>()),
                kFp64Bound * std::fabs(want_loss.item<double>()))
          << "vocab " << vocab << " z " << z;
      EXPECT_LE(max_rel_diff(grad, want_grad), kFp64Bound) << "vocab " << vocab << " z " << z;
      if (std::getenv("LOOM_TEST_VERBOSE"))
        std::printf("vocab %lld z %g: loss %.3g, gradient %.3g relative\n", (long long)vocab, z,
                    std::fabs(loss.item<double>() - want_loss.item<double>()) /
                        std::fabs(want_loss.item<double>()),
                    max_rel_diff(grad, want_grad));
      // Ignored rows: no gradient at all.
      EXPECT_EQ(grad.view({-1, vocab})[1].abs().max().item<double>(), 0.0);
    }
}

TEST(FusedCrossEntropy, PaddingColumnsAreLeftOutAndGetNoGradient) {
  const int64_t vocab = 45, padded = 64;
  const auto logits = randn({4, 6, vocab}, 3);
  const auto targets = make_targets({4, 6}, vocab, 4);
  // Padding with huge values: they would swamp the softmax if they were counted.
  const auto padded_logits =
      at::cat({logits, at::full({4, 6, padded - vocab}, 1e4, at::kDouble)}, -1);
  ops::FusedCrossEntropyOptions o;
  const auto [want_loss, want_grad] = loss_and_grad(logits, targets, o, false);
  o.valid = vocab;
  const auto [loss, grad] = loss_and_grad(padded_logits, targets, o, true);
  EXPECT_NEAR(loss.item<double>(), want_loss.item<double>(), kFp64Bound * want_loss.item<double>());
  EXPECT_LE(max_rel_diff(grad.narrow(-1, 0, vocab), want_grad), kFp64Bound);
  EXPECT_EQ(grad.narrow(-1, vocab, padded - vocab).abs().max().item<double>(), 0.0);
}

TEST(FusedCrossEntropy, NarrowDtypesAreWithinTheErrorOfTheirFp32Sums) {
  // The same rounded logits in fp64 are the reference. The loss: each host "thread" folds
  // ceil(V / 256) values, then 10 butterfly levels, each step a few fp32 roundings: the
  // log-sum-exp is within (V / 256 + 11) * 5 * 2^-24 (plus 2 roundings of |lse|); the mean adds
  // one rounding per row. The gradient: fp32 arithmetic (|x - lse| + 6) * 2^-24 relative to p,
  // then one rounding to the element type (2^-8 bf16, 2^-11 fp16, 2^-24 fp32).
  const int64_t vocab = 1000, rows = 24;
  for (const auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    const auto logits = randn({rows, vocab}, 5, dtype);
    const auto exact = logits.to(at::kDouble);
    const auto targets = make_targets({rows}, vocab, 6);
    ops::FusedCrossEntropyOptions o;
    const auto [want_loss, want_grad] = loss_and_grad(exact, targets, o, false);
    const auto [loss, grad] = loss_and_grad(logits, targets, o, true);
    EXPECT_EQ(loss.scalar_type(), at::kFloat);
    EXPECT_EQ(grad.scalar_type(), dtype);
    const double u32 = std::ldexp(1.0, -24);
    const double lse_max = at::logsumexp(exact, 1).abs().max().item<double>();
    const double loss_bound = (double(vocab) / 256 + 11) * 5 * u32 + 2 * u32 * lse_max +
                              double(rows) * u32 * std::fabs(want_loss.item<double>());
    EXPECT_LE(std::fabs(loss.item<double>() - want_loss.item<double>()), loss_bound)
        << c10::toString(dtype);
    const double unit = dtype == at::kBFloat16 ? std::ldexp(1.0, -8)
                        : dtype == at::kHalf   ? std::ldexp(1.0, -11)
                                               : u32;
    const double spread = (exact - at::logsumexp(exact, 1, true)).abs().max().item<double>();
    const double scale = 1.0 / double(rows - 2);  // two rows ignored
    const auto err = (grad.to(at::kDouble) - want_grad).abs();
    const auto bound = want_grad.abs() * unit * 1.01 +
                       scale * ((want_grad.abs() / scale + 1) * (spread + 6) * u32 + 4 * u32);
    EXPECT_TRUE((err <= bound).all().item<bool>())
        << c10::toString(dtype) << ": worst excess " << (err - bound).max().item<double>();
    if (std::getenv("LOOM_TEST_VERBOSE"))
      std::printf("%s: loss error %.3g (bound %.3g), gradient error / bound at most %.3g\n",
                  c10::toString(dtype), std::fabs(loss.item<double>() - want_loss.item<double>()),
                  loss_bound, (err / bound).max().item<double>());
  }
}

TEST(FusedCrossEntropy, OverwritingTheLogitsGivesTheSameGradientAndRefusesASecondBackward) {
  const int64_t vocab = 50;
  const auto logits = randn({2, 7, vocab}, 7);
  const auto targets = make_targets({2, 7}, vocab, 8);
  ops::FusedCrossEntropyOptions o;
  const auto [want_loss, want_grad] = loss_and_grad(logits, targets, o, true);

  // A non-leaf (as a model's head output is): its memory becomes the gradient.
  auto w = at::ones({}, at::kDouble).requires_grad_();
  auto x = logits * w;
  o.overwrite_logits = true;
  auto loss = ops::fused_cross_entropy(x, targets, o);
  const auto x_grad = torch::autograd::grad({loss}, {x}, {}, /*retain_graph=*/true)[0];
  EXPECT_TRUE(at::equal(x_grad, want_grad));
  EXPECT_TRUE(at::equal(x.detach(), want_grad)) << "the gradient was not written over the logits";
  const auto msg = error_of<std::exception>([&] { loss.backward(); });
  EXPECT_TRUE(contains(msg, "second backward")) << msg;

  // Without overwrite_logits the caller's logits are left alone.
  auto y = logits * w;
  o.overwrite_logits = false;
  ops::fused_cross_entropy(y, targets, o).backward();
  EXPECT_TRUE(at::equal(y.detach(), logits));

  // Another node that saved the logits sees them changed: autograd refuses, loudly.
  // Made first, so that its backward runs after the loss's (autograd runs later nodes first).
  auto z = logits * w;
  auto square = (z * z).sum();
  o.overwrite_logits = true;
  auto fused_loss = ops::fused_cross_entropy(z, targets, o);
  auto total = fused_loss + square;
  const auto saved_msg = error_of<std::exception>([&] { total.backward(); });
  EXPECT_TRUE(contains(saved_msg, "modified by an inplace operation")) << saved_msg;
}

TEST(FusedCrossEntropy, NaNWhereNoColumnHoldsTheTargetOrEveryRowIsIgnored) {
  const int64_t vocab = 20;
  const auto logits = randn({3, vocab}, 9);
  ops::FusedCrossEntropyOptions o;
  o.valid = 16;  // ids 16..19 are padding here
  auto outside = at::tensor({3, 17, 5}, at::kLong);
  EXPECT_TRUE(std::isnan(ops::fused_cross_entropy(logits, outside, o).item<double>()));
  auto ignored = at::full({3}, -100, at::kLong);
  EXPECT_TRUE(std::isnan(ops::fused_cross_entropy(logits, ignored, {}).item<double>()));
  // A NaN logit reaches the loss.
  auto with_nan = logits.clone();
  with_nan[1][4] = std::numeric_limits<double>::quiet_NaN();
  EXPECT_TRUE(std::isnan(
      ops::fused_cross_entropy(with_nan, at::tensor({0, 1, 2}, at::kLong), {}).item<double>()));
}

TEST(FusedCrossEntropy, BadInputIsNamed) {
  const auto logits = randn({2, 8}, 10);
  const auto targets = at::tensor({1, 2}, at::kLong);
  auto msg = error_of([&] { ops::fused_cross_entropy(logits, targets.to(at::kInt), {}); });
  EXPECT_TRUE(contains(msg, "targets must be int64")) << msg;
  msg = error_of([&] { ops::fused_cross_entropy(logits, at::tensor({1, 2, 3}, at::kLong), {}); });
  EXPECT_TRUE(contains(msg, "do not match")) << msg;
  ops::FusedCrossEntropyOptions o;
  o.z_loss = -1;
  msg = error_of([&] { ops::fused_cross_entropy(logits, targets, o); });
  EXPECT_TRUE(contains(msg, "z_loss -1")) << msg;
  o = {};
  o.valid = 9;
  msg = error_of([&] { ops::fused_cross_entropy(logits, targets, o); });
  EXPECT_TRUE(contains(msg, "valid 9")) << msg;
  msg = error_of([&] { ops::parse_loss_backend("fast"); });
  EXPECT_TRUE(contains(msg, "'fast'") && contains(msg, "auto, fused, math")) << msg;
  msg = error_of([&] { ops::uses_fused_loss(ops::LossBackend::kFused, targets); });
  EXPECT_TRUE(contains(msg, "Long")) << msg;
  EXPECT_FALSE(ops::uses_fused_loss(ops::LossBackend::kAuto, logits));  // CPU: math
  EXPECT_TRUE(ops::uses_fused_loss(ops::LossBackend::kFused, logits));
}

// --- On a GPU (scripts/gpu-check; skipped elsewhere) ------------------------------------

// The kernels against their host reference (the same algorithm; only expf's last bits differ)
// and against fp64 math, at GPT-2's head width (odd: scalar loads) and padded (16-byte vector
// loads), with ignored rows and z-loss.
TEST(FusedCrossEntropyGpu, KernelsMatchTheHostReferenceAndFp64Math) {
  if (!ops::built_with_cuda()) GTEST_SKIP() << "built without LOOM_WITH_CUDA";
  if (ops::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device on this machine";
  struct Case {
    at::ScalarType dtype;
    int64_t rows, vocab;
    double z;
  };
  for (const auto& c : {Case{at::kBFloat16, 257, 50257, 0.0}, Case{at::kBFloat16, 256, 50304, 1e-4},
                        Case{at::kHalf, 64, 1000, 0.0}, Case{at::kFloat, 64, 1001, 1e-3}}) {
    const auto what = fmt::format("{} {} x {}", c10::toString(c.dtype), c.rows, c.vocab);
    const auto logits = randn({c.rows, c.vocab}, 21, c.dtype);
    const auto targets = make_targets({c.rows}, c.vocab, 22);
    ops::FusedCrossEntropyOptions o;
    o.z_loss = c.z;
    const auto [host_loss, host_grad] = loss_and_grad(logits, targets, o, true);
    const auto [gpu_loss, gpu_grad] = loss_and_grad(logits.cuda(), targets.cuda(), o, true);
    const auto [want_loss, want_grad] = loss_and_grad(logits.to(at::kDouble), targets, o, false);
    const double u32 = std::ldexp(1.0, -24);
    // GPU expf within 2 ulp of the host's: each row's sum within ~2u relative, each gradient
    // within 2u before its rounding to the element type (then one unit apart at most).
    EXPECT_NEAR(gpu_loss.item<double>(), host_loss.item<double>(),
                8 * u32 * std::fabs(host_loss.item<double>()) + 1e-6)
        << what;
    const double unit = c.dtype == at::kBFloat16 ? std::ldexp(1.0, -8)
                        : c.dtype == at::kHalf   ? std::ldexp(1.0, -11)
                                                 : u32;
    const auto host = host_grad.to(at::kDouble);
    const auto gpu = gpu_grad.cpu().to(at::kDouble);
    EXPECT_TRUE(((gpu - host).abs() <= host.abs() * 2.01 * unit + 1e-9).all().item<bool>())
        << what << ": worst " << (gpu - host).abs().max().item<double>();
    // fp64 math: the bound of NarrowDtypesAreWithinTheErrorOfTheirFp32Sums.
    const double lse_max = at::logsumexp(logits.to(at::kDouble), 1).abs().max().item<double>();
    const double loss_bound = (double(c.vocab) / 256 + 11) * 5 * u32 + 2 * u32 * lse_max +
                              double(c.rows) * u32 * std::fabs(want_loss.item<double>()) +
                              c.z * 4 * lse_max * ((double(c.vocab) / 256 + 11) * 5 * u32);
    EXPECT_NEAR(gpu_loss.item<double>(), want_loss.item<double>(), loss_bound) << what;
    EXPECT_LE(max_rel_diff(gpu, want_grad), 3 * unit + 1e-5) << what;
  }
}

// --- Whole models: fused against math, fp64 ----------------------------------------------

struct ModelCase {
  models::Family family;
  int64_t pad_multiple;  // the vocabulary padded to a multiple of this (1: none)
  double z_loss;
};

class FusedLossModel : public ::testing::TestWithParam<ModelCase> {};

// Loss and every gradient (by name) of one forward and backward.
std::pair<double, std::map<std::string, at::Tensor>> step(models::CausalLM& m,
                                                          const at::Tensor& tokens,
                                                          const at::Tensor& targets) {
  m.zero_grad();
  auto loss = m.loss(tokens, targets);
  // The backend asked for is the one that ran (else fused-vs-math compares math with itself).
  const bool fused = loss.grad_fn()->name().find("FusedCrossEntropy") != std::string::npos;
  EXPECT_EQ(fused, m.loss_backend() == ops::LossBackend::kFused) << loss.grad_fn()->name();
  loss.backward();
  std::map<std::string, at::Tensor> grads;
  for (const auto& item : m.named_parameters())
    grads.emplace(item.key(), item.value().grad().clone());
  return {loss.item<double>(), grads};
}

TEST_P(FusedLossModel, LossAndEveryGradientEqualTheMathPathInFp64) {
  const auto [family, pad_multiple, z_loss] = GetParam();
  auto config = loom::testing::tiny_model_config(family, 61);
  auto tp = std::make_shared<loom::parallel::tensor::TpGroup>(
      nullptr, loom::parallel::tensor::TpOptions{false, pad_multiple});
  config.dropout = 0;  // train mode (the z-loss is a training term) with nothing random
  auto model = models::make_model(config, tp);
  models::init_parameters(*model, 3);
  model->to(at::kDouble);
  model->train();
  model->set_z_loss(z_loss);
  auto g = at::make_generator<at::CPUGeneratorImpl>(11);
  const auto tokens = at::randint(0, config.vocab_size, {3, 16}, g, at::kLong);
  const auto targets = at::randint(0, config.vocab_size, {3, 16}, g, at::kLong);

  model->set_loss_backend(ops::LossBackend::kMath);
  const auto [want_loss, want] = step(*model, tokens, targets);
  model->set_loss_backend(ops::LossBackend::kFused);
  const auto [loss, got] = step(*model, tokens, targets);
  // One forward and backward of a small model in another order of sums: ~1e-14; bound 1e-11
  // (docs/testing.md).
  EXPECT_NEAR(loss, want_loss, 1e-11 * want_loss);
  double worst = std::fabs(loss - want_loss) / want_loss;
  for (const auto& [name, grad] : want) {
    const double rel = max_rel_diff(got.at(name), grad);
    EXPECT_LE(rel, 1e-11) << name;
    worst = std::max(worst, rel);
  }
  if (std::getenv("LOOM_TEST_VERBOSE")) std::printf("fused vs math: worst relative %.3g\n", worst);

  // The z-loss term itself, against the whole logits' log-sum-exp; in eval mode the loss is
  // the cross-entropy alone (the validation loss stays comparable).
  {
    torch::NoGradGuard no_grad;
    const auto logits = model->forward(tokens);
    const double ce =
        at::cross_entropy_loss(logits.reshape({-1, config.vocab_size}), targets.reshape({-1}))
            .item<double>();
    const double z = at::logsumexp(logits, -1).square().mean().item<double>();
    EXPECT_NEAR(loss, ce + z_loss * z, 1e-11 * loss);
    model->eval();
    EXPECT_NEAR(model->loss(tokens, targets).item<double>(), ce, 1e-11 * ce);
    model->train();
  }

  // Per-row losses for per-source metrics: a training loss records each row's summed
  // cross-entropy (the z-loss left out), taken once; an evaluation loss records nothing.
  {
    model->set_record_row_losses(true);
    model->loss(tokens, targets);
    auto recorded = model->take_row_losses();
    ASSERT_EQ(recorded.size(), 1u);
    EXPECT_EQ(recorded[0].tokens_per_row, 16);
    EXPECT_TRUE(model->take_row_losses().empty());
    torch::NoGradGuard no_grad;
    const auto logits = model->forward(tokens);
    const auto rows = at::cross_entropy_loss(logits.reshape({-1, config.vocab_size}),
                                             targets.reshape({-1}), {}, at::Reduction::None)
                          .view({3, 16})
                          .sum(1);
    EXPECT_LT(max_rel_diff(recorded[0].sums, rows), 1e-12);
    model->eval();
    model->loss(tokens, targets);
    EXPECT_TRUE(model->take_row_losses().empty());
    model->train();
    model->set_record_row_losses(false);
  }

  // loss_from_logits leaves the caller's logits alone; loss() may overwrite its own.
  auto logits = model->logits_shard(tokens);
  const auto before = logits.detach().clone();
  model->loss_from_logits(logits, targets).backward();
  EXPECT_TRUE(at::equal(logits.detach(), before));
}

// The per-token losses per-source metrics are measured with: chunks of rows (here three: 2^24 /
// 262147 columns = 64 rows a chunk, 150 rows) and padding columns left out give each token's
// cross-entropy of the unpadded columns, from bf16 logits as from their fp32 values.
TEST(VocabParallelTokenLosses, ChunksAndPaddingGiveEachTokensCrossEntropy) {
  constexpr int64_t kVocab = 262140, kPadded = 262147;
  auto tp = std::make_shared<loom::parallel::tensor::TpGroup>(nullptr);
  auto g = at::make_generator<at::CPUGeneratorImpl>(5);
  const auto logits = (at::randn({3, 50, kPadded}, g) * 3).to(at::kBFloat16);
  const auto targets = at::randint(0, kVocab, {3, 50}, g, at::kLong);
  const auto got =
      loom::parallel::tensor::vocab_parallel_token_losses(logits, targets, kVocab, *tp);
  ASSERT_EQ(got.sizes(), targets.sizes());
  EXPECT_EQ(got.scalar_type(), at::kFloat);
  const auto want =
      at::cross_entropy_loss(logits.narrow(-1, 0, kVocab).to(at::kFloat).reshape({-1, kVocab}),
                             targets.reshape({-1}), {}, at::Reduction::None);
  // Both sum 2.6e5 fp32 exponentials pairwise (ATen's reductions): each sum errs by about
  // (log2 V + 4) eps ~ 1.3e-6 relative; 1e-4 leaves room for any order a CPU's kernels take.
  EXPECT_LT(max_rel_diff(got.reshape({-1}), want), 1e-4);
  const auto msg = loom::testing::error_of([&] {
    loom::parallel::tensor::vocab_parallel_token_losses(logits, targets.narrow(1, 0, 7), kVocab,
                                                        *tp);
  });
  EXPECT_TRUE(loom::testing::contains(msg, "do not match")) << msg;
}

INSTANTIATE_TEST_SUITE_P(Families, FusedLossModel,
                         ::testing::Values(ModelCase{models::Family::kGpt2, 1, 0.0},
                                           ModelCase{models::Family::kGpt2, 64, 0.0},
                                           ModelCase{models::Family::kLlama, 1, 1e-3},
                                           ModelCase{models::Family::kLlama, 64, 0.0},
                                           ModelCase{models::Family::kGpt2, 1, 1e-3}),
                         [](const ::testing::TestParamInfo<ModelCase>& info) {
                           return fmt::format("{}_pad{}{}", models::to_string(info.param.family),
                                              info.param.pad_multiple,
                                              info.param.z_loss > 0 ? "_zloss" : "");
                         });

TEST(FusedLossModel, ZLossWeightIsChecked) {
  auto model =
      loom::testing::make_initialized(loom::testing::tiny_model_config(models::Family::kGpt2));
  const auto msg = error_of([&] { model->set_z_loss(-0.5); });
  EXPECT_TRUE(contains(msg, "z-loss weight -0.5")) << msg;
}

}  // namespace
