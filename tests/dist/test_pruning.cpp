// Pruning under layouts: the masks, losses and parameters of a pruned run at dp, tp, pp and
// ZeRO-1/2/3 equal the single-process pruned run's. The global threshold is found from counts
// summed over the tp and pp ranks (and under ZeRO-3 over the dp ranks' shards), never by
// gathering a weight, so equal masks are what shows it is right.
#include <gtest/gtest.h>

#include <set>

#include "../test_util.h"
#include "dist_util.h"
#include "loom/ops/sparse_linear.h"
#include "loom/parallel/tensor/layers.h"
#include "loom/train/trainer.h"
#include "train_compare.h"

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
  bool offload = false;  // --offload-optimizer
  std::string describe() const {
    return fmt::format("dp {} x tp {} x pp {}, zero {}{}, {} {} to {}", dp, tp, pp, zero,
                       offload ? " offloaded" : "", pattern, scope, to);
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
               {1, 2, 1, 0, "block:32", "layer", 0.875},
               // ZeRO-3: each rank masks its shard of each weight; shard boundaries cut rows,
               // tiles and groups (block scores summed from the pieces, N:M on the gathered
               // weight).
               {2, 1, 1, 3, "unstructured", "global"},
               {2, 1, 1, 3, "block:16", "layer"},
               {2, 1, 1, 3, "block:32", "global", 0.875},
               {2, 1, 1, 3, "2:4t", "layer"},
               // The optimizer's masters on the host: the masks act on the parameters it
               // copies back, as on bf16 parameters with fp32 masters.
               {2, 1, 1, 2, "unstructured", "global", 0.5, true},
               {2, 1, 1, 3, "block:16", "layer", 0.5, true}};
  } else if (n == 4) {
    layouts = {{2, 2, 1, 0, "unstructured", "global"},
               {1, 2, 2, 0, "unstructured", "global"},
               {2, 1, 2, 2, "block:16", "global"},
               // ZeRO-3 with tp and with pp.
               {2, 2, 1, 3, "unstructured", "global"},
               {2, 1, 2, 3, "block:16", "global"},
               {2, 2, 1, 3, "2:4", "layer"}};
  } else if (n == 8) {
    // dp x tp x pp in one run (dist.np8_3d), also with ZeRO-3 over its dp pairs.
    layouts = {{2, 2, 2, 0, "unstructured", "global"}, {2, 2, 2, 3, "block:16", "global"}};
  } else {
    GTEST_SKIP() << "runs at 2, 4 and 8 ranks";
  }
  loom::testing::SharedTempDir dir;
  loom::testing::write_shared_corpus(dir, 60000, 4000);
  std::map<std::string, loom::testing::RunResult> single;  // by pattern + scope
  std::set<std::string> prunable;                          // the pruned layers' weights
  for (const auto& l : layouts) {
    SCOPED_TRACE(l.describe());
    const auto key = fmt::format("{} {} {}", l.pattern, l.scope, l.to);
    auto config = pruned_config(dir.path(), l.pattern, l.scope, l.to);
    if (!single.count(key)) {
      train::Trainer t(config);
      single[key] = loom::testing::run(t);
      for (const auto& item : t.model().named_modules())
        if (dynamic_cast<loom::parallel::tensor::PrunableLinear*>(item.value().get()))
          prunable.insert(item.key() + ".weight");
    }
    config.tp = l.tp;
    config.pp = l.pp;
    config.zero = l.zero;
    config.offload_optimizer = l.offload;
    train::Trainer t(config, loom::testing::layout_mesh({.dp = l.dp, .tp = l.tp, .pp = l.pp}));
    const auto got = loom::testing::run(t);
    const auto& want = single.at(key);
    // The block-sparse CPU product; on a GPU these fp64 runs take the masked dense product (the
    // BSR kernel computes in bf16/fp16: BsrGpu tests it).
    if (loom::testing::test_device() == "cpu" && l.pattern.starts_with("block") &&
        l.to >= ops::kBlockSparseMinTileSparsity) {
      int64_t block_sparse = 0;
      for (const auto& item : t.model().named_modules())
        if (const auto* p =
                dynamic_cast<loom::parallel::tensor::PrunableLinear*>(item.value().get()))
          block_sparse += p->last_path() == ops::SparseLinearPath::kBlockCpu;
      EXPECT_GT(block_sparse, 0) << "no layer took the block-sparse product";
    }
    // The same weights pruned, exactly, and the same training otherwise. Only the prunable
    // weights: a bias can hold exact zeros in one run and not the other (the key bias, whose
    // gradient is 0 up to rounding, which differs between layouts on a GPU).
    int64_t pruned = 0;
    for (const auto& [name, w] : want.params) {
      if (!got.params.count(name)) continue;  // expect_same_run reports it
      if (!prunable.count(name)) continue;
      EXPECT_TRUE(at::equal(got.params.at(name) == 0, w == 0)) << name;
      pruned += (w == 0).sum().item<int64_t>();
    }
    EXPECT_GT(pruned, 0);
    loom::testing::expect_same_run(got, want);
  }
}

// A pruned checkpoint resumes in another layout: saved at tp 2 after the second step (masks
// already set), resumed as ZeRO-3 over dp 2 (and the other way round), it carries the masks as
// the weights' zeros, keeps pruning on the schedule, and ends where the uninterrupted run ends:
// the same zeros, and parameters within the fp64 bound of every layout test.
TEST(TrainerPrune, ACheckpointReshardsToAnotherLayoutWithItsMasks) {
  if (world().size() != 2) GTEST_SKIP() << "runs at 2 ranks (tp 2 and dp 2)";
  loom::testing::SharedTempDir dir;
  loom::testing::write_shared_corpus(dir, 60000, 4000);
  struct Layout {
    int64_t dp, tp, zero;
  };
  const std::vector<std::pair<Layout, Layout>> cases = {{{1, 2, 0}, {2, 1, 3}},
                                                        {{2, 1, 3}, {1, 2, 0}}};
  for (const std::string pattern : {"unstructured", "block:16"}) {
    for (const auto& [from, to] : cases) {
      SCOPED_TRACE(fmt::format("{}: tp {} zero {} -> tp {} zero {}", pattern, from.tp, from.zero,
                               to.tp, to.zero));
      auto config = pruned_config(dir.path(), pattern, "global", 0.5);
      const auto configure = [&](train::TrainConfig c, const Layout& l) {
        c.tp = l.tp;
        c.zero = l.zero;
        return c;
      };
      std::map<std::string, at::Tensor> want;
      {
        train::Trainer t(configure(config, from),
                         loom::testing::layout_mesh({.dp = from.dp, .tp = from.tp}));
        want = loom::testing::run(t).params;
      }
      auto saving = configure(config, from);
      saving.save_dir = (dir / fmt::format("ckpt-{}-{}", pattern.substr(0, 3), from.tp)).string();
      saving.save_every = 2;
      train::Trainer(saving, loom::testing::layout_mesh({.dp = from.dp, .tp = from.tp})).fit();
      world().barrier();
      auto resumed = configure(config, to);
      resumed.resume = (fs::path(saving.save_dir) / "step-00000002").string();
      train::Trainer t(resumed, loom::testing::layout_mesh({.dp = to.dp, .tp = to.tp}));
      ASSERT_EQ(t.step(), 2);
      const auto got = loom::testing::run(t).params;
      int64_t pruned = 0;
      for (const auto& [name, w] : want) {
        ASSERT_TRUE(got.count(name)) << name;
        EXPECT_TRUE(at::equal(got.at(name) == 0, w == 0)) << name;
        pruned += (w == 0).sum().item<int64_t>();
        const double scale = std::max(w.abs().max().item<double>(), 1e-30);
        EXPECT_LE((got.at(name) - w).abs().max().item<double>() / scale, 1e-9) << name;
      }
      EXPECT_GT(pruned, 0);
    }
  }
}

// Under ZeRO-3 the masks live as the zeros of each rank's shards: a resume rebuilds them there
// (checking the 2:4 pattern on the gathered weights, the tile counts from the pieces) and
// continues the uninterrupted run bit for bit.
TEST(TrainerPrune, ZeroThreeResumeContinuesTheMasksAndTheCurveExactly) {
  if (world().size() != 2) GTEST_SKIP() << "runs at 2 ranks (dp 2)";
  loom::testing::SharedTempDir dir;
  loom::testing::write_shared_corpus(dir, 60000, 4000);
  for (const std::string pattern : {"2:4", "block:16"}) {
    SCOPED_TRACE(pattern);
    auto config = pruned_config(dir.path(), pattern, "layer", 0.5);
    config.zero = 3;
    std::vector<double> straight;
    std::map<std::string, at::Tensor> params;
    {
      train::Trainer t(config, loom::testing::layout_mesh({.dp = 2}));
      const auto r = loom::testing::run(t);
      straight = r.losses;
      params = r.params;
    }
    config.save_dir = (dir / ("ckpt-" + pattern.substr(0, 3))).string();
    config.save_every = 2;
    train::Trainer(config, loom::testing::layout_mesh({.dp = 2})).fit();
    world().barrier();
    auto resumed = config;
    resumed.resume = (fs::path(config.save_dir) / "step-00000002").string();
    resumed.save_dir.clear();
    train::Trainer t(resumed, loom::testing::layout_mesh({.dp = 2}));
    ASSERT_EQ(t.step(), 2);
    // The layers got the pattern's format back from the shards' zeros.
    int64_t formatted = 0;
    for (const auto& item : t.model().named_modules())
      if (const auto* p =
              dynamic_cast<loom::parallel::tensor::PrunableLinear*>(item.value().get())) {
        const auto& f = p->sparse_format();
        if (pattern == "2:4") {
          EXPECT_EQ(f.kind, ops::SparseLinearFormat::Kind::kTwoFour) << item.key();
        } else {
          EXPECT_EQ(f.kind, ops::SparseLinearFormat::Kind::kBlock) << item.key();
          EXPECT_GT(f.tile_sparsity, 0.1) << item.key();
        }
        ++formatted;
      }
    EXPECT_GT(formatted, 0);
    const auto r = loom::testing::run(t);
    ASSERT_EQ(r.losses.size(), 2u);
    EXPECT_EQ(r.losses[0], straight[2]);
    EXPECT_EQ(r.losses[1], straight[3]);
    for (const auto& [name, w] : params) EXPECT_TRUE(at::equal(r.params.at(name), w)) << name;
  }
}
