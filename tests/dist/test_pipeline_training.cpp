// Training over pp, dp x pp, tp x pp and dp x tp x pp (ZeRO-1/2/3 among them) against one
// process, with checkpoints that reshard between layouts, and the layouts that cannot be.
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>

#include "../custom_model_util.h"
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
#include "loom/train/run_context.h"
#include "loom/train/strategy.h"
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
const pl::Partition* partition_of(const train::Trainer& t) {
  return t.runtime().context().find<pl::Partition>("pipeline.partition");
}

}  // namespace

namespace {

// The broken variant of TrainerDropout: masks keyed by each rank's own sample index, as if every
// data-parallel rank drew from a generator of its own.
class RankLocalDropout : public train::Strategy {
 public:
  explicit RankLocalDropout(const train::StrategySpec& /*spec*/) {}
  std::string name() const override { return "test-rank-local-dropout"; }
  void before_forward(train::RunContext& run, const train::MicroBatch& mb) override {
    if (!mb.training) return;
    const int64_t micro = run.config.micro_batch_size(run.mesh->size(dist::Dim::dp));
    run.tp_group->dropout().set_micro_batch(run.step, mb.index * micro);
  }
};
LOOM_REGISTER_STRATEGY(test_rank_local_dropout, RankLocalDropout, "test-rank-local-dropout")

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
  double dropout = 0;   // also in the one-process run it is compared with
  std::string checkpointing = "none";
  // `c` laid out this way.
  train::TrainConfig applied_to(train::TrainConfig c) const {
    c.tp = tp;
    c.pp = pp;
    c.schedule = schedule;
    c.virtual_stages = v;
    c.sequence_parallel = sp;
    c.zero = zero;
    c.zero3_reshard_after_forward = reshard;
    c.activation_checkpointing = checkpointing;
    return c;
  }
  std::string describe() const {
    return fmt::format("{} dp {} x tp {}{} x pp {} ({}, v {}){}{}{}{}", model, dp, tp,
                       sp ? " sp" : "", pp, schedule, v,
                       zero > 0 ? fmt::format(", ZeRO-{}", zero) : "",
                       reshard ? "" : ", units kept gathered",
                       dropout > 0 ? fmt::format(", dropout {}", dropout) : "",
                       checkpointing == "none" ? "" : ", checkpointing " + checkpointing);
  }
};

// Trains `layout` and the one-process run of the same config; they must agree.
void expect_layout_trains_like_one_process(
    const Layout& layout, const fs::path& dir,
    std::map<std::string, loom::testing::RunResult>& single) {
  SCOPED_TRACE(layout.describe());
  auto config = pipeline_config(dir, layout.model, layout.micro_batches);
  config.dropout = layout.dropout;
  const auto key = fmt::format("{} {} {}", layout.model, layout.micro_batches, layout.dropout);
  if (!single.count(key)) {
    train::Trainer t(config);
    single[key] = loom::testing::run(t);
  }
  config = layout.applied_to(config);
  train::Trainer t(config,
                   loom::testing::layout_mesh({.dp = layout.dp, .tp = layout.tp, .pp = layout.pp}));
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

// Dropout masks follow the samples (counter-based, keyed by the step and each sample's index in
// the global batch: parallel/tensor/random.h), so with dropout on every layout still trains like
// one process: data-parallel ranks and their share of the batch, micro-batches of a pipeline
// (blocks recomputed in backward after other micro-batches' forwards), tensor and sequence
// parallelism, ZeRO. Broken variant: masks keyed by the rank-local sample index (what a
// per-rank generator amounts to) must be caught.
TEST(TrainerDropout, EveryLayoutTrainsLikeOneProcessWithDropout) {
  const int64_t n = world().size();
  if (n != 2 && n != 4) GTEST_SKIP() << "runs at 2 and 4 ranks";
  loom::testing::SharedTempDir dir;
  loom::testing::write_shared_corpus(dir, 30000, 4000);
  std::vector<Layout> layouts;
  auto add = [&](Layout l, const std::string& checkpointing = "none") {
    l.dropout = 0.1;
    l.checkpointing = checkpointing;
    layouts.push_back(l);
  };
  if (n == 2) {
    add({"gpt2", 2, 1, 1, "1f1b", 1, false, 2});
    add({"gpt2", 1, 2, 1, "1f1b", 1, true}, "selective");
    add({"gpt2", 1, 1, 2, "1f1b"}, "full");
    add({"llama", 1, 1, 2, "interleaved", 2}, "full");
  } else {
    add({"gpt2", 4, 1, 1, "1f1b", 1, false, 2, 2});
    add({"gpt2", 2, 2, 1, "1f1b", 1, true}, "full");
    add({"llama", 2, 1, 2, "interleaved", 2, false, 4, 3}, "full");
    add({"gpt2", 1, 2, 2, "1f1b", 1, true}, "selective");
  }
  std::map<std::string, loom::testing::RunResult> single;
  for (const auto& layout : layouts)
    expect_layout_trains_like_one_process(layout, dir.path(), single);

  // The broken variant: each data-parallel rank keys its masks by its own sample index.
  auto config = layouts.front().applied_to(pipeline_config(dir.path(), "gpt2", 2));
  config.dropout = 0.1;
  config.strategies = {"test-rank-local-dropout"};
  train::Trainer broken(config, loom::testing::layout_mesh({.dp = n}));
  loom::testing::expect_caught(loom::testing::run(broken), single.at("gpt2 2 0.1"),
                               "dropout masks keyed by the rank-local sample index");
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
      train::Trainer t(config, loom::testing::layout_mesh(
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
                                    : loom::testing::layout_mesh(
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
        diff2 +=
            (p.to(at::kCPU, at::kDouble) - reference.params.at(name)).pow(2).sum().item<double>();
        norm2 += reference.params.at(name).pow(2).sum().item<double>();
      }
      EXPECT_LE(std::sqrt(diff2 / norm2), loom::testing::kFp64Relative);
    }
  }
}

// Every message of a step counts in its comm_bytes, the stages' own ones included (they travel
// on channels split from the pipeline group, Communicator::family_bytes_sent): at pp 2 stage 0
// sends each micro-batch's activations forward and stage 1 their gradients back, B x T x d
// values a step each way, and the two stages sum the tied embedding's gradient (an all-reduce of
// V x d values, which sends V x d at 2 ranks). The rest is the loss and norm's few scalars.
TEST(TrainerPipeline, CommBytesCountTheStagesMessages) {
  if (world().size() != 2) GTEST_SKIP() << "runs at 2 ranks";
  loom::testing::SharedTempDir dir;
  loom::testing::write_shared_corpus(dir, 30000, 4000);
  auto config = Layout{"gpt2", 1, 1, 2, "1f1b"}.applied_to(pipeline_config(dir.path(), "gpt2"));
  train::Trainer t(config, loom::testing::layout_mesh({.dp = 1, .tp = 1, .pp = 2}));
  int64_t vocab_rows = 0;
  for (const auto& item : t.model().named_parameters())
    if (item.key().find("wte") != std::string::npos ||
        item.key().find("lm_head") != std::string::npos)
      vocab_rows = item.value().size(0);
  ASSERT_GT(vocab_rows, 0) << "no embedding copy on this stage";
  const double d = static_cast<double>(t.model_config().d_model), value = 8;  // fp64
  const double activations = static_cast<double>(config.batch_size * config.seq_len) * d * value;
  const double tied = static_cast<double>(vocab_rows) * d * value;
  for (int step = 0; step < 2; ++step) {
    const auto r = t.train_step();
    if (std::getenv("LOOM_TEST_VERBOSE") != nullptr)
      std::printf("pp 2 stage %d: comm_bytes %.0f, activations %.0f, tied embedding %.0f\n",
                  static_cast<int>(world().rank()), r.comm_bytes, activations, tied);
    EXPECT_GE(r.comm_bytes, activations + tied);
    EXPECT_LE(r.comm_bytes, activations + tied + 1024);
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
  auto mesh = [] { return loom::testing::layout_mesh({.dp = 1, .tp = 2, .pp = 2}); };
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
    train::Trainer t(config, loom::testing::layout_mesh({.pp = 2}));
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
        error_of([&] { train::Trainer t(resumed, loom::testing::layout_mesh({.pp = 2})); });
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
  auto mesh = loom::testing::layout_mesh({.pp = 2});
  auto config = pipeline_config(dir.path(), "gpt2");
  config.pp = 2;
  auto with = [&](auto change) {
    auto c = config;
    change(c);
    return error_of([&] { train::Trainer t(c, mesh); });
  };
  // A custom model (plain LibTorch) does not say how to split it into stages, nor over tp.
  auto e = error_of([&] { train::Trainer t(config, mesh, loom::testing::plain_lm()); });
  EXPECT_TRUE(contains(e,
                       "strategy 'pipeline' (--pp 2) splits loom's GPT-2 and Llama into "
                       "stages of layers; a custom model does not say how"))
      << e;
  {
    auto tp = config;
    tp.pp = 1;
    tp.tp = 2;
    e = error_of([&] {
      train::Trainer t(tp, loom::testing::layout_mesh({.tp = 2}), loom::testing::plain_lm());
    });
    EXPECT_TRUE(contains(e, "strategy 'tensor-parallel' (--tp 2) splits loom's parallel layers"))
        << e;
  }
  e = with([](train::TrainConfig& c) { c.layers = 1; });
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
    auto mesh = [] { return loom::testing::layout_mesh({.dp = 2, .pp = 2}); };
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
    train::Trainer t(other, loom::testing::layout_mesh({.dp = 2, .tp = 2}));
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
      train::Trainer o(other_first, loom::testing::layout_mesh({.dp = 2, .tp = 2}));
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
  train::Trainer t(config, loom::testing::layout_mesh({.dp = 2, .pp = 2}));
  const auto d = loom::testing::compare_runs(loom::testing::run(t), single);
  EXPECT_LE(d.loss, 1e-5) << d.describe();
  if (world().rank() == 0)
    std::printf("ZeRO-3 x pp (fp32) vs one process: %s\n", d.describe().c_str());
}
