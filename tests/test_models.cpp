#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/autocast_mode.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "loom/core/files.h"
#include "loom/core/memory.h"
#include "loom/core/rng.h"
#include "loom/core/safetensors.h"
#include "loom/models/causal_lm.h"
#include "loom/models/generate.h"
#include "loom/models/hf.h"
#include "loom/ops/attention.h"
#include "loom/ops/cuda.h"
#include "loom/parallel/memory/activation_checkpoint.h"
#include "test_util.h"

using loom::testing::contains;
using loom::testing::error_of;
using loom::testing::TempDir;
namespace models = loom::models;

namespace {

models::ModelConfig tiny(models::Family family, int64_t vocab = 61) {
  auto c =
      models::ModelConfig::preset(family == models::Family::kGpt2 ? "gpt2-tiny" : "llama-tiny");
  c.vocab_size = vocab;
  c.d_model = 32;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = family == models::Family::kGpt2 ? 4 : 2;
  c.d_ff = family == models::Family::kGpt2 ? 128 : 88;
  c.max_seq_len = 32;
  return c;
}

std::shared_ptr<models::CausalLM> make(const models::ModelConfig& c, uint64_t seed = 1) {
  auto m = models::make_model(c);
  models::init_parameters(*m, seed);
  return m;
}

double max_rel_diff(const at::Tensor& a, const at::Tensor& b) {
  return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item<double>();
}

class BothFamilies : public ::testing::TestWithParam<models::Family> {};

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

namespace {

using loom::parallel::memory::checkpoint;
using models::ActivationCheckpointing;

// CPU bf16 autocast for one scope (the Trainer's --precision bf16).
class CpuBf16Autocast {
 public:
  explicit CpuBf16Autocast(bool enabled)
      : enabled_(enabled),
        was_enabled_(at::autocast::is_autocast_enabled(at::kCPU)),
        previous_dtype_(at::autocast::get_autocast_dtype(at::kCPU)) {
    if (!enabled_) return;
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    at::autocast::set_autocast_enabled(at::kCPU, true);
  }
  ~CpuBf16Autocast() {
    if (!enabled_) return;
    at::autocast::set_autocast_enabled(at::kCPU, was_enabled_);
    at::autocast::set_autocast_dtype(at::kCPU, previous_dtype_);
    at::autocast::clear_cache();
  }
  CpuBf16Autocast(const CpuBf16Autocast&) = delete;
  CpuBf16Autocast& operator=(const CpuBf16Autocast&) = delete;

 private:
  bool enabled_, was_enabled_;
  at::ScalarType previous_dtype_;
};

// The message of whatever a call throws (errors raised inside backward come back through the
// autograd engine); empty, and a test failure, if it does not throw.
template <typename F>
std::string any_error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an exception";
  return "";
}

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
    CpuBf16Autocast autocast(bf16);
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
  auto msg = any_error_of([&] { torch::autograd::grad({again.sum()}, {x}); });
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
      CpuBf16Autocast autocast(true);
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
    CpuBf16Autocast autocast(true);
    auto first_use = checkpoint(fn, {x});
    auto second_use = at::matmul(x.detach(), w);
    EXPECT_EQ(second_use.scalar_type(), at::kBFloat16);
    EXPECT_TRUE(second_use.requires_grad());
  }
  // The recompute (in backward, outside any autocast region) caches no cast: after the weight
  // changes (an optimizer step), the next forward under autocast reads the new weight.
  at::Tensor out;
  {
    CpuBf16Autocast autocast(true);
    out = checkpoint(fn, {x});
  }
  out.to(at::kFloat).sum().backward();
  {
    torch::NoGradGuard no_grad;
    w.mul_(2.0);
  }
  at::Tensor next, fresh;
  {
    CpuBf16Autocast autocast(true);
    next = fn({x});
  }
  {
    at::autocast::clear_cache();
    CpuBf16Autocast autocast(true);
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

INSTANTIATE_TEST_SUITE_P(Models, BothFamilies,
                         ::testing::Values(models::Family::kGpt2, models::Family::kLlama),
                         [](const auto& info) { return models::to_string(info.param); });

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
