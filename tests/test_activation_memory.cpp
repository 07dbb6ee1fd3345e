// Activation memory in the models: checkpointing (none, selective, full), block wrappers and
// activation offload: the same loss and gradients as a plain step, under bf16 autocast too, and
// the memory they are for (the GPU offload test skips without a device).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <string>

#include "loom/core/autocast.h"
#include "loom/core/memory.h"
#include "loom/core/rng.h"
#include "loom/models/causal_lm.h"
#include "loom/ops/cuda.h"
#include "loom/parallel/memory/activation_checkpoint.h"
#include "model_test_util.h"
#include "test_util.h"

using loom::testing::BothFamilies;
using loom::testing::contains;
using loom::testing::error_of;
using loom::testing::max_rel_diff;
namespace models = loom::models;

namespace {

models::ModelConfig tiny(models::Family family) {
  return loom::testing::tiny_model_config(family);
}

std::shared_ptr<models::CausalLM> make(const models::ModelConfig& c, uint64_t seed = 1) {
  return loom::testing::make_initialized(c, seed);
}

using loom::parallel::memory::checkpoint;
using models::ActivationCheckpointing;

// One training step's loss and parameter gradients, and the dropout stream's position after
// backward (where it was left).
struct StepResult {
  at::Tensor loss;
  std::map<std::string, at::Tensor> grads;
  loom::ops::DropoutPosition after_backward;
};

StepResult train_step(const models::ModelConfig& c, ActivationCheckpointing mode, bool bf16,
                      std::shared_ptr<loom::parallel::memory::ActivationOffloader> offload = {}) {
  auto m = make(c, 7);
  m->set_activation_checkpointing(mode);
  m->set_activation_offload(offload);
  EXPECT_EQ(m->activation_checkpointing(), mode);
  m->tp().dropout().reseed(123);
  m->tp().dropout().set_micro_batch(3, 5);
  auto tokens = at::randint(0, c.vocab_size, {3, 16}, loom::core::make_generator(1));
  auto targets = at::randint(0, c.vocab_size, {3, 16}, loom::core::make_generator(2));
  StepResult r;
  {
    loom::core::Bf16Autocast autocast(bf16, at::kCPU);
    r.loss = m->loss(tokens, targets);
  }
  // What a pipeline does between a micro-batch's forward and its backward: other micro-batches'
  // forwards, at other positions. A recompute must use the forward's.
  m->tp().dropout().set_micro_batch(3, 17);
  r.loss.backward();
  for (const auto& item : m->named_parameters()) {
    EXPECT_TRUE(item.value().grad().defined()) << item.key();
    r.grads.emplace(item.key(), item.value().grad().clone());
  }
  r.after_backward = m->tp().dropout().position();
  return r;
}

// The largest relative difference (to the reference's largest magnitude) over all gradients.
double max_grad_rel_diff(const StepResult& a, const StepResult& reference) {
  double worst = 0;
  for (const auto& [name, g] : reference.grads)
    worst = std::max(worst, max_rel_diff(a.grads.at(name), g));
  return worst;
}

}  // namespace

TEST(ActivationCheckpoint, GivesThePlainFunctionsInputAndParameterGradients) {
  auto gen = loom::core::make_generator(5);
  auto w = at::randn({6, 6}, gen).requires_grad_();  // a parameter the function captures
  auto bias = at::randn({6}, gen);                   // a captured constant (no gradient)
  auto x = at::randn({4, 6}, gen).requires_grad_();
  auto y = at::randn({6}, gen).requires_grad_();
  auto ids = at::tensor(std::vector<int64_t>{2, 0, 3});  // integer input: no gradient
  auto weights = at::randn({3, 6}, gen);
  auto dropout_gen = loom::core::make_generator(9);
  // Input 2 is undefined (an optional argument left out).
  auto fn = [w, bias, dropout_gen](const std::vector<at::Tensor>& in) {
    EXPECT_FALSE(in[2].defined());
    auto h = at::tanh(at::matmul(in[0].index_select(0, in[1]), w) + bias) * in[3];
    return h * at::empty(h.sizes()).bernoulli_(0.7, dropout_gen);
  };
  const std::vector<at::Tensor> inputs{x, ids, at::Tensor(), y};
  // Each run: forward, a draw by code after it, backward, a draw after backward.
  auto run = [&](bool checkpointed) {
    dropout_gen.set_current_seed(4);
    for (auto* t : {&w, &x, &y})
      if (t->grad().defined()) t->mutable_grad().reset();
    auto out = checkpointed ? checkpoint(fn, inputs, {.generators = {dropout_gen}}) : fn(inputs);
    auto after_forward = at::empty({5}).uniform_(0, 1, dropout_gen);
    (out * weights).sum().backward();
    auto after_backward = at::empty({5}).uniform_(0, 1, dropout_gen);
    return std::vector<at::Tensor>{out.detach(),     x.grad().clone(), y.grad().clone(),
                                   w.grad().clone(), after_forward,    after_backward};
  };
  const auto plain = run(false), checkpointed = run(true);
  const char* what[] = {
      "output", "x grad", "y grad", "w grad", "draws after forward", "draws after backward"};
  for (size_t i = 0; i < plain.size(); ++i)
    EXPECT_TRUE(at::equal(checkpointed[i], plain[i])) << what[i];

  // No input needs a gradient: the captured parameter still gets its own.
  w.mutable_grad().reset();
  dropout_gen.set_current_seed(4);
  auto out =
      checkpoint(fn, {x.detach(), ids, at::Tensor(), y.detach()}, {.generators = {dropout_gen}});
  ASSERT_TRUE(out.requires_grad());
  (out * weights).sum().backward();
  EXPECT_TRUE(at::equal(w.grad(), plain[3]));

  // Grad mode off: just the function, no graph.
  {
    torch::NoGradGuard no_grad;
    dropout_gen.set_current_seed(4);
    auto direct = checkpoint(fn, inputs, {.generators = {dropout_gen}});
    EXPECT_FALSE(direct.requires_grad());
    EXPECT_TRUE(at::equal(direct, plain[0]));
  }

  // torch::autograd::grad cannot see the parameters' gradients: refused, not silently wrong.
  auto again = checkpoint(fn, inputs, {.generators = {dropout_gen}});
  auto msg = error_of<std::exception>([&] { torch::autograd::grad({again.sum()}, {x}); });
  EXPECT_TRUE(contains(msg, "supports .backward() only")) << msg;
}

// Autocast is thread-local and backward runs outside the autocast region: the recompute must run
// under the autocast state forward had, or its activations (and gradients) would be fp32 ones.
// And a weight used by the checkpointed function and again after it in the same autocast region
// keeps its history there (a cast of it cached during the no-grad forward would have none).
TEST(ActivationCheckpoint, RecomputesUnderTheForwardsAutocastState) {
  auto gen = loom::core::make_generator(6);
  auto w = at::randn({16, 16}, gen).requires_grad_();
  auto x = at::randn({8, 16}, gen).requires_grad_();
  auto fn = [w](const std::vector<at::Tensor>& in) { return at::gelu(at::matmul(in[0], w)); };
  auto run = [&](bool checkpointed) {
    for (auto* t : {&w, &x})
      if (t->grad().defined()) t->mutable_grad().reset();
    at::Tensor out;
    {
      loom::core::Bf16Autocast autocast(true, at::kCPU);
      out = checkpointed ? checkpoint(fn, {x}) : fn({x});
    }
    EXPECT_EQ(out.scalar_type(), at::kBFloat16);
    out.to(at::kFloat).pow(2).sum().backward();
    return std::make_pair(x.grad().clone(), w.grad().clone());
  };
  const auto plain = run(false), checkpointed = run(true);
  EXPECT_TRUE(at::equal(checkpointed.first, plain.first));
  EXPECT_TRUE(at::equal(checkpointed.second, plain.second));

  {
    loom::core::Bf16Autocast autocast(true, at::kCPU);
    auto first_use = checkpoint(fn, {x});
    auto second_use = at::matmul(x.detach(), w);
    EXPECT_EQ(second_use.scalar_type(), at::kBFloat16);
    EXPECT_TRUE(second_use.requires_grad());
  }
  // The recompute (in backward, outside any autocast region) caches no cast: after the weight
  // changes (an optimizer step), the next forward under autocast reads the new weight.
  at::Tensor out;
  {
    loom::core::Bf16Autocast autocast(true, at::kCPU);
    out = checkpoint(fn, {x});
  }
  out.to(at::kFloat).sum().backward();
  {
    torch::NoGradGuard no_grad;
    w.mul_(2.0);
  }
  at::Tensor next, fresh;
  {
    loom::core::Bf16Autocast autocast(true, at::kCPU);
    next = fn({x});
  }
  {
    at::autocast::clear_cache();
    loom::core::Bf16Autocast autocast(true, at::kCPU);
    fresh = fn({x});
  }
  EXPECT_TRUE(at::equal(next, fresh)) << "a stale bf16 copy of the weight was used";
}

TEST(Models, ActivationCheckpointingModesAreParsedAndNamed) {
  for (auto mode : {ActivationCheckpointing::kNone, ActivationCheckpointing::kFull,
                    ActivationCheckpointing::kSelective})
    EXPECT_EQ(models::parse_activation_checkpointing(models::to_string(mode)), mode);
  auto msg = error_of([] { models::parse_activation_checkpointing("everything"); });
  EXPECT_TRUE(contains(msg, "'everything'") && contains(msg, "none, full, selective")) << msg;
}

// Recomputing changes no number: the same loss and gradients as keeping everything (fp32), with
// dropout too (the recompute runs at the forward's dropout position, and leaves the stream where
// kNone leaves it).
TEST_P(BothFamilies, ActivationCheckpointingKeepsLossAndGradients) {
  for (const double dropout : {0.0, 0.1}) {
    auto c = tiny(GetParam());
    c.dropout = dropout;
    const auto reference = train_step(c, ActivationCheckpointing::kNone, false);
    for (auto mode : {ActivationCheckpointing::kFull, ActivationCheckpointing::kSelective}) {
      const auto r = train_step(c, mode, false);
      const auto label = models::to_string(mode) + ", dropout " + std::to_string(dropout);
      EXPECT_TRUE(at::equal(r.loss, reference.loss)) << label;
      EXPECT_LE(max_grad_rel_diff(r, reference), 1e-6) << label;
      EXPECT_EQ(r.after_backward.first_sample, 17) << label;
      EXPECT_EQ(r.after_backward.step, reference.after_backward.step) << label;
    }
  }
}

// Under CPU bf16 autocast, compared with kNone under the same autocast (not with fp32: bf16's
// rounding would dominate). The recompute runs under the autocast state forward had, so it
// repeats the same bf16 casts and products and the results agree to fp32 accumulation order
// (measured: bitwise; a recompute in fp32 instead fails this test).
TEST_P(BothFamilies, ActivationCheckpointingUnderBf16AutocastTracksBf16) {
  auto c = tiny(GetParam());
  c.dropout = 0.1;
  const auto reference = train_step(c, ActivationCheckpointing::kNone, true);
  for (auto mode : {ActivationCheckpointing::kFull, ActivationCheckpointing::kSelective}) {
    const auto r = train_step(c, mode, true);
    EXPECT_TRUE(at::equal(r.loss, reference.loss)) << models::to_string(mode);
    EXPECT_LE(max_grad_rel_diff(r, reference), 1e-6) << models::to_string(mode);
  }
}

TEST_P(BothFamilies, BlocksAreNamedAsTheirParameters) {
  auto m = make(tiny(GetParam()));
  const auto blocks = m->blocks();
  ASSERT_EQ(static_cast<int64_t>(blocks.size()), m->config().n_layers);
  const std::string prefix =
      GetParam() == models::Family::kGpt2 ? "transformer.h." : "model.layers.";
  auto params = m->named_parameters();
  for (size_t i = 0; i < blocks.size(); ++i) {
    EXPECT_EQ(blocks[i].first, prefix + std::to_string(i));
    const auto block_params = blocks[i].second->named_parameters();
    EXPECT_GT(block_params.size(), 0u);
    for (const auto& item : block_params) {
      const auto* in_model = params.find(blocks[i].first + "." + item.key());
      ASSERT_NE(in_model, nullptr) << blocks[i].first << "." << item.key();
      EXPECT_TRUE(in_model->is_same(item.value())) << item.key();
    }
  }
}

// Wrappers run once per layer per forward, in order, nested first-added innermost, and what they
// return is what the next layer gets. With kFull they sit outside the checkpoint: they see a
// checkpointed block and are not called again by the recompute in backward.
TEST_P(BothFamilies, BlockWrappersNestInOrderAndComposeWithFullCheckpointing) {
  auto c = tiny(GetParam());
  auto tokens = at::randint(0, c.vocab_size, {2, 12}, loom::core::make_generator(1));
  auto targets = at::randint(0, c.vocab_size, {2, 12}, loom::core::make_generator(2));
  std::vector<std::string> calls;
  auto step = [&](ActivationCheckpointing mode, bool wrapped) {
    auto m = make(c, 3);
    m->set_activation_checkpointing(mode);
    if (wrapped) {
      m->add_block_wrapper([&](int64_t layer, const at::Tensor& x, const auto& run) {
        calls.push_back(fmt::format("inner {}", layer));
        auto out = run(x);
        const bool checkpointed = out.grad_fn() && contains(out.grad_fn()->name(), "Checkpoint");
        EXPECT_EQ(checkpointed, mode == ActivationCheckpointing::kFull);
        return layer == 0 ? out * 0.5 : out;  // what the next layer (or the head) gets
      });
      m->add_block_wrapper([&](int64_t layer, const at::Tensor& x, const auto& run) {
        calls.push_back(fmt::format("outer {}", layer));
        return run(x);
      });
    }
    calls.clear();
    auto loss = m->loss(tokens, targets);
    loss.backward();
    std::map<std::string, at::Tensor> grads;
    for (const auto& item : m->named_parameters()) grads.emplace(item.key(), item.value().grad());
    return std::make_pair(loss.detach(), grads);
  };
  const auto plain = step(ActivationCheckpointing::kNone, false);
  const auto wrapped = step(ActivationCheckpointing::kNone, true);
  const std::vector<std::string> expected{"outer 0", "inner 0", "outer 1", "inner 1"};
  EXPECT_EQ(calls, expected);
  EXPECT_FALSE(at::equal(wrapped.first, plain.first));  // the halving took effect
  const auto checkpointed = step(ActivationCheckpointing::kFull, true);
  EXPECT_EQ(calls, expected);  // backward's recompute did not call them again
  EXPECT_TRUE(at::equal(checkpointed.first, wrapped.first));
  for (const auto& [name, g] : wrapped.second)
    EXPECT_LE(max_rel_diff(checkpointed.second.at(name), g), 1e-6) << name;
}

// kFull keeps one [batch, seq, d_model] input per block instead of every activation inside it:
// the peak of allocated bytes during forward drops well below kNone's (measured: 28%).
TEST(ActivationOffload, TicketsRoundTripAndTheHostEmpties) {
  loom::parallel::memory::ActivationOffloader offload;
  const auto a = at::randn({4, 8}), b = at::randn({3});
  const auto ta = offload.offload(a), tb = offload.offload(b);
  EXPECT_EQ(tb, ta + 1);  // tickets in call order: what prefetching one block back relies on
  auto s = offload.stats();
  EXPECT_EQ(s.offloaded, 2);
  EXPECT_EQ(s.host_bytes, (32 + 3) * 4);
  offload.prefetch(ta);
  offload.prefetch(ta);  // twice: once
  EXPECT_TRUE(at::equal(offload.fetch(tb), b));
  EXPECT_TRUE(at::equal(offload.fetch(ta), a));
  s = offload.stats();
  EXPECT_EQ(s.fetched, 2);
  EXPECT_EQ(s.prefetched, 1);
  EXPECT_EQ(s.host_bytes, 0);
  EXPECT_EQ(s.peak_host_bytes, (32 + 3) * 4);
  EXPECT_TRUE(loom::testing::contains(loom::testing::error_of([&] { offload.fetch(ta); }),
                                      "was never issued or was fetched already"));
}

TEST_P(BothFamilies, ActivationOffloadKeepsGradientsAndPrefetchesBlockByBlock) {
  auto c = tiny(GetParam());
  c.n_layers = 3;
  c.dropout = 0.1;
  const auto reference = train_step(c, ActivationCheckpointing::kNone, false);
  auto offload = std::make_shared<loom::parallel::memory::ActivationOffloader>();
  const auto r = train_step(c, ActivationCheckpointing::kFull, false, offload);
  EXPECT_TRUE(at::equal(r.loss, reference.loss));
  EXPECT_LE(max_grad_rel_diff(r, reference), 1e-6);
  const auto s = offload->stats();
  EXPECT_EQ(s.offloaded, c.n_layers);  // one saved input per block
  EXPECT_EQ(s.fetched, c.n_layers);
  EXPECT_EQ(s.prefetched, c.n_layers - 1);  // every block but the last one backward reaches
  EXPECT_EQ(s.host_bytes, 0);
  EXPECT_EQ(s.peak_host_bytes, c.n_layers * 3 * 16 * c.d_model * 4);  // [3, 16, d] fp32 each
  // Offload needs full checkpointing, in either order of the calls.
  auto m = make(c);
  EXPECT_TRUE(
      loom::testing::contains(loom::testing::error_of([&] { m->set_activation_offload(offload); }),
                              "needs activation checkpointing 'full'"));
  m->set_activation_checkpointing(ActivationCheckpointing::kFull);
  m->set_activation_offload(offload);
  EXPECT_TRUE(loom::testing::contains(loom::testing::error_of([&] {
                                        m->set_activation_checkpointing(
                                            ActivationCheckpointing::kSelective);
                                      }),
                                      "turn offload off first"));
}

TEST(Models, FullActivationCheckpointingLowersThePeakMemoryOfForward) {
  auto c = tiny(models::Family::kGpt2);
  c.n_layers = 4;
  auto tokens = at::randint(0, c.vocab_size, {4, 32}, loom::core::make_generator(1));
  auto targets = at::randint(0, c.vocab_size, {4, 32}, loom::core::make_generator(2));
  loom::core::install_memory_tracking();
  auto forward_peak = [&](ActivationCheckpointing mode) {
    auto m = make(c);
    m->set_activation_checkpointing(mode);
    const int64_t before = loom::core::memory_counters().current_bytes;
    loom::core::reset_peak_memory();
    auto loss = m->loss(tokens, targets);
    const int64_t peak = loom::core::memory_counters().peak_bytes - before;
    loss.backward();  // still works, and its gradients are checked by the tests above
    return peak;
  };
  const int64_t none = forward_peak(ActivationCheckpointing::kNone);
  const int64_t full = forward_peak(ActivationCheckpointing::kFull);
  EXPECT_LT(full, none / 2) << "kFull " << full << " bytes, kNone " << none << " bytes";
  // With attention dropout the [batch, heads, seq, seq] probabilities and masks dominate, and
  // kSelective stops keeping them (measured: 63% of kNone's peak).
  c.dropout = 0.1;
  const int64_t none_dropout = forward_peak(ActivationCheckpointing::kNone);
  const int64_t selective_dropout = forward_peak(ActivationCheckpointing::kSelective);
  EXPECT_LT(selective_dropout, none_dropout * 4 / 5)
      << "kSelective " << selective_dropout << " bytes, kNone " << none_dropout << " bytes";
}


// GPU-only: skipped with a message where no CUDA device exists (CI and the dev machines).
TEST(Cuda, KernelsLaunchWhereADeviceExists) {
  if (!loom::ops::built_with_cuda()) GTEST_SKIP() << "built without LOOM_WITH_CUDA";
  if (loom::ops::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device on this machine";
  EXPECT_TRUE(loom::ops::cuda_smoke_test(0));
}

// GPU-only (skipped with a message where no CUDA device exists): what activation offload is
// for. After a forward with full checkpointing, the device holds every block's input; with
// offload those inputs wait in pinned host memory, so the device holds about that much less,
// and backward (prefetching each input back on a side stream) gives the same gradients.
TEST(Cuda, ActivationOffloadMovesBlockInputsOffTheDevice) {
  if (!loom::ops::built_with_cuda()) GTEST_SKIP() << "built without LOOM_WITH_CUDA";
  if (loom::ops::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device on this machine";
  auto c = tiny(models::Family::kGpt2);
  c.n_layers = 8;
  c.max_seq_len = 128;
  const at::Device cuda(at::kCUDA, 0);
  auto tokens = at::randint(0, c.vocab_size, {8, 128}, loom::core::make_generator(1)).to(cuda);
  auto targets = at::randint(0, c.vocab_size, {8, 128}, loom::core::make_generator(2)).to(cuda);
  const int64_t input_bytes = 8 * 128 * c.d_model * 4;
  struct Outcome {
    int64_t held_after_forward;
    std::map<std::string, at::Tensor> grads;
  };
  auto run = [&](bool offload) {
    auto m = make(c, 7);
    m->to(cuda);
    m->set_activation_checkpointing(ActivationCheckpointing::kFull);
    if (offload)
      m->set_activation_offload(std::make_shared<loom::parallel::memory::ActivationOffloader>());
    torch::cuda::synchronize();
    const int64_t before = loom::core::memory_counters(cuda).current_bytes;
    auto loss = m->loss(tokens, targets);
    torch::cuda::synchronize();
    at::empty({1}, at::TensorOptions(cuda));  // lets the allocator retire side-stream frees
    Outcome o{loom::core::memory_counters(cuda).current_bytes - before, {}};
    loss.backward();
    for (const auto& item : m->named_parameters())
      o.grads.emplace(item.key(), item.value().grad().cpu());
    return o;
  };
  const auto kept = run(false), offloaded = run(true);
  EXPECT_LT(offloaded.held_after_forward, kept.held_after_forward - c.n_layers * input_bytes / 2)
      << "kept " << kept.held_after_forward << " B, offloaded " << offloaded.held_after_forward
      << " B, block inputs " << c.n_layers * input_bytes << " B";
  for (const auto& [name, g] : kept.grads)
    EXPECT_LE(max_rel_diff(offloaded.grads.at(name), g), 1e-6) << name;
}
