// Error feedback resharded across numbers of data-parallel ranks (parallel/data/comm_hook.h:
// StateResharder, each hook's reshard rules; train/comm_hook_state.h): what the run owes is kept.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <spdlog/sinks/ringbuffer_sink.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dist_util.h"
#include "loom/core/safetensors.h"
#include "loom/parallel/data/comm_hook.h"
#include "loom/parallel/data/data_parallel.h"
#include "loom/train/checkpoint.h"
#include "loom/train/trainer.h"
#include "train_compare.h"

using loom::testing::world;
namespace pd = loom::parallel::data;
namespace train = loom::train;

namespace {

constexpr double kU = 5.960464477539063e-08;  // 2^-24
constexpr int kSeed = 700;

// What rank `rank` of `ranks` owes its group after reductions through `hook`, summed over the
// group (a collective over `comm`): the mean of the ranks' carried errors, plus the server
// segments' error (int8, onebit) joined over the group; the first n values, fp64.
at::Tensor owed(const pd::CommHook& hook, int64_t index, int64_t n,
                loom::dist::Communicator& comm) {
  const auto state = hook.state();
  // A copy: the all-reduce works in place, and state() hands out the hook's own tensors.
  auto error = state.at(pd::bucket_state_key(index, "error")).to(at::kFloat).clone();
  comm.all_reduce(error, loom::dist::ReduceOp::Sum);
  // int8 and onebit carry an error for every value (padded past n), powersgd for the matrices it
  // compresses (here the bucket's first 2400 values), topk for every value.
  auto out = at::zeros({n}, at::kDouble);
  const int64_t covered = std::min(n, error.numel());
  out.narrow(0, 0, covered).copy_(error.narrow(0, 0, covered) / comm.size());
  if (const auto server = state.find(pd::bucket_state_key(index, "server_error"));
      server != state.end()) {
    auto all = at::empty({comm.size() * server->second.numel()});
    comm.all_gather(all, server->second.to(at::kFloat).contiguous());
    out += all.narrow(0, 0, n).to(at::kDouble);
  }
  return out;
}

// A 3000-value bucket: a 60 x 40 matrix (what powersgd compresses at rank 2) and a 600-value
// tail (sent as it is), laid out as the data-parallel strategy lays out gradients.
pd::GradBucket make_bucket(int64_t index) {
  pd::GradBucket b;
  b.index = index;
  b.params = {at::zeros({60, 40}), at::zeros({600})};
  b.offsets = {0, 2400};
  b.buffer = at::zeros({3000});
  return b;
}

// Saves `hook`'s state to `path`, as a rank-state file holds it.
void save_state(const pd::CommHook& hook, const std::filesystem::path& path) {
  loom::core::NamedTensors tensors;
  for (const auto& [key, t] : hook.state()) tensors.emplace_back(key, t);
  loom::core::save_safetensors(path, tensors);
}

// A new `spec` hook loaded with the state resharded from the files of `before` old ranks; the
// resharded entries go to *resharded.
std::shared_ptr<pd::CommHook> resharded_hook(const std::string& spec, int before,
                                             const std::function<std::filesystem::path(int)>& file,
                                             std::map<std::string, at::Tensor>* resharded) {
  auto hook = pd::make_comm_hook(spec);
  pd::StateResharder resharder(*hook);
  for (int r = 0; r < before; ++r) resharder.add(loom::core::load_safetensors(file(r)).tensors);
  EXPECT_EQ(resharder.ranks(), before);
  *resharded = resharder.result();
  hook->load_resharded_state(*resharded);
  return hook;
}

// What the new group delivered plus what it owes equals what the old group owed (`owed_before`,
// held by world rank 0, which is rank 0 of both groups), up to fp32 roundings: a few per value
// and rank of magnitudes up to twice what the new ranks carried (x + its error). The bound,
// 8 (R + 32) u x 2 x the sum of the resharded entries' largest magnitudes (thresholds and
// momenta included), is a loose guard of those roundings; a lost or doubled error is of the
// size of what was owed, which the test requires to be over 100 times the bound. Collective over
// `group`.
void expect_nothing_lost(const at::Tensor& delivered, const at::Tensor& owed_after,
                         const at::Tensor& owed_before, loom::dist::Communicator& group,
                         const std::map<std::string, at::Tensor>& resharded,
                         const std::string& what) {
  auto reference = owed_before.defined() && world().rank() == 0
                       ? owed_before.clone()
                       : at::zeros({delivered.numel()}, at::kDouble);
  group.broadcast(reference, 0);
  double carried = 0;
  for (const auto& [key, t] : resharded)
    if (t.is_floating_point()) carried += t.abs().max().item<double>();
  const double bound = 8 * (world().size() + 32) * kU * 2 * carried;
  const double lost = (delivered + owed_after - reference).abs().max().item<double>();
  EXPECT_LE(lost, bound);
  EXPECT_GT(reference.abs().max().item<double>(), 100 * bound) << "nothing was owed";
  if (std::getenv("LOOM_TEST_VERBOSE") != nullptr && world().rank() == 0)
    std::printf("%s: lost %.3g (bound %.3g), owed up to %.3g\n", what.c_str(), lost, bound,
                reference.abs().max().item<double>());
}

}  // namespace

// A group of R ranks reduces a 3000-value bucket 4 times through each error-feedback hook and
// saves its state, one file per rank; a group of R' ranks (R' = R - 1 and R + 1 within the world)
// builds its state from those files with StateResharder and reduces a zero bucket once. What it
// delivers plus what it then owes equals what the old group owed, up to fp32 roundings (a few u
// of the largest value per rank and step), while what was owed is far larger: nothing lost,
// nothing counted twice. int8 and onebit: every rank's mean error and the server segments
// re-cut for R' ranks; powersgd and topk: the mean error (the warm start and threshold held alike).
TEST(HookReshard, WhatTheGroupOwesSurvivesAnotherNumberOfRanks) {
  const int world_size = world().size(), me = world().rank();
  if (world_size < 2) GTEST_SKIP() << "needs 2 ranks";
  loom::testing::SharedTempDir dir;
  const int64_t n = 3000, index = 2;
  for (const auto& [before, after] :
       {std::pair{world_size, world_size - 1}, std::pair{world_size - 1, world_size}}) {
    auto old_group = world().split(me < before ? 0 : -1, me, "old-dp");
    auto new_group = world().split(me < after ? 0 : -1, me, "new-dp");
    for (const std::string spec : {"int8", "onebit", "powersgd:rank=2", "topk:ratio=0.1"}) {
      SCOPED_TRACE(fmt::format("{}: {} ranks, then {}", spec, before, after));
      const auto file = [&](int r) { return dir / fmt::format("{}-{}-{}.st", before, r, spec); };
      at::Tensor owed_before;
      if (old_group) {
        auto hook = pd::make_comm_hook(spec);
        auto bucket = make_bucket(index);
        for (int t = 0; t < 4; ++t) {
          bucket.buffer.copy_(loom::testing::rank_gradient(kSeed, me, t, n));
          hook->begin_step(t);
          hook->start(bucket, *old_group)->wait();
          hook->finish(bucket, *old_group);
        }
        owed_before = owed(*hook, index, n, *old_group);
        save_state(*hook, file(me));
      }
      world().barrier();
      if (new_group) {
        std::map<std::string, at::Tensor> resharded;
        auto hook = resharded_hook(spec, before, file, &resharded);
        auto bucket = make_bucket(index);
        hook->begin_step(4);
        hook->start(bucket, *new_group)->wait();
        hook->finish(bucket, *new_group);
        const auto delivered = bucket.buffer.to(at::kDouble);
        const auto owed_after = owed(*hook, index, n, *new_group);
        expect_nothing_lost(delivered, owed_after, owed_before, *new_group, resharded,
                            fmt::format("{}, {} ranks then {}", spec, before, after));
      }
      world().barrier();
    }
  }
}

// The same under ZeRO: a group of R ranks reduce-scatters a 3001-value bucket (padded to R
// shards) 4 times through each hook that compresses the shard layout and saves its state; a group
// of R' ranks reshards it, cuts it into its own shards (lay_out_resharded with its padded size)
// and reduce-scatters a zero bucket once. What the new shards deliver, joined, plus the new
// ranks' mean error equals the old ranks' mean error, up to fp32 roundings.
TEST(HookReshard, UnderZeroWhatTheGroupOwesSurvivesAnotherNumberOfRanks) {
  const int world_size = world().size(), me = world().rank();
  // R and R - 1 both at least 2 (one rank reduces without the hook).
  if (world_size < 3) GTEST_SKIP() << "needs 3 ranks";
  loom::testing::SharedTempDir dir;
  // 3001 values: padded to a multiple of R, a different length at every R (the lay-out must
  // carry the error over a longer or a shorter padded bucket).
  const int64_t n = 3001, index = 4;
  // A rank's carried error over the bucket, in bucket order (int8 and onebit pad each shard to
  // their block in it), averaged over `comm`: what the group owes.
  const auto owed_scatter = [&](const pd::CommHook& hook, int64_t ranks,
                                loom::dist::Communicator& comm) {
    const auto state = hook.state();
    auto error = state.at(pd::bucket_state_key(index, "scatter_error")).to(at::kFloat).clone();
    const int64_t shard = (n + ranks - 1) / ranks;
    error = error.view({ranks, -1}).narrow(1, 0, shard).reshape({-1}).narrow(0, 0, n).clone();
    comm.all_reduce(error, loom::dist::ReduceOp::Sum);
    return error.to(at::kDouble) / comm.size();
  };
  const auto padded = [&](int64_t ranks) {
    pd::GradBucket b;
    b.index = index;
    b.buffer = at::zeros({(n + ranks - 1) / ranks * ranks});
    return b;
  };
  for (const auto& [before, after] :
       {std::pair{world_size, world_size - 1}, std::pair{world_size - 1, world_size}}) {
    auto old_group = world().split(me < before ? 0 : -1, me, "old-zero");
    auto new_group = world().split(me < after ? 0 : -1, me, "new-zero");
    for (const std::string spec :
         {"int8", "onebit", "topk:ratio=0.1", "threshold:ratio=0.1,every=3"}) {
      SCOPED_TRACE(fmt::format("{}: {} ranks, then {}", spec, before, after));
      const auto file = [&](int r) { return dir / fmt::format("z{}-{}-{}.st", before, r, spec); };
      at::Tensor owed_before;
      if (old_group) {
        auto hook = pd::make_comm_hook(spec);
        auto bucket = padded(before);
        auto recv = at::empty({bucket.numel() / before});
        for (int t = 0; t < 4; ++t) {
          bucket.buffer.narrow(0, 0, n).copy_(loom::testing::rank_gradient(kSeed, me, t, n));
          hook->begin_step(t);
          loom::testing::reduce_scatter_through(*hook, bucket, recv, *old_group);
        }
        owed_before = owed_scatter(*hook, before, *old_group);
        save_state(*hook, file(me));
      }
      world().barrier();
      if (new_group) {
        std::map<std::string, at::Tensor> resharded;
        auto hook = resharded_hook(spec, before, file, &resharded);
        auto bucket = padded(after);
        const int64_t shard = bucket.numel() / after;
        hook->lay_out_resharded(index, bucket.numel(), new_group->rank(), after);
        // Laid out already: a checkpoint written now holds the new shards' errors.
        const auto laid_out = hook->state().at(pd::bucket_state_key(index, "scatter_error"));
        EXPECT_GE(laid_out.numel(), bucket.numel());
        auto recv = at::empty({shard});
        hook->begin_step(4);
        loom::testing::reduce_scatter_through(*hook, bucket, recv, *new_group);
        auto joined = at::empty({bucket.numel()});
        new_group->all_gather(joined, recv);
        const auto delivered = joined.narrow(0, 0, n).to(at::kDouble);
        const auto owed_after = owed_scatter(*hook, after, *new_group);
        expect_nothing_lost(delivered, owed_after, owed_before, *new_group, resharded,
                            fmt::format("{} under ZeRO, {} ranks then {}", spec, before, after));
      }
      world().barrier();
    }
  }
}

// The same through checkpoints: a run at dp R - 1 with --comm-hook int8 (plain data parallelism;
// also topk at ZeRO-2 and onebit on momenta at ZeRO-3) saves at step 2, and the run resumed at dp
// R reshards its error feedback (the log says so; no warning of a restart at zero), holds the
// resharded errors in a checkpoint written before its first step, and trains on.
TEST(HookReshard, AResumeAtAnotherDpSizeReshardsTheErrorFeedback) {
  const int world_size = world().size(), me = world().rank();
  // The saving run needs 2 dp ranks to reduce anything.
  if (world_size < 3) GTEST_SKIP() << "needs 3 ranks";
  loom::testing::SharedTempDir dir;
  loom::testing::write_shared_corpus(dir, 30000, 4000);
  auto small = world().split(me < world_size - 1 ? 0 : -1, me, "smaller-world");
  // Plain data parallelism; ZeRO-2 with topk on the shard layout; ZeRO-3 with onebit on momenta
  // (its whole-bucket reduction, whose padded bucket changes with the number of ranks).
  const std::vector<std::pair<std::string, int>> cases = {
      {"int8", 0}, {"topk:ratio=0.05", 2}, {"onebit:warmup=1,momentum=0.9", 3}};
  for (const auto& [hook, zero] : cases) {
    SCOPED_TRACE(fmt::format("{} at ZeRO-{}", hook, zero));
    const auto sub = dir / fmt::format("{}-{}", zero, hook);
    auto config = loom::testing::small_run_config(dir.path(), 1, "fp32");
    config.comm_hook = hook;
    config.zero = zero;
    config.steps = 2;
    config.lr_decay_steps = 4;  // the resumed run goes on to step 4 on the same schedule
    config.save_dir = (sub / "ckpt").string();
    if (small) {
      auto mesh = std::make_shared<loom::dist::Mesh>(small, loom::dist::MeshShape{.dp = 0});
      train::Trainer(config, mesh).fit();
    }
    world().barrier();
    auto sink = std::make_shared<spdlog::sinks::ringbuffer_sink_mt>(200);
    spdlog::default_logger()->sinks().push_back(sink);
    const auto level = spdlog::get_level();  // the test binary logs warnings only
    spdlog::set_level(spdlog::level::info);
    auto resumed = config;
    resumed.steps = 4;
    resumed.save_dir = (sub / "again").string();
    resumed.resume = (sub / "ckpt" / "step-00000002").string();
    {
      train::Trainer t(resumed, loom::testing::layout_mesh({}));
      // Saved before any reduction: the resharded errors are laid out already, so they are in it.
      t.save_checkpoint();
      const auto file = sub / "again" / "step-00000002" / train::rank_state_name(me, world_size);
      ASSERT_TRUE(std::filesystem::exists(file));
      const auto saved = loom::core::load_safetensors(file).tensors;
      const std::string prefix = zero == 0 ? "data-parallel/c0/b0/" : "zero/c0/b0/";
      const std::vector<std::string> keys =
          zero == 0 ? std::vector<std::string>{"error", "server_error"}
          : zero == 2
              ? std::vector<std::string>{"scatter_error", "scatter_threshold", "scatter_steps"}
              : std::vector<std::string>{"momentum", "error", "server_error"};
      for (const auto& key : keys) {
        const auto it = saved.find(prefix + key);
        ASSERT_TRUE(it != saved.end()) << "no " << prefix + key;
        // (A rank's server segment may lie wholly in the bucket's padding: present, maybe 0.)
        if (key == "error" || key == "scatter_error" || key == "momentum") {
          EXPECT_GT(it->second.abs().max().item<double>(), 0) << prefix + key << " is all zero";
        }
      }
      for (int s = 0; s < 2; ++s) EXPECT_TRUE(std::isfinite(t.train_step().loss));
    }
    spdlog::set_level(level);
    spdlog::default_logger()->sinks().pop_back();
    std::string log;
    for (const auto& line : sink->last_formatted()) log += line;
    EXPECT_TRUE(loom::testing::contains(
        log, fmt::format("resharded from the {} data-parallel ranks", world_size - 1)))
        << log;
    EXPECT_FALSE(loom::testing::contains(log, "restarts at zero")) << log;
    world().barrier();
  }
}
