// Gradual magnitude pruning: the schedule, the mask patterns, the exact threshold search, and
// the "prune" strategy in single-process training (tests/dist/test_pruning.cpp: under layouts).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "loom/core/autocast.h"
#include "loom/ops/block_sparse.h"
#include "loom/ops/sparse_linear.h"
#include "loom/ops/sparsity.h"
#include "loom/parallel/tensor/layers.h"
#include "loom/train/config.h"
#include "loom/train/trainer.h"
#include "sparse24_util.h"
#include "test_util.h"

using loom::testing::contains;
using loom::testing::error_of;
using loom::testing::TempDir;
namespace ops = loom::ops;
namespace train = loom::train;
namespace fs = std::filesystem;

TEST(PruneSchedule, CubicValuesAtChosenStepsAndUpdateSteps) {
  const ops::PruneSchedule s{.final_sparsity = 0.8, .start = 10, .end = 110, .every = 20};
  EXPECT_EQ(s.at(0), 0.0);
  EXPECT_EQ(s.at(10), 0.0);  // t0: the initial sparsity
  // Halfway: s_f + (s_i - s_f) (1 - 1/2)^3 = 0.8 - 0.8 / 8.
  EXPECT_NEAR(s.at(60), 0.7, 1e-15);
  EXPECT_NEAR(s.at(35), 0.8 - 0.8 * std::pow(0.75, 3), 1e-15);
  EXPECT_EQ(s.at(110), 0.8);
  EXPECT_EQ(s.at(500), 0.8);
  for (const int64_t t : {10, 30, 50, 70, 90, 110}) EXPECT_TRUE(s.updates_at(t)) << t;
  for (const int64_t t : {0, 9, 20, 31, 111, 130}) EXPECT_FALSE(s.updates_at(t)) << t;
  // The end is an update even off the grid; a schedule of one step jumps to the final sparsity.
  const ops::PruneSchedule odd{.final_sparsity = 0.5, .start = 0, .end = 7, .every = 3};
  EXPECT_TRUE(odd.updates_at(6));
  EXPECT_TRUE(odd.updates_at(7));
  const ops::PruneSchedule jump{.final_sparsity = 0.5, .start = 4, .end = 4, .every = 1};
  EXPECT_EQ(jump.at(3), 0.0);
  EXPECT_EQ(jump.at(4), 0.5);
}

TEST(SparsityMasks, NofMKeepsTheNLargestOfEveryMConsecutiveWeights) {
  at::manual_seed(3);
  const auto w = at::randn({6, 16}, at::kDouble);
  for (const auto& [n, m] : std::vector<std::pair<int64_t, int64_t>>{{2, 4}, {1, 4}, {3, 8}}) {
    const auto mask = ops::n_of_m_mask(w, n, m);
    ASSERT_EQ(mask.sizes(), w.sizes());
    const auto groups = mask.reshape({-1, m}), values = w.abs().reshape({-1, m});
    for (int64_t g = 0; g < groups.size(0); ++g) {
      EXPECT_EQ(groups[g].sum().item<int64_t>(), n) << n << ":" << m << " group " << g;
      // Every kept weight is at least every dropped one.
      const auto kept = values[g].masked_select(groups[g]);
      const auto dropped = values[g].masked_select(groups[g].logical_not());
      EXPECT_GE(kept.min().item<double>(), dropped.max().item<double>());
    }
  }
  // Ties: the lower index wins, so equal weights keep the group's first n.
  const auto ties = ops::n_of_m_mask(at::ones({1, 8}), 2, 4);
  EXPECT_TRUE(at::equal(ties, at::tensor({1, 1, 0, 0, 1, 1, 0, 0}).to(at::kBool).reshape({1, 8})));
  EXPECT_TRUE(contains(error_of([] {
                         ops::n_of_m_mask(at::ones({2, 6}), 2, 4);
                       }),
                       "groups the last dimension by M = 4: a tensor of shape [2, 6]"));
}

// Transposable N:M: every M x M block keeps exactly N per row and per column, so w and w^T are
// both N:M; of all such block patterns it keeps the one of largest kept magnitude (checked by
// brute force over the 2^16 masks of each 4 x 4 block).
TEST(SparsityMasks, TransposableNofMKeepsNPerRowAndColumnAndTheLargestSuchPattern) {
  const auto w = at::randn({8, 12}, at::kDouble);
  for (const int64_t n : {1, 2, 3}) {
    const auto mask = ops::transposable_n_of_m_mask(w, n, 4);
    EXPECT_TRUE(at::all(mask.reshape({-1, 4}).sum(1) == n).item<bool>()) << n << ":4t rows";
    EXPECT_TRUE(at::all(mask.t().contiguous().reshape({-1, 4}).sum(1) == n).item<bool>())
        << n << ":4t columns";
  }
  const auto mask = ops::transposable_n_of_m_mask(w, 2, 4);
  const auto a = w.abs();
  for (int64_t br = 0; br < 2; ++br)
    for (int64_t bc = 0; bc < 3; ++bc) {
      const auto block = a.slice(0, 4 * br, 4 * br + 4).slice(1, 4 * bc, 4 * bc + 4);
      double best = -1;
      for (uint32_t bits = 0; bits < (1u << 16); ++bits) {
        bool ok = true;
        double sum = 0;
        for (int i = 0; i < 4 && ok; ++i) {
          int row = 0, col = 0;
          for (int j = 0; j < 4; ++j) {
            row += (bits >> (4 * i + j)) & 1;
            col += (bits >> (4 * j + i)) & 1;
            if ((bits >> (4 * i + j)) & 1) sum += block[i][j].item<double>();
          }
          ok = row == 2 && col == 2;
        }
        if (ok) best = std::max(best, sum);
      }
      const auto kept = (block * mask.slice(0, 4 * br, 4 * br + 4).slice(1, 4 * bc, 4 * bc + 4))
                            .sum()
                            .item<double>();
      EXPECT_NEAR(kept, best, 1e-12) << "block " << br << ", " << bc;
    }
  EXPECT_TRUE(contains(error_of([&] {
                         ops::transposable_n_of_m_mask(at::randn({8, 6}), 2, 4);
                       }),
                       "[8, 6] does not divide"));
  EXPECT_EQ(ops::SparsityPattern::parse("2:4t").describe(), "2:4t");
  EXPECT_TRUE(ops::SparsityPattern::parse("2:4t").transposable);
  EXPECT_TRUE(contains(error_of([] { ops::SparsityPattern::parse("2:8t"); }), "M <= 4 (M 8)"));
}

TEST(SparsityMasks, BlockScoresSumEachTileAndMasksSpreadToWholeTiles) {
  const auto w = at::arange(24, at::kDouble).reshape({4, 6}) - 12;
  const auto scores = ops::block_scores(w, 2);
  ASSERT_EQ(scores.sizes(), (std::vector<int64_t>{2, 3}));
  for (int64_t i = 0; i < 2; ++i)
    for (int64_t j = 0; j < 3; ++j)
      EXPECT_EQ(scores[i][j].item<double>(),
                w.narrow(0, 2 * i, 2).narrow(1, 2 * j, 2).abs().sum().item<double>());
  const auto tiles = at::tensor({1, 0, 1, 0, 1, 0}).to(at::kBool).reshape({2, 3});
  const auto mask = ops::expand_block_mask(tiles, 2);
  ASSERT_EQ(mask.sizes(), w.sizes());
  for (int64_t r = 0; r < 4; ++r)
    for (int64_t c = 0; c < 6; ++c)
      EXPECT_EQ(mask[r][c].item<bool>(), tiles[r / 2][c / 2].item<bool>()) << r << "," << c;
  EXPECT_TRUE(contains(error_of([] {
                         ops::block_scores(at::ones({4, 6}), 4);
                       }),
                       "tiles a 2-D weight by 4 x 4: shape [4, 6] does not divide"));
}

// ZeRO-3 pieces: the tile sums of pieces that cover a weight (cut at offsets that split rows
// and tiles) add up to the whole weight's, and each piece's slice of a tile mask is the spread
// mask's elements at those offsets.
TEST(SparsityMasks, BlockScoresAndMasksOfPiecesMatchTheWholeWeight) {
  const auto w = at::randn({8, 12}, at::kDouble);
  const auto whole = ops::block_scores(w, 4);
  const auto flat = w.flatten();
  auto summed = at::zeros_like(whole);
  const std::vector<int64_t> cuts = {0, 5, 37, 38, 90, 96};
  const auto tiles = whole > whole.median();
  const auto spread = ops::expand_block_mask(tiles, 4).flatten();
  for (size_t i = 0; i + 1 < cuts.size(); ++i) {
    const int64_t n = cuts[i + 1] - cuts[i];
    summed += ops::block_scores_of_piece(flat.narrow(0, cuts[i], n), cuts[i], w.sizes(), 4);
    EXPECT_TRUE(at::equal(ops::block_mask_of_piece(tiles, cuts[i], n, w.sizes(), 4),
                          spread.narrow(0, cuts[i], n)))
        << "piece " << i;
  }
  // Both sides add the 16 non-negative magnitudes of a tile in some order: each within
  // 15 u |sum| of the exact sum (u = 2^-53), so they differ by at most 30 u |sum| < 3.4e-15 |sum|.
  EXPECT_TRUE(at::allclose(summed, whole, 3.4e-15, 0));
  EXPECT_EQ(ops::block_scores_of_piece(flat.narrow(0, 0, 0), 0, w.sizes(), 4).sum().item<double>(),
            0.0);
  EXPECT_TRUE(contains(
      error_of([&] { ops::block_scores_of_piece(flat.narrow(0, 0, 10), 90, w.sizes(), 4); }),
      "elements [90, 100) is outside a weight of 96 elements"));
}

// The bisection finds the k-th largest exactly, for several scopes at once, and the same
// threshold when a scope's keys are split into pieces whose counts are summed (as ranks do).
TEST(SparsityThreshold, BisectionFindsTheKthLargestExactlyAlsoFromSummedPieces) {
  at::manual_seed(5);
  const auto a = at::randn({1000}, at::kDouble).abs(), b = at::rand({300}, at::kDouble) * 1e-3;
  const auto ka = ops::score_keys(a), kb = ops::score_keys(b);
  const auto count = [&](const std::vector<int64_t>& t) {
    return std::vector<int64_t>{(ka >= t[0]).sum().item<int64_t>(),
                                (kb >= t[1]).sum().item<int64_t>()};
  };
  const auto sorted_a = std::get<0>(a.sort(0, /*descending=*/true));
  for (const int64_t k : {1, 2, 37, 500, 999}) {
    const auto t = ops::kth_largest_keys({k, 7}, count);
    EXPECT_EQ((ka >= t[0]).sum().item<int64_t>(), k);
    EXPECT_EQ((kb >= t[1]).sum().item<int64_t>(), 7);
    // The threshold is the k-th largest value itself.
    EXPECT_EQ(
        at::tensor({sorted_a[k - 1].item<double>()}, at::kDouble).view(at::kLong).item<int64_t>(),
        t[0]);
  }
  // Keep nothing, everything, more than everything.
  auto t = ops::kth_largest_keys({0, 300}, count);
  EXPECT_EQ((ka >= t[0]).sum().item<int64_t>(), 0);
  EXPECT_EQ((kb >= t[1]).sum().item<int64_t>(), 300);
  t = ops::kth_largest_keys({5000, 1}, count);
  EXPECT_EQ((ka >= t[0]).sum().item<int64_t>(), 1000);
  // The keys of `a` in three pieces, counts summed: the same thresholds.
  const auto pieces = ka.split(400);
  const auto summed = [&](const std::vector<int64_t>& th) {
    int64_t n = 0;
    for (const auto& p : pieces) n += (p >= th[0]).sum().item<int64_t>();
    return std::vector<int64_t>{n};
  };
  EXPECT_EQ(ops::kth_largest_keys({123}, summed)[0], ops::kth_largest_keys({123, 1}, count)[0]);
  // Ties: at least k kept, and fewer than k strictly above the threshold.
  const auto tied = ops::score_keys(at::tensor({3.0, 1.0, 2.0, 2.0, 2.0, 0.0}, at::kDouble));
  const auto tied_count = [&](const std::vector<int64_t>& th) {
    return std::vector<int64_t>{(tied >= th[0]).sum().item<int64_t>()};
  };
  const auto th = ops::kth_largest_keys({3}, tied_count)[0];
  EXPECT_EQ((tied >= th).sum().item<int64_t>(), 4);
  EXPECT_LT((tied > th).sum().item<int64_t>(), 3);
}

TEST(SparsityPattern, ParsesTheFormsAndRejectsBadInputNamingTheValue) {
  EXPECT_EQ(ops::SparsityPattern::parse("unstructured").kind,
            ops::SparsityPattern::Kind::kUnstructured);
  const auto nm = ops::SparsityPattern::parse("2:4");
  EXPECT_EQ(nm.n, 2);
  EXPECT_EQ(nm.m, 4);
  EXPECT_EQ(nm.fixed_sparsity(), 0.5);
  EXPECT_EQ(ops::SparsityPattern::parse("block:32").block, 32);
  EXPECT_EQ(ops::SparsityPattern::parse("block:32").describe(), "block:32");
  for (const char* bad : {"", "dense", "2:", ":4", "2:x", "block:", "block:0", "block:-2"})
    EXPECT_TRUE(contains(error_of([&] { ops::SparsityPattern::parse(bad); }),
                         fmt::format("--prune-pattern '{}' is not valid", bad)))
        << bad;
  EXPECT_TRUE(contains(error_of([] { ops::SparsityPattern::parse("4:2"); }),
                       "needs 1 <= N < M (N 4 and M 2)"));
  EXPECT_TRUE(contains(error_of([] { ops::SparsityPattern::parse("0:4"); }), "1 <= N < M"));

  const auto error_for = [](auto edit) {
    train::PruneConfig p;
    p.to = 0.5;
    edit(p);
    return error_of([&] { p.validate(100); });
  };
  EXPECT_TRUE(contains(error_for([](auto& p) { p.to = 1.0; }),
                       "--prune-to 1 is not a sparsity: it must be in [0, 1)"));
  EXPECT_TRUE(contains(error_for([](auto& p) { p.to = -0.1; }), "--prune-to -0.1"));
  EXPECT_TRUE(contains(error_for([](auto& p) {
                         p.start = 50;
                         p.end = 20;
                       }),
                       "--prune-end 20 is before --prune-start 50"));
  EXPECT_TRUE(contains(error_for([](auto& p) { p.every = 0; }), "--prune-every 0 must be >= 1"));
  EXPECT_TRUE(contains(error_for([](auto& p) { p.scope = "model"; }),
                       "--prune-scope 'model' is not valid"));
  EXPECT_TRUE(contains(error_for([](auto& p) { p.targets = "mlp,embedding"; }),
                       "embeddings and the output head are never pruned"));
  EXPECT_TRUE(contains(error_for([](auto& p) { p.targets = "mlp,norms"; }),
                       "'norms' is not a target; valid: mlp, attention"));
  train::PruneConfig two_of_four;
  two_of_four.pattern = "2:4";
  EXPECT_NO_THROW(two_of_four.validate(100));  // --prune-to left out: the pattern's 0.5
  two_of_four.to = 0.5;
  EXPECT_NO_THROW(two_of_four.validate(100));
  EXPECT_TRUE(two_of_four.enabled());
  EXPECT_FALSE(train::PruneConfig{}.enabled());
  EXPECT_TRUE(contains(error_for([](auto& p) {
                         p.pattern = "2:4";
                         p.to = 0.7;
                       }),
                       "--prune-to 0.7 contradicts it"));
  // The whole config checks it too, before anything is built.
  train::TrainConfig c;
  c.data = "train.bin";
  c.prune.to = 1.5;
  EXPECT_TRUE(contains(error_of([&] { c.validate(); }), "--prune-to 1.5 is not a sparsity"));
}

// --- The prune strategy in one process -------------------------------------------------------

namespace {

train::TrainConfig prune_config(const fs::path& dir) {
  train::TrainConfig c;
  c.model = "gpt2";
  c.preset = "gpt2-tiny";
  c.data = (dir / "train.bin").string();
  c.val_data = (dir / "val.bin").string();
  c.seq_len = 32;
  c.batch_size = 8;
  c.steps = 8;
  c.lr = 3e-3;
  c.warmup_steps = 1;
  c.log_every = 1000;
  c.eval_batches = 1;
  c.prune.to = 0.5;
  c.prune.start = 2;
  c.prune.end = 6;
  c.prune.every = 2;
  return c;
}

bool is_target(const std::string& name, const at::Tensor& p) {
  return p.dim() == 2 && name.ends_with(".weight") &&
         (name.find(".mlp.") != std::string::npos || name.find(".attn.") != std::string::npos);
}

std::map<std::string, at::Tensor> targets_of(train::Trainer& t) {
  std::map<std::string, at::Tensor> out;
  for (const auto& item : t.model().named_parameters())
    if (is_target(item.key(), item.value())) out[item.key()] = item.value().detach().clone();
  return out;
}

int64_t zeros(const at::Tensor& t) {
  return (t == 0).sum().item<int64_t>();
}

}  // namespace

// Per-weight thresholds: after every step each target weight holds exactly the zeros the schedule
// asks for at its last mask update (weights are continuous: no ties, no natural zeros), the
// pruned ones stay zero while training continues, and the masks freeze after --prune-end.
TEST(Pruning, LayerScopeFollowsTheScheduleAndPrunedWeightsStayZero) {
  TempDir dir;
  loom::testing::write_corpus_data(dir.path(), 50000, 5000);
  auto c = prune_config(dir.path());
  const ops::PruneSchedule schedule{.final_sparsity = 0.5, .start = 2, .end = 6, .every = 2};
  train::Trainer t(c);
  std::map<std::string, at::Tensor> previous;
  double last_update_sparsity = 0;
  while (t.step() < c.steps) {
    t.train_step();
    const int64_t step = t.step();
    if (schedule.updates_at(step)) last_update_sparsity = schedule.at(step);
    const auto now = targets_of(t);
    ASSERT_EQ(now.size(), 16u);  // 4 blocks x (c_attn, attn.c_proj, c_fc, mlp.c_proj)
    for (const auto& [name, w] : now) {
      const int64_t want =
          w.numel() - std::llround((1.0 - last_update_sparsity) * static_cast<double>(w.numel()));
      EXPECT_EQ(zeros(w), want) << name << " after step " << step;
      // A weight pruned earlier is still zero.
      if (previous.count(name)) {
        EXPECT_EQ(((previous.at(name) == 0) & (w != 0)).sum().item<int64_t>(), 0) << name;
      }
    }
    // After the end the masks are fixed: the same zeros.
    if (step > 6) {
      for (const auto& [name, w] : now) EXPECT_TRUE(at::equal(w == 0, previous.at(name) == 0));
    }
    previous = now;
  }
  EXPECT_EQ(schedule.at(4), 0.5 - 0.5 * 0.125);  // the middle update: 0.4375
  // The metrics report the sparsity of the pruned weights.
  c.metrics_out = (dir / "metrics.jsonl").string();
  train::Trainer(c).fit();
  std::ifstream in(c.metrics_out);
  std::vector<nlohmann::json> rows;
  for (std::string line; std::getline(in, line);) rows.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(rows.size(), 8u);
  EXPECT_EQ(rows[0]["sparsity"].get<double>(), 0.0);
  EXPECT_NEAR(rows[3]["sparsity"].get<double>(), 0.4375, 1e-4);
  EXPECT_NEAR(rows[7]["sparsity"].get<double>(), 0.5, 1e-4);
}

// One threshold over all pruned weights: exactly the scheduled fraction of them all is zero, and
// the layers end up pruned by different amounts.
TEST(Pruning, GlobalScopeSharesOneThresholdAcrossLayers) {
  TempDir dir;
  loom::testing::write_corpus_data(dir.path(), 50000, 5000);
  auto c = prune_config(dir.path());
  c.prune.scope = "global";
  c.steps = 6;
  train::Trainer t(c);
  t.fit();
  int64_t all = 0, pruned = 0;
  std::vector<double> fractions;
  std::vector<at::Tensor> kept;
  for (const auto& [name, w] : targets_of(t)) {
    all += w.numel();
    pruned += zeros(w);
    fractions.push_back(static_cast<double>(zeros(w)) / static_cast<double>(w.numel()));
    kept.push_back(w.abs().flatten().index({w.flatten() != 0}));
  }
  // Half are kept, more only where several weights equal the smallest kept magnitude (among
  // 786 k fp32 values a tie there happens about one run in 50).
  const auto magnitudes = at::cat(kept);
  const int64_t at_threshold = (magnitudes == magnitudes.min()).sum().item<int64_t>();
  const int64_t keep = std::llround(0.5 * static_cast<double>(all));
  EXPECT_LE(pruned, all - keep);
  EXPECT_GE(pruned, all - keep - (at_threshold - 1)) << at_threshold << " at the threshold";
  const auto [lo, hi] = std::minmax_element(fractions.begin(), fractions.end());
  EXPECT_GT(*hi - *lo, 0.05) << "global pruning left every layer at the same sparsity";
}

// 2:4 keeps exactly 2 of every 4 weights of each row from --prune-start on, and a pruned weight
// never comes back at a later update; block:16 drops whole 16 x 16 tiles.
TEST(Pruning, NofMAndBlockPatternsHoldThroughTraining) {
  TempDir dir;
  loom::testing::write_corpus_data(dir.path(), 50000, 5000);
  {
    auto c = prune_config(dir.path());
    c.prune.to = 0;
    c.prune.pattern = "2:4";
    c.steps = 7;
    train::Trainer t(c);
    std::map<std::string, at::Tensor> previous;
    while (t.step() < c.steps) {
      t.train_step();
      const auto now = targets_of(t);
      for (const auto& [name, w] : now) {
        if (t.step() < 2) continue;
        const auto nonzero_per_group = (w.reshape({-1, 4}) != 0).sum(1);
        EXPECT_TRUE(at::all(nonzero_per_group == 2).item<bool>()) << name;
        // Later updates (steps 4 and 6) choose among the weights still alive: none comes back.
        if (previous.count(name)) {
          EXPECT_EQ(((previous.at(name) == 0) & (w != 0)).sum().item<int64_t>(), 0)
              << name << " at step " << t.step();
        }
      }
      previous = now;
    }
  }
  {  // transposable 2:4: every weight and its transpose are 2:4 once pruned
    auto c = prune_config(dir.path());
    c.prune.to = 0;
    c.prune.pattern = "2:4t";
    c.steps = 3;
    train::Trainer t(c);
    t.fit();
    for (const auto& [name, w] : targets_of(t)) {
      EXPECT_TRUE(at::all((w.reshape({-1, 4}) != 0).sum(1) == 2).item<bool>()) << name;
      EXPECT_TRUE(at::all((w.t().contiguous().reshape({-1, 4}) != 0).sum(1) == 2).item<bool>())
          << name << " transposed";
    }
  }
  {
    auto c = prune_config(dir.path());
    c.prune.pattern = "block:16";
    c.prune.to = 0.75;
    c.steps = 6;
    train::Trainer t(c);
    t.fit();
    int64_t tiles = 0, dropped = 0;
    for (const auto& [name, w] : targets_of(t)) {
      const auto nonzero = (w != 0)
                               .to(at::kLong)
                               .reshape({w.size(0) / 16, 16, w.size(1) / 16, 16})
                               .sum(at::IntArrayRef{1, 3});
      // Every tile is wholly kept or wholly dropped.
      EXPECT_TRUE(at::all((nonzero == 0) | (nonzero == 256)).item<bool>()) << name;
      tiles += nonzero.numel();
      dropped += (nonzero == 0).sum().item<int64_t>();
      EXPECT_EQ((nonzero == 0).sum().item<int64_t>(),
                nonzero.numel() - std::llround(0.25 * static_cast<double>(nonzero.numel())))
          << name;
    }
    EXPECT_GT(tiles, 0);
    EXPECT_GT(dropped, tiles / 2);
  }
}

// The masks are the weights' zeros, so a resume continues the same masks and the same curve, bit
// for bit.
TEST(Pruning, ResumeContinuesTheMasksAndTheLossCurveExactly) {
  TempDir dir;
  loom::testing::write_corpus_data(dir.path(), 50000, 5000);
  auto c = prune_config(dir.path());
  std::vector<double> straight_losses;
  std::map<std::string, at::Tensor> straight;
  {
    train::Trainer t(c);
    while (t.step() < c.steps) straight_losses.push_back(t.train_step().loss);
    straight = targets_of(t);
  }
  c.save_dir = (dir / "ckpt").string();
  c.save_every = 3;
  {
    auto first = c;
    first.steps = 3;
    first.lr_decay_steps = c.steps;
    train::Trainer(first).fit();
  }
  c.resume = c.save_dir;
  c.lr_decay_steps = c.steps;
  train::Trainer resumed(c);
  ASSERT_EQ(resumed.step(), 3);
  for (size_t s = 3; s < straight_losses.size(); ++s)
    EXPECT_EQ(resumed.train_step().loss, straight_losses[s]) << "step " << s + 1;
  for (const auto& [name, w] : targets_of(resumed)) EXPECT_TRUE(at::equal(w, straight.at(name)));
  // Changing the schedule on resume would change the masks: refused.
  c.prune.to = 0.6;
  EXPECT_TRUE(contains(error_of([&] { train::Trainer again(c); }), "--prune-to was 0.5"));
}

// The paths of the pruned layers' product: the block-sparse CPU product from 70% of the tiles
// dropped, the masked dense product below (and for 2:4 off CUDA), each with its reason; the
// block path equals the dense product of the weight with its zeros (fp64: the same sums in
// another order).
TEST(SparseLinear, TakesAKernelWhereThePatternHasOneAndSaysWhyNotElsewhere) {
  using Format = ops::SparseLinearFormat;
  const auto x = at::randn({5, 128}, at::kDouble);
  auto weight_keeping = [](int64_t kept_tiles) {
    auto tiles = at::zeros({16}, at::kBool);
    tiles.slice(0, 0, kept_tiles).fill_(true);
    const auto mask =
        ops::expand_block_mask(tiles.index_select(0, at::randperm(16)).view({4, 4}), 32);
    return at::randn({128, 128}, at::kDouble) * mask;
  };
  const Format block{Format::Kind::kBlock, 32};
  const auto sparse_w = weight_keeping(2);  // 87.5% of the tiles dropped
  const auto choice = ops::choose_sparse_linear(x, sparse_w, block);
  EXPECT_EQ(choice.path, ops::SparseLinearPath::kBlockCpu) << ops::describe(choice);
  const auto y = ops::sparse_linear(x, sparse_w, block, choice);
  EXPECT_LE((y - at::linear(x, sparse_w)).abs().max().item<double>(), 1e-12);

  const auto half = ops::choose_sparse_linear(x, weight_keeping(8), block);
  EXPECT_EQ(half.path, ops::SparseLinearPath::kMaskedDense);
  EXPECT_TRUE(contains(half.reason, "50% of the 32x32 tiles are dropped, below the 70%"))
      << half.reason;
  const auto two_four =
      ops::choose_sparse_linear(x.to(at::kBFloat16), sparse_w, {Format::Kind::kTwoFour, 0});
  EXPECT_EQ(two_four.path, ops::SparseLinearPath::kMaskedDense);
  EXPECT_TRUE(contains(ops::describe(two_four),
                       "masked dense product (the 2:4 kernel runs on "
                       "CUDA; the input is on cpu)"))
      << ops::describe(two_four);
  EXPECT_EQ(ops::choose_sparse_linear(x, sparse_w, {}).path, ops::SparseLinearPath::kDense);
}

// The CUDA paths' autograd functions run on the CPU too (their products through the host
// references), so their dtypes, the 2:4t input gradient on W^T and the block path's masked weight
// gradient are checked here: each of y, dx, dW within the fp64 bound with 2 K fp32 roundings for
// sums of K terms. Also: an fp32 master weight under bf16 autocast gets an fp32 gradient, and the
// CPU block path takes autocast's dtype like at::linear.
TEST(SparseLinear, KernelPathsCarryGradientsLikeTheDenseProduct) {
  using Format = ops::SparseLinearFormat;
  const auto check = loom::testing::expect_product_within_bound;
  {  // 2:4t, bf16 throughout
    const auto dense = at::randn({64, 128}, at::kDouble);
    const auto w0 = (dense * ops::transposable_n_of_m_mask(dense, 2, 4)).to(at::kBFloat16);
    const auto x0 = at::randn({24, 128}).to(at::kBFloat16);
    const auto gy0 = at::randn({24, 64}).to(at::kBFloat16);
    auto x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
    const auto y = ops::sparse_linear(x, w, {Format::Kind::kTwoFour, 0, true},
                                      {ops::SparseLinearPath::kTwoFourCuda, ""});
    y.backward(gy0);
    EXPECT_EQ(y.scalar_type(), at::kBFloat16);
    EXPECT_EQ(w.grad().scalar_type(), at::kBFloat16);
    const auto x64 = x0.to(at::kDouble), w64 = w0.to(at::kDouble), gy64 = gy0.to(at::kDouble);
    check(y, x64, w64.t(), 128, "2:4t y", at::kBFloat16, {});
    check(x.grad(), gy64, w64, 64, "2:4t dx (the kernel on W^T)", at::kBFloat16, {});
    check(w.grad(), gy64.t(), x64, 24, "2:4t dw", at::kBFloat16, {});
  }
  {  // 2:4 with an fp32 master weight under bf16 autocast
    const auto dense = at::randn({32, 64});
    auto w = (dense * ops::n_of_m_mask(dense, 2, 4)).requires_grad_(true);
    auto x = at::randn({8, 64}).requires_grad_(true);
    at::Tensor y;
    {
      loom::core::Bf16Autocast autocast(true, at::kCPU);
      y = ops::sparse_linear(x, w, {Format::Kind::kTwoFour, 0, false},
                             {ops::SparseLinearPath::kTwoFourCuda, ""});
    }
    EXPECT_EQ(y.scalar_type(), at::kBFloat16);
    y.sum().backward();
    EXPECT_EQ(w.grad().scalar_type(), at::kFloat);
    EXPECT_EQ(x.grad().scalar_type(), at::kFloat);
  }
  {  // the block path, 64 x 64 tiles, 3 of 8 kept
    auto tiles = at::zeros({2, 4}, at::kBool);
    tiles[0][1] = tiles[1][0] = tiles[1][3] = true;
    const auto mask = tiles.repeat_interleave(64, 0).repeat_interleave(64, 1);
    const auto w0 = (at::randn({128, 256}) * mask).to(at::kBFloat16);
    const auto x0 = at::randn({10, 256}).to(at::kBFloat16);
    const auto gy0 = at::randn({10, 128}).to(at::kBFloat16);
    auto x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
    const auto y = ops::sparse_linear(x, w, {Format::Kind::kBlock, 64},
                                      {ops::SparseLinearPath::kBlockCuda, ""});
    y.backward(gy0);
    const auto x64 = x0.to(at::kDouble), w64 = w0.to(at::kDouble), gy64 = gy0.to(at::kDouble);
    check(y, x64, w64.t(), 256, "block y", at::kBFloat16, {});
    check(x.grad(), gy64, w64, 128, "block dx (the kernel on W^T's tiles)", at::kBFloat16, {});
    check(w.grad(), gy64.t(), x64, 10, "block dw", at::kBFloat16, mask);
    EXPECT_EQ(w.grad().masked_select(~mask).abs().max().item<float>(), 0.f);
  }
  {  // the CPU block path under bf16 autocast: fp32 x and master weight, a bf16 product
    auto tiles = at::zeros({4, 4}, at::kBool);
    tiles[2][1] = true;
    auto w = (at::randn({128, 128}) * tiles.repeat_interleave(32, 0).repeat_interleave(32, 1))
                 .requires_grad_(true);
    const auto x = at::randn({6, 128});
    const Format block{Format::Kind::kBlock, 32};
    loom::core::Bf16Autocast autocast(true, at::kCPU);
    const auto choice = ops::choose_sparse_linear(x, w, block);
    ASSERT_EQ(choice.path, ops::SparseLinearPath::kBlockCpu) << ops::describe(choice);
    const auto y = ops::sparse_linear(x, w, block, choice);
    EXPECT_EQ(y.scalar_type(), at::kBFloat16);
    y.sum().backward();
    EXPECT_EQ(w.grad().scalar_type(), at::kFloat);
    // Tiles smaller than 32 stay on the masked dense product, which names why.
    const auto small = ops::choose_sparse_linear(x, w, {Format::Kind::kBlock, 16});
    EXPECT_EQ(small.path, ops::SparseLinearPath::kMaskedDense);
    EXPECT_TRUE(contains(small.reason, "16 x 16 tiles")) << small.reason;
  }
}

// With block:32 at 87.5% the pruned layers take the block-sparse CPU product from the update that
// reaches that sparsity; the run equals the one with --prune-kernels off (the masked dense
// product) in fp64 within 1e-9 relative (sums in another order, as the layout tests bound them).
// Gradient clipping (0.05) acts at every step, so the two agree only if a pruned weight gets no
// gradient on the dense path either (the block path gives its dropped tiles none): this checks
// the prune strategy's gradient mask too.
TEST(Pruning, BlockSparseProductTrainsLikeTheMaskedDenseProduct) {
  TempDir dir;
  loom::testing::write_corpus_data(dir.path(), 50000, 5000);
  auto c = prune_config(dir.path());
  c.precision = "fp64";
  c.prune.pattern = "block:32";
  c.prune.to = 0.875;
  c.prune.start = 2;
  c.prune.end = 4;
  c.grad_clip = 0.05;
  auto run = [&](const std::string& kernels, std::vector<ops::SparseLinearPath>& paths) {
    auto config = c;
    config.prune.kernels = kernels;
    train::Trainer t(config);
    std::vector<double> losses;
    while (t.step() < config.steps) {
      const auto r = t.train_step();
      EXPECT_GT(r.grad_norm, config.grad_clip) << "clipping must act for this test to see it";
      losses.push_back(r.loss);
    }
    for (const auto& item : t.model().named_modules())
      if (const auto* l = dynamic_cast<loom::parallel::tensor::PrunableLinear*>(item.value().get()))
        if (is_target(item.key() + ".weight", at::zeros({1, 1}))) paths.push_back(l->last_path());
    return std::make_pair(losses, targets_of(t));
  };
  std::vector<ops::SparseLinearPath> block_paths, dense_paths;
  const auto [block_losses, block_weights] = run("auto", block_paths);
  const auto [dense_losses, dense_weights] = run("off", dense_paths);
  ASSERT_EQ(block_paths.size(), block_weights.size());  // every target weight's layer was found
  for (const auto p : block_paths) EXPECT_EQ(p, ops::SparseLinearPath::kBlockCpu);
  for (const auto p : dense_paths) EXPECT_EQ(p, ops::SparseLinearPath::kDense);
  for (size_t s = 0; s < block_losses.size(); ++s)
    EXPECT_NEAR(block_losses[s], dense_losses[s], 1e-9 * std::abs(dense_losses[s])) << "step " << s;
  for (const auto& [name, w] : block_weights) {
    const auto& d = dense_weights.at(name);
    EXPECT_LE((w - d).abs().max().item<double>(), 1e-9 * d.abs().max().item<double>()) << name;
  }
}

TEST(Pruning, ShapesThePatternCannotTileAreClearErrors) {
  TempDir dir;
  loom::testing::write_corpus_data(dir.path(), 50000, 5000);
  auto c = prune_config(dir.path());
  c.prune.pattern = "block:48";
  const auto msg = error_of([&] { train::Trainer t(c); });
  EXPECT_TRUE(contains(msg,
                       "--prune-pattern block:48: 'transformer.h.0.attn.c_attn.weight' is "
                       "[384, 128] on this rank"))
      << msg;
  c.prune.pattern = "3:7";
  c.prune.to = 0;
  const auto nm = error_of([&] { train::Trainer t(c); });
  EXPECT_TRUE(contains(nm, "do not split into groups of 7")) << nm;
}
