// Structured MLPs under tensor parallelism (--ffn-blocks, --ffn-rank): what they communicate,
// counted, and training through them equal to one process. Their layers and every gradient at
// each tp are checked beside the dense cases (test_tensor_parallel.cpp, TpModel *_ffn_*).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <tuple>

#include "dist_util.h"
#include "loom/models/causal_lm.h"
#include "loom/train/trainer.h"
#include "tp_models.h"
#include "train_compare.h"

using loom::testing::small_config;
using loom::testing::world;
using loom::testing::world_group;
namespace models = loom::models;
namespace pt = loom::parallel::tensor;
namespace train = loom::train;

// A block-diagonal MLP (--ffn-blocks) moves its activations by all-gathers: no all-reduce. Without
// sequence parallelism the all-reduces are the attention's entry and exit per block, the
// embedding's exit and the head's entry — the dense MLP's two per block are gone — and each block
// all-gathers its MLP's output forward and its input's gradient backward, (tp - 1) / tp of a
// b * s * h tensor each way: half what the two all-reduces moved. With it the volume of
// all-gathers and reduce-scatters equals the dense model's (the sequence is gathered and cut as
// before) and there is still no all-reduce.
TEST(TpModel, BlockDiagonalMlpIssuesNoAllReduce) {
  for (const bool sp : {false, true}) {
    auto tp = world_group(sp);
    if (tp->size() == 1) GTEST_SKIP() << "needs tp > 1";
    for (const auto family : {models::Family::kGpt2, models::Family::kLlama}) {
      SCOPED_TRACE(fmt::format("{} sp {}", models::to_string(family), sp));
      auto dense_config = small_config(family, tp->size());
      auto config = dense_config;
      config.ffn_blocks = 12;
      const int64_t b = 2, s = 12, h = config.d_model, layers = config.n_layers;
      auto tokens = at::zeros({b, s}, at::kLong);
      pt::TpCommStats dense, blocks;
      for (auto* c : {&dense_config, &config}) {
        auto model = models::make_model(*c, tp);
        models::init_parameters(*model, 1);
        tp->stats().reset();
        model->loss(tokens, tokens).backward();
        (c == &config ? blocks : dense) = tp->stats();
      }
      if (!sp) {
        EXPECT_EQ(blocks.all_reduce_elements, (2 * layers + 2) * b * s * h);
        EXPECT_EQ(dense.all_reduce_elements, (4 * layers + 2) * b * s * h);
        EXPECT_EQ(blocks.reduce_scatter_elements, 0);
        // The exit's all-gather forward and the entry's backward, each of a b s h output.
        EXPECT_EQ(blocks.all_gather_elements, 2 * layers * b * s * h);
      } else {
        EXPECT_EQ(blocks.all_reduce_elements, 0);
        EXPECT_EQ(blocks.all_gather_elements + blocks.reduce_scatter_elements,
                  dense.all_gather_elements + dense.reduce_scatter_elements);
      }
    }
  }
}

// A low-rank MLP (--ffn-rank r) leaves its region after the second factor's first half: without
// sequence parallelism its all-reduce carries r values per token instead of d_model, the rest as
// dense: (3 layers + 2) b s h + layers b s r elements all-reduced, exactly. With it no
// all-reduce, and ((3 layers + 2) h + layers r) b s elements all-gathered and as many
// reduce-scattered (the MLP's exit and its backward dual carry r per token).
TEST(TpModel, LowRankMlpAllReducesRankValuesPerToken) {
  for (const bool sp : {false, true}) {
    auto tp = world_group(sp);
    if (tp->size() == 1) GTEST_SKIP() << "needs tp > 1";
    for (const auto family : {models::Family::kGpt2, models::Family::kLlama}) {
      SCOPED_TRACE(fmt::format("{} sp {}", models::to_string(family), sp));
      auto config = small_config(family, tp->size());
      config.ffn_rank = 8;
      const int64_t b = 2, s = 12, h = config.d_model, layers = config.n_layers, r = 8;
      auto model = models::make_model(config, tp);
      models::init_parameters(*model, 1);
      auto tokens = at::zeros({b, s}, at::kLong);
      tp->stats().reset();
      model->loss(tokens, tokens).backward();
      const auto& st = tp->stats();
      if (!sp) {
        EXPECT_EQ(st.all_reduce_elements, (3 * layers + 2) * b * s * h + layers * b * s * r);
      } else {
        EXPECT_EQ(st.all_reduce_elements, 0);
        EXPECT_EQ(st.all_gather_elements, ((3 * layers + 2) * h + layers * r) * b * s);
        EXPECT_EQ(st.reduce_scatter_elements, ((3 * layers + 2) * h + layers * r) * b * s);
      }
    }
  }
}

// Structured MLPs through the Trainer: gpt2-tiny with --ffn-blocks 4 (sequence parallel) and
// llama-tiny with --ffn-rank 16, 3 fp64 steps at tp 2 (dp the rest), equal one process within the
// fp64 bounds (losses, gradient norms, every parameter): the low-rank factor's partial gradients
// summed across tp, the block-diagonal MLP's all-gathers in place of all-reduces. The tp 2 run's
// checkpoint resumes at tp 1 with the same parameters, bit for bit, and refuses another
// --ffn-blocks.
TEST(TrainerTp, StructuredMlpsTrainLikeOneProcess) {
  const int64_t n = world().size();
  if (n != 2 && n != 4) GTEST_SKIP() << "runs at tp 2 (dp 1 or 2)";
  loom::testing::SharedTempDir dir;
  loom::testing::write_shared_corpus(dir, 30000, 4000);
  for (const auto& [model, blocks, rank] :
       {std::tuple<const char*, int64_t, int64_t>{"gpt2", 4, 0}, {"llama", 1, 16}}) {
    SCOPED_TRACE(fmt::format("{} blocks {} rank {}", model, blocks, rank));
    auto config = loom::testing::tiny_layout_config(dir.path(), model);
    config.ffn_blocks = blocks;
    config.ffn_rank = rank;
    loom::testing::RunResult single;
    {
      train::Trainer t(config);
      single = loom::testing::run(t);
    }
    config.tp = 2;
    config.sequence_parallel = blocks > 1;
    config.save_dir = (dir / fmt::format("ckpt-{}", model)).string();
    loom::testing::RunResult distributed;
    {
      train::Trainer t(config, loom::testing::layout_mesh({.tp = 2}));
      distributed = loom::testing::run(t);
      t.save_checkpoint();
    }
    loom::testing::expect_same_run(distributed, single);
    // Resumed without tensor parallelism: the block weights and factors reassembled from the tp
    // shards exactly, and the structure checked against the checkpoint's.
    auto resumed = config;
    resumed.tp = 1;
    resumed.sequence_parallel = false;
    resumed.steps = 4;
    resumed.lr_decay_steps = 3;  // the saved run's schedule
    resumed.resume = (dir / fmt::format("ckpt-{}", model) / "step-00000003").string();
    train::Trainer again(resumed, loom::testing::layout_mesh({}));
    for (const auto& [name, p] : again.gather_parameters())
      EXPECT_TRUE(at::equal(p.to(at::kCPU, at::kDouble), distributed.params.at(name))) << name;
    EXPECT_TRUE(std::isfinite(again.train_step().loss));
    auto other = resumed;
    other.ffn_blocks = blocks == 1 ? 2 : 1;
    other.ffn_rank = 0;
    const auto msg =
        loom::testing::error_of([&] { train::Trainer(other, loom::testing::layout_mesh({})); });
    EXPECT_TRUE(loom::testing::contains(msg, "--ffn-blocks")) << msg;
  }
}
