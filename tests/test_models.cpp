#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "loom/core/files.h"
#include "loom/core/rng.h"
#include "loom/core/safetensors.h"
#include "loom/models/causal_lm.h"
#include "loom/models/generate.h"
#include "loom/models/hf.h"
#include "loom/ops/attention.h"
#include "model_test_util.h"
#include "test_util.h"

using loom::testing::contains;
using loom::testing::error_of;
using loom::testing::TempDir;
namespace models = loom::models;

namespace {

models::ModelConfig tiny(models::Family family, int64_t vocab = 61) {
  return loom::testing::tiny_model_config(family, vocab);
}

std::shared_ptr<models::CausalLM> make(const models::ModelConfig& c, uint64_t seed = 1) {
  return loom::testing::make_initialized(c, seed);
}

using loom::testing::BothFamilies;
using loom::testing::max_rel_diff;

}  // namespace

TEST(Attention, MatchesReferenceForwardAndBackwardWithGqa) {
  for (int64_t kv_heads : {4, 2, 1}) {
    auto gen = loom::core::make_generator(kv_heads);
    auto q = at::randn({2, 4, 13, 8}, gen).requires_grad_();
    auto k = at::randn({2, kv_heads, 13, 8}, gen).requires_grad_();
    auto v = at::randn({2, kv_heads, 13, 8}, gen).requires_grad_();
    auto w = at::randn({2, 4, 13, 8}, gen);
    auto fast = loom::ops::attention(q, k, v);
    auto grads_fast = torch::autograd::grad({(fast * w).sum()}, {q, k, v}, {}, std::nullopt);
    auto ref = loom::ops::attention_reference(q, k, v);
    auto grads_ref = torch::autograd::grad({(ref * w).sum()}, {q, k, v}, {}, std::nullopt);
    EXPECT_LT(max_rel_diff(fast, ref), 1e-5) << "kv_heads " << kv_heads;
    for (int i = 0; i < 3; ++i)
      EXPECT_LT(max_rel_diff(grads_fast[i], grads_ref[i]), 1e-5) << "grad " << i;
  }
}

TEST(Attention, RejectsShapesThatDoNotFit) {
  auto q = at::randn({1, 6, 4, 8}), k = at::randn({1, 4, 4, 8});
  EXPECT_TRUE(contains(error_of([&] { loom::ops::attention(q, k, k); }), "6 query heads"));
  EXPECT_TRUE(contains(error_of([&] {
                         loom::ops::attention(at::randn({1, 4, 8}), k, k);
                       }),
                       "[batch, heads, seq, head_dim]"));
}

TEST_P(BothFamilies, ChangingTokenTNeverChangesEarlierLogits) {
  auto m = make(tiny(GetParam()));
  m->eval();
  torch::NoGradGuard no_grad;
  auto tokens = at::randint(0, 61, {2, 20}, loom::core::make_generator(3));
  auto changed = tokens.clone();
  changed.select(1, 11).fill_(7);
  changed.select(1, 11).add_(tokens.select(1, 11).eq(7).to(at::kLong));  // really different
  auto a = m->forward(tokens);
  auto b = m->forward(changed);
  EXPECT_TRUE(at::allclose(a.slice(1, 0, 11), b.slice(1, 0, 11), 0, 1e-6));
  EXPECT_FALSE(at::allclose(a.slice(1, 11), b.slice(1, 11), 0, 1e-3));
}

// Token ids [2, 24] of vocabulary 61 with documents starting (token 1) at 0, 9 and 17 in row 0
// and at 0 and 5 in row 1; no other position holds 1.
at::Tensor two_rows_of_documents(uint64_t seed) {
  auto tokens = at::randint(2, 61, {2, 24}, loom::core::make_generator(seed));
  for (int64_t at_pos : {0, 9, 17}) tokens[0][at_pos] = 1;
  for (int64_t at_pos : {0, 5}) tokens[1][at_pos] = 1;
  return tokens;
}

// Under a document mask a document's logits do not depend on the documents before it in the
// window; with RoPE (Llama) they equal the document's logits alone, which only relative
// positions reach. fp64, so that the comparisons measure the mask, not rounding.
TEST_P(BothFamilies, DocumentMaskKeepsDocumentsApart) {
  auto m = make(tiny(GetParam()));
  m->to(at::kDouble);
  m->eval();
  torch::NoGradGuard no_grad;
  const auto tokens = two_rows_of_documents(5);
  auto earlier_changed = tokens.clone();
  earlier_changed[0][3] = (tokens[0][3].item<int64_t>() + 1 - 2) % 59 + 2;  // in document 0..8
  earlier_changed[1][2] = (tokens[1][2].item<int64_t>() + 1 - 2) % 59 + 2;  // in document 0..4
  const auto unmasked = m->forward(tokens);
  m->set_document_mask(1);
  EXPECT_EQ(m->document_mask(), 1);
  const auto masked = m->forward(tokens);
  const auto masked_changed = m->forward(earlier_changed);
  // Row 0 from position 9 and row 1 from 5 lie in later documents: unchanged.
  EXPECT_LT(max_rel_diff(masked_changed[0].slice(0, 9), masked[0].slice(0, 9)), 1e-12);
  EXPECT_LT(max_rel_diff(masked_changed[1].slice(0, 5), masked[1].slice(0, 5)), 1e-12);
  // The first document of each row sees what it saw without the mask; later ones do not.
  EXPECT_LT(max_rel_diff(masked[0].slice(0, 0, 9), unmasked[0].slice(0, 0, 9)), 1e-12);
  EXPECT_GT(max_rel_diff(masked[0].slice(0, 9), unmasked[0].slice(0, 9)), 1e-3);
  if (GetParam() == models::Family::kLlama) {
    const auto alone = m->forward(tokens.slice(1, 9, 17));
    EXPECT_LT(max_rel_diff(masked.slice(0, 0, 1).slice(1, 9, 17), alone.slice(0, 0, 1)), 1e-10);
  }
  m->set_document_mask(std::nullopt);
  EXPECT_LT(max_rel_diff(m->forward(tokens), unmasked), 1e-15);
}

// Recomputation in backward (full or selective) uses the first keys of its own forward, and a
// pipeline's later part reads them from the tokens it is given: the same loss and gradients as
// the whole model run plainly.
TEST_P(BothFamilies, DocumentMaskHoldsThroughRecomputeAndPipelineParts) {
  const auto config = tiny(GetParam());
  const auto tokens = two_rows_of_documents(6);
  const auto targets = at::roll(tokens, -1, 1);
  auto grads_of = [&](models::CausalLM& model) {
    model.zero_grad();
    auto loss = model.loss(tokens, targets);
    loss.backward();
    std::vector<at::Tensor> g{loss.detach()};
    for (const auto& p : model.parameters()) g.push_back(p.grad().clone());
    return g;
  };
  auto plain = make(config);
  plain->set_document_mask(1);
  const auto want = grads_of(*plain);
  for (auto mode :
       {models::ActivationCheckpointing::kFull, models::ActivationCheckpointing::kSelective}) {
    auto m = make(config);
    m->set_document_mask(1);
    m->set_activation_checkpointing(mode);
    const auto got = grads_of(*m);
    for (size_t i = 0; i < want.size(); ++i)
      EXPECT_LT(max_rel_diff(got[i], want[i]), 1e-6) << models::to_string(mode) << " " << i;
  }
  // Two parts: layers [0, 1) with the embedding, [1, 2) with the head.
  auto first = models::make_model(config, nullptr, {0, 1, true, false});
  auto last = models::make_model(config, nullptr, {1, 2, false, true});
  models::init_parameters(*first, 1);
  models::init_parameters(*last, 1);
  first->set_document_mask(1);
  last->set_document_mask(1);
  torch::NoGradGuard no_grad;
  const auto hidden = first->forward_part(tokens);
  const auto msg = loom::testing::error_of([&] { last->forward_part(hidden); });
  EXPECT_TRUE(contains(msg, "needs the micro-batch's token ids")) << msg;
  const auto loss = last->loss_from_logits(last->forward_part(hidden, tokens), targets);
  EXPECT_LT(std::abs(loss.item<double>() - want[0].item<double>()), 1e-6);
  EXPECT_TRUE(contains(error_of([&] { plain->set_document_mask(61); }), "start token 61"));
}

TEST_P(BothFamilies, InitializationDependsOnSeedAndNameOnly) {
  auto c2 = tiny(GetParam());
  auto c4 = c2;
  c4.n_layers = 4;  // more parameters created before and after the shared ones
  auto a = make(c2, 5), b = make(c4, 5), other_seed = make(c2, 6);
  auto b_params = b->named_parameters();
  auto o_params = other_seed->named_parameters();
  for (const auto& item : a->named_parameters()) {
    const auto* in_b = b_params.find(item.key());
    ASSERT_NE(in_b, nullptr) << item.key();
    const auto rule_a = a->init_for(item.key()), rule_b = b->init_for(item.key());
    if (rule_a.std == rule_b.std) {
      EXPECT_TRUE(at::equal(item.value(), *in_b)) << item.key();
    } else {
      // Residual projections scale with depth (0.02 / sqrt(2 L)); the draw underneath is the same.
      EXPECT_TRUE(at::allclose(item.value() / rule_a.std, *in_b / rule_b.std, 1e-5, 1e-6))
          << item.key();
    }
    if (rule_a.kind == models::ParamInit::Kind::kNormal) {
      EXPECT_FALSE(at::equal(item.value(), *o_params.find(item.key()))) << item.key();
    }
  }
}

TEST_P(BothFamilies, InitializationFollowsTheStatedRules) {
  auto c = tiny(GetParam());
  c.d_model = 256;
  c.d_ff = 1024;
  auto m = make(c);
  const double residual_std = 0.02 / std::sqrt(2.0 * c.n_layers);
  for (const auto& item : m->named_parameters()) {
    const auto rule = m->init_for(item.key());
    const auto& p = item.value();
    switch (rule.kind) {
      case models::ParamInit::Kind::kZeros:
        EXPECT_EQ(p.abs().max().item<float>(), 0) << item.key();
        break;
      case models::ParamInit::Kind::kOnes:
        EXPECT_TRUE(at::equal(p, at::ones_like(p))) << item.key();
        break;
      case models::ParamInit::Kind::kNormal:
        EXPECT_NEAR(p.std().item<double>(), rule.std, 0.1 * rule.std) << item.key();
        EXPECT_TRUE(rule.std == 0.02 || std::abs(rule.std - residual_std) < 1e-12) << item.key();
        break;
      case models::ParamInit::Kind::kKeep:  // custom models only
        ADD_FAILURE() << item.key() << ": a loom model keeps no module-made value";
    }
  }
}

TEST_P(BothFamilies, ParameterCountFormulaMatchesTheModel) {
  for (auto c :
       {tiny(GetParam()), models::ModelConfig::preset(
                              GetParam() == models::Family::kGpt2 ? "gpt2-tiny" : "llama-tiny")}) {
    auto m = models::make_model(c);
    int64_t n = 0;
    for (const auto& p : m->parameters()) n += p.numel();
    EXPECT_EQ(n, c.num_parameters());
  }
}

TEST(Models, PresetSizesMatchThePublishedModels) {
  EXPECT_EQ(models::ModelConfig::preset("gpt2-124m").num_parameters(), 124439808);  // GPT-2 small
  EXPECT_EQ(models::ModelConfig::preset("gpt2-350m").num_parameters(), 354823168);  // GPT-2 medium
  EXPECT_EQ(models::ModelConfig::preset("llama-1b").num_parameters(), 1100048384);  // TinyLlama
  // Meta Llama 3 8B: 8,030,261,248 parameters (untied 128256-token embedding and head).
  EXPECT_EQ(models::ModelConfig::preset("llama-8b").num_parameters(), 8030261248);
  // llama-mini: gpt2-mini's width and depth; its count checked against the model's own.
  auto llama_mini = models::ModelConfig::preset("llama-mini");
  EXPECT_EQ(llama_mini.d_model, 256);
  EXPECT_EQ(llama_mini.n_layers, 6);
  {
    int64_t n = 0;
    for (const auto& p : make(llama_mini)->parameters()) n += p.numel();
    EXPECT_EQ(n, llama_mini.num_parameters());
  }
  auto llama_tiny = models::ModelConfig::preset("llama-tiny");
  EXPECT_LT(llama_tiny.n_kv_heads, llama_tiny.n_heads);  // grouped-query attention
  EXPECT_EQ(llama_tiny.dropout, 0.0);
  EXPECT_FALSE(llama_tiny.tie_embeddings);
}

TEST(Models, BadConfigsAreNamedClearly) {
  auto c = models::ModelConfig::preset("gpt2-tiny");
  c.n_heads = 5;
  c.n_kv_heads = 5;
  auto msg = error_of([&] { c.validate(); });
  EXPECT_TRUE(contains(msg, "n_heads = 5 does not divide d_model = 128")) << msg;
  msg = error_of([] { models::ModelConfig::preset("gpt5-huge"); });
  EXPECT_TRUE(contains(msg, "gpt5-huge") && contains(msg, "llama-tiny")) << msg;
  auto l = models::ModelConfig::preset("llama-tiny");
  l.n_kv_heads = 3;
  EXPECT_TRUE(contains(error_of([&] { l.validate(); }), "n_kv_heads = 3"));
  EXPECT_TRUE(contains(error_of([&] { make(l); }), "n_kv_heads = 3"));
  auto m = make(tiny(models::Family::kGpt2));
  EXPECT_TRUE(contains(error_of([&] {
                         m->forward(at::zeros({1, 33}, at::kLong));
                       }),
                       "max_seq_len 32"));
}

// Autograd gradients of every hand-written piece (RMSNorm, RoPE, the blocks, tied heads) agree
// with central finite differences, in float64.
TEST_P(BothFamilies, GradientsMatchFiniteDifferences) {
  auto c = tiny(GetParam(), 11);
  c.d_model = 16;
  c.d_ff = 24;
  c.n_layers = 1;
  auto m = make(c);
  m->to(at::kDouble);
  auto tokens = at::randint(0, 11, {2, 6}, loom::core::make_generator(1));
  auto targets = at::randint(0, 11, {2, 6}, loom::core::make_generator(2));
  // next_token_loss computes in fp32, too coarse for finite differences: use float64 here.
  auto loss64 = [&] {
    auto logits = m->forward(tokens);
    return at::cross_entropy_loss(logits.reshape({-1, 11}), targets.reshape({-1}));
  };
  loss64().backward();
  torch::NoGradGuard no_grad;
  auto gen = loom::core::make_generator(9);
  for (auto& named : m->named_parameters()) {
    auto p = named.value().view({-1});
    auto g = named.value().grad().view({-1});
    for (int trial = 0; trial < 3; ++trial) {
      const int64_t i = at::randint(0, p.numel(), {1}, gen).item<int64_t>();
      const double orig = p[i].item<double>(), h = 1e-6;
      p[i].fill_(orig + h);
      const double up = loss64().item<double>();
      p[i].fill_(orig - h);
      const double down = loss64().item<double>();
      p[i].fill_(orig);
      const double numeric = (up - down) / (2 * h), analytic = g[i].item<double>();
      EXPECT_NEAR(analytic, numeric, 1e-6 + 1e-5 * std::abs(numeric))
          << named.key() << "[" << i << "]";
    }
  }
}

TEST_P(BothFamilies, HuggingFaceRoundTripKeepsEveryParameterAndLogit) {
  TempDir dir;
  auto m = make(tiny(GetParam()), 17);
  models::save_hf(*m, dir.path());
  auto config = nlohmann::json::parse(loom::core::read_file(dir / "config.json"));
  auto weights = loom::core::load_safetensors(dir / "model.safetensors").tensors;
  if (GetParam() == models::Family::kGpt2) {
    EXPECT_EQ(config["architectures"][0], "GPT2LMHeadModel");
    EXPECT_EQ(config["n_embd"], 32);
    // HF's Conv1D layout: [in, out].
    EXPECT_EQ(weights.at("transformer.h.0.attn.c_attn.weight").sizes(),
              (std::vector<int64_t>{32, 96}));
    EXPECT_EQ(weights.count("lm_head.weight"), 0u);  // tied
  } else {
    EXPECT_EQ(config["architectures"][0], "LlamaForCausalLM");
    EXPECT_EQ(config["num_key_value_heads"], 2);
    EXPECT_EQ(weights.at("model.layers.1.self_attn.k_proj.weight").sizes(),
              (std::vector<int64_t>{16, 32}));
    EXPECT_EQ(weights.count("lm_head.weight"), 1u);
  }
  auto back = models::load_hf(dir.path());
  EXPECT_EQ(back->config().to_json(), m->config().to_json());
  auto back_params = back->named_parameters();
  for (const auto& item : m->named_parameters())
    EXPECT_TRUE(at::equal(item.value(), *back_params.find(item.key()))) << item.key();
  torch::NoGradGuard no_grad;
  auto tokens = at::randint(0, 61, {2, 9}, loom::core::make_generator(4));
  EXPECT_TRUE(at::equal(m->forward(tokens), back->forward(tokens)));
}

TEST(Models, HuggingFaceDirectoryProblemsAreNamed) {
  TempDir dir;
  EXPECT_TRUE(contains(error_of([&] { models::load_hf(dir.path()); }), "config.json"));
  loom::core::write_file_atomic(dir / "config.json", R"({"model_type": "bert"})");
  EXPECT_TRUE(contains(error_of([&] { models::load_hf(dir.path()); }), "model_type 'bert'"));
  loom::core::write_file_atomic(dir / "config.json", R"({"model_type": "gpt2", "vocab_size": 10})");
  EXPECT_TRUE(contains(error_of([&] { models::load_hf(dir.path()); }), "'n_positions'"));
  // Integer keys take only JSON integers: a float would be cast (undefined when out of range).
  auto m0 = make(tiny(models::Family::kLlama));
  models::save_hf(*m0, dir.path());
  const auto saved = nlohmann::json::parse(loom::core::read_file(dir / "config.json"));
  for (const auto& [key, value] :
       std::vector<std::pair<std::string, nlohmann::json>>{{"num_hidden_layers", 1e300},
                                                           {"hidden_size", 32.5},
                                                           {"num_key_value_heads", 2.0},
                                                           {"head_dim", 1e20},
                                                           {"intermediate_size", "64"}}) {
    auto j = saved;
    j[key] = value;
    loom::core::write_file_atomic(dir / "config.json", j.dump());
    const auto msg = error_of([&] { models::load_hf(dir.path()); });
    EXPECT_TRUE(contains(msg, "'" + key + "' is " + value.dump() + ": it must be an integer"))
        << msg;
  }
  auto j = saved;
  j["num_key_value_heads"] = nullptr;  // absent or null: the heads' count
  loom::core::write_file_atomic(dir / "config.json", j.dump());
  EXPECT_EQ(models::read_hf_config(dir.path()).n_kv_heads, m0->config().n_heads);
  auto mj = m0->config().to_json();
  mj["n_layers"] = 2.5;
  EXPECT_TRUE(contains(error_of([&] { models::ModelConfig::from_json(mj); }),
                       "model config.n_layers is 2.5: it must be an integer"));
  auto m = make(tiny(models::Family::kLlama));
  models::save_hf(*m, dir.path());
  auto weights = loom::core::load_safetensors(dir / "model.safetensors").tensors;
  weights.erase("model.norm.weight");
  loom::core::NamedTensors partial(weights.begin(), weights.end());
  loom::core::save_safetensors(dir / "model.safetensors", partial);
  EXPECT_TRUE(contains(error_of([&] { models::load_hf(dir.path()); }), "model.norm.weight"));
}

TEST(Models, GenerationIsDeterministicAndGreedyFollowsArgmax) {
  auto m = make(tiny(models::Family::kLlama), 3);
  models::GenerateOptions opt{.max_new_tokens = 40, .temperature = 0.9, .top_k = 5, .seed = 11};
  auto a = models::generate(*m, {1, 2, 3}, opt);
  auto b = models::generate(*m, {1, 2, 3}, opt);
  EXPECT_EQ(a, b);
  ASSERT_EQ(a.size(), 43u);  // longer than max_seq_len 32: the window slides
  opt.temperature = 0;
  auto greedy = models::generate(*m, {1, 2, 3}, opt);
  torch::NoGradGuard no_grad;
  auto logits = m->forward(at::tensor(std::vector<int64_t>{1, 2, 3}).unsqueeze(0));
  EXPECT_EQ(greedy[3], logits[0][2].argmax().item<int64_t>());
  EXPECT_TRUE(contains(error_of([&] { models::generate(*m, {99}, opt); }), "token 99"));
  // With a context of 8, the next token depends on the last 8 tokens only.
  opt.max_new_tokens = 1;
  opt.context = 8;
  std::vector<int64_t> long_prompt(a.begin(), a.begin() + 20);
  std::vector<int64_t> tail(long_prompt.end() - 8, long_prompt.end());
  EXPECT_EQ(models::generate(*m, long_prompt, opt).back(), models::generate(*m, tail, opt).back());
  opt.context = 33;
  EXPECT_TRUE(contains(error_of([&] { models::generate(*m, tail, opt); }), "context 33"));
}

INSTANTIATE_TEST_SUITE_P(Models, BothFamilies,
                         ::testing::Values(models::Family::kGpt2, models::Family::kLlama),
                         [](const auto& info) { return models::to_string(info.param); });
