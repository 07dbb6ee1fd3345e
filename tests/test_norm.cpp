// The fused residual add + norm (ops/norm.h): its host reference in fp64 against ATen's math
// (values and every gradient), the bf16 output under autocast, unused outputs, refusals; and
// whole models with every fused path on (norms, loss, SwiGLU) against the unfused ones in fp64.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <set>

#include "loom/core/autocast.h"
#include "loom/core/error.h"
#include "loom/models/causal_lm.h"
#include "loom/ops/cuda.h"
#include "loom/ops/norm.h"
#include "loom/parallel/tensor/tp_group.h"
#include "model_test_util.h"
#include "test_util.h"

namespace {

using loom::testing::contains;
using loom::testing::error_of;
using loom::testing::max_rel_diff;
namespace ops = loom::ops;
namespace models = loom::models;

at::Tensor randn(std::vector<int64_t> shape, uint64_t seed, double mean = 0, double scale = 1) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, g, at::kDouble) * scale + mean;
}

struct NormCase {
  ops::NormKind kind;
  bool bias, branch;
  int64_t width;
};

// Outputs and the gradients of residual, branch, weight, bias for one random upstream gradient
// of each output.
struct Results {
  at::Tensor sum, normed, g_residual, g_branch, g_weight, g_bias;
};

Results run(const NormCase& c, bool fused, at::ScalarType dtype = at::kDouble) {
  const std::vector<int64_t> shape{3, 5, c.width};
  auto residual = randn(shape, 1, 0.4).to(dtype).requires_grad_();
  auto branch = c.branch ? randn(shape, 2, 0, 0.5).to(dtype).requires_grad_() : at::Tensor();
  auto weight = randn({c.width}, 3, 1, 0.2).to(dtype).requires_grad_();
  auto bias = c.bias ? randn({c.width}, 4, 0, 0.1).to(dtype).requires_grad_() : at::Tensor();
  const ops::NormParams p{c.kind, weight, bias, 1e-5};
  const auto out =
      fused ? ops::fused_add_norm(residual, branch, p) : ops::math_add_norm(residual, branch, p);
  // Both outputs feed the loss, as in a block (the sum goes on down the residual stream).
  auto loss = (out.normed * randn(shape, 5).to(dtype)).sum();
  if (c.branch) loss = loss + (out.sum * randn(shape, 6).to(dtype)).sum();
  loss.backward();
  return {out.sum.detach(), out.normed.detach(),
          residual.grad(),  c.branch ? branch.grad() : at::Tensor(),
          weight.grad(),    c.bias ? bias.grad() : at::Tensor()};
}

// fp64 sums of at most a few hundred terms: ~1e-15 relative; bound 1e-12.
constexpr double kFp64Bound = 1e-12;

TEST(FusedNorm, Fp64HostReferenceEqualsAtenMathWithEveryGradient) {
  for (const auto& c : {NormCase{ops::NormKind::kLayerNorm, true, true, 100},
                        NormCase{ops::NormKind::kLayerNorm, true, false, 33},
                        NormCase{ops::NormKind::kLayerNorm, false, true, 17},
                        NormCase{ops::NormKind::kRmsNorm, false, true, 64},
                        NormCase{ops::NormKind::kRmsNorm, false, false, 3}}) {
    const auto what = ::testing::Message()
                      << (c.kind == ops::NormKind::kLayerNorm ? "LayerNorm" : "RMSNorm")
                      << " width " << c.width << (c.bias ? " bias" : "")
                      << (c.branch ? " branch" : "");
    const auto want = run(c, false), got = run(c, true);
    double worst = 0;
    const auto check = [&](const at::Tensor& a, const at::Tensor& b, const char* name) {
      ASSERT_EQ(a.defined(), b.defined()) << what << " " << name;
      if (!a.defined()) return;
      ASSERT_EQ(a.scalar_type(), b.scalar_type()) << what << " " << name;
      const double rel = max_rel_diff(a, b);
      EXPECT_LE(rel, kFp64Bound) << what << " " << name;
      worst = std::max(worst, rel);
    };
    check(got.sum, want.sum, "sum");
    check(got.normed, want.normed, "normed");
    check(got.g_residual, want.g_residual, "residual grad");
    check(got.g_branch, want.g_branch, "branch grad");
    check(got.g_weight, want.g_weight, "weight grad");
    check(got.g_bias, want.g_bias, "bias grad");
    if (std::getenv("LOOM_TEST_VERBOSE")) std::printf("worst relative %.3g\n", worst);
  }
}

TEST(FusedNorm, Bf16OutputUnderAutocastIsTheRoundedFp32Norm) {
  // Under autocast the fused op writes the normed activation in bf16 (what the next matrix
  // product reads); the math path gives fp32 that autocast rounds at that product. The two agree
  // within one bf16 rounding plus the fp32 error of the statistics.
  const int64_t width = 96;
  const auto residual = randn({4, 7, width}, 11, 0.3).to(at::kFloat);
  const auto branch = randn({4, 7, width}, 12, 0, 0.5).to(at::kBFloat16);
  const auto weight = randn({width}, 13, 1, 0.2).to(at::kFloat);
  const auto bias = randn({width}, 14, 0, 0.1).to(at::kFloat);
  const ops::NormParams p{ops::NormKind::kLayerNorm, weight, bias, 1e-5};
  const loom::core::Bf16Autocast autocast(true, at::kCPU);
  const auto fused = ops::fused_add_norm(residual, branch, p);
  EXPECT_EQ(fused.normed.scalar_type(), at::kBFloat16);
  EXPECT_EQ(fused.sum.scalar_type(), at::kFloat);
  EXPECT_EQ(ops::normed_dtype(residual, at::Tensor()), at::kBFloat16);
  const auto exact =
      ops::math_add_norm(residual.to(at::kDouble), branch.to(at::kDouble),
                         {p.kind, weight.to(at::kDouble), bias.to(at::kDouble), 1e-5});
  // The sum is the fp32 add, rounded once, as ATen's.
  EXPECT_TRUE(at::equal(fused.sum, residual + branch.to(at::kFloat)));
  // bf16 rounding (2^-8 relative) plus fp32 statistics over 96 values (< 2^-16 of the scale).
  const auto err = (fused.normed.to(at::kDouble) - exact.normed).abs();
  const auto bound = exact.normed.abs() * std::ldexp(1.0, -8) * 1.01 + std::ldexp(1.0, -16) * 4;
  EXPECT_TRUE(at::all(err <= bound).item<bool>()) << "worst " << (err - bound).max().item<double>();
}

TEST(FusedNorm, AnUnusedOutputPassesTheOtherGradientThrough) {
  const int64_t width = 40;
  for (const bool use_sum : {true, false}) {
    auto residual = randn({6, width}, 21).requires_grad_();
    auto branch = randn({6, width}, 22).requires_grad_();
    auto weight = randn({width}, 23, 1).requires_grad_();
    const auto out =
        ops::fused_add_norm(residual, branch, {ops::NormKind::kRmsNorm, weight, {}, 1e-6});
    (use_sum ? out.sum : out.normed).sum().backward();
    if (use_sum) {
      EXPECT_TRUE(at::equal(residual.grad(), at::ones_like(residual)));
      EXPECT_TRUE(at::equal(branch.grad(), at::ones_like(branch)));
      EXPECT_FALSE(weight.grad().defined() && weight.grad().abs().sum().item<double>() != 0);
    } else {
      EXPECT_TRUE(at::equal(residual.grad(), branch.grad()));
      EXPECT_TRUE(weight.grad().defined());
    }
  }
}

TEST(FusedNorm, BadInputIsNamed) {
  const auto x = randn({2, 8}, 31);
  const auto w = randn({8}, 32);
  auto msg = error_of([&] {
    ops::fused_add_norm(x, randn({2, 7}, 33), {ops::NormKind::kLayerNorm, w, {}, 1e-5});
  });
  EXPECT_TRUE(contains(msg, "differ in shape")) << msg;
  msg = error_of([&] { ops::fused_add_norm(x, {}, {ops::NormKind::kRmsNorm, w, w, 1e-5}); });
  EXPECT_TRUE(contains(msg, "RMSNorm takes no bias")) << msg;
  msg = error_of([&] {
    ops::fused_add_norm(x, {}, {ops::NormKind::kLayerNorm, randn({9}, 34), {}, 1e-5});
  });
  EXPECT_TRUE(contains(msg, "weight [9] must be [8]")) << msg;
  msg = error_of([&] {
    ops::uses_fused_norm(ops::NormBackend::kFused, x.to(at::kBFloat16), {},
                         {ops::NormKind::kLayerNorm, w.to(at::kBFloat16), {}, 1e-5});
  });
  EXPECT_TRUE(contains(msg, "--norm fused: the residual stream must be fp32")) << msg;
  msg = error_of([&] { ops::parse_norm_backend("fast"); });
  EXPECT_TRUE(contains(msg, "norm backend 'fast' is not valid: auto, fused, math")) << msg;
  // kAuto on the CPU is the math path; kFused takes fp32 and fp64.
  EXPECT_FALSE(ops::uses_fused_norm(ops::NormBackend::kAuto, x, {},
                                    {ops::NormKind::kLayerNorm, w, {}, 1e-5}));
  EXPECT_TRUE(ops::uses_fused_norm(ops::NormBackend::kFused, x, {},
                                   {ops::NormKind::kLayerNorm, w, {}, 1e-5}));
}

TEST(FusedNormGpu, KernelsEqualTheHostReference) {
  if (!ops::built_with_cuda()) GTEST_SKIP() << "built without LOOM_WITH_CUDA";
  if (ops::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device on this machine";
  // Every operation of the kernels is correctly rounded (_rn adds, multiplies, divides and
  // square roots) and sums in the host reference's order, so the GPU's forward and input
  // gradients equal the CPU's bit for bit; the weight gradients' sum over slices is ATen's (its
  // order differs by device): within the fp32 error of that sum.
  for (const auto kind : {ops::NormKind::kLayerNorm, ops::NormKind::kRmsNorm})
    for (const auto io : {at::kBFloat16, at::kHalf, at::kFloat}) {
      const int64_t width = kind == ops::NormKind::kLayerNorm ? 768 : 2050;
      const auto residual = randn({37, width}, 41, 0.3).to(at::kFloat);
      const auto branch = randn({37, width}, 42, 0, 0.5).to(io);
      const auto weight = randn({width}, 43, 1, 0.2).to(at::kFloat);
      const auto bias = kind == ops::NormKind::kLayerNorm
                            ? randn({width}, 44, 0, 0.1).to(at::kFloat)
                            : at::Tensor();
      const auto grad_normed = randn({37, width}, 45).to(io);
      const auto grad_sum = randn({37, width}, 46).to(at::kFloat);
      std::vector<at::Tensor> results[2];
      for (const auto device : {at::kCPU, at::kCUDA}) {
        auto r = residual.to(device).requires_grad_();
        auto b = branch.to(device).requires_grad_();
        auto w = weight.to(device).requires_grad_();
        auto bi = bias.defined() ? bias.to(device).requires_grad_() : at::Tensor();
        const auto out = ops::fused_add_norm(r, b, {kind, w, bi, 1e-5});
        torch::autograd::backward({out.sum, out.normed},
                                  {grad_sum.to(device), grad_normed.to(device)});
        auto& v = results[device == at::kCUDA];
        for (const auto& t : {out.sum, out.normed, r.grad(), b.grad(), w.grad()})
          v.push_back(t.detach().cpu());
        if (bi.defined()) v.push_back(bi.grad().cpu());
      }
      const char* names[] = {"sum",         "normed",      "residual grad",
                             "branch grad", "weight grad", "bias grad"};
      for (size_t i = 0; i < results[0].size(); ++i) {
        if (i < 4) {
          EXPECT_TRUE(at::equal(results[1][i], results[0][i]))
              << names[i] << " " << c10::toString(io) << " differs from the host reference";
        } else {
          // fp32 sums over 37 rows: 37 + a few roundings of the magnitudes.
          EXPECT_LE(max_rel_diff(results[1][i], results[0][i]), 64 * std::ldexp(1.0, -24) * 37)
              << names[i];
        }
      }
    }
}

// --- Whole models ---------------------------------------------------------------------------

struct FusedModelCase {
  models::Family family;
  int64_t pad_multiple;
};

class FusedModel : public ::testing::TestWithParam<FusedModelCase> {};

// The names of the autograd nodes behind `root`.
std::set<std::string> node_names(const at::Tensor& root) {
  std::set<std::string> names;
  std::set<torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> todo{root.grad_fn().get()};
  while (!todo.empty()) {
    auto* node = todo.back();
    todo.pop_back();
    if (!node || !seen.insert(node).second) continue;
    names.insert(node->name());
    for (const auto& edge : node->next_edges()) todo.push_back(edge.function.get());
  }
  return names;
}

bool has_node(const std::set<std::string>& names, const std::string& part) {
  for (const auto& n : names)
    if (n.find(part) != std::string::npos) return true;
  return false;
}

TEST_P(FusedModel, EveryFusedPathEqualsTheMathPathInFp64) {
  const auto [family, pad_multiple] = GetParam();
  auto config = loom::testing::tiny_model_config(family, 61);
  auto tp = std::make_shared<loom::parallel::tensor::TpGroup>(
      nullptr, loom::parallel::tensor::TpOptions{false, pad_multiple});
  config.dropout = 0;
  auto model = models::make_model(config, tp);
  models::init_parameters(*model, 5);
  model->to(at::kDouble);
  model->train();
  auto g = at::make_generator<at::CPUGeneratorImpl>(17);
  const auto tokens = at::randint(0, config.vocab_size, {2, 16}, g, at::kLong);
  const auto targets = at::randint(0, config.vocab_size, {2, 16}, g, at::kLong);
  std::map<std::string, at::Tensor> want;
  double want_loss = 0;
  for (const auto choice : {ops::FusedChoice::kMath, ops::FusedChoice::kFused}) {
    model->zero_grad();
    model->set_norm_backend(choice);
    model->set_loss_backend(choice);
    model->set_activation_backend(choice);
    auto loss = model->loss(tokens, targets);
    // The paths asked for are the ones that ran: a fused norm node per norm, or none.
    const auto names = node_names(loss);
    EXPECT_EQ(has_node(names, "FusedAddNorm"), choice == ops::FusedChoice::kFused);
    EXPECT_EQ(has_node(names, "FusedCrossEntropy"), choice == ops::FusedChoice::kFused);
    // Llama's SwiGLU likewise; GPT-2 has none.
    EXPECT_EQ(has_node(names, "FusedSwiglu"),
              choice == ops::FusedChoice::kFused && family == models::Family::kLlama);
    loss.backward();
    if (choice == ops::FusedChoice::kMath) {
      want_loss = loss.item<double>();
      for (const auto& item : model->named_parameters())
        want.emplace(item.key(), item.value().grad().clone());
      continue;
    }
    // One forward and backward of a small model in another order of sums: ~1e-15; bound 1e-11
    // (docs/testing.md).
    EXPECT_NEAR(loss.item<double>(), want_loss, 1e-11 * want_loss);
    double worst = std::fabs(loss.item<double>() - want_loss) / want_loss;
    for (const auto& item : model->named_parameters()) {
      const double rel = max_rel_diff(item.value().grad(), want.at(item.key()));
      EXPECT_LE(rel, 1e-11) << item.key();
      worst = std::max(worst, rel);
    }
    if (std::getenv("LOOM_TEST_VERBOSE"))
      std::printf("fused vs math: worst relative %.3g\n", worst);
  }
}

INSTANTIATE_TEST_SUITE_P(Families, FusedModel,
                         ::testing::Values(FusedModelCase{models::Family::kGpt2, 1},
                                           FusedModelCase{models::Family::kGpt2, 64},
                                           FusedModelCase{models::Family::kLlama, 1},
                                           FusedModelCase{models::Family::kLlama, 64}),
                         [](const ::testing::TestParamInfo<FusedModelCase>& info) {
                           return fmt::format("{}_pad{}", models::to_string(info.param.family),
                                              info.param.pad_multiple);
                         });

}  // namespace
