// Structured MLPs (--ffn-blocks): a block-diagonal layer equals the dense layer with its
// structure masked in, forward and backward; a model built with it counts its parameters, exports
// to Hugging Face's dense format as the same function, and bad shapes are errors naming them.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

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

class StructuredFfnModels : public ::testing::TestWithParam<models::Family> {};

// gpt2-tiny and llama-tiny with 4 blocks: the parameter count is the config's formula (the
// MLP a quarter of the dense one's), the config survives JSON, and the Hugging Face export
// writes dense matrices (the blocks on the diagonal) whose model, loaded back as a dense one,
// gives the same logits.
TEST_P(StructuredFfnModels, CountExportAndReloadAsTheSameFunction) {
  auto config =
      models::ModelConfig::preset(GetParam() == models::Family::kGpt2 ? "gpt2-tiny" : "llama-tiny");
  config.vocab_size = 61;
  config.max_seq_len = 32;
  auto dense_config = config;
  config.ffn_blocks = 4;
  auto model = models::make_model(config);
  models::init_parameters(*model, 3);
  int64_t count = 0;
  for (const auto& p : model->parameters()) count += p.numel();
  EXPECT_EQ(count, config.num_parameters());
  const int64_t mlp = GetParam() == models::Family::kGpt2 ? 2 : 3;
  EXPECT_EQ(dense_config.num_parameters() - config.num_parameters(),
            config.n_layers * mlp * config.d_model * config.d_ff * 3 / 4);
  EXPECT_EQ(models::ModelConfig::from_json(config.to_json()).ffn_blocks, 4);
  EXPECT_FALSE(dense_config.to_json().contains("ffn_blocks"));  // dense configs read as before

  TempDir dir;
  models::save_hf(*model, dir.path());
  auto back = models::load_hf(dir.path());
  EXPECT_EQ(back->config().ffn_blocks, 1);
  torch::NoGradGuard no_grad;
  model->eval();
  back->eval();
  auto tokens = at::randint(0, 61, {2, 9}, loom::core::make_generator(4));
  EXPECT_TRUE(at::allclose(model->forward(tokens), back->forward(tokens), 1e-5, 1e-5));
}

INSTANTIATE_TEST_SUITE_P(Families, StructuredFfnModels,
                         ::testing::Values(models::Family::kGpt2, models::Family::kLlama),
                         [](const auto& info) { return models::to_string(info.param); });
