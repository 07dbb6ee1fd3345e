// Pipeline parallelism: the schedules (complete, deadlock-free, their bubble and in-flight
// bounds), the partitioner (balance, heterogeneous devices, memory), the executor on model
// parts against one process (loss and every gradient), and training over pp, dp x pp, tp x pp
// and dp x tp x pp against one process, with checkpoints that reshard between layouts.
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>

#include "../test_util.h"
#include "dist_util.h"
#include "loom/core/files.h"
#include "loom/core/memory.h"
#include "loom/core/safetensors.h"
#include "loom/dist/gather_tensors.h"
#include "loom/models/layer_costs.h"
#include "loom/parallel/pipeline/executor.h"
#include "loom/parallel/pipeline/partition.h"
#include "loom/parallel/pipeline/schedule.h"
#include "loom/parallel/zero/zero_optimizer.h"
#include "loom/train/trainer.h"
#include "train_compare.h"

using loom::testing::contains;
using loom::testing::error_of;
using loom::testing::world;
namespace dist = loom::dist;
namespace models = loom::models;
namespace pl = loom::parallel::pipeline;
namespace train = loom::train;
namespace fs = std::filesystem;

namespace {

// The layer split a pipelined Trainer's strategy published (null without --pp).
const loom::parallel::pipeline::Partition* partition_of(const loom::train::Trainer& t) {
  return t.runtime().context().find<loom::parallel::pipeline::Partition>("pipeline.partition");
}

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
                                    pl::make_schedule(schedule));
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

namespace {

// 8 layers (pp 4 x v 2 stages), `micro_batches` micro-batches of the 24-sequence batch.
train::TrainConfig pipeline_config(const fs::path& dir, const std::string& model,
                                   int64_t micro_batches = 4) {
  auto c = loom::testing::small_run_config(dir, micro_batches);
  c.model = model;
  c.preset = model == "gpt2" ? "gpt2-tiny" : "llama-tiny";
  c.layers = 8;
  c.vocab_size = 320;  // the byte corpus's 257 ids fit; small heads keep the test fast
  return c;
}

struct Layout {
  std::string model;
  int64_t dp, tp, pp;
  std::string schedule;
  int64_t v = 1;
  bool sp = false;
  int64_t micro_batches = 4;  // interleaved needs a multiple of pp
  int64_t zero = 0;
  bool reshard = true;  // --zero3-reshard-after-forward
  // `c` laid out this way.
  train::TrainConfig applied_to(train::TrainConfig c) const {
    c.tp = tp;
    c.pp = pp;
    c.schedule = schedule;
    c.virtual_stages = v;
    c.sequence_parallel = sp;
    c.zero = zero;
    c.zero3_reshard_after_forward = reshard;
    return c;
  }
  std::string describe() const {
    return fmt::format("{} dp {} x tp {}{} x pp {} ({}, v {}){}{}", model, dp, tp, sp ? " sp" : "",
                       pp, schedule, v, zero > 0 ? fmt::format(", ZeRO-{}", zero) : "",
                       reshard ? "" : ", units kept gathered");
  }
};

// Trains `layout` and the one-process run of the same config; they must agree.
void expect_layout_trains_like_one_process(
    const Layout& layout, const fs::path& dir,
    std::map<std::string, loom::testing::RunResult>& single) {
  SCOPED_TRACE(layout.describe());
  auto config = pipeline_config(dir, layout.model, layout.micro_batches);
  const auto key = fmt::format("{} {}", layout.model, layout.micro_batches);
  if (!single.count(key)) {
    train::Trainer t(config);
    single[key] = loom::testing::run(t);
  }
  config = layout.applied_to(config);
  train::Trainer t(
      config, loom::testing::runtime().mesh({.dp = layout.dp, .tp = layout.tp, .pp = layout.pp}));
  EXPECT_EQ(t.runtime().find_strategy("pipeline") != nullptr, layout.pp > 1);
  EXPECT_EQ(static_cast<int64_t>(t.chunks().size()), layout.v);
  EXPECT_EQ(t.zero() ? t.zero()->stage() : 0, layout.zero);
  auto distributed = loom::testing::run(t);
  loom::testing::expect_same_run(distributed, single[key]);
  if (layout.zero == 3) {
    // Each rank holds 1/dp of its stage's parameters (plus each flat unit's padding to a
    // multiple of dp) once the step's units are released.
    int64_t stage_bytes = 0;
    for (const auto& chunk : t.chunks())
      for (const auto& p : chunk->parameters())
        stage_bytes += p.numel() * static_cast<int64_t>(p.element_size());
    const double expected = static_cast<double>(stage_bytes) / static_cast<double>(layout.dp);
    const auto held = static_cast<double>(t.memory_report().parameters);
    EXPECT_GE(held, expected) << "parameter bytes per rank";
    EXPECT_LE(held, expected * 1.02) << "parameter bytes per rank";
    // The all-gathers of the last step and the evaluation after it: kept gathered, each unit once
    // in each; released after each use, again for every micro-batch's forward and backward.
    const auto& z = *t.zero();
    const auto once_each = 2 * static_cast<int64_t>(z.num_buckets());
    if (layout.reshard)
      EXPECT_GT(z.comm_stats().gathers, once_each);
    else
      EXPECT_EQ(z.comm_stats().gathers, once_each);
    if (world().rank() == 0)
      std::printf("%s: parameters %.0f bytes per rank, stage / dp = %.0f\n",
                  layout.describe().c_str(), held, expected);
  }
}

}  // namespace

TEST(TrainerPipeline, EveryScheduleAndLayoutTrainsLikeOneProcess) {
  const int64_t n = world().size();
  if (n < 2) GTEST_SKIP() << "a pipeline needs 2 or more ranks";
  loom::testing::SharedTempDir dir;
  loom::testing::write_shared_corpus(dir, 30000, 4000);
  const int64_t m = n == 3 ? 6 : 4;
  std::vector<Layout> layouts = {{"gpt2", 1, 1, n, "gpipe", 1, false, m},
                                 {"gpt2", 1, 1, n, "1f1b", 1, false, m},
                                 {"gpt2", 1, 1, n, "interleaved", 2, false, m},
                                 {"llama", 1, 1, n, "1f1b", 1, false, m}};
  if (n == 4)
    layouts.insert(layouts.end(), {{"gpt2", 2, 1, 2, "1f1b"},
                                   {"llama", 2, 1, 2, "interleaved", 2},
                                   {"gpt2", 1, 2, 2, "interleaved", 2, true},
                                   {"llama", 1, 2, 2, "gpipe"},
                                   // ZeRO along dp of a pipeline (the tied embedding's copies in
                                   // buckets of their own), and over tensor parallelism.
                                   {"gpt2", 2, 1, 2, "1f1b", 1, false, 4, 1},
                                   {"gpt2", 2, 1, 2, "interleaved", 2, false, 4, 2},
                                   {"llama", 2, 1, 2, "interleaved", 2, false, 4, 2},
                                   {"gpt2", 2, 2, 1, "1f1b", 1, false, 4, 2},
                                   // ZeRO with sequence parallelism: the norms' (and GPT-2's
                                   // biases' and positions') gradient shards summed over tp.
                                   {"gpt2", 2, 2, 1, "1f1b", 1, true, 4, 2},
                                   {"llama", 2, 2, 1, "1f1b", 1, true, 4, 1},
                                   // ZeRO-3 over tp: each rank holds 1/dp of its tp shards and
                                   // gathers them over dp block by block.
                                   {"gpt2", 2, 2, 1, "1f1b", 1, true, 4, 3},
                                   {"llama", 2, 2, 1, "1f1b", 1, false, 4, 3},
                                   {"gpt2", 2, 2, 1, "1f1b", 1, true, 4, 3, false},
                                   // ZeRO-3 over a pipeline: each stage's parameters sharded over
                                   // its dp group, the tied embedding's copies in units of their
                                   // own; units released after each use, or kept gathered.
                                   {"gpt2", 2, 1, 2, "1f1b", 1, false, 4, 3},
                                   {"gpt2", 2, 1, 2, "interleaved", 2, false, 4, 3},
                                   {"llama", 2, 1, 2, "interleaved", 2, false, 4, 3, false},
                                   {"gpt2", 2, 1, 2, "gpipe", 1, false, 4, 3, false}});
  if (n == 2) layouts.push_back({"gpt2", 1, 1, 2, "gpipe", 1, false, 4, 2});
  std::map<std::string, loom::testing::RunResult> single;
  for (const auto& layout : layouts)
    expect_layout_trains_like_one_process(layout, dir.path(), single);
}

// dp x tp x pp = 2 x 2 x 2 on 8 ranks (ctest's dist.np8_3d runs this alone).
TEST(Pipeline3D, Dp2Tp2Pp2TrainsLikeOneProcess) {
  if (world().size() != 8) GTEST_SKIP() << "needs 8 ranks (ctest dist.np8_3d)";
  loom::testing::SharedTempDir dir;
  loom::testing::write_shared_corpus(dir, 30000, 4000);
  std::map<std::string, loom::testing::RunResult> single;
  for (const auto& layout : std::vector<Layout>{{"gpt2", 2, 2, 2, "1f1b", 1, true},
                                                {"llama", 2, 2, 2, "interleaved", 2},
                                                {"gpt2", 2, 2, 2, "interleaved", 2, true, 4, 1},
                                                {"llama", 2, 2, 2, "1f1b", 1, false, 4, 2},
                                                {"gpt2", 2, 2, 2, "1f1b", 1, true, 4, 3},
                                                {"llama", 2, 2, 2, "interleaved", 2, false, 4, 3}})
    expect_layout_trains_like_one_process(layout, dir.path(), single);
}

// ZeRO over tp 4 with llama-tiny's 2 key/value heads, each held by 2 tp ranks: their gradient
// shards are summed across the ranks that share them (stage 2, and stage 3 with sequence
// parallelism).
TEST(Pipeline3D, ZeroWithKeyValueHeadsReplicatedAcrossTp) {
  if (world().size() != 8) GTEST_SKIP() << "needs 8 ranks (ctest dist.np8_3d)";
  loom::testing::SharedTempDir dir;
  loom::testing::write_shared_corpus(dir, 30000, 4000);
  std::map<std::string, loom::testing::RunResult> single;
  expect_layout_trains_like_one_process({"llama", 2, 4, 1, "1f1b", 1, false, 4, 2}, dir.path(),
                                        single);
  expect_layout_trains_like_one_process({"llama", 2, 4, 1, "1f1b", 1, true, 4, 3}, dir.path(),
                                        single);
}

// A checkpoint saved under one layout resumes under any other: five layouts (one with ZeRO-2,
// one with ZeRO-3 over tp) save at step 2, four others (ZeRO-1 and ZeRO-3 among them) load each
// checkpoint (their assembled model gives the checkpoint's logits) and continue to step 4 on the
// one-process loss curve.
TEST(TrainerPipeline, CheckpointsReshardBetweenLayouts) {
  const int64_t n = world().size();
  if (n != 4) GTEST_SKIP() << "runs at 4 ranks";
  loom::testing::SharedTempDir dir;
  loom::testing::write_shared_corpus(dir, 30000, 4000);
  auto base = pipeline_config(dir.path(), "gpt2");
  base.lr_decay_steps = base.steps;  // the same schedule for a 2-step and a 4-step run
  loom::testing::RunResult reference;
  {
    train::Trainer t(base);
    reference = loom::testing::run(t);
  }
  const std::vector<Layout> savers = {{"gpt2", 1, 1, 4, "1f1b"},
                                      {"gpt2", 2, 1, 2, "gpipe"},
                                      {"gpt2", 1, 2, 2, "interleaved", 2, true},
                                      {"gpt2", 2, 1, 2, "1f1b", 1, false, 4, 2},   // ZeRO-2
                                      {"gpt2", 2, 2, 1, "1f1b", 1, true, 4, 3}};   // ZeRO-3
  const std::vector<Layout> loaders = {{"gpt2", 1, 1, 1, "1f1b"},                  // one process
                                       {"gpt2", 2, 2, 1, "1f1b", 1, false, 4, 1},  // ZeRO-1
                                       {"gpt2", 2, 1, 2, "interleaved", 2},
                                       {"gpt2", 2, 2, 1, "1f1b", 1, false, 4, 3}};  // ZeRO-3
  auto tokens = at::randint(0, 256, {2, 16}, at::kLong);
  world().broadcast(tokens, 0);
  for (size_t i = 0; i < savers.size(); ++i) {
    auto config = savers[i].applied_to(base);
    config.steps = 2;
    config.save_dir = (dir / fmt::format("saved{}", i)).string();
    {
      train::Trainer t(config, loom::testing::runtime().mesh(
                                   {.dp = savers[i].dp, .tp = savers[i].tp, .pp = savers[i].pp}));
      t.fit();
    }
    const auto ckpt = fs::path(config.save_dir) / "step-00000002";
    // Written as one shard file per (pp, tp) rank of replica 0, no whole model anywhere.
    for (int64_t p = 0; p < savers[i].pp; ++p)
      for (int64_t t = 0; t < savers[i].tp; ++t)
        EXPECT_TRUE(fs::exists(ckpt / fmt::format("model-pp{:03d}-tp{:03d}.safetensors", p, t)));
    if (world().rank() == 0) {
      EXPECT_TRUE(loom::core::load_safetensors(ckpt / "model.safetensors").tensors.empty());
    }
    at::Tensor saved_logits;
    {
      torch::NoGradGuard no_grad;
      auto saved = train::load_model_from_checkpoint(ckpt);
      EXPECT_EQ(saved->parameters().front().scalar_type(), at::kDouble);  // an fp64 checkpoint
      saved->eval();
      saved_logits = saved->forward(tokens);
    }
    for (const auto& loader : loaders) {
      SCOPED_TRACE(savers[i].describe() + " -> " + loader.describe());
      auto resumed = loader.applied_to(base);
      resumed.resume = ckpt.string();
      const bool one_process = loader.dp * loader.tp * loader.pp == 1;
      train::Trainer t(resumed, one_process
                                    ? nullptr
                                    : loom::testing::runtime().mesh(
                                          {.dp = loader.dp, .tp = loader.tp, .pp = loader.pp}));
      EXPECT_EQ(t.step(), 2);
      {
        // The loaded shards make up the checkpoint's model: the same logits.
        auto whole = models::make_model(t.model_config());
        whole->to(at::kDouble);  // the fp64 run's parameters, not rounded to fp32
        models::load_parameters(*whole, t.gather_parameters(), "the resumed trainer");
        torch::NoGradGuard no_grad;
        whole->eval();
        EXPECT_TRUE(at::equal(whole->forward(tokens), saved_logits));
      }
      std::vector<double> losses;
      while (t.step() < resumed.steps) losses.push_back(t.train_step().loss);
      ASSERT_EQ(losses.size(), 2u);
      for (size_t s = 0; s < 2; ++s)
        EXPECT_NEAR(losses[s], reference.losses[s + 2],
                    loom::testing::kFp64Relative * reference.losses[s + 2])
            << "step " << s + 3;
      double diff2 = 0, norm2 = 0;
      for (const auto& [name, p] : t.gather_parameters()) {
        diff2 += (p - reference.params.at(name)).pow(2).sum().item<double>();
        norm2 += reference.params.at(name).pow(2).sum().item<double>();
      }
      EXPECT_LE(std::sqrt(diff2 / norm2), loom::testing::kFp64Relative);
    }
  }
}

// A resume reads the checkpoint tensor by tensor and each rank keeps only its own shards: at
// tp 2 x pp 2, building the resumed Trainer holds well under the whole model's state at its peak
// (what a loader that assembles every tensor first must hold at least once), yet resumes
// exactly: the step after the resume gives the saver's parameters bit for bit (its AdamW
// moments and step count came back too).
TEST(TrainerPipeline, AResumeHoldsOnlyTheRanksOwnShards) {
  if (world().size() != 4) GTEST_SKIP() << "runs at 4 ranks";
  loom::testing::SharedTempDir dir;
  loom::testing::write_shared_corpus(dir, 30000, 4000);
  auto config = Layout{"gpt2", 1, 2, 2, "1f1b"}.applied_to(pipeline_config(dir.path(), "gpt2"));
  config.precision = "fp32";  // memory as a real run holds it
  config.steps = 3;
  config.save_every = 2;
  config.save_dir = (dir / "saved").string();
  auto mesh = [] { return loom::testing::runtime().mesh({.dp = 1, .tp = 2, .pp = 2}); };
  std::map<std::string, at::Tensor> saved;
  double whole_state = 0;  // the single-process model's parameters and AdamW moments, fp32
  {
    train::Trainer t(config, mesh());
    t.fit();
    for (auto& [name, p] : t.gather_parameters()) saved[name] = p.clone();
    whole_state = 3.0 * 4.0 * static_cast<double>(t.model_config().num_parameters());
  }
  loom::core::install_memory_tracking();
  world().barrier();
  const auto before = loom::core::memory_counters().current_bytes;
  loom::core::reset_peak_memory();
  auto resumed = config;
  resumed.resume = (fs::path(config.save_dir) / "step-00000002").string();
  resumed.save_dir = (dir / "resumed").string();
  train::Trainer t(resumed, mesh());
  const double peak = static_cast<double>(loom::core::memory_counters().peak_bytes - before);
  const auto own = t.memory_report();
  const double own_state = static_cast<double>(own.parameters + own.optimizer);
  std::printf("rank %d: resume peak %.2f MiB, own state %.2f MiB, whole model state %.2f MiB\n",
              static_cast<int>(world().rank()), peak / (1 << 20), own_state / (1 << 20),
              whole_state / (1 << 20));
  EXPECT_GT(own_state, 0.2 * whole_state);  // the model is big enough to tell the two apart
  EXPECT_LT(own_state, 0.5 * whole_state);
  EXPECT_LT(peak, 0.6 * whole_state);  // measured 0.25-0.28 (an assembling loader: >= 1)
  EXPECT_EQ(t.step(), 2);
  t.train_step();
  for (const auto& [name, p] : t.gather_parameters())
    EXPECT_TRUE(at::equal(p, saved.at(name))) << name << " differs one step after the resume";
}

// A missing or corrupted shard file is found before any weights are touched.
TEST(TrainerPipeline, MissingOrCorruptShardsAreClearErrors) {
  if (world().size() != 2) GTEST_SKIP() << "runs at 2 ranks";
  loom::testing::SharedTempDir dir;
  loom::testing::write_shared_corpus(dir, 30000, 4000);
  auto config = pipeline_config(dir.path(), "gpt2");
  config.pp = 2;
  config.steps = 1;
  config.save_dir = (dir / "saved").string();
  {
    train::Trainer t(config, loom::testing::runtime().mesh({.pp = 2}));
    t.fit();
  }
  // A tensor missing from the second stage's shard (the file otherwise sound, its checksum
  // updated): only rank 1 needs it and fails naming it; rank 0, whose part loads, fails too
  // instead of waiting for rank 1 in the first collective.
  const auto ckpt = fs::path(config.save_dir) / "step-00000001";
  const auto lacking = dir / "lacking";
  if (world().rank() == 0) {
    fs::copy(ckpt, lacking, fs::copy_options::recursive);
    const auto shard = lacking / "model-pp001-tp000.safetensors";
    auto contents = loom::core::load_safetensors(shard);
    EXPECT_EQ(contents.tensors.erase("model/transformer.h.7.mlp.c_fc.weight"), 1u);
    loom::core::save_safetensors(shard, {contents.tensors.begin(), contents.tensors.end()},
                                 contents.metadata);
    auto state = nlohmann::json::parse(loom::core::read_file(lacking / "state.json"));
    state["checksums"]["model-pp001-tp000.safetensors"] = loom::core::file_crc32(shard);
    loom::core::write_file_atomic(lacking / "state.json", state.dump(2));
  }
  world().barrier();
  {
    auto resumed = config;
    resumed.resume = lacking.string();
    resumed.save_dir = (dir / "resumed").string();
    const auto e =
        error_of([&] { train::Trainer t(resumed, loom::testing::runtime().mesh({.pp = 2})); });
    if (world().rank() == 1)
      EXPECT_TRUE(contains(e, "has no tensor 'transformer.h.7.mlp.c_fc.weight'")) << e;
    else
      EXPECT_TRUE(contains(e, "1 rank(s) could not load their part of checkpoint")) << e;
  }
  world().barrier();
  if (world().rank() == 0) {
    // A state.json that lists no shard files (edited by hand, say): an error, not a crash.
    const auto listless = dir / "listless";
    fs::copy(ckpt, listless, fs::copy_options::recursive);
    auto state = nlohmann::json::parse(loom::core::read_file(listless / "state.json"));
    state["model_shards"] = nlohmann::json::array();
    loom::core::write_file_atomic(listless / "state.json", state.dump(2));
    const auto e = error_of([&] { train::load_checkpoint(listless); });
    EXPECT_TRUE(contains(e, "state.json lists no model shard files")) << e;
  }
  if (world().rank() == 0) {
    // A model of another shape: refused, naming the tensor, before any weight is written.
    {
      auto other_config = models::ModelConfig::preset("gpt2-tiny");
      other_config.n_layers = 8;
      other_config.vocab_size = 320;
      other_config.d_ff = 384;
      auto other = models::make_model(other_config);
      models::init_parameters(*other, 3);
      const auto before = other->named_parameters()["transformer.wte.weight"].clone();
      const auto e = error_of([&] {
        models::load_parameters(*other, train::load_checkpoint(ckpt).model, ckpt.string());
      });
      EXPECT_TRUE(contains(e,
                           "tensor 'transformer.h.0.mlp.c_fc.weight' has shape [512, 128] "
                           "but the model needs [384, 128]"))
          << e;
      EXPECT_TRUE(at::equal(other->named_parameters()["transformer.wte.weight"], before));
    }
    const auto shard = ckpt / "model-pp001-tp000.safetensors";
    const auto saved = loom::core::read_file(shard);
    // Corrupt one byte in the middle of the tensor data.
    auto bad = saved;
    bad[bad.size() / 2] = static_cast<char>(bad[bad.size() / 2] ^ 0x5a);
    loom::core::write_file_atomic(shard, bad);
    auto e = error_of([&] { train::load_checkpoint(ckpt); });
    EXPECT_TRUE(contains(e, "model-pp001-tp000.safetensors' is corrupt")) << e;
    fs::remove(shard);
    e = error_of([&] { train::load_checkpoint(ckpt); });
    EXPECT_TRUE(contains(e, "is incomplete: 'model-pp001-tp000.safetensors' is missing")) << e;
    e = error_of([&] {
      auto resumed = config;
      resumed.resume = ckpt.string();
      resumed.pp = 1;  // one process: the shards are read, not the mesh
      train::Trainer t(resumed);
    });
    EXPECT_TRUE(contains(e, "is incomplete: 'model-pp001-tp000.safetensors' is missing")) << e;
  }
  world().barrier();
}

TEST(TrainerPipeline, LayoutsThatCannotBeAreClearErrors) {
  if (world().size() != 2) GTEST_SKIP() << "runs at 2 ranks";
  loom::testing::SharedTempDir dir;
  loom::testing::write_shared_corpus(dir, 30000, 4000);
  auto mesh = loom::testing::runtime().mesh({.pp = 2});
  auto config = pipeline_config(dir.path(), "gpt2");
  config.pp = 2;
  auto with = [&](auto change) {
    auto c = config;
    change(c);
    return error_of([&] { train::Trainer t(c, mesh); });
  };
  auto e = with([](train::TrainConfig& c) { c.layers = 1; });
  EXPECT_TRUE(contains(e, "the model has 1 layers but the pipeline has 2 stages")) << e;
  e = with([](train::TrainConfig& c) { c.zero3_reshard_after_forward = false; });
  EXPECT_TRUE(contains(e,
                       "--zero3-reshard-after-forward false keeps ZeRO-3's gathered blocks "
                       "across micro-batches: it needs --zero 3 (it is 0)"))
      << e;
  e = with([](train::TrainConfig& c) { c.pp = 1; });
  EXPECT_TRUE(contains(e, "--pp 1 does not match the mesh, whose pipeline-parallel size is 2"))
      << e;
  e = with([&](train::TrainConfig& c) { c.pp_devices = (dir / "missing.json").string(); });
  EXPECT_TRUE(contains(e, "cannot open the device file")) << e;
  // A device file with rank 1 twice as fast: it gets twice rank 0's layers (uniform costs).
  if (world().rank() == 0)
    std::ofstream(dir / "devices.json") << R"({"devices": [{"speed": 1}, {"speed": 2}]})";
  world().barrier();
  config.pp_devices = (dir / "devices.json").string();
  config.pp_partition = "uniform";
  config.layers = 6;
  {
    train::Trainer t(config, mesh);
    ASSERT_NE(partition_of(t), nullptr);
    EXPECT_EQ(partition_of(t)->bounds, (std::vector<int64_t>{0, 2, 6}))
        << partition_of(t)->describe();
    EXPECT_EQ(t.model().blocks().size(), world().rank() == 0 ? 2u : 4u);
  }
  // Measured costs: every rank computes the same split (times averaged over the world), and
  // the faster rank still gets more blocks.
  config.pp_partition = "measured";
  train::Trainer t(config, mesh);
  ASSERT_NE(partition_of(t), nullptr);
  auto bounds = at::tensor(partition_of(t)->bounds, at::kLong);
  auto max = bounds.clone();
  world().all_reduce(max, dist::ReduceOp::Max);
  EXPECT_TRUE(at::equal(bounds, max)) << partition_of(t)->describe();
  EXPECT_GE(partition_of(t)->layers(1), partition_of(t)->layers(0)) << partition_of(t)->describe();
  EXPECT_EQ(t.train_step().step, 1);
  // Speeds measured at start-up: every rank computes the same split from the same timings.
  config.pp_devices = "measured";
  train::Trainer m(config, mesh);
  ASSERT_NE(partition_of(m), nullptr);
  bounds = at::tensor(partition_of(m)->bounds, at::kLong);
  max = bounds.clone();
  world().all_reduce(max, dist::ReduceOp::Max);
  EXPECT_TRUE(at::equal(bounds, max)) << partition_of(m)->describe();
  for (const auto& d : partition_of(m)->devices) {
    EXPECT_TRUE(d.speed > 0 && d.speed <= 1.0) << partition_of(m)->describe();
  }
}

// ZeRO-1/2/3 shards of a pipeline (one file per chunk, tp rank and dp rank) resume in the layout
// that wrote them, continuing the uninterrupted run exactly, and reshard into another; a
// checkpoint of another layout reshards into ZeRO-3 over the pipeline.
TEST(TrainerPipeline, ZeroShardsOfAPipelineResumeExactlyAndReshard) {
  if (world().size() != 4) GTEST_SKIP() << "runs at 4 ranks";
  loom::testing::SharedTempDir dir;
  loom::testing::write_shared_corpus(dir, 30000, 4000);
  for (int64_t stage : {1, 2, 3}) {
    SCOPED_TRACE(fmt::format("ZeRO-{}", stage));
    auto config = pipeline_config(dir.path(), "gpt2");
    config.pp = 2;
    config.zero = stage;
    config.lr_decay_steps = config.steps;
    auto mesh = [] { return loom::testing::runtime().mesh({.dp = 2, .pp = 2}); };
    std::vector<double> full;
    {
      train::Trainer t(config, mesh());
      while (t.step() < config.steps) full.push_back(t.train_step().loss);
    }
    auto first = config;
    first.steps = 2;
    first.save_dir = (dir / fmt::format("z{}", stage)).string();
    {
      train::Trainer t(first, mesh());
      t.fit();
    }
    const auto ckpt = fs::path(first.save_dir) / "step-00000002";
    if (world().rank() == 0) {
      for (const char* f : {"zero-pp000-c0-tp000-dp00000-of-pp2-tp1-dp2.safetensors",
                            "zero-pp001-c0-tp000-dp00001-of-pp2-tp1-dp2.safetensors"}) {
        EXPECT_TRUE(fs::exists(ckpt / f)) << f;
      }
    }
    auto resumed = config;
    resumed.resume = ckpt.string();
    {
      train::Trainer t(resumed, mesh());
      std::vector<double> rest;
      while (t.step() < config.steps) rest.push_back(t.train_step().loss);
      ASSERT_EQ(rest.size(), 2u);
      EXPECT_EQ(rest[0], full[2]);
      EXPECT_EQ(rest[1], full[3]);
    }
    // Another layout reshards them (dp 2 x tp 2, ZeRO-1): the same run up to float rounding.
    auto other = resumed;
    other.pp = 1;
    other.tp = 2;
    other.zero = 1;
    train::Trainer t(other, loom::testing::runtime().mesh({.dp = 2, .tp = 2}));
    std::vector<double> rest;
    while (t.step() < config.steps) rest.push_back(t.train_step().loss);
    ASSERT_EQ(rest.size(), 2u);
    EXPECT_NEAR(rest[0], full[2], loom::testing::kFp64Relative * full[2]);
    EXPECT_NEAR(rest[1], full[3], loom::testing::kFp64Relative * full[3]);
    if (stage != 3) continue;
    // And back: that layout's checkpoint resumes as ZeRO-3 over the pipeline.
    auto other_first = other;
    other_first.resume.clear();
    other_first.steps = 2;
    other_first.save_dir = (dir / "other").string();
    {
      train::Trainer o(other_first, loom::testing::runtime().mesh({.dp = 2, .tp = 2}));
      o.fit();
    }
    auto back = config;
    back.resume = (fs::path(other_first.save_dir) / "step-00000002").string();
    train::Trainer b(back, mesh());
    rest.clear();
    while (b.step() < config.steps) rest.push_back(b.train_step().loss);
    ASSERT_EQ(rest.size(), 2u);
    EXPECT_NEAR(rest[0], full[2], loom::testing::kFp64Relative * full[2]);
    EXPECT_NEAR(rest[1], full[3], loom::testing::kFp64Relative * full[3]);
  }
}

// ZeRO-3 over a pipeline in fp32: the loss of every step within 1e-5 (relative) of one process.
TEST(TrainerPipeline, Zero3OverAPipelineInFp32) {
  if (world().size() != 4) GTEST_SKIP() << "runs at 4 ranks";
  loom::testing::SharedTempDir dir;
  loom::testing::write_shared_corpus(dir, 30000, 4000);
  auto config = pipeline_config(dir.path(), "llama");
  config.precision = "fp32";
  loom::testing::RunResult single;
  {
    train::Trainer t(config);
    single = loom::testing::run(t);
  }
  config.pp = 2;
  config.zero = 3;
  config.schedule = "interleaved";
  config.virtual_stages = 2;
  train::Trainer t(config, loom::testing::runtime().mesh({.dp = 2, .pp = 2}));
  const auto d = loom::testing::compare_runs(loom::testing::run(t), single);
  EXPECT_LE(d.loss, 1e-5) << d.describe();
  if (world().rank() == 0)
    std::printf("ZeRO-3 x pp (fp32) vs one process: %s\n", d.describe().c_str());
}
