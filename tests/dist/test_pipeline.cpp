// Pipeline parallelism: the schedules (complete, deadlock-free, their bubble and in-flight
// bounds), the partitioner (balance, heterogeneous devices, memory) and the executor on model
// parts against one process (loss and every gradient). Training over a pipeline:
// test_pipeline_training.cpp.
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>

#include "../test_util.h"
#include "dist_util.h"
#include "loom/core/safetensors.h"
#include "loom/dist/gather_tensors.h"
#include "loom/models/causal_lm.h"
#include "loom/models/layer_costs.h"
#include "loom/parallel/pipeline/executor.h"
#include "loom/parallel/pipeline/partition.h"
#include "loom/parallel/pipeline/schedule.h"

using loom::testing::contains;
using loom::testing::error_of;
using loom::testing::world;
namespace dist = loom::dist;
namespace models = loom::models;
namespace pl = loom::parallel::pipeline;

namespace {

// The bubble of GPipe and 1F1B with p stages and m micro-batches when a backward takes twice a
// forward and messages are free: (p - 1) / (m + p - 1).
double bubble_formula(int64_t p, int64_t m) {
  return static_cast<double>(p - 1) / static_cast<double>(m + p - 1);
}

// A schedule that forgets the last micro-batch's backward.
class ForgetfulSchedule : public pl::Schedule {
 public:
  std::string name() const override { return "forgetful"; }
  std::vector<pl::Action> actions(int64_t rank, const pl::PipelineShape& shape) const override {
    auto out = pl::GPipeSchedule().actions(rank, shape);
    out.pop_back();
    return out;
  }
};

// A schedule whose ranks wait on each other: the last rank runs its backwards before the
// forwards the others need to hand it.
class CrossedSchedule : public pl::Schedule {
 public:
  std::string name() const override { return "crossed"; }
  std::vector<pl::Action> actions(int64_t rank, const pl::PipelineShape& shape) const override {
    std::vector<pl::Action> out;
    if (rank == 0) {
      out.push_back(pl::forward(0));
      out.push_back(pl::backward(0));  // needs rank 1's backward of 0, which waits for F1
      out.push_back(pl::forward(1));
      out.push_back(pl::backward(1));
    } else {
      out.push_back(pl::forward(0));
      out.push_back(pl::forward(1));
      out.push_back(pl::backward(1));
      out.push_back(pl::backward(0));
    }
    return out;
  }
};

}  // namespace

TEST(PipelineSchedule, GPipeAnd1F1BHaveTheTheoreticalBubbleAndInFlightBounds) {
  for (int64_t p : {2, 3, 4}) {
    for (int64_t m : {1, 2, 4, 8, 16}) {
      const pl::PipelineShape shape{p, 1, m};
      const auto gpipe = pl::simulate(pl::GPipeSchedule(), shape);
      const auto ofob = pl::simulate(pl::OneFOneBSchedule(), shape);
      EXPECT_NEAR(gpipe.bubble_fraction(), bubble_formula(p, m), 1e-12) << shape.describe();
      EXPECT_NEAR(ofob.bubble_fraction(), bubble_formula(p, m), 1e-12) << shape.describe();
      for (int64_t r = 0; r < p; ++r) {
        EXPECT_EQ(gpipe.max_in_flight[static_cast<size_t>(r)], m);
        // 1F1B: rank r holds at most p - r micro-batches, however many there are.
        EXPECT_EQ(ofob.max_in_flight[static_cast<size_t>(r)], std::min(p - r, m))
            << shape.describe() << " rank " << r;
      }
    }
  }
}

TEST(PipelineSchedule, InterleavedDividesTheBubbleByTheVirtualStages) {
  for (int64_t p : {2, 4}) {
    for (int64_t v : {2, 3}) {
      for (int64_t m : {p, 2 * p, 4 * p}) {
        const pl::PipelineShape shape{p, v, m};
        // A chunk is 1/v of a rank's layers: its forward takes 1/v, its backward 2/v.
        const auto run = pl::simulate(pl::InterleavedSchedule(), shape, 1.0 / v, 2.0 / v);
        const double theory = static_cast<double>(p - 1) /
                              static_cast<double>(v * m + p - 1);  // (p-1)/v / (m + (p-1)/v)
        EXPECT_LE(run.bubble_fraction(), theory * 1.10 + 1e-12) << shape.describe();
        EXPECT_LT(run.bubble_fraction(), bubble_formula(p, m)) << shape.describe();
      }
    }
  }
}

TEST(PipelineSchedule, ActionsAreCompleteAndBrokenSchedulesAreClearErrors) {
  // Every (micro-batch, chunk) forward then backward, once: simulate checks it.
  EXPECT_NO_THROW(pl::simulate(pl::InterleavedSchedule(), {4, 2, 8}));
  auto e = error_of([] { pl::simulate(pl::InterleavedSchedule(), {4, 2, 6}); });
  EXPECT_TRUE(contains(e, "--micro-batches 6 must be a multiple of --pp 4")) << e;
  e = error_of([] { pl::simulate(pl::GPipeSchedule(), {2, 2, 4}); });
  EXPECT_TRUE(contains(e, "needs --schedule interleaved")) << e;
  e = error_of([] { pl::simulate(ForgetfulSchedule(), {2, 1, 3}); });
  EXPECT_TRUE(contains(e, "never runs B2")) << e;
  e = error_of([] { pl::simulate(CrossedSchedule(), {2, 1, 2}); });
  EXPECT_TRUE(contains(e, "deadlocks")) << e;
  EXPECT_TRUE(contains(e, "rank 0 at B0")) << e;
  e = error_of([] { pl::make_schedule("zero-bubble-v"); });
  EXPECT_TRUE(contains(e, "valid: 1f1b, gpipe, interleaved")) << e;
}

TEST(PipelinePartition, BalancesCostsAndGivesFasterDevicesMoreLayers) {
  pl::LayerCosts costs;
  costs.layer_time.assign(12, 1.0);
  costs.layer_bytes.assign(12, 1.0);
  // Equal devices: equal stages.
  auto even = pl::partition_layers(costs, {3, 1, 4}, pl::uniform_devices(3));
  EXPECT_EQ(even.bounds, (std::vector<int64_t>{0, 4, 8, 12}));
  // Rank 1 twice as fast: twice the layers (3 : 6 : 3).
  auto devices = pl::uniform_devices(3);
  devices[1].speed = 2.0;
  auto hetero = pl::partition_layers(costs, {3, 1, 4}, devices);
  EXPECT_EQ(hetero.bounds, (std::vector<int64_t>{0, 3, 9, 12})) << hetero.describe();
  EXPECT_NEAR(hetero.imbalance(), 1.0, 1e-12);
  // A heavy head moves layers off the last stage.
  costs.last_time = 4.0;
  auto headed = pl::partition_layers(costs, {2, 1, 4}, pl::uniform_devices(2));
  EXPECT_EQ(headed.bounds, (std::vector<int64_t>{0, 8, 12}));
  // Memory: a device that holds 2 GiB takes at most 2 one-GiB layers.
  costs.last_time = 0;
  costs.layer_bytes.assign(12, 1024.0 * 1024 * 1024);
  devices = pl::uniform_devices(3);
  devices[0].memory_gb = 2;
  auto capped = pl::partition_layers(costs, {3, 1, 4}, devices);
  EXPECT_LE(capped.layers(0), 2) << capped.describe();
  devices[1].memory_gb = devices[2].memory_gb = 2;
  auto e = error_of([&] { pl::partition_layers(costs, {3, 1, 4}, devices); });
  EXPECT_TRUE(contains(e, "no pipeline partition of 12 layers into 3 stages fits")) << e;
  EXPECT_TRUE(contains(e, "rank 0 needs 4.0 GiB of 2 GiB")) << e;
  e = error_of([&] { pl::partition_layers(costs, {4, 4, 4}, pl::uniform_devices(4)); });
  EXPECT_TRUE(contains(e, "12 layers but the pipeline has 16 stages")) << e;
}

TEST(PipelinePartition, DeviceFilesAndModelCosts) {
  if (world().rank() != 0) GTEST_SKIP() << "a local check: rank 0 runs it";
  loom::testing::TempDir dir;
  const auto path = (dir.path() / "devices.json").string();
  auto write = [&](const std::string& text) { std::ofstream(path) << text; };
  write(R"({"devices": [{"name": "h100", "speed": 2.0, "memory_gb": 80}, {"name": "a100"}]})");
  const auto devices = pl::load_device_file(path, 2);
  EXPECT_EQ(devices[0].name, "h100");
  EXPECT_EQ(devices[0].speed, 2.0);
  EXPECT_EQ(devices[1].speed, 1.0);
  EXPECT_EQ(devices[1].memory_gb, 0.0);
  auto e = error_of([&] { pl::load_device_file(path, 4); });
  EXPECT_TRUE(contains(e, "lists 2 devices but --pp is 4")) << e;
  write(R"({"devices": [{"speed": 0}, {}]})");
  e = error_of([&] { pl::load_device_file(path, 2); });
  EXPECT_TRUE(contains(e, "has speed 0; it must be > 0")) << e;
  write("{not json");
  e = error_of([&] { pl::load_device_file(path, 2); });
  EXPECT_TRUE(contains(e, "is not valid JSON")) << e;
  e = error_of([&] { pl::load_device_file((dir.path() / "missing.json").string(), 2); });
  EXPECT_TRUE(contains(e, "cannot open the device file")) << e;

  // FLOPs: GPT-2 124M's head (2 d V per token) outweighs a block (24 d^2 + 2 T d) ~2x.
  auto config = models::ModelConfig::preset("gpt2-124m");
  auto flops = models::layer_costs(config, "flops", {1, 1024, 1, 1});
  const double d = 768, t = 1024;
  EXPECT_DOUBLE_EQ(flops.layer_time[0], 2 * (4 * d * d + 2 * d * 3072) + 2 * t * d);
  EXPECT_DOUBLE_EQ(flops.last_time, 2 * d * 50257 + 5 * 50257);
  auto params = models::layer_costs(config, "params", {1, 1024, 1, 1});
  EXPECT_DOUBLE_EQ(params.layer_time[0], 7087872);  // one GPT-2 block, as Hugging Face counts
  e = error_of([&] { models::layer_costs(config, "vibes", {}); });
  EXPECT_TRUE(contains(e, "valid: uniform, params, flops (measured times come from")) << e;
}

namespace {

models::ModelConfig eight_layers(const std::string& preset) {
  auto c = models::ModelConfig::preset(preset);
  c.n_layers = 8;
  c.vocab_size = 512;
  c.max_seq_len = 64;
  return c;
}

// All forwards, then the backwards: newest first on even ranks, oldest first on odd ones. Each
// rank then needs its gradients in the reverse of the order its neighbour sends them, so the
// executor must keep all but one until they are needed (what NCCL's untagged, in-order
// messages demand of it).
class OppositeOrderGPipe : public pl::Schedule {
 public:
  std::string name() const override { return "opposite-order-gpipe"; }
  std::vector<pl::Action> actions(int64_t rank, const pl::PipelineShape& shape) const override {
    std::vector<pl::Action> out;
    const int64_t m = shape.micro_batches;
    for (int64_t k = 0; k < m; ++k) out.push_back(pl::forward(k));
    for (int64_t k = 0; k < m; ++k) out.push_back(pl::backward(rank % 2 == 0 ? m - 1 - k : k));
    return out;
  }
};

}  // namespace

// The executor over model parts: loss and every gradient equal to one process running the same
// micro-batches.
TEST(PipelineExecutor, ModelPartsEqualOneProcessForEverySchedule) {
  const int64_t n = world().size();
  if (n < 2) GTEST_SKIP() << "a pipeline needs 2 or more ranks";
  auto mesh = loom::testing::runtime().mesh({.pp = n});
  const int64_t rank = mesh->coord(dist::Dim::pp);
  for (const std::string preset : {"gpt2-tiny", "llama-tiny", "llama-tiny tied"}) {
    auto config = eight_layers(preset.substr(0, preset.find(' ')));
    if (preset.ends_with("tied")) config.tie_embeddings = true;  // Llama with a tied head
    const int64_t m = 2 * n, mb = 2, seq = 16;
    auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
    auto tokens = at::randint(0, config.vocab_size, {m * mb, seq + 1}, gen, at::kLong);
    const auto inputs = tokens.narrow(1, 0, seq), targets = tokens.narrow(1, 1, seq);
    // One process: m micro-batches, gradients accumulated, losses scaled by 1/m. In fp64: the
    // pipeline only reorders sums, so everything agrees to ~1e-14 (bound 1e-11).
    const double bound = 1e-11;
    auto whole = models::make_model(config);
    whole->to(at::kDouble);
    models::init_parameters(*whole, 5);
    double want_loss = 0;
    for (int64_t k = 0; k < m; ++k) {
      auto loss = whole->loss(inputs.narrow(0, k * mb, mb), targets.narrow(0, k * mb, mb)) /
                  static_cast<double>(m);
      loss.backward();
      want_loss += loss.item<double>();
    }
    // The last entry is a deliberately broken variant: the last stage pairs micro-batch k's
    // activations with micro-batch k+1's targets (a wrong micro-batch order).
    struct Run {
      std::string schedule;
      int64_t v;
      bool broken;
    };
    for (const auto& [schedule, v, broken] : std::vector<Run>{{"gpipe", 1, false},
                                                              {"1f1b", 1, false},
                                                              {"interleaved", 2, false},
                                                              {"opposite-order", 1, false},
                                                              {"1f1b", 1, true}}) {
      SCOPED_TRACE(fmt::format("{} {} pp {} v {}{}", preset, schedule, n, v,
                               broken ? " (broken: targets of the next micro-batch)" : ""));
      const pl::PipelineShape shape{n, v, m};
      pl::LayerCosts costs;
      costs.layer_time.assign(8, 1.0);
      costs.layer_bytes.assign(8, 0.0);
      const auto partition = pl::partition_layers(costs, shape, pl::uniform_devices(n));
      std::vector<std::shared_ptr<models::CausalLM>> chunks;
      for (int64_t c = 0; c < v; ++c) {
        const int64_t s = shape.stage_of(rank, c);
        chunks.push_back(models::make_model(
            config, nullptr,
            {partition.first_layer(s), partition.end_layer(s), s == 0, s == shape.stages() - 1}));
        chunks.back()->to(at::kDouble);
        models::init_parameters(*chunks.back(), 5);
      }
      pl::PipelineExecutor executor(mesh->comm_ptr(dist::Dim::pp), shape,
                                    schedule == "opposite-order"
                                        ? std::make_shared<const OppositeOrderGPipe>()
                                        : pl::make_schedule(schedule));
      const auto stats = executor.run([&](int64_t c, int64_t k, const at::Tensor& in) {
        auto& part = *chunks[static_cast<size_t>(c)];
        auto out = part.forward_part(part.part().first ? inputs.narrow(0, k * mb, mb) : in);
        if (!part.part().last) return out;
        const int64_t target_batch = broken ? (k + 1) % m : k;
        return part.loss_from_logits(out, targets.narrow(0, target_batch * mb, mb)) /
               static_cast<double>(m);
      });
      // 1F1B keeps at most pp - rank micro-batches; GPipe all of them.
      if (schedule == "1f1b" && !broken) {
        EXPECT_EQ(stats.max_in_flight, std::min(n - rank, m));
      }
      if (schedule == "gpipe") {
        EXPECT_EQ(stats.max_in_flight, m);
      }
      // Every rank but the last gets m gradients in the opposite order to its use: it keeps all
      // but the one it needs first. The in-order schedules keep none.
      if (schedule == "opposite-order") {
        EXPECT_EQ(stats.messages_received_early, rank < n - 1 ? m - 1 : 0);
      } else if (schedule != "interleaved") {
        EXPECT_EQ(stats.messages_received_early, 0);
      }
      auto loss = at::zeros({1}, at::kDouble);
      if (executor.has_last_stage())
        for (double l : stats.outputs) loss += l;
      mesh->comm(dist::Dim::pp).broadcast(loss, static_cast<int>(n - 1));
      if (!broken) {
        EXPECT_NEAR(loss.item<double>(), want_loss, bound * want_loss);
      }
      // Every gradient; the tied embedding's two copies add up to the one-process gradient.
      loom::core::NamedTensors grads;
      for (const auto& chunk : chunks)
        for (const auto& p : chunk->named_parameters())
          grads.emplace_back(p.key(), p.value().grad());
      std::map<std::string, at::Tensor> got;
      for (auto& [name, g] : dist::all_gather_named_tensors(mesh->comm(dist::Dim::pp), grads)) {
        if (got.count(name))
          got[name] = got[name] + g;
        else
          got[name] = g;
      }
      double worst = 0;
      for (const auto& p : whole->named_parameters()) {
        ASSERT_TRUE(got.count(p.key())) << p.key();
        const auto& want = p.value().grad();
        const double rel = ((got[p.key()] - want).abs().max() / want.abs().max()).item<double>();
        if (!broken) {
          EXPECT_LE(rel, bound) << p.key();
        }
        worst = std::max(worst, rel);
      }
      if (!broken && std::getenv("LOOM_TEST_VERBOSE") && world().rank() == 0)
        fmt::print("executor {} {} pp {}: worst gradient {:.3g}\n", preset, schedule, n, worst);
      if (broken) {
        if (world().rank() == 0)
          fmt::print("[broken variant] {} pp {}: wrong micro-batch order: worst gradient {:.3g}\n",
                     preset, n, worst);
        EXPECT_GE(worst, 1000 * bound);
      }
    }
  }
}
