// Structured MLPs (--ffn-blocks, --ffn-rank): a block-diagonal layer equals the dense layer with
// its structure masked in, a low-rank one the dense layer of its factors' product, forward and
// backward; a model built with it counts its parameters, exports
// to Hugging Face's dense format as the same function, and bad shapes are errors naming them.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "loom/core/files.h"
#include "loom/core/rng.h"
#include "loom/models/causal_lm.h"
#include "loom/models/config.h"
#include "loom/models/hf.h"
#include "loom/parallel/tensor/layers.h"
#include "test_util.h"

using loom::testing::contains;
using loom::testing::error_of;
using loom::testing::TempDir;
namespace models = loom::models;
namespace pt = loom::parallel::tensor;

// 4 blocks of 3 -> 2 features: y equals x times the block-diagonal matrix (zeros off the
// diagonal) plus the bias, and the weight's gradient equals the dense gradient on the diagonal
// blocks (what masking the dense layer would train); the input's gradient equals the dense one.
TEST(BlockDiagonal, EqualsTheDenseLayerWithItsStructureMasked) {
  auto gen = loom::core::make_generator(5);
  pt::BlockDiagonalLinear layer(12, 8, 4, nullptr, true, "test");
  ASSERT_EQ(layer.weight.sizes(), (std::vector<int64_t>{4, 2, 3}));
  {
    torch::NoGradGuard no_grad;
    layer.weight.copy_(at::randn({4, 2, 3}, gen, at::kDouble).to(at::kFloat));
    layer.bias.copy_(at::randn({8}, gen, at::kDouble).to(at::kFloat));
  }
  layer.to(at::kDouble);
  auto dense = at::block_diag(std::vector<at::Tensor>(layer.weight.detach().unbind(0)))
                   .clone()
                   .requires_grad_();
  auto bias = layer.bias.detach().clone().requires_grad_();
  auto x = at::randn({2, 5, 12}, gen, at::kDouble).requires_grad_();
  auto x2 = x.detach().clone().requires_grad_();
  const auto y = layer.forward(x);
  const auto want = at::linear(x2, dense, bias);
  EXPECT_TRUE(at::allclose(y, want, 1e-12, 1e-12));
  const auto dy = at::randn({2, 5, 8}, gen, at::kDouble);
  y.backward(dy);
  want.backward(dy);
  EXPECT_TRUE(at::allclose(x.grad(), x2.grad(), 1e-12, 1e-12));
  EXPECT_TRUE(at::allclose(layer.bias.grad(), bias.grad(), 1e-12, 1e-12));
  for (int64_t i = 0; i < 4; ++i)
    EXPECT_TRUE(at::allclose(layer.weight.grad()[i],
                             dense.grad().narrow(0, 2 * i, 2).narrow(1, 3 * i, 3), 1e-12, 1e-12))
        << "block " << i;
  // Off the diagonal the dense gradient is not zero: what the structure leaves out.
  EXPECT_GT(dense.grad().narrow(0, 0, 2).narrow(1, 3, 9).abs().max().item<double>(), 0);
}

TEST(BlockDiagonal, ShapesThatDoNotSplitAreClearErrors) {
  auto msg = error_of([] { pt::BlockDiagonalLinear(12, 8, 0, nullptr, true, "mlp.c_fc"); });
  EXPECT_TRUE(contains(msg, "mlp.c_fc") && contains(msg, "0 blocks")) << msg;
  msg = error_of([] { pt::BlockDiagonalLinear(12, 8, 3, nullptr, true, "mlp.c_fc"); });
  EXPECT_TRUE(contains(msg, "3 blocks") && contains(msg, "8 output")) << msg;
  auto config = models::ModelConfig::preset("gpt2-tiny");
  config.ffn_blocks = 3;  // d_model 128
  msg = error_of([&] { config.validate(); });
  EXPECT_TRUE(contains(msg, "ffn_blocks = 3") && contains(msg, "d_model = 128")) << msg;
  config.ffn_blocks = 0;
  msg = error_of([&] { config.validate(); });
  EXPECT_TRUE(contains(msg, "ffn_blocks = 0")) << msg;
}

// u [out, r] and v [r, in] against the dense layer whose weight is u v: the same output, the same
// input gradient, and the factors' gradients the dense gradient G carried back (G v^T, u^T G);
// the column and the row placement alike at tp 1.
TEST(LowRank, EqualsTheDenseLayerOfTheFactorsProduct) {
  auto gen = loom::core::make_generator(6);
  pt::LowRankColumnLinear column(12, 10, 3, nullptr, true, "column");
  pt::LowRankRowLinear row(12, 10, 3, nullptr, true, "row");
  for (torch::nn::Module* layer :
       {static_cast<torch::nn::Module*>(&column), static_cast<torch::nn::Module*>(&row)}) {
    layer->to(at::kDouble);
    torch::NoGradGuard no_grad;
    for (auto& p : layer->parameters()) p.copy_(at::randn(p.sizes(), gen, at::kDouble));
  }
  const auto check = [&](const at::Tensor& u, const at::Tensor& v, const at::Tensor& bias,
                         const std::function<at::Tensor(const at::Tensor&)>& forward) {
    auto dense = at::mm(u.detach(), v.detach()).requires_grad_();
    auto x = at::randn({2, 4, 12}, gen, at::kDouble).requires_grad_();
    auto x2 = x.detach().clone().requires_grad_();
    const auto y = forward(x);
    const auto want = at::linear(x2, dense, bias.detach());
    EXPECT_TRUE(at::allclose(y, want, 1e-12, 1e-12));
    const auto dy = at::randn({2, 4, 10}, gen, at::kDouble);
    y.backward(dy);
    want.backward(dy);
    EXPECT_TRUE(at::allclose(x.grad(), x2.grad(), 1e-12, 1e-12));
    EXPECT_TRUE(at::allclose(u.grad(), at::mm(dense.grad(), v.detach().t()), 1e-12, 1e-12));
    EXPECT_TRUE(at::allclose(v.grad(), at::mm(u.detach().t(), dense.grad()), 1e-12, 1e-12));
  };
  check(column.u, column.v, column.bias, [&](const at::Tensor& x) { return column.forward(x); });
  check(row.u, row.v, row.bias, [&](const at::Tensor& x) { return row.forward(x); });
  auto config = models::ModelConfig::preset("gpt2-tiny");
  config.ffn_rank = 128;  // d_model
  auto msg = error_of([&] { config.validate(); });
  EXPECT_TRUE(contains(msg, "ffn_rank = 128") && contains(msg, "[1, 128)")) << msg;
  config.ffn_rank = 8;
  config.ffn_blocks = 2;
  msg = error_of([&] { config.validate(); });
  EXPECT_TRUE(contains(msg, "block-diagonal or low rank")) << msg;
  msg = error_of([] { pt::LowRankColumnLinear(12, 10, 0, nullptr, true, "mlp.c_fc"); });
  EXPECT_TRUE(contains(msg, "mlp.c_fc: low rank 0")) << msg;
}

struct Structure {
  models::Family family;
  int64_t blocks = 1, rank = 0;
};

class StructuredFfnModels : public ::testing::TestWithParam<Structure> {};

// gpt2-tiny and llama-tiny with 4 blocks or rank 16: the parameter count is the config's
// formula (the MLP a quarter of the dense one's; rank (d_model + d_ff) per linear), the config
// survives JSON, and the Hugging Face export writes dense matrices (the blocks on the diagonal;
// the factors' product) whose model, loaded back as a dense one, gives the same logits.
TEST_P(StructuredFfnModels, CountExportAndReloadAsTheSameFunction) {
  const auto structure = GetParam();
  auto config = models::ModelConfig::preset(
      structure.family == models::Family::kGpt2 ? "gpt2-tiny" : "llama-tiny");
  config.vocab_size = 61;
  config.max_seq_len = 32;
  auto dense_config = config;
  config.ffn_blocks = structure.blocks;
  config.ffn_rank = structure.rank;
  auto model = models::make_model(config);
  models::init_parameters(*model, 3);
  int64_t count = 0;
  for (const auto& p : model->parameters()) count += p.numel();
  EXPECT_EQ(count, config.num_parameters());
  const int64_t mlp = structure.family == models::Family::kGpt2 ? 2 : 3;
  const int64_t d = config.d_model, ff = config.d_ff;
  const int64_t one = structure.rank > 0 ? structure.rank * (d + ff) : d * ff / structure.blocks;
  EXPECT_EQ(dense_config.num_parameters() - config.num_parameters(),
            config.n_layers * mlp * (d * ff - one));
  const auto back_config = models::ModelConfig::from_json(config.to_json());
  EXPECT_EQ(back_config.ffn_blocks, structure.blocks);
  EXPECT_EQ(back_config.ffn_rank, structure.rank);
  EXPECT_FALSE(dense_config.to_json().contains("ffn_blocks"));  // dense configs read as before

  TempDir dir;
  models::save_hf(*model, dir.path());
  auto back = models::load_hf(dir.path());
  EXPECT_EQ(back->config().ffn_blocks, 1);
  EXPECT_EQ(back->config().ffn_rank, 0);
  torch::NoGradGuard no_grad;
  model->eval();
  back->eval();
  auto tokens = at::randint(0, 61, {2, 9}, loom::core::make_generator(4));
  EXPECT_TRUE(at::allclose(model->forward(tokens), back->forward(tokens), 1e-5, 1e-5));
}

INSTANTIATE_TEST_SUITE_P(Families, StructuredFfnModels,
                         ::testing::Values(Structure{models::Family::kGpt2, 4, 0},
                                           Structure{models::Family::kLlama, 4, 0},
                                           Structure{models::Family::kGpt2, 1, 16},
                                           Structure{models::Family::kLlama, 1, 16}),
                         [](const auto& info) {
                           return models::to_string(info.param.family) +
                                  (info.param.rank > 0 ? "_rank" : "_blocks");
                         });
