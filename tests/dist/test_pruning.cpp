// Pruning under layouts: the masks, losses and parameters of a pruned run at dp, tp, pp and ZeRO
// equal the single-process pruned run's. The global threshold is found from counts summed over
// the tp and pp ranks, never by gathering a weight, so equal masks are what shows it is right.
#include <gtest/gtest.h>

#include "../test_util.h"
#include "dist_util.h"
#include "loom/ops/sparse_linear.h"
#include "loom/parallel/tensor/layers.h"
#include "loom/train/trainer.h"
#include "train_compare.h"

using loom::testing::contains;
using loom::testing::error_of;
using loom::testing::world;
namespace ops = loom::ops;
namespace train = loom::train;
namespace fs = std::filesystem;

namespace {

// 4 fp64 steps, 2 micro-batches (the pipeline's), pruned to 50 % over steps 1..3.
train::TrainConfig pruned_config(const fs::path& dir, const std::string& pattern,
                                 const std::string& scope, double to) {
  auto c = loom::testing::small_run_config(dir, 2);
  c.prune.to = to;
  c.prune.pattern = pattern;
  c.prune.scope = scope;
  c.prune.start = 1;
  c.prune.end = 3;
  c.prune.every = 1;
  return c;
}

struct PruneLayout {
  int64_t dp, tp, pp, zero;
  std::string pattern, scope;
  double to = 0.5;
  std::string describe() const {
    return fmt::format("dp {} x tp {} x pp {}, zero {}, {} {} to {}", dp, tp, pp, zero, pattern,
                       scope, to);
  }
};

}  // namespace

TEST(TrainerPrune, EveryLayoutPrunesLikeOneProcess) {
  const int64_t n = world().size();
  std::vector<PruneLayout> layouts;
  if (n == 2) {
    layouts = {{2, 1, 1, 0, "unstructured", "global"},
               {1, 2, 1, 0, "unstructured", "global"},
               {1, 2, 1, 0, "block:16", "layer"},
               {1, 1, 2, 0, "unstructured", "global"},
               {1, 1, 2, 0, "2:4", "layer"},
               {2, 1, 1, 1, "unstructured", "layer"},
               // Transposable 2:4; block:32 at 87.5 %, where the layers take the block-sparse
               // CPU product (at tp 2: the column and row shards each their own).
               {1, 2, 1, 0, "2:4t", "layer"},
               {1, 2, 1, 0, "block:32", "layer", 0.875}};
  } else if (n == 4) {
    layouts = {{2, 2, 1, 0, "unstructured", "global"},
               {1, 2, 2, 0, "unstructured", "global"},
               {2, 1, 2, 2, "block:16", "global"}};
  } else {
    GTEST_SKIP() << "runs at 2 and 4 ranks";
  }
  loom::testing::SharedTempDir dir;
  loom::testing::write_shared_corpus(dir, 60000, 4000);
  std::map<std::string, loom::testing::RunResult> single;  // by pattern + scope
  for (const auto& l : layouts) {
    SCOPED_TRACE(l.describe());
    const auto key = fmt::format("{} {} {}", l.pattern, l.scope, l.to);
    auto config = pruned_config(dir.path(), l.pattern, l.scope, l.to);
    if (!single.count(key)) {
      train::Trainer t(config);
      single[key] = loom::testing::run(t);
    }
    config.tp = l.tp;
    config.pp = l.pp;
    config.zero = l.zero;
    train::Trainer t(config, loom::testing::layout_mesh({.dp = l.dp, .tp = l.tp, .pp = l.pp}));
    const auto got = loom::testing::run(t);
    const auto& want = single.at(key);
    if (l.pattern.starts_with("block") && l.to >= ops::kBlockSparseMinTileSparsity) {
      int64_t block_sparse = 0;
      for (const auto& item : t.model().named_modules())
        if (const auto* p =
                dynamic_cast<loom::parallel::tensor::PrunableLinear*>(item.value().get()))
          block_sparse += p->last_path() == ops::SparseLinearPath::kBlockCpu;
      EXPECT_GT(block_sparse, 0) << "no layer took the block-sparse product";
    }
    // The same weights pruned, exactly, and the same training otherwise.
    int64_t pruned = 0;
    for (const auto& [name, w] : want.params) {
      if (!got.params.count(name)) continue;  // expect_same_run reports it
      EXPECT_TRUE(at::equal(got.params.at(name) == 0, w == 0)) << name;
      pruned += (w == 0).sum().item<int64_t>();
    }
    EXPECT_GT(pruned, 0);
    loom::testing::expect_same_run(got, want);
  }
}

TEST(TrainerPrune, ZeroThreeAndOptimizerOffloadAreRefusedBeforeTraining) {
  if (world().size() < 2) GTEST_SKIP() << "needs dp 2";
  loom::testing::SharedTempDir dir;
  loom::testing::write_shared_corpus(dir, 60000, 4000);
  auto config = pruned_config(dir.path(), "unstructured", "layer", 0.5);
  config.zero = 3;
  const auto msg = error_of([&] { train::Trainer t(config, loom::testing::layout_mesh({})); });
  EXPECT_TRUE(contains(msg, "strategy 'prune' with --zero 3")) << msg;
  config.zero = 2;
  config.offload_optimizer = true;
  const auto offload = error_of([&] { train::Trainer t(config, loom::testing::layout_mesh({})); });
  EXPECT_TRUE(contains(offload, "strategy 'prune' with --offload-optimizer")) << offload;
}
