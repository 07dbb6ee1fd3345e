// Cross-layer parameter sharing (--share-layers) through the Trainer under every parallel layout:
// a shared block's gradient summed over its uses within a stage (one accumulation, so data
// parallelism and ZeRO reduce it once), over the pipeline stages holding a copy of it (and over
// a rank's interleaved chunks), and sharded by ZeRO like any parameter.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "dist_util.h"
#include "loom/train/trainer.h"
#include "train_compare.h"

using loom::testing::world;
namespace train = loom::train;

namespace {}  // namespace

// gpt2-tiny with --share-layers cycle:2 (dropout 0.1, masks keyed by the layer) and llama-tiny
// with "all" (4 layers, 1 block), 3 fp64 steps, on the layouts this world size allows (2 ranks:
// dp 2 with full recompute, tp 2 with sequence parallelism, pp 2 partitioned by measured block
// times (a block is held by both stages),
// ZeRO-3 at dp 2 with full recompute, cp 2 (llama: context parallelism refuses dropout); 4 ranks:
// tp 2 x pp 2 interleaved (a rank's two chunks hold the same block), dp 2 x pp 2 with ZeRO-1, and
// interleaved with ZeRO-3), equal to one process within the fp64 bounds of train_compare.h (losses,
// gradient norms, validation loss, every parameter). The pp runs' checkpoints hold one copy of each
// block and resume in one process with the same parameters; another --share-layers is refused.
TEST(TrainerSharing, LayoutsTrainLikeOneProcess) {
  const int64_t n = world().size();
  if (n != 2 && n != 4) GTEST_SKIP() << "runs at 2 or 4 ranks";
  loom::testing::SharedTempDir dir;
  loom::testing::write_shared_corpus(dir, 30000, 4000);
  std::vector<loom::testing::TrainLayout> layouts;
  if (n == 2) {
    layouts = {{"dp2 full recompute", {.dp = 2}, 0, false, false, "full"},
               {"tp2 sp", {.dp = 1, .tp = 2}, 0, true},
               {"pp2 measured partition", {.dp = 1, .pp = 2}, 0, false, false, "none", "measured"},
               {"dp2 zero3 full recompute", {.dp = 2}, 3, false, false, "full"},
               {"cp2", {.dp = 1, .cp = 2}, 0, false, false, "none", "flops", true}};
  } else {
    layouts = {{"tp2 pp2 interleaved", {.dp = 1, .tp = 2, .pp = 2}, 0, false, true},
               {"dp2 pp2 zero1", {.dp = 2, .pp = 2}, 1},
               {"dp2 pp2 interleaved zero3", {.dp = 2, .pp = 2}, 3, false, true}};
  }
  for (const char* model : {"gpt2", "llama"}) {
    SCOPED_TRACE(model);
    const bool gpt2 = std::string(model) == "gpt2";
    auto config = loom::testing::tiny_layout_config(dir.path(), model);
    config.share_layers = gpt2 ? "cycle:2" : "all";
    if (gpt2) config.dropout = 0.1;
    const auto single = loom::testing::run_alone(config);
    const std::string prefix = gpt2 ? "transformer.h." : "model.layers.";
    for (const auto& layout : layouts) {
      SCOPED_TRACE(layout.name);
      if (layout.without_dropout && config.dropout > 0) continue;
      auto c = loom::testing::with_layout(config, layout);
      const bool saves = layout.shape.pp == 2;
      const auto save_dir = dir / fmt::format("share-{}-{}-{}", model, n, layout.zero);
      if (saves) c.save_dir = save_dir.string();
      loom::testing::RunResult distributed;
      {
        train::Trainer t(c, loom::testing::layout_mesh(layout.shape));
        distributed = loom::testing::run(t);
        if (saves) t.save_checkpoint();
      }
      loom::testing::expect_same_run(distributed, single);
      // One copy of each distinct block: layers 0 and 1 (cycle:2) or layer 0 (all).
      for (const auto& [name, p] : distributed.params) {
        if (!name.starts_with(prefix)) continue;
        EXPECT_TRUE(name.starts_with(prefix + "0.") || (gpt2 && name.starts_with(prefix + "1.")))
            << name;
      }
      if (!saves) continue;
      auto resumed = config;
      resumed.grad_accum = c.grad_accum;
      resumed.steps = 4;
      resumed.lr_decay_steps = 3;
      resumed.resume = (save_dir / "step-00000003").string();
      train::Trainer again(resumed);
      for (const auto& [name, p] : again.gather_parameters())
        EXPECT_TRUE(at::equal(p.to(at::kCPU, at::kDouble), distributed.params.at(name))) << name;
      EXPECT_TRUE(std::isfinite(again.train_step().loss));
      auto other = resumed;
      other.share_layers = "none";
      const auto msg = loom::testing::error_of([&] { train::Trainer{other}; });
      EXPECT_TRUE(loom::testing::contains(msg, "--share-layers")) << msg;
    }
  }
}

// Global magnitude pruning over a pipeline whose stages hold copies of the same blocks: the
// threshold counts each shared weight once (as one process does), and every copy gets the same
// mask. gpt2-tiny with layer 3 using layer 0's block, pruned to 50% over steps 1-3, pp 2 against
// one process.
TEST(TrainerSharing, GlobalPruningCountsSharedWeightsOnce) {
  if (world().size() != 2) GTEST_SKIP() << "runs at 2 ranks";
  loom::testing::SharedTempDir dir;
  loom::testing::write_shared_corpus(dir, 30000, 4000);
  auto config = loom::testing::tiny_layout_config(dir.path(), "gpt2");
  // Layer 3 uses layer 0's block: stage 1 holds a copy of it beside its own block 2, so counting
  // the copy would weigh block 0 twice against the others (and move the threshold).
  config.share_layers = "3=0";
  config.prune.to = 0.5;
  config.prune.scope = "global";
  config.prune.start = 1;
  config.prune.end = 3;
  config.prune.every = 1;
  const auto single = loom::testing::run_alone(config);
  const loom::testing::TrainLayout pp2{"pp2", {.dp = 1, .pp = 2}};
  train::Trainer t(loom::testing::with_layout(config, pp2), loom::testing::layout_mesh(pp2.shape));
  loom::testing::expect_same_run(loom::testing::run(t), single);
}

// A shared model's checkpoint resumes bit for bit: 2 steps, save, 2 more from the checkpoint
// equal 4 steps straight (losses, gradient norms and every parameter exactly), with Adam's
// moments of the shared blocks restored. One process, gpt2-tiny with "all".
TEST(TrainerSharing, ResumeContinuesBitForBit) {
  if (world().size() != 1) GTEST_SKIP() << "runs at 1 rank";
  loom::testing::SharedTempDir dir;
  loom::testing::write_shared_corpus(dir, 30000, 4000);
  auto config = loom::testing::tiny_layout_config(dir.path(), "gpt2");
  config.share_layers = "all";
  config.steps = 4;
  const auto straight = loom::testing::run_alone(config);
  auto first = config;
  first.steps = 2;
  first.lr_decay_steps = 4;
  first.save_dir = (dir / "share-resume").string();
  {
    train::Trainer t(first);
    loom::testing::run(t);
    t.save_checkpoint();
  }
  auto second = config;
  second.lr_decay_steps = 4;
  second.resume = (dir / "share-resume" / "step-00000002").string();
  train::Trainer t(second);
  const auto resumed = loom::testing::run(t);
  ASSERT_EQ(resumed.losses.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(resumed.losses[i], straight.losses[i + 2]) << "step " << i + 3;
    EXPECT_EQ(resumed.grad_norms[i], straight.grad_norms[i + 2]) << "step " << i + 3;
  }
  for (const auto& [name, p] : resumed.params)
    EXPECT_TRUE(at::equal(p, straight.params.at(name))) << name;
}
