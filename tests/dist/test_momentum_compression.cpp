// momentum=B on a communication hook (1-bit Adam's momentum compression): the optimizer's
// momentum update, fed what the hook returns, rebuilds the averaged momentum the hook kept; with
// the exact average the returned gradient is the mean gradient; a NaN leaves the momentum as it
// was; the state (the momentum and the inner hook's errors) round-trips.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <vector>

#include "dist_util.h"
#include "loom/ops/adamw.h"
#include "loom/parallel/data/comm_hook.h"

using loom::testing::same_on_every_rank;
using loom::testing::world;
namespace pd = loom::parallel::data;

namespace {

constexpr double kU = 5.960464477539063e-08;  // 2^-24

constexpr int kGradientSeed = 1300;

at::Tensor gradient_of(int rank, int step, int64_t n) {
  return loom::testing::rank_gradient(kGradientSeed, rank, step, n);
}

std::shared_ptr<pd::MomentumCompressionHook> momentum_hook(const std::string& spec) {
  auto hook = std::dynamic_pointer_cast<pd::MomentumCompressionHook>(pd::make_comm_hook(spec));
  EXPECT_NE(hook, nullptr) << spec;
  return hook;
}

constexpr int kWarmup = 3, kSteps = 8;

struct FrozenAdamWRun {
  std::vector<at::Tensor> steps;           // per compressed step: each value's step
  std::vector<bool> exempt_from_clipping;  // per step
};

// kSteps steps of one n-value bucket through `hook` (made with warmup=kWarmup), this rank's
// gradient at step t from `gradient`, and AdamW (variance frozen after the warm-up, no decay) fed
// what the hook returns. For each compressed step, the step AdamW takes per unit of
// lr / (1 - beta1^t) (weight before minus after, unsigned).
FrozenAdamWRun steps_after_warmup(pd::MomentumCompressionHook& hook, int64_t n,
                                  const std::function<at::Tensor(int)>& gradient) {
  loom::ops::AdamWOptions adamw;
  adamw.freeze_variance_after = kWarmup;
  adamw.weight_decay = 0;
  const auto exp_avg = at::zeros({n}), exp_avg_sq = at::zeros({n});
  pd::GradBucket bucket;
  bucket.index = 0;
  bucket.buffer = at::zeros({n});
  FrozenAdamWRun run;
  for (int t = 0; t < kSteps; ++t) {
    hook.begin_step(t);
    bucket.buffer.copy_(gradient(t));
    hook.start(bucket, world())->wait();
    hook.finish(bucket, world());
    run.exempt_from_clipping.push_back(hook.exempt_from_clipping_this_step());
    const auto weight = at::zeros({n});
    loom::ops::adamw_update_(weight, bucket.buffer, exp_avg, exp_avg_sq, 1.0, t + 1, adamw);
    if (t >= kWarmup) run.steps.push_back(weight.abs() * (1 - std::pow(adamw.beta1, t + 1)));
  }
  return run;
}

}  // namespace

// Six steps through avg and through onebit (2 of them dense), beta 0.9. Every rank gets the same
// gradient; AdamW's momentum update m <- beta m + (1 - beta) g applied to it (in fp64, from zero)
// gives the hook's averaged momentum within 8 u / (1 - beta) of the largest momentum per step (the
// division by 1 - beta and the update's roundings). Through avg (and onebit's dense steps) the
// averages are exact, so the gradient handed over is the mean gradient within 16 u / (1 - beta)
// of the largest momentum and mean gradient; through onebit's compressed steps it is not.
TEST(MomentumCompression, TheOptimizersMomentumUpdateRebuildsTheAveragedMomentum) {
  auto& comm = world();
  const int ranks = comm.size();
  const int64_t n = 4096;
  const double beta = 0.9;
  for (const std::string spec : {"avg:momentum=0.9", "onebit:warmup=2,momentum=0.9"}) {
    SCOPED_TRACE(spec);
    const auto hook = momentum_hook(spec);
    pd::GradBucket bucket;
    bucket.index = 1;
    bucket.buffer = at::zeros({n});
    auto optimizer_m = at::zeros({n}, at::kDouble);
    double worst = 0, worst_mean = 0;
    for (int t = 0; t < 6; ++t) {
      hook->begin_step(t);
      bucket.buffer.copy_(gradient_of(comm.rank(), t, n));
      const auto mean = loom::testing::mean_rank_gradient(kGradientSeed, t, n);
      hook->start(bucket, comm)->wait();
      hook->finish(bucket, comm);
      ASSERT_TRUE(same_on_every_rank(bucket.buffer)) << "step " << t;
      optimizer_m = beta * optimizer_m + (1 - beta) * bucket.buffer.to(at::kDouble);
      const auto kept = hook->momentum(bucket.index).to(at::kDouble);
      const double scale = std::max(kept.abs().max().item<double>(), 1e-30);
      const double gap = (optimizer_m - kept).abs().max().item<double>();
      worst = std::max(worst, gap / scale);
      EXPECT_LE(gap, (t + 1) * 8 * kU / (1 - beta) * scale) << "step " << t;
      const double from_mean = (bucket.buffer.to(at::kDouble) - mean).abs().max().item<double>();
      worst_mean = std::max(worst_mean, from_mean / scale);
      if (spec.rfind("avg", 0) == 0 || t < 2) {
        EXPECT_LE(from_mean, 16 * kU / (1 - beta) * (scale + mean.abs().max().item<double>()))
            << "step " << t << ": the exact average does not give the mean gradient back";
      } else {
        EXPECT_GT(from_mean, 1e-3) << "step " << t << ": not compressed";
      }
    }
    if (std::getenv("LOOM_TEST_VERBOSE") != nullptr)
      std::printf(
          "%s at %d ranks: momentum rebuilt within %.3g, gradient vs mean %.3g (of the "
          "largest momentum)\n",
          spec.c_str(), ranks, worst, worst_mean);
  }
}

// A NaN in one rank's gradient reaches every rank's result and leaves the momentum as it was
// (the trainer stops before such a step's update); the state holds the momentum and onebit's
// errors, and a hook restored from it reduces the next step to the same bits, and one restored on
// rank 0 alone keeps the ranks equal.
TEST(MomentumCompression, ANaNLeavesTheMomentumAndTheStateRoundTrips) {
  auto& comm = world();
  const int64_t n = 2048;
  const auto hook = momentum_hook("onebit:momentum=0.9");
  pd::GradBucket bucket;
  bucket.index = 4;
  bucket.buffer = at::zeros({n});
  for (int t = 0; t < 3; ++t) {
    bucket.buffer.copy_(gradient_of(comm.rank(), t, n));
    hook->start(bucket, comm)->wait();
    hook->finish(bucket, comm);
  }
  const auto before = hook->momentum(bucket.index).clone();
  bucket.buffer.copy_(gradient_of(comm.rank(), 3, n));
  if (comm.rank() == 0) bucket.buffer[7] = std::numeric_limits<float>::quiet_NaN();
  hook->start(bucket, comm)->wait();
  hook->finish(bucket, comm);
  EXPECT_FALSE(at::isfinite(bucket.buffer).all().item<bool>());
  EXPECT_TRUE(at::equal(hook->momentum(bucket.index), before));

  const auto state = hook->state();
  EXPECT_EQ(state.count("b4/momentum"), 1u);
  EXPECT_EQ(state.count("b4/error"), 1u);
  const auto restored = momentum_hook("onebit:momentum=0.9");
  restored->load_state(state);
  pd::GradBucket twin = bucket;
  twin.buffer = at::zeros({n});
  for (auto* b : {&bucket, &twin}) b->buffer.copy_(gradient_of(comm.rank(), 4, n));
  hook->start(bucket, comm)->wait();
  hook->finish(bucket, comm);
  restored->start(twin, comm)->wait();
  restored->finish(twin, comm);
  EXPECT_TRUE(at::equal(bucket.buffer, twin.buffer));
  EXPECT_TRUE(at::equal(hook->momentum(bucket.index), restored->momentum(twin.index)));

  // Restored on rank 0 alone (the others' files did not load): the first reduction takes rank 0's
  // momentum everywhere, so the ranks stay equal.
  const auto partial = momentum_hook("onebit:momentum=0.9");
  partial->load_state(comm.rank() == 0 ? hook->state() : std::map<std::string, at::Tensor>{});
  twin.buffer.copy_(gradient_of(comm.rank(), 5, n));
  partial->start(twin, comm)->wait();
  partial->finish(twin, comm);
  EXPECT_TRUE(same_on_every_rank(twin.buffer));
  EXPECT_TRUE(same_on_every_rank(partial->momentum(twin.index)));
}

// Preconditioning (comm_hook.h): on the warm-up's exact steps the hook keeps AdamW's variance of
// the averaged gradients it returns: the optimizer's own exp_avg_sq, fed the same gradients by
// ops::adamw_update_, within 4 u per step of the largest variance (both fp32; the two may round
// the update differently). Once compression starts the variance stops changing (frozen after W
// steps, as --freeze-variance-after W freezes the optimizer's), and the state carries it: a hook
// restored from it reduces the next step to the same bits. (With unclipped=1 the preconditioned
// steps are exempt from the trainer's clipping: AValueWithoutVarianceTakesNoOutsizedStep.)
TEST(MomentumCompression, ThePreconditionerIsTheOptimizersVarianceOfTheWarmUp) {
  auto& comm = world();
  const int64_t n = 2048;
  const int warmup = 3;
  const auto hook = momentum_hook("onebit:warmup=3,momentum=0.9");
  ASSERT_TRUE(hook->preconditioning().enabled);
  loom::ops::AdamWOptions adamw;  // the hook's beta2 and eps by default
  adamw.freeze_variance_after = warmup;
  adamw.weight_decay = 0;
  const auto weight = at::zeros({n}), exp_avg = at::zeros({n}), exp_avg_sq = at::zeros({n});
  pd::GradBucket bucket;
  bucket.index = 1;
  bucket.buffer = at::zeros({n});
  at::Tensor frozen;
  for (int t = 0; t < 6; ++t) {
    hook->begin_step(t);
    bucket.buffer.copy_(gradient_of(comm.rank(), t, n));
    hook->start(bucket, comm)->wait();
    hook->finish(bucket, comm);
    loom::ops::adamw_update_(weight, bucket.buffer, exp_avg, exp_avg_sq, 1e-3, t + 1, adamw);
    const auto v = hook->variance(bucket.index);
    ASSERT_TRUE(v.defined());
    EXPECT_EQ(hook->variance_steps(bucket.index), std::min(t + 1, warmup)) << "step " << t;
    const double largest = exp_avg_sq.abs().max().item<double>();
    EXPECT_LE((v - exp_avg_sq).abs().max().item<double>(), 4 * (t + 1) * kU * largest)
        << "step " << t;
    // Clipped as usual: unclipped=1 was not asked for.
    EXPECT_FALSE(hook->exempt_from_clipping_this_step()) << "step " << t;
    if (t == warmup - 1) frozen = v.clone();
    if (t >= warmup) {
      EXPECT_TRUE(at::equal(v, frozen)) << "step " << t << ": not frozen";
    }
  }
  EXPECT_TRUE(same_on_every_rank(hook->variance(bucket.index)));

  const auto state = hook->state();
  ASSERT_EQ(state.count("b1/variance"), 1u);
  ASSERT_EQ(state.count("b1/variance_steps"), 1u);
  EXPECT_EQ(state.at("b1/variance_steps").item<int64_t>(), warmup);
  EXPECT_EQ(hook->reshard_rule("b1/variance"), pd::StateReshard::kFirst);
  EXPECT_EQ(hook->reshard_rule("b1/variance_steps"), pd::StateReshard::kFirst);
  const auto restored = momentum_hook("onebit:warmup=3,momentum=0.9");
  restored->load_state(state);
  pd::GradBucket twin = bucket;
  twin.buffer = at::zeros({n});
  for (auto* b : {&bucket, &twin}) b->buffer.copy_(gradient_of(comm.rank(), 6, n));
  hook->begin_step(6);
  restored->begin_step(6);
  hook->start(bucket, comm)->wait();
  hook->finish(bucket, comm);
  restored->start(twin, comm)->wait();
  restored->finish(twin, comm);
  EXPECT_TRUE(at::equal(bucket.buffer, twin.buffer));
  EXPECT_TRUE(at::equal(hook->momentum(1), restored->momentum(1)));
}

// The momentum is divided by d = sqrt(v / (1 - beta2^W)) + eps before the inner hook compresses it
// and the mean multiplied by d again. Through bf16 (a relative rounding per value) that gives each
// value's averaged momentum back within (R + 2) 2^-8 of its largest local momentum, whatever d:
// the gradients are scaled by 1e-3, so d ~ 1e-3 and a missing division or multiplication is off
// by a factor ~1000.
TEST(MomentumCompression, PreconditioningDividesAndMultipliesByTheSameDenominator) {
  auto& comm = world();
  const int ranks = comm.size();
  const int64_t n = 1024;
  const double beta = 0.9;
  // No clamp: these random gradients have values whose mean over the ranks is near 0 in both
  // warm-up steps, and a rank's momentum is then many d (AValueThatLearnsAfterTheWarmUpIsClamped).
  pd::MomentumPreconditioning unclamped;
  unclamped.limit = 1e30;
  const auto hook = std::make_shared<pd::MomentumCompressionHook>(
      pd::make_comm_hook("bf16:warmup=2"), 0.9, unclamped);
  pd::GradBucket bucket;
  bucket.index = 0;
  bucket.buffer = at::zeros({n});
  for (int t = 0; t < 6; ++t) {
    hook->begin_step(t);
    const auto m = hook->momentum(bucket.index);
    const auto previous = m.defined() ? m.to(at::kDouble) : at::zeros({n}, at::kDouble);
    auto mean = at::zeros({n}, at::kDouble), largest = at::zeros({n}, at::kDouble);
    for (int r = 0; r < ranks; ++r) {
      const auto local = beta * previous + (1 - beta) * 1e-3 * gradient_of(r, t, n).to(at::kDouble);
      mean += local / ranks;
      largest = at::maximum(largest, local.abs());
    }
    bucket.buffer.copy_(1e-3 * gradient_of(comm.rank(), t, n));
    hook->start(bucket, comm)->wait();
    hook->finish(bucket, comm);
    const auto gap = (hook->momentum(bucket.index).to(at::kDouble) - mean).abs();
    EXPECT_TRUE((gap <= (ranks + 2) * std::ldexp(1.0, -8) * largest).all().item<bool>())
        << "step " << t << ": worst gap " << (gap / largest).max().item<double>()
        << " of the largest local momentum";
  }
  EXPECT_EQ(hook->variance_steps(bucket.index), 2);
}

// What preconditioning is for: values whose gradient is zero on every rank (a position row past
// --seq-len, a vocabulary row the corpus never holds) share onebit blocks with values that learn.
// After a 3-step warm-up, five compressed steps: AdamW (variance frozen after the warm-up) steps
// each value by its averaged momentum / d. Preconditioned, a zero-variance value's step is no
// larger than the largest step of a value that learns (each value of a block gets one magnitude);
// compressing the momentum itself (precondition=0) gives it its block's mean momentum / eps, over
// 1000 times larger (the 1-bit Adam run of docs/compression.md that diverged).
TEST(MomentumCompression, AValueWithoutVarianceTakesNoOutsizedStep) {
  auto& comm = world();
  const int64_t n = 2048, silent = 64;
  for (const std::string spec :
       {"onebit:warmup=3,momentum=0.9", "onebit:warmup=3,momentum=0.9,unclipped=1",
        "onebit:warmup=3,momentum=0.9,precondition=0"}) {
    SCOPED_TRACE(spec);
    const bool preconditioned = spec.find("precondition=0") == std::string::npos;
    const bool unclipped = spec.find("unclipped=1") != std::string::npos;
    const auto run = steps_after_warmup(*momentum_hook(spec), n, [&](int t) {
      auto g = gradient_of(comm.rank(), t, n);
      g.narrow(0, 0, silent).zero_();
      return g;
    });
    for (int t = 0; t < kSteps; ++t)
      EXPECT_EQ(run.exempt_from_clipping[t], unclipped && t >= kWarmup) << "step " << t;
    double worst_ratio = 0;
    for (size_t i = 0; i < run.steps.size(); ++i) {
      const double silent_step = run.steps[i].narrow(0, 0, silent).max().item<double>();
      const double learning_step = run.steps[i].narrow(0, silent, n - silent).max().item<double>();
      worst_ratio = std::max(worst_ratio, silent_step / learning_step);
      if (preconditioned) {
        EXPECT_LE(silent_step, (1 + 1e-4) * learning_step) << "compressed step " << i;
      }
    }
    if (!preconditioned) {
      EXPECT_GT(worst_ratio, 1000) << "the test no longer shows the problem";
    }
    if (std::getenv("LOOM_TEST_VERBOSE") != nullptr)
      std::printf("%s: a zero-variance value's largest step is %.3g times a learning value's\n",
                  spec.c_str(), worst_ratio);
  }
}

// A value silent through the warm-up (variance 0, so d = eps) that learns afterwards, with
// gradients of 100: divided by d its momentum is ~1e9, which would set its onebit block's scale and
// step every value of the block by that. Clamped to MomentumPreconditioning::limit (10 of AdamW's
// unit steps) times sqrt(R), no value of the bucket steps by more than that (measured: about 1).
TEST(MomentumCompression, AValueThatLearnsAfterTheWarmUpIsClamped) {
  auto& comm = world();
  const int64_t n = 2048, silent = 64;
  const auto hook = momentum_hook("onebit:warmup=3,momentum=0.9");
  EXPECT_EQ(hook->preconditioning().limit, 10);
  const double limit = 10 * std::sqrt(static_cast<double>(comm.size()));  // sqrt(R) x limit
  const auto run = steps_after_warmup(*hook, n, [&](int t) {
    auto g = gradient_of(comm.rank(), t, n);
    g.narrow(0, 0, silent).mul_(t < kWarmup ? 0.0 : 100.0);
    return g;
  });
  double largest = 0;
  for (size_t i = 0; i < run.steps.size(); ++i) {
    largest = std::max(largest, run.steps[i].max().item<double>());
    EXPECT_LE(run.steps[i].max().item<double>(), limit * (1 + 1e-4)) << "compressed step " << i;
  }
  if (std::getenv("LOOM_TEST_VERBOSE") != nullptr)
    std::printf(
        "a value learning after the warm-up: the largest step in its bucket %.3g (limit "
        "%.3g)\n",
        largest, limit);
}
