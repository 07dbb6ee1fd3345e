// Multi-token prediction (--mtp) through the Trainer under every parallel layout: the extra heads
// on the last pipeline stage, their logits vocabulary-parallel under tp, their parameters and the
// shared unembedding reduced over dp (and sharded by ZeRO) like the rest, one accumulation each.
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

namespace {

// loom::testing::run, also keeping each step's head losses.
struct MtpRun {
  loom::testing::RunResult result;
  std::vector<double> head_losses;
};
MtpRun run_mtp(train::Trainer& t) {
  MtpRun out;
  while (t.step() < t.config().steps) {
    const auto step = t.train_step();
    out.result.losses.push_back(step.loss);
    out.result.grad_norms.push_back(step.grad_norm);
    out.head_losses.insert(out.head_losses.end(), step.mtp_losses.begin(), step.mtp_losses.end());
  }
  out.result.val_loss = t.evaluate(1);
  for (const auto& [name, p] : t.gather_parameters())
    out.result.params[name] = p.to(at::kCPU, at::kDouble).clone();
  return out;
}

}  // namespace

// gpt2-tiny (dropout 0.1: the heads' masks replayed in their recompute) and llama-tiny with
// --mtp 2 --mtp-weights 1,0.5, 3 fp64 steps, on the layouts this world size allows (2 ranks: dp 2,
// tp 2 with sequence parallelism, pp 2, ZeRO-3 at dp 2; 4 ranks: tp 2 x pp 2, dp 2 x pp 2 with
// ZeRO-1), equal to one process within the fp64 bounds (losses, gradient norms, validation loss,
// every parameter, heads included; train_compare.h), and so are the heads' own losses that every
// rank reports (StepResult::mtp_losses), though the layouts run the main head in chunks of rows
// and the one process over whole logits. The issue asks for 1e-5; fp64 holds them to 1e-9. The
// pp run's checkpoint resumes in one process with the same parameters, and refuses
// another --mtp.
TEST(TrainerMtp, LayoutsTrainLikeOneProcess) {
  const int64_t n = world().size();
  if (n != 2 && n != 4) GTEST_SKIP() << "runs at 2 or 4 ranks";
  loom::testing::SharedTempDir dir;
  loom::testing::write_shared_corpus(dir, 30000, 4000);
  std::vector<loom::testing::TrainLayout> layouts;
  if (n == 2) {
    layouts = {{"dp2", {.dp = 2}},
               {"tp2 sp", {.dp = 1, .tp = 2}, 0, true},
               {"pp2", {.dp = 1, .pp = 2}},
               {"dp2 zero3", {.dp = 2}, 3}};
  } else {
    layouts = {{"tp2 pp2 interleaved", {.dp = 1, .tp = 2, .pp = 2}, 0, false, true},
               {"dp2 pp2 zero1", {.dp = 2, .pp = 2}, 1}};
  }
  for (const char* model : {"gpt2", "llama"}) {
    SCOPED_TRACE(model);
    auto config = loom::testing::tiny_layout_config(dir.path(), model);
    config.mtp = 2;
    config.mtp_weights = {1.0, 0.5};
    if (std::string(model) == "gpt2") config.dropout = 0.1;
    MtpRun single;
    {
      train::Trainer t(config);
      single = run_mtp(t);
    }
    // Two heads a step, each near the loss of a fresh model (ln 257 = 5.5).
    ASSERT_EQ(single.head_losses.size(), 2 * static_cast<size_t>(config.steps));
    for (double l : single.head_losses) EXPECT_TRUE(l > 3 && l < 8) << l;
    for (const auto& layout : layouts) {
      SCOPED_TRACE(layout.name);
      // Several micro-batches through a pipeline: the heads' means over them.
      auto c = loom::testing::with_layout(config, layout);
      // The layouts run the main head with the loss in chunks of 7 rows (--loss-chunk-rows),
      // the one process over whole logits: the chunked head under tp (vocabulary shards,
      // sequence parallelism), pp (the last stage's part_loss), ZeRO-3, beside the heads.
      c.loss_chunk_rows = "7";
      const bool saves = layout.shape.pp == 2;
      if (saves) c.save_dir = (dir / fmt::format("ckpt-{}-{}-{}", model, n, layout.zero)).string();
      MtpRun run;
      {
        train::Trainer t(c, loom::testing::layout_mesh(layout.shape));
        run = run_mtp(t);
        // The last part's losses ran chunked (training and validation forwards).
        for (const auto& chunk : t.chunks()) {
          if (chunk->part().last) {
            EXPECT_GT(chunk->chunked_losses(), 0);
          }
        }
        if (saves) t.save_checkpoint();
      }
      const auto& distributed = run.result;
      loom::testing::expect_same_run(distributed, single.result);
      ASSERT_EQ(run.head_losses.size(), single.head_losses.size());
      for (size_t i = 0; i < run.head_losses.size(); ++i)
        EXPECT_NEAR(run.head_losses[i], single.head_losses[i],
                    loom::testing::kFp64Relative * single.head_losses[i])
            << "head loss " << i;
      if (!saves) continue;
      // In one process (each rank on its own), from the pipeline's checkpoint: the heads and
      // every other parameter come back as they were.
      auto resumed = config;
      resumed.grad_accum = c.grad_accum;  // the same batches
      resumed.steps = 4;
      resumed.lr_decay_steps = 3;
      resumed.resume =
          (dir / fmt::format("ckpt-{}-{}-{}", model, n, layout.zero) / "step-00000003").string();
      train::Trainer again(resumed);
      int64_t heads = 0;
      for (const auto& [name, p] : again.gather_parameters()) {
        heads += name.find(".mtp.") != std::string::npos;
        EXPECT_TRUE(at::equal(p.to(at::kCPU, at::kDouble), distributed.params.at(name))) << name;
      }
      EXPECT_GT(heads, 0);
      EXPECT_TRUE(std::isfinite(again.train_step().loss));
      auto other = resumed;
      other.mtp = 1;
      other.mtp_weights.clear();
      const auto msg = loom::testing::error_of([&] { train::Trainer{other}; });
      EXPECT_TRUE(loom::testing::contains(msg, "--mtp")) << msg;
    }
  }
}
