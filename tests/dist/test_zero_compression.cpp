// Communication hooks under ZeRO's reduce-scatter: topk and threshold select on the shard layout
// (each shard a bucket of its own, sent to its owner by an all-to-all) and lose nothing over
// steps; every other hook reduces the whole bucket its own way and the rank keeps its shard,
// which equals that hook's all-reduce bit for bit; a momentum compression is refused where ZeRO
// would reduce it more than once a step.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "../test_util.h"
#include "dist_util.h"
#include "loom/dist/communicator.h"
#include "loom/parallel/data/comm_hook.h"
#include "loom/parallel/data/sparse_hook.h"
#include "loom/parallel/zero/zero_optimizer.h"

using loom::testing::error_of;
using loom::testing::world;
namespace pd = loom::parallel::data;

namespace {

constexpr int kGradientSeed = 900;

// A flat bucket of a 60 x 40 matrix, a 45 x 30 matrix and a 15-value vector, padded with zeros to
// `ranks` equal shards, as ZeRO lays one out; the parameters serve for their shapes only.
pd::GradBucket shard_bucket(int64_t index, int64_t ranks) {
  pd::GradBucket b;
  b.index = index;
  int64_t offset = 0;
  const std::vector<std::pair<std::string, std::vector<int64_t>>> params = {
      {"a.weight", {60, 40}}, {"b.weight", {45, 30}}, {"b.bias", {15}}};
  for (const auto& [name, shape] : params) {
    b.params.push_back(at::empty(shape));
    b.names.push_back(name);
    b.offsets.push_back(offset);
    offset += b.params.back().numel();
  }
  const int64_t shard = (offset + ranks - 1) / ranks;
  b.buffer = at::zeros({shard * ranks});
  return b;
}

// Rank `rank`'s gradients at step t in `bucket`'s layout, zero in the padding.
at::Tensor gradient_in(const pd::GradBucket& bucket, int rank, int step) {
  const int64_t used = bucket.offsets.back() + bucket.params.back().numel();
  auto g = at::zeros_like(bucket.buffer);
  g.narrow(0, 0, used).copy_(loom::testing::rank_gradient(kGradientSeed, rank, step, used));
  return g;
}

}  // namespace

// topk and threshold under ZeRO: R shards of a 3765-value bucket, 6 steps. Rank r's output is
// the mean of the R ranks' selections from shard r; summed over the steps it equals the sum of
// the true shard means minus the ranks' mean carried error for that shard, up to fp32 roundings
// (the add of gradient and error, the R adds and the division: (R + 2) u of the largest value per
// step; the bound allows (R + 32) u). A lost or doubled value would be of the size of a selected
// gradient, far above it. Bytes: R - 1 messages of k pairs, k = ceil(ratio shard).
TEST(ZeroHooks, SparseSelectionOnTheShardLayoutLosesNothing) {
  auto& comm = world();
  const int ranks = comm.size(), me = comm.rank();
  const int steps = 6;
  for (const std::string spec : {"topk:ratio=0.05", "threshold:ratio=0.05,every=4"}) {
    SCOPED_TRACE(spec);
    const auto made = pd::make_comm_hook(spec);
    auto& hook = dynamic_cast<pd::SparseCompressHook&>(*made);
    ASSERT_TRUE(hook.reduces_scatter());
    auto bucket = shard_bucket(5, ranks);
    const int64_t shard = bucket.numel() / ranks;
    auto sum_out = at::zeros({shard}, at::kDouble), sum_mean = at::zeros({shard}, at::kDouble);
    double largest = 0, sent = 0;
    for (int t = 0; t < steps; ++t) {
      bucket.buffer.copy_(gradient_in(bucket, me, t));
      for (int r = 0; r < ranks; ++r) {
        const auto g = gradient_in(bucket, r, t);
        largest = std::max(largest, g.abs().max().item<double>());
        sum_mean += g.narrow(0, me * shard, shard).to(at::kDouble) / ranks;
      }
      auto recv = at::empty({shard});
      sent += loom::testing::reduce_scatter_through(hook, bucket, recv, comm);
      auto errors = hook.scatter_error(5).abs().max().reshape({1});
      comm.all_reduce(errors, loom::dist::ReduceOp::Max);
      largest = std::max(largest, 2 * errors.item<double>());
      sum_out += recv.to(at::kDouble);
      // At most k values of each shard were sent: the rest of the shard's error is carried.
      EXPECT_LE((recv != 0).sum().item<int64_t>(), ranks * hook.capacity(shard));
    }
    auto error = hook.scatter_error(5).clone();
    ASSERT_EQ(error.numel(), ranks * shard);
    comm.all_reduce(error, loom::dist::ReduceOp::Sum);
    const auto owed = error.view({ranks, shard})[me].to(at::kDouble) / ranks;
    loom::testing::expect_feedback_loses_nothing(sum_out, sum_mean, owed, steps, largest,
                                                 spec + " reduce-scatter on the shard layout");
    EXPECT_NEAR(sent, steps * (ranks - 1.0) * 8.0 * static_cast<double>(hook.capacity(shard)),
                1e-9 * (sent + 1));
    // The state round-trips: a hook restored from it continues exactly as this one.
    const auto again = pd::make_comm_hook(spec);
    again->load_state(hook.state());
    auto other = shard_bucket(5, ranks);
    other.buffer.copy_(gradient_in(bucket, me, steps));
    bucket.buffer.copy_(other.buffer);
    auto mine = at::empty({shard}), theirs = at::empty({shard});
    loom::testing::reduce_scatter_through(hook, bucket, mine, comm);
    loom::testing::reduce_scatter_through(*again, other, theirs, comm);
    EXPECT_TRUE(at::equal(mine, theirs));
    EXPECT_TRUE(at::equal(hook.scatter_error(5),
                          dynamic_cast<pd::SparseCompressHook&>(*again).scatter_error(5)));
  }
}

// A hook that does not reduce the shard layout itself serves ZeRO through its own whole-bucket
// reduction: over 3 steps each rank's shard equals, bit for bit, its slice of what the same hook
// (a second instance, fed the same gradients) leaves in the bucket by start and finish.
TEST(ZeroHooks, AnyOtherHookGivesItsShardOfTheWholeBucketReduction) {
  auto& comm = world();
  const int ranks = comm.size(), me = comm.rank();
  if (ranks < 2) GTEST_SKIP() << "ZeRO reduces without a hook on one rank";
  for (const std::string spec :
       {"bf16", "powersgd:rank=2", "onebit:momentum=0.9", "topk:ratio=0.05,momentum=0.9"}) {
    SCOPED_TRACE(spec);
    const auto scattering = pd::make_comm_hook(spec), reducing = pd::make_comm_hook(spec);
    EXPECT_FALSE(scattering->reduces_scatter());
    auto bucket = shard_bucket(2, ranks), whole = shard_bucket(2, ranks);
    const int64_t shard = bucket.numel() / ranks;
    for (int t = 0; t < 3; ++t) {
      bucket.buffer.copy_(gradient_in(bucket, me, t));
      whole.buffer.copy_(bucket.buffer);
      auto recv = at::empty({shard});
      loom::testing::reduce_scatter_through(*scattering, bucket, recv, comm);
      reducing->start(whole, comm)->wait();
      reducing->finish(whole, comm);
      EXPECT_TRUE(at::equal(recv, whole.buffer.narrow(0, me * shard, shard))) << "step " << t;
      // Compressed: not the plain mean.
      auto mean = at::zeros({shard}, at::kDouble);
      for (int r = 0; r < ranks; ++r)
        mean += gradient_in(bucket, r, t).narrow(0, me * shard, shard).to(at::kDouble) / ranks;
      EXPECT_GT((recv.to(at::kDouble) - mean).abs().max().item<double>(), 0) << "step " << t;
    }
  }
}

// A momentum compression's reduction is a momentum update, so ZeRO-2/3 must reduce once per step
// (the zero strategy sets reduce_once for it); an engine asked otherwise refuses, naming the hook.
TEST(ZeroHooks, AMomentumCompressionNeedsOneReductionPerStep) {
  auto weight = at::randn({8, 4}).requires_grad_(true);
  loom::parallel::zero::ZeroOptions options;
  options.stage = 2;
  options.hook = pd::make_comm_hook("onebit:momentum=0.9");
  const auto make = [&] {
    loom::parallel::zero::ZeroOptimizer engine({{"w", weight}}, loom::testing::runtime().world(),
                                               options);
  };
  const auto error = error_of(make);
  EXPECT_NE(error.find("ZeRO-2: --comm-hook onebit must see each step's gradients once"),
            std::string::npos)
      << error;
  options.reduce_once = true;
  EXPECT_NO_THROW(make());
  options.stage = 1;
  options.reduce_once = false;
  EXPECT_NO_THROW(make());
}

// A momentum compression's momentum (and its preconditioner's variance) spans ZeRO's padded
// bucket, whose length changes with the number of ranks: resharded, each is fitted to the new
// length (the values kept, the padding added as zeros or dropped), so the next reduction's size
// check passes.
TEST(ZeroHooks, AReshardFitsTheMomentumToTheNewPaddedBucket) {
  const auto hook = pd::make_comm_hook("onebit:momentum=0.9");
  const auto& compression = dynamic_cast<const pd::MomentumCompressionHook&>(*hook);
  const auto m = at::arange(1, 3003, at::kFloat);  // 3001 values padded to 2 shards, padding 1
  const auto v = m * m;                            // and so is the preconditioner's variance
  hook->load_resharded_state({{pd::bucket_state_key(1, "momentum"), m},
                              {pd::bucket_state_key(1, "variance"), v},
                              {pd::bucket_state_key(1, "variance_steps"), at::full({1}, 7L)}});
  hook->lay_out_resharded(1, 3003, 0, 3);  // padded to 3 shards
  EXPECT_EQ(compression.variance_steps(1), 7);
  for (const auto& [fitted, want] :
       {std::pair{compression.momentum(1), m}, std::pair{compression.variance(1), v}}) {
    ASSERT_EQ(fitted.numel(), 3003);
    EXPECT_TRUE(at::equal(fitted.narrow(0, 0, 3002), want));
    EXPECT_EQ(fitted[3002].item<float>(), 0.0f);
  }
  hook->lay_out_resharded(1, 3000, 0, 4);  // a shorter bucket keeps its first values
  EXPECT_TRUE(at::equal(compression.momentum(1), m.narrow(0, 0, 3000)));
  EXPECT_TRUE(at::equal(compression.variance(1), v.narrow(0, 0, 3000)));
}

namespace {

// The plain average, then 1000 written past the parameters, where ZeRO pads the bucket: what a
// lossy hook may deliver there (a sign of 0 decodes to +scale). Not a reduce-scatter of its own.
class PaddingFillHook : public pd::CommHook {
 public:
  std::string name() const override { return "test-padding-fill"; }
  loom::dist::WorkPtr start(pd::GradBucket& bucket, loom::dist::Communicator& comm) override {
    return comm.all_reduce_async(bucket.buffer, loom::dist::ReduceOp::Avg);
  }
  void finish(pd::GradBucket& bucket, loom::dist::Communicator& /*comm*/) override {
    int64_t used = 0;
    for (const auto& p : bucket.params) used += p.numel();
    if (used < bucket.numel()) bucket.buffer.narrow(0, used, bucket.numel() - used).fill_(1000);
  }
};

}  // namespace

// ZeRO-2 over six 3001-value parameters in buckets of their own, through a whole-bucket hook:
// the reductions finish in launch order with at most two in flight (no rank waits on another's
// order), and what the hook left past the parameters does not reach the gradient shards: the
// norm is that of the mean gradient, within fp32 roundings.
TEST(ZeroHooks, WholeBucketReductionsKeepNothingPastTheParameters) {
  const int ranks = world().size(), me = world().rank();
  if (ranks < 2) GTEST_SKIP() << "ZeRO reduces without a hook on one rank";
  loom::parallel::zero::ZeroOptimizer::NamedParams params;
  for (int i = 0; i < 6; ++i)
    params.emplace_back("p" + std::to_string(i), at::zeros({3001}).requires_grad_(true));
  loom::parallel::zero::ZeroOptions options;
  options.stage = 2;
  options.bucket_mb = 0.001;  // one bucket per parameter
  options.hook = std::make_shared<PaddingFillHook>();
  loom::parallel::zero::ZeroOptimizer engine(params, loom::testing::runtime().world(), options);
  ASSERT_EQ(engine.num_buckets(), 6u);
  auto loss = at::zeros({});
  double want = 0;
  for (int i = 0; i < 6; ++i) {
    loss =
        loss + (params[i].second * loom::testing::rank_gradient(kGradientSeed, me, i, 3001)).sum();
    auto mean = at::zeros({3001}, at::kDouble);
    for (int r = 0; r < ranks; ++r)
      mean += loom::testing::rank_gradient(kGradientSeed, r, i, 3001).to(at::kDouble) / ranks;
    want += mean.pow(2).sum().item<double>();
  }
  engine.set_sync(true);
  loss.backward();
  engine.finish_gradient_sync();
  const double norm = engine.clip_grad_norm(0);
  EXPECT_NEAR(norm, std::sqrt(want), 1e-5 * std::sqrt(want));
}
