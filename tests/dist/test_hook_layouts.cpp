// Error feedback carried across layouts through checkpoints (train/hook_values.h): a run saved
// in one layout resumes in another (other tp, cp or pp sizes, other buckets, another ZeRO stage
// or none), and what the run owes each parameter is the same before and after.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <spdlog/sinks/ringbuffer_sink.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "dist_util.h"
#include "loom/core/safetensors.h"
#include "loom/parallel/data/comm_hook.h"
#include "loom/train/checkpoint.h"
#include "loom/train/hook_values.h"
#include "loom/train/trainer.h"
#include "train_compare.h"

using loom::testing::world;
namespace pd = loom::parallel::data;
namespace train = loom::train;

namespace {

constexpr double kU = 5.960464477539063e-08;  // 2^-24

struct Layout {
  loom::dist::MeshShape shape;
  int zero = 0;
  double bucket_mb = 0.05;
  bool sequence_parallel = false;
};

train::TrainConfig config_for(const train::TrainConfig& base, const Layout& l) {
  auto c = base;
  c.tp = l.shape.tp;
  c.pp = l.shape.pp;
  c.cp = l.shape.cp;
  c.zero = l.zero;
  c.bucket_mb = l.bucket_mb;
  c.sequence_parallel = l.sequence_parallel;
  return c;
}

// Every parameter's totals (what the run owes it, and a momentum and variance) from the hook
// state a checkpoint holds.
std::map<std::string, std::map<std::string, at::Tensor>> totals_in(
    const std::filesystem::path& checkpoint, const std::string& hook) {
  const auto contents = train::open_checkpoint(checkpoint);
  const auto made = pd::make_comm_hook(hook);
  const auto totals = train::read_hook_values(contents, *made, hook);
  EXPECT_GT(totals.groups(), 0) << "no rank-state file records its hook layout";
  return totals.totals();
}

// What each old data-parallel group of a checkpoint (one chunk per rank; entries "error",
// "server_error", "momentum" as int8 and onebit keep them for whole buckets) owes each parameter,
// read without group_values or HookValueTotals: per bucket the group's mean error plus its
// server segments joined in dp order, cut at each parameter's offset; and the momentum its dp
// rank 0 holds. By group (tp, cp, pp rank), then entry, then parameter. *scale: the largest
// magnitude of what was added (the library rounds each term to fp32 before adding them).
using Coords = std::tuple<int64_t, int64_t, int64_t>;
std::map<Coords, std::map<std::string, std::map<std::string, at::Tensor>>> owed_by_hand(
    const std::filesystem::path& checkpoint, const std::string& owner, double* scale) {
  const auto contents = train::open_checkpoint(checkpoint);
  struct Group {
    train::HookValueLayout layout;
    std::map<int64_t, at::Tensor> error_sum, momentum;
    std::map<int64_t, std::map<int64_t, at::Tensor>> server;  // by bucket, then dp rank
    int64_t ranks = 0;
  };
  std::map<Coords, Group> groups;
  for (const auto& name : contents.state.at("rank_state_files")) {
    const auto file = loom::core::load_safetensors(contents.dir / name.get<std::string>());
    const auto layout =
        train::HookValueLayout::from_json(file.metadata.at(train::kHookValueLayoutKey), "f");
    auto& g = groups[{layout.tp, layout.cp, layout.pp}];
    g.layout = layout;
    ++g.ranks;
    for (size_t b = 0; b < layout.chunks[0].size(); ++b) {
      const auto key = [&](const char* what) {
        return fmt::format("{}/c0/b{}/{}", owner, b, what);
      };
      const auto index = static_cast<int64_t>(b);
      const auto error = file.tensors.at(key("error")).to(at::kDouble);
      g.error_sum[index] = g.error_sum.count(index) ? g.error_sum[index] + error : error;
      g.server[index][layout.dp] = file.tensors.at(key("server_error")).to(at::kDouble);
      if (layout.dp == 0 && file.tensors.count(key("momentum")))
        g.momentum[index] = file.tensors.at(key("momentum")).to(at::kDouble);
    }
  }
  std::map<Coords, std::map<std::string, std::map<std::string, at::Tensor>>> out;
  for (auto& [coords, g] : groups) {
    for (size_t b = 0; b < g.layout.chunks[0].size(); ++b) {
      const auto index = static_cast<int64_t>(b);
      const auto mean = g.error_sum[index] / static_cast<double>(g.ranks);
      std::vector<at::Tensor> segments;
      for (const auto& [dp, t] : g.server[index]) segments.push_back(t);
      const auto joined = at::cat(segments);
      *scale =
          std::max({*scale, mean.abs().max().item<double>(), joined.abs().max().item<double>()});
      const auto owed = mean + joined;
      const auto& bucket = g.layout.chunks[0][b];
      for (size_t k = 0; k < bucket.names.size(); ++k) {
        int64_t n = 1;
        for (auto size : bucket.shapes[k]) n *= size;
        const auto& name = bucket.names[k];
        out[coords]["owed"][name] = owed.narrow(0, bucket.offsets[k], n).view(bucket.shapes[k]);
        if (g.momentum.count(index)) {
          *scale = std::max(*scale, g.momentum[index].abs().max().item<double>());
          out[coords]["momentum"][name] =
              g.momentum[index].narrow(0, bucket.offsets[k], n).view(bucket.shapes[k]);
        }
      }
    }
  }
  return out;
}

}  // namespace

// gpt2-tiny in fp32 saves at step 2 in layout A and resumes in layout B, which saves again
// before any step. In each case the log says the error feedback was carried (not restarted at
// zero), and every parameter's totals in B's checkpoint equal A's: what the old copies owed,
// summed or averaged as the layout makes them, split over the new copies and summed again. The
// bound: fp32's rounding of each share and of the sums, 16 u of the largest total (a lost or
// doubled piece is of the size of the total itself, which the test requires to be nonzero).
// For int8 and onebit (whole buckets) A's totals also equal the files read by hand (the mean
// error plus the server segments, the momentum): every parameter at plain dp; a partial norm, a
// column-split weight and the tied embedding's two stages at tp 2 and pp 2. Cases: int8 from dp 2 x
// tp 2 with sequence parallelism (partial norms) to dp 4 with other buckets; int8 from dp 2 x pp 2
// (the tied embedding's two stages) to dp 2 x tp 2; topk from ZeRO-2 at dp 2 x tp 2 to plain data
// parallelism at dp 4; onebit on momenta (the momentum and variance too) from ZeRO-1 at dp 4 to dp
// 2 x pp 2; powersgd from dp 2 x cp 2 to dp 2 x tp 2; int8 from dp 2 x pp 2 into ZeRO-2's shard
// layout at dp 4. Then B trains two finite steps.
TEST(HookLayouts, WhatTheRunOwesEachParameterSurvivesAnotherLayout) {
  if (world().size() != 4) GTEST_SKIP() << "runs 4-rank layouts";
  loom::testing::SharedTempDir dir;
  loom::testing::write_shared_corpus(dir, 30000, 4000);
  struct Case {
    std::string hook;
    Layout from, to;
    bool hand_checked = false;  // the old state is int8/onebit's whole buckets: read by hand too
  };
  const std::vector<Case> cases = {
      {"int8", {{.dp = 2, .tp = 2}, 0, 0.05, true}, {{.dp = 4}, 0, 0.1}, true},
      {"int8", {{.dp = 2, .pp = 2}}, {{.dp = 2, .tp = 2}}, true},
      {"topk:ratio=0.05", {{.dp = 2, .tp = 2}, 2}, {{.dp = 4}, 0}},
      {"onebit:warmup=1,momentum=0.9", {{.dp = 4}, 1}, {{.dp = 2, .pp = 2}, 0}, true},
      {"powersgd:rank=2", {{.dp = 2, .cp = 2}}, {{.dp = 2, .tp = 2}}},
      // Into ZeRO's shard layout.
      {"int8", {{.dp = 2, .pp = 2}}, {{.dp = 4}, 2}},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto& c = cases[i];
    SCOPED_TRACE(fmt::format("{}: {} (ZeRO-{}) to {} (ZeRO-{})", c.hook, c.from.shape.describe(),
                             c.from.zero, c.to.shape.describe(), c.to.zero));
    const auto sub = dir / fmt::format("case-{}", i);
    auto base = loom::testing::small_run_config(dir.path(), 1, "fp32");
    base.comm_hook = c.hook;
    base.steps = 2;
    base.lr_decay_steps = 4;
    base.save_dir = (sub / "from").string();
    train::Trainer(config_for(base, c.from), loom::testing::layout_mesh(c.from.shape)).fit();
    world().barrier();

    auto sink = std::make_shared<spdlog::sinks::ringbuffer_sink_mt>(200);
    spdlog::default_logger()->sinks().push_back(sink);
    const auto level = spdlog::get_level();  // the test binary logs warnings only
    spdlog::set_level(spdlog::level::info);
    auto resumed = config_for(base, c.to);
    resumed.steps = 4;
    resumed.save_dir = (sub / "to").string();
    resumed.resume = (sub / "from" / "step-00000002").string();
    {
      train::Trainer t(resumed, loom::testing::layout_mesh(c.to.shape));
      t.save_checkpoint();  // before any reduction: the carried values are laid out already
      world().barrier();
      if (world().rank() == 0) {
        const auto before = totals_in(sub / "from" / "step-00000002", c.hook);
        const auto after = totals_in(sub / "to" / "step-00000002", c.hook);
        EXPECT_EQ(before.size(), after.size());
        if (c.hand_checked) {
          // The old totals themselves, against the files read by hand: at plain dp every
          // parameter; at tp 2 with sequence parallelism a norm (partial: the two tp groups
          // summed) and a column-split weight (their halves stacked); at pp 2 the tied
          // embedding (its two stages summed) and a layer of stage 0.
          double scale = 0;
          const auto hand = owed_by_hand(sub / "from" / "step-00000002",
                                         c.from.zero > 0 ? "zero" : "data-parallel", &scale);
          const auto expect_total = [&](const std::string& what, const std::string& name,
                                        const at::Tensor& want) {
            ASSERT_TRUE(before.count(what) && before.at(what).count(name)) << what << " " << name;
            EXPECT_LE((before.at(what).at(name) - want).abs().max().item<double>(), 4 * kU * scale)
                << what << " of " << name;
          };
          const auto piece = [&](int64_t tp, int64_t pp, const std::string& name) {
            return hand.at({tp, 0, pp}).at("owed").at(name);
          };
          const std::string ln = "transformer.h.0.ln_1.weight";
          if (c.from.shape.tp == 2) {
            expect_total("owed", ln, piece(0, 0, ln) + piece(1, 0, ln));
            const std::string fc = "transformer.h.0.mlp.c_fc.weight";
            expect_total("owed", fc, at::cat({piece(0, 0, fc), piece(1, 0, fc)}, 0));
          } else if (c.from.shape.pp == 2) {
            const std::string wte = "transformer.wte.weight";
            expect_total("owed", wte, piece(0, 0, wte) + piece(0, 1, wte));
            expect_total("owed", ln, piece(0, 0, ln));
          } else {
            for (const auto& [what, by_name] : hand.at({0, 0, 0}))
              for (const auto& [name, t] : by_name) expect_total(what, name, t);
          }
        }
        for (const auto& [what, by_name] : before) {
          double largest = 0, lost = 0;
          for (const auto& [name, t0] : by_name) {
            ASSERT_TRUE(after.count(what) && after.at(what).count(name)) << what << " " << name;
            largest = std::max(largest, t0.abs().max().item<double>());
            lost = std::max(lost, (after.at(what).at(name) - t0).abs().max().item<double>());
          }
          EXPECT_GT(largest, 0) << what << ": nothing was owed";
          EXPECT_LE(lost, 16 * kU * largest) << what;
          if (std::getenv("LOOM_TEST_VERBOSE") != nullptr)
            std::printf("%s, %s: %zu parameters, lost %.3g of up to %.3g\n", c.hook.c_str(),
                        what.c_str(), by_name.size(), lost, largest);
        }
      }
      for (int s = 0; s < 2; ++s) EXPECT_TRUE(std::isfinite(t.train_step().loss));
    }
    spdlog::set_level(level);
    spdlog::default_logger()->sinks().pop_back();
    std::string log;
    for (const auto& line : sink->last_formatted()) log += line;
    EXPECT_TRUE(loom::testing::contains(log, "carried from another layout")) << log;
    EXPECT_FALSE(loom::testing::contains(log, "restarts at zero")) << log;
    world().barrier();
  }
}
