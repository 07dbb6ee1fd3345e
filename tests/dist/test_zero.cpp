// ZeRO stages 1-3: the flat layout, the engine against plain data parallelism on a user's own
// module (FullyShardedModule units, fp32 and bf16 with fp32 masters), the ZeRO paper's memory
// formulas, and the Trainer at every stage against one process and plain DP, with gradient
// accumulation, activation checkpointing, checkpoint resume and its errors.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "../test_util.h"
#include "dist_util.h"
#include "loom/core/files.h"
#include "loom/core/memory.h"
#include "loom/parallel/data/data_parallel.h"
#include "loom/parallel/zero/fully_sharded.h"
#include "loom/parallel/zero/zero_optimizer.h"
#include "loom/train/grad_clip.h"
#include "loom/train/optimizer.h"
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
namespace zero = loom::parallel::zero;
namespace train = loom::train;
namespace fs = std::filesystem;

TEST(FlatLayout, SegmentsCoverEveryElementOnceWithPadding) {
  const std::vector<int64_t> numels = {5, 3, 0, 7};  // 15 elements
  for (int64_t ranks = 1; ranks <= 4; ++ranks) {
    zero::FlatLayout layout(numels, ranks);
    EXPECT_EQ(layout.total(), 15);
    EXPECT_EQ(layout.padded_total() % ranks, 0);
    EXPECT_LT(layout.padding(), ranks);
    EXPECT_EQ(layout.shard_numel() * ranks, layout.padded_total());
    std::vector<int> seen(15, 0);
    for (int64_t r = 0; r < ranks; ++r)
      for (const auto& s : layout.segments(r)) {
        EXPECT_GT(s.numel, 0);
        EXPECT_LE(s.shard_offset + s.numel, layout.shard_numel());
        for (int64_t e = 0; e < s.numel; ++e) ++seen[layout.offset(s.param) + s.param_offset + e];
      }
    for (int c : seen) EXPECT_EQ(c, 1) << ranks << " ranks";
  }
  EXPECT_TRUE(contains(error_of([] { zero::FlatLayout({1}, 0); }), "at least one rank"));
}

// --- The engine on a user's module ------------------------------------------------------

namespace {

using ShardedLinear = zero::FullyShardedModule<torch::nn::LinearImpl>;

// A user's module: two FullyShardedModule units, a plain layer and a bare parameter in the root,
// 1115 parameters (not divisible by 2, 3 or 4: every shard layout is padded).
struct Net : torch::nn::Module {
  std::shared_ptr<ShardedLinear> a, b;
  torch::nn::Linear c{nullptr};
  at::Tensor odd;
  Net() {
    torch::manual_seed(11);
    a = register_module("a", std::make_shared<ShardedLinear>(16, 24));
    b = register_module("b", std::make_shared<ShardedLinear>(24, 24));
    c = register_module("c", torch::nn::Linear(24, 4));
    odd = register_parameter("odd", torch::randn({7}) * 0.1);
  }
  bool use_odd = true;  // false: `odd` gets no gradient in this rank's backward
  at::Tensor forward(const at::Tensor& x) {
    auto y = c(at::tanh(b->forward(at::tanh(a->forward(x)))));
    return use_odd ? y + odd.sum() : y;
  }
};

std::vector<std::pair<std::string, at::Tensor>> named(torch::nn::Module& m) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : m.named_parameters()) out.emplace_back(item.key(), item.value());
  return out;
}

at::Tensor input_of(int64_t rank, int64_t step, int64_t micro, at::ScalarType dtype) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(5000 + 100 * step + 10 * rank + micro);
  return at::randn({8, 16}, g).to(dtype);
}

struct EngineRun {
  std::map<std::string, at::Tensor> params;
  std::vector<double> norms;
};

constexpr double kMaxNorm = 0.05;  // small enough that every step clips
const loom::ops::AdamWOptions kAdamW{0.9, 0.95, 1e-8, 0.1};

// Plain data parallelism (DataParallel + AdamW), the reference.
EngineRun run_plain(int64_t micros, at::ScalarType dtype, bool use_odd = true) {
  Net net;
  net.use_odd = use_odd;
  net.to(dtype);
  std::unique_ptr<pd::DataParallel> dp;
  if (world().size() > 1)
    dp = std::make_unique<pd::DataParallel>(named(net), loom::testing::runtime().world());
  train::AdamW opt(named(net), kAdamW);
  EngineRun out;
  for (int64_t step = 0; step < 3; ++step) {
    for (int64_t k = 0; k < micros; ++k) {
      if (dp) dp->set_sync(k == micros - 1);
      (net.forward(input_of(world().rank(), step, k, dtype))
           .to(at::promote_types(dtype, at::kFloat))
           .pow(2)
           .mean() /
       static_cast<double>(micros))
          .backward();
    }
    if (dp) dp->finish_gradient_sync();
    std::vector<at::Tensor> params;
    for (const auto& p : net.parameters()) params.push_back(p);
    out.norms.push_back(train::clip_grad_norm(params, kMaxNorm));
    opt.step(1e-2);
    if (dp)
      dp->zero_grad();
    else
      opt.zero_grad();
  }
  for (const auto& [name, p] : named(net)) out.params[name] = p.detach().clone();
  return out;
}

EngineRun run_zero(int stage, int64_t micros, at::ScalarType dtype, bool offload = false,
                   bool use_odd = true) {
  Net net;
  net.use_odd = use_odd;
  net.to(dtype);
  zero::ZeroOptions options;
  options.stage = stage;
  options.bucket_mb = 0.001;  // stages 1-2: several buckets
  options.adamw = kAdamW;
  options.offload_optimizer = offload;
  auto engine = zero::shard_module(net, loom::testing::runtime().world(), options);
  EngineRun out;
  for (int64_t step = 0; step < 3; ++step) {
    for (int64_t k = 0; k < micros; ++k) {
      engine->set_sync(k == micros - 1);
      engine->prepare_forward();
      (net.forward(input_of(world().rank(), step, k, dtype))
           .to(at::promote_types(dtype, at::kFloat))
           .pow(2)
           .mean() /
       static_cast<double>(micros))
          .backward();
      engine->finish_gradient_sync();
    }
    out.norms.push_back(engine->clip_grad_norm(kMaxNorm));
    engine->step(1e-2);
    engine->zero_grad();
  }
  for (const auto& [name, p] : engine->gather_parameters()) out.params[name] = p.clone();
  net.a->unbind();
  net.b->unbind();
  return out;
}

void expect_close(const EngineRun& got, const EngineRun& want, double rtol) {
  ASSERT_EQ(got.norms.size(), want.norms.size());
  for (size_t s = 0; s < want.norms.size(); ++s)
    EXPECT_NEAR(got.norms[s], want.norms[s], rtol * want.norms[s]) << "grad norm, step " << s;
  ASSERT_EQ(got.params.size(), want.params.size());
  for (const auto& [name, p] : want.params) {
    const auto q = got.params.at(name).to(at::kDouble), r = p.to(at::kDouble);
    const double rel = ((q - r).norm() / r.norm()).item<double>();
    EXPECT_LE(rel, rtol) << name;
    if (std::getenv("LOOM_TEST_VERBOSE")) fmt::print("engine: {} {:.3g}\n", name, rel);
  }
}

}  // namespace

class ZeroEngine : public ::testing::TestWithParam<std::tuple<int, int64_t>> {};

TEST_P(ZeroEngine, MatchesPlainDataParallelOnAUserModule) {
  const auto [stage, micros] = GetParam();
  // fp64: the engines differ only in the order of sums (bound: docs/testing.md).
  const auto want = run_plain(micros, at::kDouble);
  expect_close(run_zero(stage, micros, at::kDouble), want, loom::testing::kFp64Relative);
  // ZeRO-Offload runs the same update on host copies: the same numbers.
  expect_close(run_zero(stage, micros, at::kDouble, /*offload=*/true), want,
               loom::testing::kFp64Relative);
}

TEST_P(ZeroEngine, Bf16ParametersWithFp32MastersTrackPlainDataParallel) {
  // Both keep fp32 masters and round them to bf16 after each step; gradients are bf16 and
  // averaged in bf16 in another order (an all-reduce vs a reduce-scatter), so a parameter may
  // land one bf16 rounding step (2^-8 relative) apart.
  const auto [stage, micros] = GetParam();
  expect_close(run_zero(stage, micros, at::kBFloat16), run_plain(micros, at::kBFloat16), 1e-2);
}

// Data-dependent control flow: on odd ranks `odd` gets no gradient, so its bucket completes only
// when backward ends there and during backward elsewhere. Reductions still go out in one order on
// every rank, and a missing gradient counts as zeros, as plain data parallelism counts it.
TEST_P(ZeroEngine, AParameterWithoutAGradientOnSomeRanksCountsAsZeros) {
  const auto [stage, micros] = GetParam();
  const bool use_odd = world().rank() % 2 == 0;
  expect_close(run_zero(stage, micros, at::kDouble, false, use_odd),
               run_plain(micros, at::kDouble, use_odd), loom::testing::kFp64Relative);
}

INSTANTIATE_TEST_SUITE_P(StagesAndAccumulation, ZeroEngine,
                         ::testing::Combine(::testing::Values(1, 2, 3),
                                            ::testing::Values<int64_t>(1, 2)));

TEST(ZeroEngine, Stage3GathersUnitsJustInTimeAndPrefetches) {
  Net net;
  zero::ZeroOptions options;
  options.stage = 3;
  auto engine = zero::shard_module(net, loom::testing::runtime().world(), options);
  EXPECT_EQ(engine->num_buckets(), 3u);  // a, b, root
  // Released: only the shards hold memory.
  const auto released = engine->memory().parameters;
  for (int step = 0; step < 2; ++step) {
    engine->reset_comm_stats();
    engine->prepare_forward();
    auto out = net.forward(input_of(world().rank(), 0, 0, at::kFloat));
    // After forward, a and b are released again; only the root (c and odd: 107 parameters,
    // padded to a multiple of the ranks) stays gathered for backward.
    const int64_t n = world().size(), root = (107 + n - 1) / n * n;
    EXPECT_EQ(engine->memory().parameters, released + root * 4);
    out.pow(2).mean().backward();
    engine->finish_gradient_sync();
    EXPECT_EQ(engine->memory().parameters, released);
    const auto& s = engine->comm_stats();
    // root once, a and b in forward and again in backward.
    EXPECT_EQ(s.gathers, 5);
    // From the second step on the order is known: b in forward, a in backward are prefetched.
    if (step == 1) {
      EXPECT_EQ(s.prefetched, 2);
    }
    engine->step(1e-3);
    engine->zero_grad();
  }
  net.a->unbind();
  net.b->unbind();
}

TEST(ZeroEngine, BadOptionsAndUnitsAreClearErrors) {
  auto comm = loom::testing::runtime().world();
  Net net;
  zero::ZeroOptions bad;
  bad.stage = 4;
  EXPECT_TRUE(contains(error_of([&] { zero::ZeroOptimizer(named(net), comm, bad); }),
                       "--zero 4 is invalid; ZeRO stages are 1, 2 and 3"));
  zero::ZeroOptions three;
  three.stage = 3;
  EXPECT_TRUE(contains(error_of([&] {
                         zero::ZeroOptimizer(named(net), comm, three, {{"u", {"a.weight", "x"}}});
                       }),
                       "unit 'u' names parameter 'x'"));
  EXPECT_TRUE(contains(
      error_of([&] {
        zero::ZeroOptimizer(named(net), comm, three, {{"u", {"a.weight"}}, {"v", {"a.weight"}}});
      }),
      "'a.weight' is in two units"));
}

// --- Memory: the ZeRO paper's formulas ----------------------------------------------------

namespace {

// A wider module, so padding (< ranks elements per bucket) is negligible.
struct Wide : torch::nn::Module {
  std::shared_ptr<ShardedLinear> a, b;
  Wide() {
    a = register_module("a", std::make_shared<ShardedLinear>(256, 256));
    b = register_module("b", std::make_shared<ShardedLinear>(256, 256));
  }
  at::Tensor forward(const at::Tensor& x) { return b->forward(at::relu(a->forward(x))); }
};

struct Bytes {
  double parameters, gradients, optimizer;
};

// Bytes per rank for Ψ parameters on N ranks with Adam (Rajbhandari et al., ZeRO, §3 and
// Figure 1, with K = 12 for mixed precision: fp32 master, momentum, variance):
//   fp32 params:         stage 0: 4Ψ + 4Ψ + 8Ψ     1: 4Ψ + 4Ψ + 8Ψ/N
//                        stage 2: 4Ψ + (4Ψ + 8Ψ)/N  3: (4Ψ + 4Ψ + 8Ψ)/N
//   bf16 + fp32 masters: stage 0: 2Ψ + 2Ψ + 12Ψ    1: 2Ψ + 2Ψ + 12Ψ/N
//                        stage 2: 2Ψ + (2Ψ + 12Ψ)/N 3: (2Ψ + 2Ψ + 12Ψ)/N
Bytes formula(int stage, double psi, double n, bool bf16) {
  const double p = bf16 ? 2 : 4, k = bf16 ? 12 : 8;
  return {stage == 3 ? p * psi / n : p * psi, stage >= 2 ? p * psi / n : p * psi,
          stage >= 1 ? k * psi / n : k * psi};
}

void expect_within(const Bytes& got, const Bytes& want, const std::string& what) {
  EXPECT_NEAR(got.parameters, want.parameters, 0.05 * want.parameters) << what << " parameters";
  EXPECT_NEAR(got.gradients, want.gradients, 0.05 * want.gradients) << what << " gradients";
  EXPECT_NEAR(got.optimizer, want.optimizer, 0.05 * want.optimizer) << what << " optimizer";
}

}  // namespace

TEST(ZeroMemory, ParametersGradientsAndOptimizerMatchTheFormulas) {
  const double n = static_cast<double>(world().size());
  for (const bool bf16 : {false, true}) {
    const auto dtype = bf16 ? at::kBFloat16 : at::kFloat;
    for (int stage = 0; stage <= 3; ++stage) {
      Wide net;
      net.to(dtype);
      double psi = 0;
      for (const auto& p : net.parameters()) psi += static_cast<double>(p.numel());
      Bytes got{};
      auto one_step = [&](auto&& before, auto&& after) {
        before();
        net.forward(at::randn({4, 256}).to(dtype)).to(at::kFloat).pow(2).mean().backward();
        after();
      };
      if (stage == 0) {
        // Plain data parallelism keeps its gradient buckets; a single rank keeps .grad.
        std::unique_ptr<pd::DataParallel> dp;
        if (world().size() > 1)
          dp = std::make_unique<pd::DataParallel>(named(net), loom::testing::runtime().world());
        train::AdamW opt(named(net), kAdamW);
        one_step([] {},
                 [&] {
                   if (dp) dp->finish_gradient_sync();
                 });
        opt.step(1e-3);
        std::vector<at::Tensor> params, grads, state;
        for (const auto& p : net.parameters()) params.push_back(p), grads.push_back(p.grad());
        for (const auto& [k, t] : opt.state()) state.push_back(t);
        got = {static_cast<double>(loom::core::storage_bytes(params)),
               static_cast<double>(loom::core::storage_bytes(grads)),
               static_cast<double>(loom::core::storage_bytes(state))};
      } else {
        zero::ZeroOptions options;
        options.stage = stage;
        auto engine = zero::shard_module(net, loom::testing::runtime().world(), options);
        one_step([&] { engine->prepare_forward(); }, [&] { engine->finish_gradient_sync(); });
        engine->step(1e-3);
        const auto m = engine->memory();
        got = {static_cast<double>(m.parameters), static_cast<double>(m.gradients),
               static_cast<double>(m.optimizer)};
        net.a->unbind();
        net.b->unbind();
      }
      const auto want = formula(stage, psi, n, bf16);
      expect_within(got, want,
                    fmt::format("stage {} {} at dp {}", stage, bf16 ? "bf16" : "fp32", n));
      if (std::getenv("LOOM_TEST_VERBOSE") && world().rank() == 0)
        fmt::print(
            "stage {} {} dp {}: params {:.0f} ({:.0f}) grads {:.0f} ({:.0f}) opt {:.0f} "
            "({:.0f})\n",
            stage, bf16 ? "bf16" : "fp32", n, got.parameters, want.parameters, got.gradients,
            want.gradients, got.optimizer, want.optimizer);
    }
  }
}

// --- The Trainer ----------------------------------------------------------------------------

namespace {

train::TrainConfig zero_config(const fs::path& dir, int64_t zero_stage, int64_t grad_accum) {
  auto c = loom::testing::small_run_config(dir, grad_accum);
  c.zero = zero_stage;
  return c;
}

// One process and plain data parallelism at the world size, per accumulation: computed once.
const std::pair<RunResult, RunResult>& references(const fs::path& dir, int64_t grad_accum) {
  static std::map<int64_t, std::pair<RunResult, RunResult>> cache;
  auto it = cache.find(grad_accum);
  if (it != cache.end()) return it->second;
  RunResult single, plain;
  {
    train::Trainer t(zero_config(dir, 0, grad_accum));
    single = run(t);
  }
  {
    train::Trainer t(zero_config(dir, 0, grad_accum), loom::testing::layout_mesh({}));
    plain = run(t);
  }
  return cache.emplace(grad_accum, std::make_pair(single, plain)).first->second;
}

struct ZeroCase {
  int64_t stage, grad_accum;
  std::string checkpointing;
  bool offload = false;  // --offload-optimizer and --offload-activations
};

}  // namespace

class TrainerZero : public ::testing::TestWithParam<ZeroCase> {};

TEST_P(TrainerZero, SameLossesAndParametersAsOneProcessAndPlainDp) {
  const auto c = GetParam();
  // The corpus is the same bytes for every test (write_corpus_data is deterministic), so the
  // cached references stay valid across the temporary directories.
  loom::testing::SharedTempDir dir;
  loom::testing::write_shared_corpus(dir, 60000, 4000);
  const auto& [single, plain] = references(dir.path(), c.grad_accum);
  auto config = zero_config(dir.path(), c.stage, c.grad_accum);
  config.activation_checkpointing = c.checkpointing;
  config.offload_optimizer = c.offload;
  config.offload_activations = c.offload;
  train::Trainer t(config, loom::testing::layout_mesh({}));
  ASSERT_NE(t.zero(), nullptr);
  EXPECT_EQ(t.zero()->stage(), c.stage);
  const auto sharded = run(t);
  expect_same_run(sharded, single);
  expect_same_run(sharded, plain);
  // The sharded optimizer state (moments; masters under offload) is fp64 like the parameters,
  // and offload is really on: fp64 parameters have a master copy only when offloaded.
  bool has_master = false;
  for (const auto& [name, tensor] : t.zero()->state()) {
    if (at::isFloatingType(tensor.scalar_type())) {
      EXPECT_EQ(tensor.scalar_type(), at::kDouble) << name;
    }
    has_master = has_master || name.ends_with(".master");
  }
  EXPECT_EQ(has_master, c.offload);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, TrainerZero,
    ::testing::Values(ZeroCase{1, 1, "none"}, ZeroCase{2, 1, "none"}, ZeroCase{3, 1, "none"},
                      ZeroCase{1, 2, "full"}, ZeroCase{2, 2, "full"}, ZeroCase{3, 2, "full"},
                      ZeroCase{3, 1, "selective"}, ZeroCase{1, 2, "full", true},
                      ZeroCase{3, 1, "full", true}),
    [](const auto& info) {
      return fmt::format("Stage{}Accum{}{}{}", info.param.stage, info.param.grad_accum,
                         info.param.checkpointing, info.param.offload ? "Offload" : "");
    });

TEST(TrainerZero, MemoryReportFollowsTheStage) {
  loom::testing::SharedTempDir dir;
  loom::testing::write_shared_corpus(dir, 60000, 4000);
  const double n = static_cast<double>(world().size());
  for (int64_t stage = 0; stage <= 3; ++stage) {
    auto config = zero_config(dir.path(), stage, 1);
    config.precision = "fp32";  // the formulas count 4-byte parameters and moments
    config.steps = 1;
    train::Trainer t(config, loom::testing::layout_mesh({}));
    t.train_step();
    const auto m = t.memory_report();
    double psi = 0;
    for (const auto& p : t.model().parameters()) psi += static_cast<double>(p.numel());
    auto want = formula(static_cast<int>(stage), psi, n, false);
    // One process at stage 0 frees its gradients after the step (AdamW zero_grad).
    if (stage == 0 && world().size() == 1) want.gradients = 0;
    EXPECT_NEAR(static_cast<double>(m.parameters), want.parameters, 0.05 * want.parameters + 1)
        << "stage " << stage;
    EXPECT_NEAR(static_cast<double>(m.gradients), want.gradients, 0.05 * want.gradients + 1)
        << "stage " << stage;
    EXPECT_NEAR(static_cast<double>(m.optimizer), want.optimizer, 0.05 * want.optimizer)
        << "stage " << stage;
    EXPECT_GT(m.peak_activations, 0) << "stage " << stage;
    EXPECT_GT(m.current_total, 0);
  }
}

// --precision bf16 with full checkpointing: the recompute in backward must not leave bf16 copies
// of the weights in autocast's cache for the next step's forward (which would then run on the
// previous step's weights). Same losses and parameters as without checkpointing, step after step.
TEST(TrainerZero, Bf16WithFullCheckpointingTracksBf16WithoutIt) {
  loom::testing::SharedTempDir dir;
  loom::testing::write_shared_corpus(dir, 60000, 4000);
  for (const int64_t stage : {int64_t{0}, int64_t{3}}) {
    auto config = zero_config(dir.path(), stage, 2);
    config.precision = "bf16";
    RunResult kept, recomputed;
    {
      train::Trainer t(config, loom::testing::layout_mesh({}));
      kept = run(t);
    }
    config.activation_checkpointing = "full";
    {
      train::Trainer t(config, loom::testing::layout_mesh({}));
      recomputed = run(t);
    }
    expect_same_run(recomputed, kept, 1e-6);
  }
}

// Stage 3 saves a checkpoint one gathered unit at a time: rank 0, which writes the model, holds
// well under the whole model's parameters at its peak (saving used to gather all of them first),
// and the file holds the single-process model.
TEST(TrainerZero, Stage3SavesOneUnitAtATime) {
  loom::testing::SharedTempDir dir;
  loom::testing::write_shared_corpus(dir, 60000, 4000);
  auto config = zero_config(dir.path(), 3, 1);
  config.precision = "fp32";  // memory as a real run holds it
  config.layers = 8;
  config.steps = 1;
  config.save_dir = (dir / "ckpt").string();
  train::Trainer t(config, loom::testing::layout_mesh({}));
  t.train_step();
  const auto whole = t.gather_parameters();
  double whole_bytes = 0;
  for (const auto& [name, p] : whole) whole_bytes += static_cast<double>(p.numel() * 4);
  loom::core::install_memory_tracking();
  world().barrier();
  const auto before = loom::core::memory_counters().current_bytes;
  loom::core::reset_peak_memory();
  const auto ckpt = t.save_checkpoint();
  const double peak = static_cast<double>(loom::core::memory_counters().peak_bytes - before);
  if (world().rank() == 0) {
    std::printf("rank 0: save peak %.2f MiB, the model's parameters %.2f MiB\n", peak / (1 << 20),
                whole_bytes / (1 << 20));
    EXPECT_LT(peak, 0.3 * whole_bytes);  // measured 0.16 (gathering all first: >= 1)
  }
  const auto saved = loom::core::load_safetensors(ckpt / "model.safetensors").tensors;
  EXPECT_EQ(saved.size(), whole.size());
  for (const auto& [name, p] : whole) EXPECT_TRUE(at::equal(saved.at(name), p)) << name;
}

// ZeRO-3 evaluation when the validation windows do not split evenly over the ranks (5 windows),
// and before any training step: every rank runs the same number of gathering forwards, and the
// loss is the one-process loss.
TEST(TrainerZero, Stage3EvaluatesUnevenShardsBeforeTraining) {
  loom::testing::SharedTempDir dir;
  loom::testing::write_shared_corpus(dir, 60000, 5 * 32 + 1);
  auto config = zero_config(dir.path(), 3, 1);
  double single = 0, single_after_step = 0;
  {
    auto plain = zero_config(dir.path(), 0, 1);
    train::Trainer t(plain);
    single = t.evaluate(1);
    t.train_step();
    single_after_step = t.evaluate(1);
  }
  const double bound = loom::testing::kFp64Relative;
  train::Trainer t(config, loom::testing::layout_mesh({}));
  const auto released = t.zero()->memory().parameters;
  EXPECT_NEAR(t.evaluate(1), single, bound * single);
  EXPECT_EQ(t.zero()->memory().parameters, released);  // nothing left gathered
  t.train_step();
  // After a step, twice in a row (no hang, nothing left gathered between): the one-process
  // loss after the same step, both times.
  const double first = t.evaluate(1), second = t.evaluate(1);
  EXPECT_NEAR(first, single_after_step, bound * single_after_step);
  EXPECT_EQ(first, second);
}

class TrainerZeroResume : public ::testing::TestWithParam<int64_t> {};

TEST_P(TrainerZeroResume, ResumeIsExactAndEachRankSavesItsShard) {
  loom::testing::SharedTempDir dir;
  loom::testing::write_shared_corpus(dir, 60000, 4000);
  auto mesh = loom::testing::layout_mesh({});
  auto config = zero_config(dir.path(), GetParam(), 2);
  config.save_dir = (dir / "ckpt").string();
  config.save_every = 2;
  config.dropout = 0.1;  // a resume must apply the same masks (keyed by step and sample)
  // A padded vocabulary (256 -> 300 rows in the model): checkpoints hold the 256 real rows.
  config.pad_vocab_multiple = 100;
  std::map<std::string, at::Tensor> full;
  {
    train::Trainer t(config, mesh);
    t.fit();
    for (const auto& [name, p] : t.gather_parameters()) full[name] = p.clone();
  }
  const auto step2 = dir / "ckpt" / "step-00000002";
  for (int64_t r = 0; r < world().size(); ++r)
    EXPECT_TRUE(
        fs::exists(step2 / fmt::format("zero-dp{:05d}-of-{:05d}.safetensors", r, world().size())))
        << "shard of dp rank " << r;
  world().barrier();
  auto resumed = config;
  resumed.resume = step2.string();
  resumed.save_dir = (dir / "ckpt2").string();
  {
    train::Trainer t(resumed, mesh);
    EXPECT_EQ(t.step(), 2);
    t.fit();
    for (const auto& [name, p] : t.gather_parameters())
      EXPECT_TRUE(at::equal(p, full.at(name))) << name << " differs after resume";
  }
  // Another stage, or none, reshards the optimizer state and continues the same run (up to
  // float rounding: the sums run in another order).
  world().barrier();
  for (const int64_t other : {int64_t{0}, GetParam() % 3 + 1}) {
    SCOPED_TRACE(fmt::format("resumed at --zero {}", other));
    auto another = resumed;
    another.zero = other;
    another.save_dir = (dir / fmt::format("ckpt-z{}", other)).string();
    train::Trainer t(another, mesh);
    EXPECT_EQ(t.step(), 2);
    t.fit();
    double diff2 = 0, norm2 = 0;
    for (const auto& [name, p] : t.gather_parameters()) {
      diff2 += (p - full.at(name)).pow(2).sum().item<double>();
      norm2 += full.at(name).pow(2).sum().item<double>();
    }
    EXPECT_LE(std::sqrt(diff2 / norm2), loom::testing::kFp64Relative);
  }
  // A missing shard file: load_checkpoint names it.
  world().barrier();
  if (world().rank() == 0)
    fs::remove(step2 / fmt::format("zero-dp{:05d}-of-{:05d}.safetensors", world().size() - 1,
                                   world().size()));
  world().barrier();
  auto missing = resumed;
  missing.save_dir = (dir / "ckpt3").string();
  const auto error = error_of([&] { train::Trainer t(missing, mesh); });
  EXPECT_TRUE(contains(error, "is missing") &&
              contains(error, fmt::format("zero-dp{:05d}", world().size() - 1)))
      << error;
}

INSTANTIATE_TEST_SUITE_P(Stages, TrainerZeroResume, ::testing::Values(1, 2, 3));

TEST(ZeroEngine, AShardFromAnotherDpSizeIsRefused) {
  Net net;
  zero::ZeroOptions options;
  options.stage = 2;
  auto engine = zero::shard_module(net, loom::testing::runtime().world(), options);
  auto meta = engine->state_metadata();
  std::map<std::string, at::Tensor> state;
  for (auto& [k, t] : engine->state()) state[k] = t;
  meta["dp_size"] = std::to_string(world().size() + 1);
  auto error = error_of([&] { engine->load_state(state, meta, "shard.safetensors"); });
  EXPECT_TRUE(contains(error, fmt::format("of {}; this is dp rank {} of {}", world().size() + 1,
                                          world().rank(), world().size())))
      << error;
  meta = engine->state_metadata();
  meta["zero_stage"] = "1";
  error = error_of([&] { engine->load_state(state, meta, "shard.safetensors"); });
  EXPECT_TRUE(contains(error, "written at stage 1; this run is at stage 2")) << error;
  meta = engine->state_metadata();
  state.erase("zero.bucket0.exp_avg");
  error = error_of([&] { engine->load_state(state, meta, "shard.safetensors"); });
  EXPECT_TRUE(contains(error, "has no entry 'zero.bucket0.exp_avg'")) << error;
}

TEST(TrainerZero, FlagsThatDoNotFitAreRejected) {
  train::TrainConfig c;
  c.data = "train.bin";
  c.zero = 4;
  EXPECT_TRUE(contains(error_of([&] { c.validate(); }), "--zero 4 is not valid"));
  c.zero = 0;
  c.offload_optimizer = true;
  EXPECT_TRUE(contains(error_of([&] { c.validate(); }), "--offload-optimizer"));
  c.offload_optimizer = false;
  c.activation_checkpointing = "some";
  EXPECT_TRUE(contains(error_of([&] { c.validate(); }), "--activation-checkpointing 'some'"));
}

// ZeRO-1/2/3 compose with tp, sequence-parallel partial gradients included (test_pipeline.cpp
// trains them against one process). Every communication hook serves ZeRO: those that do not
// reduce the shard layout themselves through their whole-bucket reduction
// (test_zero_compression.cpp); a bad hook spec is named before any collective.
TEST(TrainerZero, EveryCommHookServesZeroAndABadOneIsNamed) {
  loom::testing::SharedTempDir dir;
  loom::testing::write_shared_corpus(dir, 60000, 4000);
  auto config = zero_config(dir.path(), 2, 1);
  for (const std::string hook :
       {"bf16", "topk:ratio=0.1,warmup=3", "powersgd:rank=2", "onebit:momentum=0.9"}) {
    config.comm_hook = hook;
    EXPECT_NO_THROW(train::Trainer t(config, loom::testing::layout_mesh({}))) << hook;
  }
  config.comm_hook = "topk:ratio=2";
  EXPECT_TRUE(contains(error_of([&] { train::Trainer t(config, loom::testing::layout_mesh({})); }),
                       "--comm-hook topk: ratio=2 is outside (0, 1]"));
}
