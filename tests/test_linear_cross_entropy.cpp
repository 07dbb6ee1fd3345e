// The head's product and the loss in chunks of rows (ops/linear_cross_entropy.h,
// CausalLM::set_loss_chunk_rows) on the CPU: against the loss over whole logits in fp64 for
// chunkings that divide the rows and ones that do not (loss, both gradients, ignored targets,
// padding rows, z-loss, the upstream gradient), per-row losses, forwards without gradient, bf16
// products under autocast within a derived bound of fp64, the errors; and whole GPT-2 / Llama
// models (tied and untied heads, multi-token heads, per-row losses) chunked against the math
// path in fp64.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <set>

#include "custom_model_util.h"
#include "loom/core/autocast.h"
#include "loom/core/error.h"
#include "loom/models/causal_lm.h"
#include "loom/ops/cross_entropy.h"
#include "loom/ops/cuda.h"
#include "loom/ops/linear_cross_entropy.h"
#include "loom/parallel/tensor/tp_group.h"
#include "model_test_util.h"
#include "test_util.h"

namespace {

using loom::testing::contains;
using loom::testing::error_of;
using loom::testing::max_rel_diff;
namespace ops = loom::ops;
namespace models = loom::models;

at::Tensor randn(std::vector<int64_t> shape, uint64_t seed, double scale = 1.0) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, g, at::kDouble) * scale;
}

// Targets over [0, vocab), rows 1 and 4 ignored.
at::Tensor make_targets(std::vector<int64_t> shape, int64_t vocab, uint64_t seed) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto t = at::randint(0, vocab, shape, g, at::kLong);
  t.view({-1})[1] = -100;
  t.view({-1})[4] = -100;
  return t;
}

struct LossAndGrads {
  at::Tensor loss, d_hidden, d_weight;
};

// Loss and gradients at (hidden, weight) times `upstream`: chunked (chunk_rows > 0) or the fused
// loss over the whole logits hidden · weightᵀ.
LossAndGrads run(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                 int64_t chunk_rows, const ops::LinearCrossEntropyOptions& base,
                 double upstream = 1.0) {
  auto h = hidden.clone().requires_grad_();
  auto w = weight.clone().requires_grad_();
  at::Tensor loss;
  if (chunk_rows > 0) {
    auto o = base;
    o.chunk_rows = chunk_rows;
    loss = ops::linear_cross_entropy(h, w, targets, o);
  } else {
    ops::FusedCrossEntropyOptions o;
    o.valid = base.valid;
    o.z_loss = base.z_loss;
    loss = ops::fused_cross_entropy(at::matmul(h, w.t()), targets, o);
  }
  (loss * upstream).backward();
  return {loss.detach(), h.grad(), w.grad()};
}

// fp64 sums of a few hundred terms in another order: ~1e-15 relative; bound 1e-12.
constexpr double kFp64Bound = 1e-12;

TEST(LinearCrossEntropy, Fp64EqualsTheLossOverWholeLogitsForEveryChunking) {
  // 51 rows of 24 features, a head of 100 rows of which 97 are vocabulary (3 padding rows).
  const auto hidden = randn({3, 17, 24}, 1);
  const auto weight = randn({100, 24}, 2, 0.5);
  const auto targets = make_targets({3, 17}, 97, 3);
  double worst = 0;
  for (const double z_loss : {0.0, 1e-3}) {
    ops::LinearCrossEntropyOptions o;
    o.valid = 97;
    o.z_loss = z_loss;
    const auto want = run(hidden, weight, targets, 0, o, 2.5);
    for (const int64_t chunk : {1, 7, 51, 1000}) {
      const auto got = run(hidden, weight, targets, chunk, o, 2.5);
      SCOPED_TRACE(fmt::format("chunk {} z {}", chunk, z_loss));
      EXPECT_EQ(got.loss.scalar_type(), at::kDouble);
      EXPECT_NEAR(got.loss.item<double>(), want.loss.item<double>(),
                  kFp64Bound * want.loss.item<double>());
      EXPECT_LE(max_rel_diff(got.d_hidden, want.d_hidden), kFp64Bound);
      EXPECT_LE(max_rel_diff(got.d_weight, want.d_weight), kFp64Bound);
      worst = std::max({worst, max_rel_diff(got.d_hidden, want.d_hidden),
                        max_rel_diff(got.d_weight, want.d_weight),
                        std::fabs(got.loss.item<double>() / want.loss.item<double>() - 1)});
      // Padding rows of the head get no gradient; ignored rows pass none to their hidden states.
      EXPECT_TRUE(at::equal(got.d_weight.narrow(0, 97, 3), at::zeros({3, 24}, at::kDouble)));
      EXPECT_TRUE(at::equal(got.d_hidden.view({-1, 24})[1], at::zeros({24}, at::kDouble)));
    }
  }
  if (std::getenv("LOOM_TEST_VERBOSE"))
    std::printf("chunked vs whole logits, fp64: worst relative %.3g\n", worst);
  // Against plain ATen math too (not only the fused loss): cross_entropy over the vocabulary rows.
  const auto plain =
      at::cross_entropy_loss(at::matmul(hidden, weight.narrow(0, 0, 97).t()).view({-1, 97}),
                             targets.view({-1}))
          .item<double>();
  ops::LinearCrossEntropyOptions o;
  o.valid = 97;
  o.chunk_rows = 10;
  EXPECT_NEAR(ops::linear_cross_entropy(hidden, weight, targets, o).item<double>(), plain,
              kFp64Bound * plain);
}

TEST(LinearCrossEntropy, RowLossesFrozenWeightsAndForwardsWithoutGradient) {
  const auto hidden = randn({20, 16}, 4);
  const auto weight = randn({40, 16}, 5, 0.5);
  const auto targets = make_targets({20}, 40, 6);
  ops::LinearCrossEntropyOptions o;
  o.chunk_rows = 6;
  o.z_loss = 1e-2;  // left out of the row losses
  at::Tensor rows;
  o.row_losses = &rows;
  {
    torch::NoGradGuard no_grad;
    const auto loss = ops::linear_cross_entropy(hidden, weight, targets, o);
    EXPECT_FALSE(loss.requires_grad());
  }
  const auto want =
      at::cross_entropy_loss(at::matmul(hidden, weight.t()), targets, {}, at::Reduction::None);
  ASSERT_EQ(rows.sizes(), targets.sizes());
  EXPECT_LE(max_rel_diff(rows, want), kFp64Bound);
  EXPECT_EQ(rows[1].item<double>(), 0.0);  // ignored

  // A frozen head: only the hidden states get a gradient, the same as with a trained head.
  o.row_losses = nullptr;
  auto h = hidden.clone().requires_grad_();
  ops::linear_cross_entropy(h, weight, targets, o).backward();
  const auto both = run(hidden, weight, targets, 6, o);
  EXPECT_LE(max_rel_diff(h.grad(), both.d_hidden), kFp64Bound);
}

// bf16 products: inputs rounded to bf16 (2^-9 each), fp32 accumulation, the logits rounded to
// bf16 (2^-9), so each logit errs by at most e = 3 * 2^-9 * sum_k |h_k| |w_k| (+ fp32 sums,
// 1%). The loss of a row moves by at most 2 max e (its log-sum-exp and its target's logit).
// The logits' gradient: its probabilities move by a factor exp(+-2e), then one bf16 rounding;
// d hidden = G W and d weight = Gᵀ H (each chunk's product rounded to bf16 before its fp32 sum)
// add three more roundings: |error| <= (|G| |W|) (2 (exp(2e) - 1) + 5 * 2^-9), likewise Gᵀ.
// Checked on `device` (the CPU's host reference, or CUDA's kernels) under bf16 autocast.
void check_bf16_within_rounding_of_fp64(at::Device device) {
  const auto hidden = randn({40, 32}, 7);
  const auto weight = randn({300, 32}, 8, 0.3);
  const auto targets = make_targets({40}, 300, 9);
  ops::LinearCrossEntropyOptions o;
  o.chunk_rows = 16;
  const auto exact = run(hidden, weight, targets, 0, o);
  LossAndGrads got;
  {
    loom::core::Bf16Autocast autocast(true, device.type());
    auto h = hidden.to(device, at::kFloat).requires_grad_();
    auto w = weight.to(device, at::kFloat).requires_grad_();
    EXPECT_EQ(ops::linear_cross_entropy_dtype(h, w), at::kBFloat16);
    got.loss = ops::linear_cross_entropy(h, w, targets.to(device), o);
    got.loss.backward();
    got.d_hidden = h.grad().cpu();
    got.d_weight = w.grad().cpu();
  }
  EXPECT_EQ(got.loss.scalar_type(), at::kFloat);
  EXPECT_EQ(got.d_hidden.scalar_type(), at::kFloat);
  EXPECT_EQ(got.d_weight.scalar_type(), at::kFloat);
  const double u = std::ldexp(1.0, -9);
  const double e = 3 * u * 1.01 * at::matmul(hidden.abs(), weight.abs().t()).max().item<double>();
  const double loss_error = std::fabs(got.loss.item<double>() - exact.loss.item<double>());
  EXPECT_LE(loss_error, 2 * e);
  // The exact logits' gradient G (mean over the 38 counted rows).
  auto x = at::matmul(hidden, weight.t()).requires_grad_();
  ops::fused_cross_entropy(x, targets).backward();
  const auto g = x.grad().abs();
  const double factor = 2 * std::expm1(2 * e) + 5 * u;
  const auto bound_h = at::matmul(g, weight.abs()) * factor;
  const auto bound_w = at::matmul(g.t(), hidden.abs()) * factor;
  const auto err_h = (got.d_hidden.to(at::kDouble) - exact.d_hidden).abs();
  const auto err_w = (got.d_weight.to(at::kDouble) - exact.d_weight).abs();
  EXPECT_TRUE((err_h <= bound_h).all().item<bool>());
  EXPECT_TRUE((err_w <= bound_w).all().item<bool>());
  if (std::getenv("LOOM_TEST_VERBOSE"))
    std::printf("bf16 chunked on %s: loss error %.3g (bound %.3g), gradients / bound %.3g, %.3g\n",
                device.str().c_str(), loss_error, 2 * e,
                (err_h / bound_h.clamp_min(1e-300)).max().item<double>(),
                (err_w / bound_w.clamp_min(1e-300)).max().item<double>());
}

TEST(LinearCrossEntropy, Bf16ProductsUnderAutocastAreWithinTheirRoundingOfFp64) {
  check_bf16_within_rounding_of_fp64(at::kCPU);
}

// The same on a GPU: cuBLAS's products and loom's cross-entropy kernels per chunk.
TEST(LinearCrossEntropyGpu, Bf16ProductsUnderAutocastAreWithinTheirRoundingOfFp64) {
  if (!ops::built_with_cuda() || ops::cuda_device_count() == 0)
    GTEST_SKIP() << "no CUDA device on this machine";
  check_bf16_within_rounding_of_fp64(at::Device(at::kCUDA, 0));
}

TEST(LinearCrossEntropy, BadInputIsNamed) {
  const auto hidden = randn({4, 8}, 1);
  const auto weight = randn({10, 8}, 2);
  const auto targets = at::zeros({4}, at::kLong);
  ops::LinearCrossEntropyOptions o;
  o.chunk_rows = 0;
  auto msg = error_of([&] { ops::linear_cross_entropy(hidden, weight, targets, o); });
  EXPECT_TRUE(contains(msg, "chunk_rows 0 must be > 0")) << msg;
  o.chunk_rows = 2;
  msg = error_of([&] { ops::linear_cross_entropy(hidden, randn({10, 7}, 2), targets, o); });
  EXPECT_TRUE(contains(msg, "do not fit")) << msg;
  msg = error_of([&] { ops::linear_cross_entropy(hidden, weight, at::zeros({5}, at::kLong), o); });
  EXPECT_TRUE(contains(msg, "targets [5]")) << msg;
  o.valid = 11;
  msg = error_of([&] { ops::linear_cross_entropy(hidden, weight, targets, o); });
  EXPECT_TRUE(contains(msg, "valid 11 columns exceed")) << msg;

  EXPECT_EQ(ops::parse_chunk_rows("auto"), ops::kAutoChunkRows);
  EXPECT_EQ(ops::parse_chunk_rows("off"), 0);
  EXPECT_EQ(ops::parse_chunk_rows("0"), 0);
  EXPECT_EQ(ops::parse_chunk_rows("4096"), 4096);
  for (const char* bad : {"lots", "-3", "12x", ""}) {
    msg = error_of([&] { ops::parse_chunk_rows(bad); });
    EXPECT_TRUE(contains(msg, fmt::format("--loss-chunk-rows '{}' is not valid", bad))) << msg;
  }
}

// --- Whole models: chunked against the math path, fp64 ------------------------------------

struct ChunkCase {
  models::Family family;
  bool tied;      // Llama: the head reuses the embedding (GPT-2's always does)
  int64_t mtp;    // multi-token heads
  int64_t pad;    // vocabulary padded to a multiple of this
  int64_t chunk;  // rows of logits a chunk
};

class ChunkedLossModel : public ::testing::TestWithParam<ChunkCase> {};

std::pair<at::Tensor, std::map<std::string, at::Tensor>> model_step(models::CausalLM& m,
                                                                    const at::Tensor& tokens,
                                                                    const at::Tensor& targets,
                                                                    bool chunked) {
  m.zero_grad();
  auto loss = m.loss(tokens, targets);
  // What ran is what was asked: the chunked node is in the graph exactly when chunking.
  bool found = false;
  std::vector<torch::autograd::Node*> todo{loss.grad_fn().get()};
  std::set<torch::autograd::Node*> seen;
  while (!todo.empty()) {
    auto* node = todo.back();
    todo.pop_back();
    if (node == nullptr || !seen.insert(node).second) continue;
    found = found || node->name().find("LinearCrossEntropy") != std::string::npos;
    for (const auto& edge : node->next_edges()) todo.push_back(edge.function.get());
  }
  EXPECT_EQ(found, chunked);
  loss.backward();
  std::map<std::string, at::Tensor> grads;
  for (const auto& item : m.named_parameters())
    if (item.value().grad().defined()) grads.emplace(item.key(), item.value().grad().clone());
  return {loss.detach(), grads};
}

TEST_P(ChunkedLossModel, LossEveryGradientAndRowLossesEqualTheMathPathInFp64) {
  const auto c = GetParam();
  auto config = loom::testing::tiny_model_config(c.family, 61);
  config.dropout = 0;
  config.mtp_heads = c.mtp;
  if (c.family == models::Family::kLlama) config.tie_embeddings = c.tied;
  auto tp = std::make_shared<loom::parallel::tensor::TpGroup>(
      nullptr, loom::parallel::tensor::TpOptions{false, c.pad});
  auto model = models::make_model(config, tp);
  models::init_parameters(*model, 3);
  model->to(at::kDouble);
  model->train();
  model->set_z_loss(1e-3);
  model->set_record_row_losses(true);
  auto g = at::make_generator<at::CPUGeneratorImpl>(11);
  const auto tokens = at::randint(0, config.vocab_size, {3, 16}, g, at::kLong);
  const auto targets = at::randint(0, config.vocab_size, {3, 16}, g, at::kLong);

  model->set_loss_backend(ops::LossBackend::kMath);
  model->set_loss_chunk_rows(0);
  const auto [want_loss, want] = model_step(*model, tokens, targets, false);
  const auto want_rows = model->take_row_losses();
  model->set_loss_backend(ops::LossBackend::kAuto);  // chunks run the fused passes
  model->set_loss_chunk_rows(c.chunk);
  EXPECT_EQ(model->resolved_loss_chunk_rows(48, at::kCPU), c.chunk);
  const auto [loss, got] = model_step(*model, tokens, targets, true);
  const auto rows = model->take_row_losses();
  // One forward and backward of a small model in another order of sums: ~1e-15; bound 1e-11
  // (docs/testing.md).
  EXPECT_NEAR(loss.item<double>(), want_loss.item<double>(), 1e-11 * want_loss.item<double>());
  ASSERT_EQ(got.size(), want.size());
  double worst = 0;
  for (const auto& [name, grad] : want) {
    const double rel = max_rel_diff(got.at(name), grad);
    EXPECT_LE(rel, 1e-11) << name;
    worst = std::max(worst, rel);
  }
  ASSERT_EQ(rows.size(), 1u);
  ASSERT_EQ(want_rows.size(), 1u);
  EXPECT_LE(max_rel_diff(rows[0].sums, want_rows[0].sums), 1e-11);
  if (std::getenv("LOOM_TEST_VERBOSE"))
    std::printf("chunked vs whole: worst relative gradient %.3g\n", worst);
  // Evaluation: the cross-entropy alone, as over whole logits.
  model->eval();
  torch::NoGradGuard no_grad;
  const double ce = model->loss(tokens, targets).item<double>();
  model->set_loss_chunk_rows(0);
  EXPECT_NEAR(ce, model->loss(tokens, targets).item<double>(), 1e-11 * ce);
}

INSTANTIATE_TEST_SUITE_P(Families, ChunkedLossModel,
                         ::testing::Values(ChunkCase{models::Family::kGpt2, true, 0, 1, 7},
                                           ChunkCase{models::Family::kGpt2, true, 1, 64, 48},
                                           ChunkCase{models::Family::kLlama, false, 0, 64, 5},
                                           ChunkCase{models::Family::kLlama, true, 1, 1, 16}),
                         [](const ::testing::TestParamInfo<ChunkCase>& info) {
                           const auto& c = info.param;
                           return fmt::format("{}_{}_mtp{}_pad{}_chunk{}",
                                              models::to_string(c.family),
                                              c.tied ? "tied" : "untied", c.mtp, c.pad, c.chunk);
                         });

TEST(ChunkedLossModel, AutoChunksOnlyLargeLogitsAndCustomHeadsAreRefused) {
  auto model =
      loom::testing::make_initialized(loom::testing::tiny_model_config(models::Family::kGpt2));
  EXPECT_EQ(model->loss_chunk_rows(), models::CausalLM::kAutoLossChunks);
  // 61 fp32 columns = 244 bytes a row: whole logits up to 2 GiB, then 1 GiB chunks.
  const int64_t row_bytes = 61 * 4;
  EXPECT_EQ(model->resolved_loss_chunk_rows((int64_t{2} << 30) / row_bytes, at::kCPU), 0);
  EXPECT_EQ(model->resolved_loss_chunk_rows((int64_t{2} << 30) / row_bytes + 1, at::kCPU),
            (int64_t{1} << 30) / row_bytes);
  {
    // bf16 products under autocast: half the bytes a row.
    loom::core::Bf16Autocast autocast(true, at::kCPU);
    EXPECT_EQ(model->resolved_loss_chunk_rows((int64_t{2} << 30) / row_bytes + 1, at::kCPU), 0);
  }
  auto msg = error_of([&] { model->set_loss_chunk_rows(-2); });
  EXPECT_TRUE(contains(msg, "loss chunk rows -2 is not valid")) << msg;
  model->set_loss_chunk_rows(0);
  EXPECT_EQ(model->resolved_loss_chunk_rows(int64_t{1} << 40, at::kCPU), 0);
  // The math loss backend: auto keeps whole logits, a number of rows is refused by name.
  model->set_loss_backend(ops::LossBackend::kMath);
  model->set_loss_chunk_rows(models::CausalLM::kAutoLossChunks);
  EXPECT_EQ(model->resolved_loss_chunk_rows(int64_t{1} << 40, at::kCPU), 0);
  model->set_loss_chunk_rows(64);
  msg = error_of([&] { model->resolved_loss_chunk_rows(100, at::kCPU); });
  EXPECT_TRUE(contains(msg, "the loss backend is 'math'")) << msg;
  // A custom model's head is its own: auto keeps whole logits, a number of rows is refused.
  auto custom = loom::testing::plain_lm()(nullptr);
  EXPECT_EQ(custom->resolved_loss_chunk_rows(int64_t{1} << 40, at::kCPU), 0);
  msg = error_of([&] { custom->set_loss_chunk_rows(64); });
  EXPECT_TRUE(contains(msg, "custom model's head is its own")) << msg;
}

}  // namespace
