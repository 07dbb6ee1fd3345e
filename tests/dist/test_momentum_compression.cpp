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
#include <limits>

#include "dist_util.h"
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
      std::printf("%s at %d ranks: momentum rebuilt within %.3g, gradient vs mean %.3g (of the "
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
