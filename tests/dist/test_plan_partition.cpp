// Training with --pp-partition model splits the layers as the planner predicts: the cost
// model's per-layer seconds on a machine profile's devices (plan::pipeline_costs) are what both
// the pipeline strategy and plan::predict partition by.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "../test_util.h"
#include "dist_util.h"
#include "loom/parallel/pipeline/partition.h"
#include "loom/plan/cost_model.h"
#include "loom/plan/machine_profile.h"
#include "loom/plan/measure.h"
#include "loom/train/trainer.h"
#include "train_compare.h"

namespace plan = loom::plan;
namespace train = loom::train;
namespace pl = loom::parallel::pipeline;
using loom::testing::contains;
using loom::testing::error_of;
using loom::testing::world;

TEST(TrainerPipeline, PartitionsByTheCostModelAsThePlannerPredicts) {
  if (world().size() != 2) GTEST_SKIP() << "runs at 2 ranks";
  loom::testing::SharedTempDir dir;
  loom::testing::write_shared_corpus(dir, 30000, 4000);
  auto mesh = loom::testing::layout_mesh({.pp = 2});
  auto config = loom::testing::small_run_config(dir.path(), 4);
  config.layers = 8;
  config.vocab_size = 320;
  config.pp = 2;
  config.pp_partition = "model";
  // Two devices, the second running matmuls and attention 3x slower; no per-op or elementwise
  // costs, so that the rates alone set the speeds.
  auto profile = plan::builtin_profile("h100-node");
  auto& fast = profile.devices.front();
  fast.pointwise_s = fast.activation_s = fast.norm_s = fast.op_s = 0;
  auto slow = fast;
  slow.name = "slow";
  slow.matmul_flops /= 3;
  slow.attention_flops /= 3;
  profile.devices.push_back(slow);
  profile.stage_devices = {"h100", "slow"};
  const auto path = dir.path() / "profile.json";
  if (world().rank() == 0) std::ofstream(path) << profile.to_json();
  world().barrier();
  config.pp_devices = path.string();

  train::Trainer t(config, mesh);
  const auto* partition = t.runtime().context().find<pl::Partition>("pipeline.partition");
  ASSERT_NE(partition, nullptr);
  plan::Layout layout;
  layout.pp = 2;
  layout.micro_batches = config.grad_accum;
  layout.schedule = config.schedule;
  const plan::Workload workload{t.model_config(), config.batch_size, config.seq_len,
                                config.precision};
  EXPECT_EQ(partition->bounds, plan::predict(workload, layout, profile).stage_bounds)
      << partition->describe();
  EXPECT_GT(partition->layers(0), partition->layers(1)) << partition->describe();
  EXPECT_NEAR(partition->devices.at(1).speed, 1.0 / 3, 0.05) << partition->describe();
  EXPECT_EQ(t.train_step().step, 1);

  // The cost model's partition needs a machine: a device file of speeds is refused, and so is
  // no --pp-devices at all.
  if (world().rank() == 0)
    std::ofstream(dir.path() / "speeds.json") << R"({"devices": [{"speed": 1}, {"speed": 2}]})";
  world().barrier();
  auto bad = config;
  bad.pp_devices = (dir.path() / "speeds.json").string();
  auto e = error_of([&] { train::Trainer x(bad, mesh); });
  EXPECT_TRUE(contains(e, "--pp-partition model needs a machine profile as --pp-devices") &&
              contains(e, "is a device file of speeds"))
      << e;
  // A profile that does not exist is named as such.
  bad.pp_devices = (dir.path() / "nowhere.json").string();
  e = error_of([&] { train::Trainer x(bad, mesh); });
  EXPECT_TRUE(contains(e, "is neither a file nor built in")) << e;
  bad.pp_devices.clear();
  e = error_of([&] { bad.validate(); });
  EXPECT_TRUE(contains(e, "name it with --pp-devices PROFILE")) << e;
}

// loom-plan --measure --measure-mesh: each dimension of the layout larger than 1 gets a link of
// its own, timed over the groups the trainer builds; every rank returns the same figures; the
// profile carries them through its JSON (and predict takes a dimension's own link when there is
// one: CostModel.* in loom_tests).
TEST(Measure, MeshLinksForEachDimensionOfTheLayout) {
  if (world().size() < 2 || world().size() % 2 != 0)
    GTEST_SKIP() << "tp 2 needs an even number of ranks, not " << world().size();
  plan::MeasureOptions o;
  o.repeats = 2;
  o.large_bytes = 1 << 20;
  const auto shape = loom::dist::MeshShape::parse("tp=2");
  const auto links = plan::measure_mesh_links(loom::testing::runtime().world(), shape, o);
  std::vector<std::string> dims;
  for (const auto& [name, link] : links) {
    dims.push_back(name);
    EXPECT_GT(link.bandwidth, 0) << name;
    EXPECT_GE(link.latency, 0) << name;
    // The same on every rank.
    auto mine = at::tensor({link.bandwidth, link.latency}, at::kDouble);
    auto most = mine.clone();
    world().all_reduce(most, loom::dist::ReduceOp::Max);
    EXPECT_TRUE(at::equal(mine, most)) << name;
  }
  const std::vector<std::string> want =
      world().size() == 2 ? std::vector<std::string>{"tp"} : std::vector<std::string>{"dp", "tp"};
  // (dp = world / 2 > 1 from 4 ranks on)
  EXPECT_EQ(dims, want);
  auto profile = plan::MachineProfile::named("h100-node");
  profile.links = links;
  const auto back = plan::MachineProfile::from_json(profile.to_json(), "round trip");
  EXPECT_EQ(back.links.size(), links.size());
  EXPECT_DOUBLE_EQ(back.links.at("tp").bandwidth, links.at("tp").bandwidth);
  // A layout that does not fit the world is refused before any collective, naming it.
  EXPECT_TRUE(contains(error_of([&] {
                         plan::measure_mesh_links(loom::testing::runtime().world(),
                                                  loom::dist::MeshShape::parse("tp=3"), o);
                       }),
                       "tp 3"));
}

// Sequence parallelism saves what the cost model counts: the drop in a step's peak activation
// bytes from tp 2 to tp 2 with sequence parallelism, against the drop in the predicted rank
// memory (the state is the same in both). The column-parallel matmuls keep their all-gathered
// inputs, so only the norms' inputs and the residual stream split: a model that splits the
// norms' outputs too predicts twice the drop and fails.
TEST(CostModel, SequenceParallelSavesWhatThePlannerCounts) {
  if (world().size() != 2) GTEST_SKIP() << "runs at 2 ranks";
  loom::testing::SharedTempDir dir;
  loom::testing::write_shared_corpus(dir, 30000, 4000);
  auto mesh = loom::testing::layout_mesh({.tp = 2});
  double measured[2] = {0, 0}, predicted[2] = {0, 0};
  for (const bool sp : {false, true}) {
    auto config = loom::testing::small_run_config(dir.path(), 1, "fp32");
    config.seq_len = 64;
    config.batch_size = 16;
    config.tp = 2;
    config.sequence_parallel = sp;
    train::Trainer t(config, mesh);
    int64_t peak = 0;
    for (int i = 0; i < 2; ++i) peak = std::max(peak, t.train_step().peak_activation_bytes);
    plan::Layout layout;
    layout.tp = 2;
    layout.sequence_parallel = sp;
    const plan::Workload workload{t.model_config(), config.batch_size, config.seq_len,
                                  config.precision};
    measured[sp] = static_cast<double>(peak);
    predicted[sp] =
        plan::predict(workload, layout, plan::builtin_profile("h100-node")).rank_memory_bytes[0];
  }
  const double measured_drop = measured[0] - measured[1],
               predicted_drop = predicted[0] - predicted[1];
  ASSERT_GT(measured_drop, 0) << "no-sp " << measured[0] << " sp " << measured[1];
  // Within a quarter: allocator rounding and the kernels' scratch do not split with the sequence.
  EXPECT_NEAR(predicted_drop / measured_drop, 1.0, 0.25)
      << "predicted drop " << predicted_drop << " measured " << measured_drop;
}
