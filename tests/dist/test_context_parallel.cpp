// Context parallelism: ring attention against the whole attention, the balance of its work, and
// training at cp 2 and 4 (alone and with dp, tp + sp, pp and ZeRO-3) against one process.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "loom/ops/attention.h"
#include "loom/parallel/context/context_group.h"
#include "loom/parallel/context/ring_attention.h"
#include "train_compare.h"

using loom::testing::contains;
using loom::testing::error_of;
using loom::testing::world;
namespace train = loom::train;
namespace ctx = loom::parallel::context;
namespace fs = std::filesystem;

namespace {

// The same fp64 tensor on every rank.
at::Tensor shared_randn(at::IntArrayRef shape) {
  auto t = at::randn(shape, at::kDouble);
  world().broadcast(t, 0);
  return t;
}

// This rank's part of x [B, H, T, D] under a contiguous split (rank r holds the r-th T / cp):
// what a ring fed in the wrong order would see, for the test that must catch it.
at::Tensor contiguous_slice(const at::Tensor& x, int64_t cp, int64_t rank) {
  const int64_t len = x.size(2) / cp;
  return x.narrow(2, rank * len, len);
}

// max |got - want| over max |want|, within `bound`.
void expect_close(const at::Tensor& got, const at::Tensor& want, const char* what, double bound) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double scale = std::max(want.abs().max().item<double>(), 1e-30);
  const double rel = (got - want).abs().max().item<double>() / scale;
  EXPECT_LE(rel, bound) << what << ": relative difference " << rel;
  if (std::getenv("LOOM_TEST_VERBOSE")) fmt::print("ring {}: {:.3g}\n", what, rel);
}

struct RingCase {
  int64_t heads, kv_heads, chunk;
};

}  // namespace

TEST(RingAttention, EqualsTheWholeAttentionForwardAndBackward) {
  const int64_t cp = world().size();
  if (cp < 2) GTEST_SKIP() << "a ring needs 2 or more ranks";
  ctx::ContextGroup group(loom::testing::runtime().world());
  ASSERT_EQ(group.size(), cp);
  // Multi-head, grouped-query and multi-query; chunks of 1 token (the causal diagonal alone) too.
  for (const auto& c : {RingCase{4, 4, 3}, RingCase{4, 2, 5}, RingCase{6, 1, 1}}) {
    SCOPED_TRACE(fmt::format("heads {} kv {} chunk {}", c.heads, c.kv_heads, c.chunk));
    const int64_t b = 2, d = 16, t = 2 * cp * c.chunk;
    at::manual_seed(17);
    const auto q = shared_randn({b, c.heads, t, d});
    const auto k = shared_randn({b, c.kv_heads, t, d});
    const auto v = shared_randn({b, c.kv_heads, t, d});
    const auto dout = shared_randn({b, c.heads, t, d});
    // The whole attention and its gradients, in one process.
    auto qw = q.clone().requires_grad_(), kw = k.clone().requires_grad_(),
         vw = v.clone().requires_grad_();
    const auto want = loom::ops::attention_reference(qw, kw, vw, {.causal = true});
    (want * dout).sum().backward();

    auto slice = [&](const at::Tensor& x) { return group.slice_sequence(x, 2); };
    auto ql = slice(q).requires_grad_(), kl = slice(k).requires_grad_(),
         vl = slice(v).requires_grad_();
    group.stats().reset();
    const auto got = ctx::ring_attention(ql, kl, vl, group);
    (got * slice(dout)).sum().backward();
    // fp64 sums in another order: differences of ~1e-15 relative; a wrong block or a missed
    // rescale moves values by 1e-2 or more.
    expect_close(got.detach(), slice(want.detach()), "output", 1e-11);
    expect_close(ql.grad(), slice(qw.grad()), "dq", 1e-11);
    expect_close(kl.grad(), slice(kw.grad()), "dk", 1e-11);
    expect_close(vl.grad(), slice(vw.grad()), "dv", 1e-11);

    // The work done is the causal pairs of this rank's chunks, the same on every rank.
    const int64_t work = group.stats().score_elements;
    EXPECT_EQ(work, ctx::causal_score_elements(t, cp, group.rank()) * b * c.heads);
    auto all = at::empty({cp}, at::kLong);
    world().all_gather(all, at::full({1}, work, at::kLong));
    const double most = static_cast<double>(all.max().item<int64_t>());
    const double least = static_cast<double>(all.min().item<int64_t>());
    EXPECT_LE(most / least, 1.01) << "ring attention work per rank: " << all;
    // Forward and backward send cp - 1 key/value blocks each, backward cp - 1 gradient hops.
    EXPECT_EQ(group.stats().messages, 3 * (cp - 1));
  }
}

TEST(RingAttention, AContiguousSplitIsCaught) {
  const int64_t cp = world().size();
  if (cp < 2) GTEST_SKIP() << "a ring needs 2 or more ranks";
  ctx::ContextGroup group(loom::testing::runtime().world());
  const int64_t b = 1, h = 2, d = 16, t = 8 * cp;
  at::manual_seed(3);
  const auto q = shared_randn({b, h, t, d}), k = shared_randn({b, h, t, d}),
             v = shared_randn({b, h, t, d});
  const auto want = loom::ops::attention_reference(q, k, v, {.causal = true});
  // Fed tokens in contiguous order, the ring attends with the wrong causal mask.
  const auto got = ctx::ring_attention(contiguous_slice(q, cp, group.rank()),
                                       contiguous_slice(k, cp, group.rank()),
                                       contiguous_slice(v, cp, group.rank()), group);
  const double diff = (got - contiguous_slice(want, cp, group.rank())).abs().max().item<double>();
  auto worst = at::full({1}, diff, at::kDouble);
  world().all_reduce(worst, loom::dist::ReduceOp::Max);
  EXPECT_GT(worst.item<double>(), 1e-3) << "the test above would not tell the layouts apart";
}

TEST(ContextGroup, CausalWorkIsBalancedOnlyWithPairedChunks) {
  for (const int64_t cp : {2, 4, 8}) {
    const int64_t t = 64 * cp;
    int64_t total = 0, most = 0, least = INT64_MAX;
    for (int64_t r = 0; r < cp; ++r) {
      const int64_t w = ctx::causal_score_elements(t, cp, r);
      total += w;
      most = std::max(most, w);
      least = std::min(least, w);
    }
    EXPECT_EQ(total, t * (t + 1) / 2) << "cp " << cp;  // every causal pair, once
    EXPECT_LE(static_cast<double>(most) / static_cast<double>(least), 1.01) << "cp " << cp;
    // The contiguous split the pairing avoids: the last rank does 2 cp - 1 times the first's.
    const int64_t len = t / cp;
    const double first = static_cast<double>(len * (len + 1) / 2);
    const double last = first + static_cast<double>((cp - 1) * len * len);
    EXPECT_GT(last / first, 2.0) << "cp " << cp;
  }
}

// --- Training at cp against one process --------------------------------------------------

namespace {

struct CpLayout {
  const char* model;
  int64_t cp, dp, tp, pp;
  bool sp;
  int64_t zero;
  int64_t grad_accum;
  const char* checkpointing = "none";  // --activation-checkpointing: recomputes the ring
  std::string describe() const {
    return fmt::format("{} cp {} dp {} tp {}{} pp {} zero {} accum {} recompute {}", model, cp, dp,
                       tp, sp ? " sp" : "", pp, zero, grad_accum, checkpointing);
  }
};

void expect_layout_trains_like_one_process(
    const loom::testing::SharedTempDir& dir, const CpLayout& layout,
    std::map<std::string, loom::testing::RunResult>& single) {
  SCOPED_TRACE(layout.describe());
  auto config = loom::testing::tiny_layout_config(dir.path(), layout.model);
  config.grad_accum = layout.grad_accum;
  const auto key = fmt::format("{} {}", layout.model, layout.grad_accum);
  if (!single.count(key)) {
    train::Trainer t(config);
    single[key] = loom::testing::run(t);
  }
  config.cp = layout.cp;
  config.tp = layout.tp;
  config.pp = layout.pp;
  config.sequence_parallel = layout.sp;
  config.zero = layout.zero;
  config.activation_checkpointing = layout.checkpointing;
  train::Trainer t(config,
                   loom::testing::layout_mesh(
                       {.dp = layout.dp, .tp = layout.tp, .pp = layout.pp, .cp = layout.cp}));
  EXPECT_NE(t.runtime().find_strategy("context-parallel"), nullptr);
  const auto got = loom::testing::run(t);
  loom::testing::expect_same_run(got, single[key]);
}

}  // namespace

TEST(TrainerCp, CpTrainsLikeOneProcess) {
  const int64_t n = world().size();
  if (n != 2 && n != 4) GTEST_SKIP() << "runs at 2 and 4 ranks (cp 2, cp 4)";
  loom::testing::SharedTempDir dir;
  loom::testing::write_shared_corpus(dir, 30000, 4000);
  std::map<std::string, loom::testing::RunResult> single;
  for (const char* model : {"gpt2", "llama"})
    expect_layout_trains_like_one_process(
        dir, {model, n, 1, 1, 1, false, 0, model[0] == 'g' ? 2 : 1}, single);
}

TEST(TrainerCp, CpComposesWithDpTpPpAndZero) {
  if (world().size() != 4) GTEST_SKIP() << "runs at 4 ranks";
  loom::testing::SharedTempDir dir;
  loom::testing::write_shared_corpus(dir, 30000, 4000);
  std::map<std::string, loom::testing::RunResult> single;
  for (const auto& layout :
       {CpLayout{"llama", 2, 1, 2, 1, true, 0, 1, "selective"},
        CpLayout{"gpt2", 2, 2, 1, 1, false, 0, 1}, CpLayout{"gpt2", 2, 1, 2, 1, true, 0, 1},
        CpLayout{"gpt2", 2, 2, 1, 1, false, 3, 1, "full"},
        CpLayout{"llama", 2, 1, 1, 2, false, 0, 2}})
    expect_layout_trains_like_one_process(dir, layout, single);
}

TEST(TrainerCp, TheRingsWorkIsBalancedAndReported) {
  const int64_t n = world().size();
  if (n != 2) GTEST_SKIP() << "runs at 2 ranks";
  loom::testing::SharedTempDir dir;
  loom::testing::write_shared_corpus(dir, 30000, 4000);
  auto config = loom::testing::tiny_layout_config(dir.path(), "gpt2");
  config.cp = 2;
  config.steps = 1;
  train::Trainer t(config, loom::testing::layout_mesh({.dp = 1, .cp = 2}));
  t.train_step();
  const auto* group = t.runtime().context().find<ctx::ContextGroup>("context-parallel.group");
  ASSERT_NE(group, nullptr);
  const auto& m = t.model_config();
  // One forward per layer over the micro-batch (backward recomputes nothing here).
  EXPECT_EQ(group->stats().score_elements,
            ctx::causal_score_elements(config.seq_len, 2, group->rank()) * config.batch_size *
                m.n_heads * m.n_layers);
  // Forward: 1 block per layer; backward: 1 block and 1 gradient hop per layer.
  EXPECT_EQ(group->stats().messages, 3 * m.n_layers);
}

TEST(TrainerCp, LayoutsThatCannotBeAreClearErrors) {
  if (world().size() != 2) GTEST_SKIP() << "runs at 2 ranks";
  loom::testing::SharedTempDir dir;
  loom::testing::write_shared_corpus(dir, 30000, 4000);
  auto config = loom::testing::tiny_layout_config(dir.path(), "gpt2");
  config.cp = 2;
  config.seq_len = 30;
  auto msg = error_of([&] { config.validate(); });
  EXPECT_TRUE(contains(msg, "--seq-len 30 is not divisible by 4")) << msg;
  msg = error_of([&] { train::Trainer t(config, loom::testing::layout_mesh({.dp = 1, .cp = 2})); });
  EXPECT_TRUE(contains(msg, "--seq-len 30 is not divisible by 4")) << msg;
  config.seq_len = 32;
  {
    train::Trainer t(config, loom::testing::layout_mesh({.dp = 1, .cp = 2}));
    msg = error_of([&] { t.model().forward(at::zeros({1, 32}, at::kLong)); });
    EXPECT_TRUE(contains(msg, "forward() returns the whole logits")) << msg;
  }
  config.dropout = 0.1;
  msg = error_of([&] { train::Trainer t(config, loom::testing::layout_mesh({.dp = 1, .cp = 2})); });
  EXPECT_TRUE(contains(msg, "dropout (0.1) under context parallelism")) << msg;
  // cp that does not divide the world: refused before any collective.
  msg = error_of([&] { loom::testing::layout_mesh({.dp = 0, .cp = 3}); });
  EXPECT_TRUE(contains(msg, "does not divide the world of 2")) << msg;
}

TEST(TrainerCp, CheckpointsAtCpResumeAtAnotherLayout) {
  if (world().size() != 4) GTEST_SKIP() << "runs at 4 ranks";
  loom::testing::SharedTempDir dir;
  loom::testing::write_shared_corpus(dir, 30000, 4000);
  auto base = loom::testing::tiny_layout_config(dir.path(), "llama");
  base.steps = 4;
  base.lr_decay_steps = base.steps;  // the same schedule for a 2-step and a 4-step run
  loom::testing::RunResult reference;
  {
    train::Trainer t(base);
    reference = loom::testing::run(t);
  }
  // Saved by cp 2 x dp 2 under ZeRO-2 (the cp ranks share their dp shard: one writes it) and by
  // cp 2 x tp 2 (sharded model files), resumed at dp 4 (ZeRO-2) and at cp 4.
  struct Case {
    CpLayout saver, loader;
  };
  for (const auto& c :
       {Case{{"llama", 2, 2, 1, 1, false, 2, 1}, {"llama", 1, 4, 1, 1, false, 2, 1}},
        Case{{"llama", 2, 1, 2, 1, false, 0, 1}, {"llama", 4, 1, 1, 1, false, 0, 1}}}) {
    SCOPED_TRACE(c.saver.describe() + " -> " + c.loader.describe());
    auto apply = [&](const CpLayout& l, train::TrainConfig config) {
      config.cp = l.cp;
      config.tp = l.tp;
      config.pp = l.pp;
      config.zero = l.zero;
      return config;
    };
    auto mesh = [](const CpLayout& l) {
      return loom::testing::layout_mesh({.dp = l.dp, .tp = l.tp, .pp = l.pp, .cp = l.cp});
    };
    auto config = apply(c.saver, base);
    config.steps = 2;
    config.save_dir = (dir / fmt::format("saved_cp{}_tp{}", c.saver.cp, c.saver.tp)).string();
    {
      train::Trainer t(config, mesh(c.saver));
      t.fit();
    }
    auto resumed = apply(c.loader, base);
    resumed.resume = (fs::path(config.save_dir) / "step-00000002").string();
    train::Trainer t(resumed, mesh(c.loader));
    EXPECT_EQ(t.step(), 2);
    auto got = loom::testing::run(t);
    // The resumed run's losses are steps 3 and 4 of the reference.
    got.losses.insert(got.losses.begin(), reference.losses.begin(), reference.losses.begin() + 2);
    got.grad_norms.insert(got.grad_norms.begin(), reference.grad_norms.begin(),
                          reference.grad_norms.begin() + 2);
    loom::testing::expect_same_run(got, reference);
  }
}

TEST(TrainerCp, Bf16TracksOneProcess) {
  const int64_t n = world().size();
  if (n != 2) GTEST_SKIP() << "runs at 2 ranks";
  loom::testing::SharedTempDir dir;
  loom::testing::write_shared_corpus(dir, 30000, 4000);
  // bf16 under autocast (head_dim 32: the math path per block, which must compute forward and
  // backward in fp32 alike): the bounds of TrainerTp.Bf16TracksOneProcess.
  for (const char* model : {"gpt2", "llama"}) {
    SCOPED_TRACE(model);
    auto config = loom::testing::tiny_layout_config(dir.path(), model);
    config.precision = "bf16";
    loom::testing::RunResult single;
    {
      train::Trainer t(config);
      single = loom::testing::run(t);
    }
    config.cp = n;
    train::Trainer t(config, loom::testing::layout_mesh({.dp = 1, .cp = n}));
    loom::testing::expect_bf16_tracks(loom::testing::run(t), single,
                                      fmt::format("{} cp {}", model, n));
  }
}

TEST(TrainerCp, ACpThatDoesNotMatchTheMeshIsAClearError) {
  if (world().size() != 2) GTEST_SKIP() << "runs at 2 ranks";
  loom::testing::SharedTempDir dir;
  loom::testing::write_shared_corpus(dir, 30000, 4000);
  auto config = loom::testing::tiny_layout_config(dir.path(), "gpt2");
  config.cp = 2;
  auto msg = error_of([&] { train::Trainer t(config, loom::testing::layout_mesh({.dp = 2})); });
  EXPECT_TRUE(contains(msg, "--cp 2 does not match the mesh, whose context-parallel size is 1"))
      << msg;
  config.cp = 1;
  msg = error_of([&] { train::Trainer t(config, loom::testing::layout_mesh({.dp = 1, .cp = 2})); });
  EXPECT_TRUE(contains(msg, "--cp 1 does not match the mesh, whose context-parallel size is 2"))
      << msg;
}
