// Cross-layer parameter sharing (--share-layers): the patterns and their errors; a shared model
// holds each block once (names, parameter count); its loss equals that of a model with untied
// copies of the same weights and each shared block's gradient equals the sum of the copies'
// gradients, with dropout (masks keyed by the layer, not the block) and under every activation
// checkpointing mode, accumulated once per backward; a pipeline part knows which blocks other
// parts hold; the Hugging Face export expands the blocks into a model that computes the same.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <iostream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "loom/core/files.h"
#include "loom/models/causal_lm.h"
#include "loom/models/config.h"
#include "loom/models/hf.h"
#include "loom/models/layer_sharing.h"
#include "loom/parallel/grad_ready_hooks.h"
#include "loom/train/mfu.h"
#include "test_util.h"

using loom::testing::contains;
using loom::testing::error_of;
using loom::testing::TempDir;
namespace models = loom::models;

namespace {

using Owners = std::vector<int64_t>;

models::ModelConfig small_config(models::Family family, int64_t layers, std::string sharing) {
  auto c =
      models::ModelConfig::preset(family == models::Family::kGpt2 ? "gpt2-tiny" : "llama-tiny");
  c.vocab_size = 97;
  c.max_seq_len = 64;
  c.n_layers = layers;
  c.d_model = 64;
  c.n_heads = 4;
  c.n_kv_heads = family == models::Family::kGpt2 ? 4 : 2;
  c.d_ff = 128;
  c.share_layers = std::move(sharing);
  return c;
}

std::string layers_prefix(models::Family family) {
  return family == models::Family::kGpt2 ? "transformer.h" : "model.layers";
}

// "transformer.h.4.attn.c_attn.weight" -> its owner's name under `owners`.
std::string owner_name(const std::string& name, const std::string& prefix, const Owners& owners) {
  if (!name.starts_with(prefix + ".")) return name;
  const auto rest = name.substr(prefix.size() + 1);
  const auto dot = rest.find('.');
  const auto layer = std::stoll(rest.substr(0, dot));
  return prefix + "." + std::to_string(owners.at(static_cast<size_t>(layer))) + rest.substr(dot);
}

double max_rel(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>() / std::max(1e-30, b.abs().max().item<double>());
}

}  // namespace

TEST(LayerSharing, PatternsGiveEachLayerItsOwner) {
  EXPECT_EQ(models::parse_layer_sharing("", 4), (Owners{0, 1, 2, 3}));
  EXPECT_EQ(models::parse_layer_sharing("none", 4), (Owners{0, 1, 2, 3}));
  EXPECT_EQ(models::parse_layer_sharing("all", 4), (Owners{0, 0, 0, 0}));
  EXPECT_EQ(models::parse_layer_sharing("cycle:2", 5), (Owners{0, 1, 0, 1, 0}));
  EXPECT_EQ(models::parse_layer_sharing("cycle:5", 5), (Owners{0, 1, 2, 3, 4}));
  EXPECT_EQ(models::parse_layer_sharing("repeat:2", 5), (Owners{0, 0, 2, 2, 4}));
  EXPECT_EQ(models::parse_layer_sharing("3=0,4=1", 6), (Owners{0, 1, 2, 0, 1, 5}));
  EXPECT_EQ(models::held_blocks({0, 1, 0, 1, 0}, 2, 4), (Owners{0, 1}));
  EXPECT_TRUE(models::used_outside({0, 1, 0, 1}, 0, 0, 2));
  EXPECT_FALSE(models::used_outside({0, 1, 2, 2}, 2, 2, 4));
}

TEST(LayerSharing, BadPatternsAreRefusedNamingThem) {
  auto refused = [](const std::string& pattern, int64_t layers, const std::string& says) {
    const auto message = error_of([&] { models::parse_layer_sharing(pattern, layers); });
    EXPECT_TRUE(contains(message, says)) << pattern << ": " << message;
    EXPECT_TRUE(contains(message, pattern)) << pattern << ": " << message;
  };
  refused("cycle:0", 4, "must be an integer in [1, 4]");
  refused("cycle:x", 4, "must be an integer in [1, 4]");
  refused("repeat:9", 4, "must be an integer in [1, 4]");
  refused("bogus", 4, "valid: none, all, cycle:K, repeat:K");
  refused("5=0", 4, "names layer 5, which does not exist (the model has layers 0-3)");
  refused("1=-1", 4, "names layer -1, which does not exist");
  refused("1=2", 4, "must come before the layer that uses them");
  refused("2=1,3=2", 4, "layer 3 uses layer 2's weights, but layer 2 itself uses layer 1's");
  refused("2=1,2=0", 4, "layer 2 is given weights twice");
  refused("2=", 4, "is not L=O with integers");
  // Through the model config, which checkpoints and loom-pretrain validate.
  auto c = small_config(models::Family::kGpt2, 4, "cycle:7");
  EXPECT_TRUE(contains(error_of([&] { c.validate(); }), "must be an integer in [1, 4]"));
  c.share_layers = "cycle:2";
  c.family = models::Family::kCustom;
  EXPECT_TRUE(contains(error_of([&] { c.validate(); }), "a custom model's blocks are its own"));
}

TEST(LayerSharing, ModelHoldsEachBlockOnceAndCountsItOnce) {
  for (auto family : {models::Family::kGpt2, models::Family::kLlama}) {
    const auto prefix = layers_prefix(family);
    auto shared_config = small_config(family, 6, "cycle:2");
    auto shared = models::make_model(shared_config);
    auto plain = models::make_model(small_config(family, 6, ""));
    int64_t held = 0;
    std::set<std::string> blocks;
    for (const auto& item : shared->named_parameters()) {
      held += item.value().numel();
      if (item.key().starts_with(prefix + "."))
        blocks.insert(item.key().substr(0, item.key().find('.', prefix.size() + 1)));
    }
    EXPECT_EQ(blocks, (std::set<std::string>{prefix + ".0", prefix + ".1"}));
    EXPECT_EQ(shared_config.unique_blocks(), 2);
    EXPECT_EQ(shared_config.num_parameters(), held);
    EXPECT_EQ(plain->config().num_parameters() - shared_config.num_parameters(),
              4 * shared_config.block_parameters());
    // Every layer still multiplies by its block's weights: the FLOPs (and MFU) are the unshared
    // model's.
    EXPECT_EQ(loom::train::model_flops_per_token(shared_config, 32),
              loom::train::model_flops_per_token(plain->config(), 32));
    ASSERT_EQ(shared->blocks().size(), 2u);
    EXPECT_EQ(shared->blocks()[1].first, prefix + ".1");
    // The config round-trips with its pattern (and without one, writes none).
    EXPECT_EQ(models::ModelConfig::from_json(shared_config.to_json()).share_layers, "cycle:2");
    EXPECT_FALSE(plain->config().to_json().contains("share_layers"));
  }
}

// The shared model against a model with untied copies of the same weights: equal losses, and
// each shared block's gradient the sum of its copies' gradients. In training mode with dropout,
// whose masks follow the layer (equal only if a shared block's uses draw different masks, as
// the copies do), under each activation checkpointing mode.
TEST(LayerSharing, GradientsAreTheSumOverUses) {
  const std::vector<std::pair<models::Family, std::string>> cases = {
      {models::Family::kGpt2, "cycle:2"},
      {models::Family::kGpt2, "all"},
      {models::Family::kLlama, "2=1,3=1,5=4"},
      {models::Family::kLlama, "repeat:3"}};
  double worst_loss = 0, worst_grad = 0;
  for (const auto& [family, pattern] : cases) {
    for (auto mode :
         {models::ActivationCheckpointing::kNone, models::ActivationCheckpointing::kFull,
          models::ActivationCheckpointing::kSelective}) {
      SCOPED_TRACE(models::to_string(family) + " " + pattern + " " + models::to_string(mode));
      const auto prefix = layers_prefix(family);
      auto config = small_config(family, 6, pattern);
      config.dropout = 0.1;
      const auto owners = config.layer_owners();
      auto shared = models::make_model(config);
      models::init_parameters(*shared, 7);
      shared->to(at::kDouble);
      auto untied_config = config;
      untied_config.share_layers = "";
      auto untied = models::make_model(untied_config);
      std::map<std::string, at::Tensor> weights;
      for (const auto& item : shared->named_parameters())
        weights.emplace(item.key(), item.value().detach());
      std::map<std::string, at::Tensor> expanded;
      for (const auto& item : untied->named_parameters())
        expanded.emplace(item.key(), weights.at(owner_name(item.key(), prefix, owners)));
      models::load_parameters(*untied, expanded, "the shared model");
      untied->to(at::kDouble);
      for (auto* model : {shared.get(), untied.get()}) {
        model->train();
        model->set_activation_checkpointing(mode);
      }
      auto tokens = at::randint(0, config.vocab_size, {2, 16}, at::kLong);
      auto targets = at::randint(0, config.vocab_size, {2, 16}, at::kLong);
      // One accumulation per shared parameter per backward (what data parallelism and ZeRO's
      // gradient hooks count on), however many layers use it.
      const auto probe_name =
          prefix + "." + std::to_string(owners.back()) + "." +
          (family == models::Family::kGpt2 ? "attn.c_attn.weight" : "self_attn.q_proj.weight");
      int calls = 0;
      loom::parallel::GradReadyHooks hooks;
      hooks.add(shared->named_parameters()[probe_name], probe_name, [&calls] { ++calls; });
      const auto loss = shared->loss(tokens, targets);
      loss.backward();
      const auto reference = untied->loss(tokens, targets);
      reference.backward();
      EXPECT_EQ(calls, 1);
      const double loss_error = std::abs(loss.item<double>() - reference.item<double>());
      worst_loss = std::max(worst_loss, loss_error);
      EXPECT_LT(loss_error, 1e-12);
      std::map<std::string, at::Tensor> summed;
      for (const auto& item : untied->named_parameters()) {
        const auto name = owner_name(item.key(), prefix, owners);
        const auto g = item.value().grad();
        ASSERT_TRUE(g.defined()) << item.key();
        auto it = summed.find(name);
        if (it == summed.end())
          summed.emplace(name, g.clone());
        else
          it->second.add_(g);
      }
      for (const auto& item : shared->named_parameters()) {
        ASSERT_TRUE(item.value().grad().defined()) << item.key();
        const double error = max_rel(item.value().grad(), summed.at(item.key()));
        worst_grad = std::max(worst_grad, error);
        EXPECT_LT(error, 1e-10) << item.key();
      }
    }
  }
  std::cout << "[ measured ] worst loss difference " << worst_loss
            << ", worst gradient relative error " << worst_grad << "\n";
}

TEST(LayerSharing, PipelinePartsKnowWhichBlocksOthersHold) {
  // 6 layers, blocks 0 and 1 in turn, split in three stages of two layers: every stage holds
  // both blocks; the first counts them, the others hold copies.
  const auto config = small_config(models::Family::kGpt2, 6, "cycle:2");
  const std::vector<int64_t> bounds{0, 2, 4, 6};
  auto first = models::make_model(config, nullptr, {0, 2, true, false});
  auto middle = models::make_model(config, nullptr, {2, 4, false, false});
  auto last = models::make_model(config, nullptr, {4, 6, false, true});
  const std::string block = "transformer.h.1.mlp.c_fc.weight";
  for (const auto& part : {first, middle, last}) {
    const auto shared = part->shared_across_parts();
    EXPECT_NE(std::find(shared.begin(), shared.end(), block), shared.end());
    EXPECT_EQ(part->stages_holding(block, bounds), (std::vector<int64_t>{0, 1, 2}));
    EXPECT_EQ(part->blocks().size(), 2u);
  }
  EXPECT_FALSE(first->is_copy(block));
  EXPECT_TRUE(middle->is_copy(block));
  EXPECT_TRUE(last->is_copy(block));
  // The tied embedding: on the first and last stages, the last one's a copy.
  EXPECT_EQ(first->stages_holding("transformer.wte.weight", bounds), (std::vector<int64_t>{0, 2}));
  EXPECT_FALSE(first->is_copy("transformer.wte.weight"));
  EXPECT_TRUE(last->is_copy("transformer.wte.weight"));
  // "3=0": block 0 is on stages 0 and 1; block 2 only on stage 1, shared with nobody.
  const auto listed = small_config(models::Family::kGpt2, 6, "3=0");
  auto second = models::make_model(listed, nullptr, {2, 4, false, false});
  EXPECT_EQ(second->stages_holding("transformer.h.0.ln_1.weight", bounds),
            (std::vector<int64_t>{0, 1}));
  const auto held = second->shared_across_parts();
  EXPECT_EQ(std::count_if(held.begin(), held.end(),
                          [](const std::string& n) { return n.starts_with("transformer.h.2."); }),
            0);
  EXPECT_GT(std::count_if(held.begin(), held.end(),
                          [](const std::string& n) { return n.starts_with("transformer.h.0."); }),
            0);
  // A whole model shares nothing with other parts.
  EXPECT_TRUE(models::make_model(config)->shared_across_parts().empty());
}

TEST(LayerSharing, HuggingFaceExportExpandsTheBlocks) {
  for (auto family : {models::Family::kGpt2, models::Family::kLlama}) {
    TempDir dir("loom_share_hf");
    auto config = small_config(family, 4, "cycle:2");
    auto shared = models::make_model(config);
    models::init_parameters(*shared, 3);
    shared->eval();
    models::save_hf(*shared, dir.path());
    auto loaded = models::load_hf(dir.path());
    EXPECT_TRUE(loaded->config().share_layers.empty());
    EXPECT_EQ(loaded->config().n_layers, 4);
    EXPECT_EQ(loaded->blocks().size(), 4u);
    EXPECT_TRUE(contains(loom::core::read_file(dir.path() / "config.json"),
                         "\"loom_share_layers\": \"cycle:2\""));
    loaded->eval();
    torch::NoGradGuard no_grad;
    auto tokens = at::randint(0, config.vocab_size, {2, 12}, at::kLong);
    // The same weights and the same operations in the same order.
    const double error = max_rel(loaded->forward(tokens), shared->forward(tokens));
    std::cout << "[ measured ] " << models::to_string(family)
              << " export against the shared model: " << error << "\n";
    EXPECT_LT(error, 1e-6);
  }
}
