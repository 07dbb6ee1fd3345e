// Data parallelism: buckets, overlapped gradient averaging, accumulation, hooks, and the
// Trainer at dp = world size giving the same losses and parameters as one process.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "../test_util.h"
#include "dist_util.h"
#include "loom/core/files.h"
#include "loom/data/sampler.h"
#include "loom/parallel/data/data_parallel.h"
#include "loom/train/trainer.h"
#include "train_compare.h"

using loom::testing::contains;
using loom::testing::error_of;
using loom::testing::expect_same_run;
using loom::testing::run;
using loom::testing::RunResult;
using loom::testing::world;
namespace dist = loom::dist;
namespace pd = loom::parallel::data;
namespace train = loom::train;
namespace fs = std::filesystem;

namespace {

// A small MLP whose parameters are the same on every rank (seeded), with an unused parameter; in
// fp64, so the averages are checked to 1e-12 (sums of at most 4 ranks' terms in another order).
struct Mlp : torch::nn::Module {
  torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr};
  torch::Tensor unused;
  Mlp() {
    torch::manual_seed(7);
    a = register_module("a", torch::nn::Linear(16, 64));
    b = register_module("b", torch::nn::Linear(64, 64));
    c = register_module("c", torch::nn::Linear(64, 4));
    unused = register_parameter("unused", torch::randn({3}));
    to(at::kDouble);
  }
  torch::Tensor forward(const torch::Tensor& x) { return c(torch::tanh(b(torch::tanh(a(x))))); }
};

pd::DataParallel::NamedParams named(torch::nn::Module& m) {
  pd::DataParallel::NamedParams out;
  for (const auto& item : m.named_parameters()) out.emplace_back(item.key(), item.value());
  return out;
}

at::Tensor input_of(int rank, int micro) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(1000 + 10 * rank + micro);
  return at::randn({8, 16}, g, at::kDouble);
}

// The dp-average gradient every rank should end up with, computed locally from every rank's
// inputs (`micros` micro-batches each, accumulated).
std::map<std::string, at::Tensor> expected_grads(int ranks, int micros) {
  Mlp m;
  for (int r = 0; r < ranks; ++r)
    for (int k = 0; k < micros; ++k) m.forward(input_of(r, k)).pow(2).mean().backward();
  std::map<std::string, at::Tensor> out;
  for (const auto& item : m.named_parameters())
    if (item.value().grad().defined()) out[item.key()] = item.value().grad() / ranks;
  return out;
}

void expect_grads_close(Mlp& m, const std::map<std::string, at::Tensor>& want, double rtol) {
  for (const auto& item : m.named_parameters()) {
    auto it = want.find(item.key());
    if (it == want.end()) continue;
    ASSERT_TRUE(item.value().grad().defined()) << item.key();
    EXPECT_TRUE(at::allclose(item.value().grad(), it->second, rtol, 1e-15))
        << item.key() << " max diff " << (item.value().grad() - it->second).abs().max();
  }
}

}  // namespace

TEST(GradBuckets, ReverseOrderSizeCapAndOneDtypePerBucket) {
  std::vector<at::Tensor> p = {at::zeros({10}), at::zeros({10}), at::zeros({100}),
                               at::zeros({10}, at::kBFloat16), at::zeros({5})};
  // 80-byte buckets: walking backwards, [4] 20 B, then [3] is bf16 (new bucket), then [2] is
  // 400 B (alone), then [1] and [0] (40 + 40 B) fit in one.
  const auto plan = pd::assign_buckets(p, 80);
  ASSERT_EQ(plan.size(), 4u);
  EXPECT_EQ(plan[0], std::vector<size_t>({4}));
  EXPECT_EQ(plan[1], std::vector<size_t>({3}));
  EXPECT_EQ(plan[2], std::vector<size_t>({2}));
  EXPECT_EQ(plan[3], std::vector<size_t>({1, 0}));
  EXPECT_TRUE(contains(error_of([&] { pd::assign_buckets(p, 0); }), "must be positive"));
}

TEST(DataParallel, GradientsAreTheAverageAndBucketsLaunchDuringBackward) {
  auto& w = world();
  Mlp m;
  pd::DataParallel dp(named(m), loom::testing::runtime().world(), {.bucket_mb = 0.01});
  ASSERT_GE(dp.buckets().size(), 3u);  // 10 KiB buckets: several
  m.forward(input_of(w.rank(), 0)).pow(2).mean().backward();
  dp.finish_gradient_sync();
  expect_grads_close(m, expected_grads(w.size(), 1), 1e-12);
  // Every bucket holding only used parameters started before backward returned.
  EXPECT_GE(dp.last_sync().buckets_launched_in_backward, 1);
  // Counted by the communicator: one rank sends nothing.
  if (w.size() > 1) {
    EXPECT_GT(dp.last_sync().bytes_sent, 0);
  } else {
    EXPECT_EQ(dp.last_sync().bytes_sent, 0);
  }
  // The unused parameter has a zero gradient, the same on every rank.
  ASSERT_TRUE(m.unused.grad().defined());
  EXPECT_EQ(m.unused.grad().abs().sum().item<double>(), 0.0);
}

TEST(DataParallel, AccumulationSyncsOnlyOnTheLastMicroBatch) {
  auto& w = world();
  Mlp m;
  auto comm = w.split(0, w.rank(), "dp");
  pd::DataParallel dp(named(m), comm, {.bucket_mb = 0.01});
  const int micros = 3;
  for (int k = 0; k < micros; ++k) {
    dp.set_sync(k == micros - 1);
    const auto before = comm->collectives_issued();
    m.forward(input_of(w.rank(), k)).pow(2).mean().backward();
    if (k < micros - 1) {
      EXPECT_EQ(comm->collectives_issued(), before) << "micro-batch " << k;
    }
  }
  dp.finish_gradient_sync();
  expect_grads_close(m, expected_grads(w.size(), micros), 1e-12);
}

TEST(DataParallel, Bf16HookAveragesWithinBf16Precision) {
  auto& w = world();
  Mlp m;
  pd::DataParallel dp(named(m), loom::testing::runtime().world(),
                      {.bucket_mb = 0.01, .hook = pd::make_comm_hook("bf16")});
  m.forward(input_of(w.rank(), 0)).pow(2).mean().backward();
  dp.finish_gradient_sync();
  EXPECT_EQ(dp.hook().name(), "bf16");
  int64_t elements = 0;
  for (const auto& [name, want] : expected_grads(w.size(), 1)) {
    auto got = m.named_parameters()[name].grad();
    elements += got.numel();
    // bf16 keeps 8 significant bits: 2^-8 relative per rounding, a few roundings.
    const double tol = 4.0 * std::pow(2.0, -8) * want.abs().max().item<double>() + 1e-6;
    EXPECT_LE((got - want).abs().max().item<double>(), tol) << name;
    // What came back from the wire is a bf16 sum: every element a bf16 number. An fp64 (or
    // fp32) reduction would leave the low bits set and fail here, at any rank count.
    EXPECT_TRUE(at::equal(got, got.to(at::kBFloat16).to(got.scalar_type())))
        << name << " holds values that are not bf16: the reduction did not run in bf16";
  }
  // A ring all-reduce of 2-byte values: 2 (R - 1) / R x 2 bytes per element (the fp64 buckets
  // would be 8), and an fp32 one 4.
  const double all = static_cast<double>(elements + m.unused.numel()),
               ring = 2.0 * (w.size() - 1) / w.size();
  EXPECT_NEAR(dp.last_sync().bytes_sent, ring * 2.0 * all, 1e-9 * all);
  EXPECT_NEAR(dp.last_sync().fp32_bytes, ring * 4.0 * all, 1e-9 * all);
  EXPECT_TRUE(contains(error_of([] { pd::make_comm_hook("fp8"); }), "valid: avg, bf16"));
}

TEST(DataParallel, BroadcastMakesReplicasEqual) {
  auto& w = world();
  Mlp m;
  {
    torch::NoGradGuard no_grad;
    m.a->weight.add_(static_cast<float>(w.rank()));
  }
  pd::DataParallel dp(named(m), loom::testing::runtime().world());
  dp.broadcast_parameters();
  Mlp reference;
  EXPECT_TRUE(at::equal(m.a->weight, reference.a->weight));
}

// --- The Trainer: dp = world size against one process -------------------------------------

namespace {

train::TrainConfig dp_config(const fs::path& dir, int64_t grad_accum) {
  return loom::testing::small_run_config(dir, grad_accum);
}

}  // namespace

class TrainerDp : public ::testing::TestWithParam<int64_t> {};

TEST_P(TrainerDp, SameLossesAndParametersAsOneProcess) {
  loom::testing::SharedTempDir dir;
  loom::testing::write_shared_corpus(dir, 60000, 4000);
  const auto config = dp_config(dir.path(), GetParam());
  RunResult single;
  {
    train::Trainer t(config);  // one process, no communication
    single = run(t);
  }
  auto mesh = loom::testing::layout_mesh({});
  train::Trainer t(config, mesh);
  EXPECT_EQ(t.mesh().size(dist::Dim::dp), world().size());
  EXPECT_EQ(t.runtime().find_strategy("data-parallel") != nullptr, world().size() > 1);
  const auto distributed = run(t);
  expect_same_run(distributed, single);
  // The replicas are bit-identical: every rank applied the same averaged gradients.
  for (const auto& [name, p] : distributed.params) {
    auto highest = p.clone(), lowest = -p;
    world().all_reduce(highest, dist::ReduceOp::Max);
    world().all_reduce(lowest, dist::ReduceOp::Max);
    EXPECT_TRUE(at::equal(highest, p) && at::equal(-lowest, p)) << name << " differs across ranks";
  }
}

INSTANTIATE_TEST_SUITE_P(GradAccum, TrainerDp, ::testing::Values(1, 2));

namespace {

// A deliberately broken hook: averages every bucket but the first, which keeps each rank's own
// gradient (the bug of a missing all-reduce of one gradient bucket).
class UnreducedFirstBucketHook : public pd::AllReduceAvgHook {
 public:
  std::string name() const override { return "test-unreduced-first-bucket"; }
  loom::dist::WorkPtr start(pd::GradBucket& bucket, loom::dist::Communicator& comm) override {
    if (bucket.index != 0) return pd::AllReduceAvgHook::start(bucket, comm);
    bucket.scratch = at::zeros({1}, bucket.buffer.options());  // a collective every rank issues
    return comm.all_reduce_async(bucket.scratch, dist::ReduceOp::Sum);
  }
};
LOOM_REGISTER_COMM_HOOK(UnreducedFirstBucketHook, "test-unreduced-first-bucket");

}  // namespace

// The fp64 bound tells the broken hook from the real one by far more than 1000x; and the fp32
// smoke run of the same layout stays within its bound derived from the fp64 run.
TEST(TrainerDp, AMissingBucketAllReduceIsCaughtAndFp32TracksWithinItsError) {
  if (world().size() < 2) GTEST_SKIP() << "needs data-parallel ranks";
  loom::testing::SharedTempDir dir;
  loom::testing::write_shared_corpus(dir, 60000, 4000);
  auto config = dp_config(dir.path(), 1);
  RunResult single64, single32, broken, dp32;
  {
    train::Trainer t(config);
    single64 = run(t);
  }
  auto broken_config = config;
  broken_config.comm_hook = "test-unreduced-first-bucket";
  {
    train::Trainer t(broken_config, loom::testing::layout_mesh({}));
    broken = run(t);
  }
  loom::testing::expect_caught(broken, single64, "dp: the first gradient bucket not all-reduced");
  auto fp32 = loom::testing::small_run_config(dir.path(), 1, "fp32");
  {
    train::Trainer t(fp32);
    single32 = run(t);
  }
  {
    train::Trainer t(fp32, loom::testing::layout_mesh({}));
    dp32 = run(t);
  }
  loom::testing::expect_fp32_run_close(dp32, single32, single64);
}

TEST(TrainerDp, OnlyRank0WritesMetricsAndCheckpointsAndResumeWithDropoutIsExact) {
  loom::testing::SharedTempDir dir;
  loom::testing::write_shared_corpus(dir, 60000, 4000);
  auto mesh = loom::testing::layout_mesh({});
  auto config = dp_config(dir.path(), 1);
  config.metrics_out = (dir / "metrics.jsonl").string();
  config.save_dir = (dir / "ckpt").string();
  config.save_every = 2;
  config.dropout = 0.1;  // a resume must apply the same masks (keyed by step and sample)
  RunResult full;
  {
    train::Trainer t(config, mesh);
    t.fit();
    full.params = run(t).params;
  }
  std::ifstream in(dir / "metrics.jsonl");
  int lines = 0;
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    EXPECT_EQ(j.at("step").get<int64_t>(), ++lines);
  }
  EXPECT_EQ(lines, config.steps);  // one writer: no duplicated or interleaved records
  // Resume from step 2 in a fresh save directory.
  world().barrier();
  auto resumed = config;
  resumed.resume = (dir / "ckpt" / "step-00000002").string();
  resumed.save_dir = (dir / "ckpt2").string();
  resumed.metrics_out.clear();
  train::Trainer t(resumed, mesh);
  EXPECT_EQ(t.step(), 2);
  t.fit();
  for (const auto& item : t.model().named_parameters())
    EXPECT_TRUE(at::equal(item.value(), full.params.at(item.key()))) << item.key();
}

TEST(TrainerDp, ABatchThatDoesNotSplitIsRejectedOnEveryRank) {
  if (world().size() < 2) GTEST_SKIP() << "any batch splits over one rank";
  loom::testing::SharedTempDir dir;
  loom::testing::write_shared_corpus(dir, 20000, 2000);
  auto config = dp_config(dir.path(), 1);
  config.batch_size = world().size() + 1;
  const auto msg = error_of([&] { train::Trainer t(config, loom::testing::layout_mesh({})); });
  EXPECT_TRUE(contains(msg, fmt::format("--batch-size {} cannot be split evenly: dp {}",
                                        config.batch_size, world().size())))
      << msg;
  config.batch_size = 24;
  config.dp = world().size() + 1;
  const auto msg2 = error_of([&] { train::Trainer t(config, loom::testing::layout_mesh({})); });
  EXPECT_TRUE(contains(msg2, "does not match the mesh")) << msg2;
}

TEST(BatchShard, SharesAreContiguousAndCoverTheBatch) {
  EXPECT_EQ(loom::data::shard_batch(12, 2, 3).first, 8);
  EXPECT_EQ(loom::data::shard_batch(12, 2, 3).count, 4);
  EXPECT_TRUE(contains(error_of([] { loom::data::shard_batch(10, 0, 4); }),
                       "cannot be split evenly across 4"));
}

TEST(TrainerDp, ACheckpointRank0CannotWriteFailsOnEveryRank) {
  loom::testing::SharedTempDir dir;
  loom::testing::write_shared_corpus(dir, 20000, 2000);
  auto config = dp_config(dir.path(), 1);
  config.save_dir = (dir / "ckpt").string();
  train::Trainer t(config, loom::testing::layout_mesh({}));
  // After the constructor's checks, the save directory turns into a file: rank 0's write fails.
  if (world().rank() == 0) {
    std::error_code ec;
    loom::core::remove_tree(dir / "ckpt", ec);
    ASSERT_FALSE(ec) << ec.message();
    std::ofstream(dir / "ckpt") << "not a directory";
  }
  world().barrier();
  const auto msg = error_of([&] { t.save_checkpoint(); });
  if (world().rank() == 0)
    EXPECT_TRUE(contains(msg, "cannot create directory")) << msg;
  else
    EXPECT_TRUE(contains(msg, "rank 0 failed to write checkpoint step 0")) << msg;
}
