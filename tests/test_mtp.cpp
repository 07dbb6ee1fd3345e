// Multi-token prediction (--mtp N): each extra head's loss equals the same computation done by
// plain models (a model whose last layer is that head's block), gradients included; the heads
// run one after another (less peak memory than all at once, measured); checkpoint_sum returns
// each listed parameter's gradient through one accumulation; self-speculative decoding gives
// greedy decoding's tokens, in fewer forwards once the heads have learned something; the heads
// export beside the Hugging Face model; bad input is refused with messages naming it.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <string>
#include <vector>

#include "loom/core/memory.h"
#include "loom/core/rng.h"
#include "loom/core/safetensors.h"
#include "loom/models/causal_lm.h"
#include "loom/models/config.h"
#include "loom/models/generate.h"
#include "loom/models/hf.h"
#include "loom/models/layer_costs.h"
#include "loom/parallel/grad_ready_hooks.h"
#include "loom/parallel/memory/activation_checkpoint.h"
#include "test_util.h"

using loom::testing::contains;
using loom::testing::error_of;
using loom::testing::TempDir;
namespace models = loom::models;
namespace mem = loom::parallel::memory;

namespace {

models::ModelConfig small_config(models::Family family, int64_t heads) {
  auto c =
      models::ModelConfig::preset(family == models::Family::kGpt2 ? "gpt2-tiny" : "llama-tiny");
  c.vocab_size = 97;
  c.max_seq_len = 64;
  c.n_layers = 3;
  c.d_model = 64;
  c.n_heads = 4;
  c.n_kv_heads = family == models::Family::kGpt2 ? 4 : 2;
  c.d_ff = 128;
  c.mtp_heads = heads;
  return c;
}

// Where a family keeps its blocks, final norm and heads.
struct Names {
  std::string layers, norm, mtp, head_norm;
};
Names names_of(models::Family family) {
  if (family == models::Family::kGpt2)
    return {"transformer.h.", "transformer.ln_f.", "transformer.mtp.", "ln_f."};
  return {"model.layers.", "model.norm.", "model.mtp.", "norm."};
}

// The MTP model's computation done by plain models (no heads): the trunk (layers 0 .. n-2) and,
// on its output, one last part per head: the main one, and for head k a last part whose layer
// n-1 and final norm hold head k's block and norm. Gradients map back to the MTP model's names.
struct PlainPieces {
  std::shared_ptr<models::CausalLM> trunk;
  std::vector<std::shared_ptr<models::CausalLM>> heads;  // [0]: the main head
  std::vector<std::map<std::string, std::string>> to_mtp_name;

  PlainPieces(const models::CausalLM& mtp_model, at::ScalarType dtype) {
    auto plain = mtp_model.config();
    const int64_t n = plain.n_layers, count = plain.mtp_heads;
    plain.mtp_heads = 0;
    const auto names = names_of(plain.family);
    std::map<std::string, at::Tensor> params;
    for (const auto& item : mtp_model.named_parameters())
      params.emplace(item.key(), item.value().detach().clone());
    trunk = models::make_model(
        plain, nullptr, {.first_layer = 0, .end_layer = n - 1, .first = true, .last = false});
    models::load_parameters(*trunk, params, "mtp model");
    trunk->to(dtype);
    const std::string last_layer = names.layers + std::to_string(n - 1) + ".";
    for (int64_t k = 0; k <= count; ++k) {
      auto part = models::make_model(
          plain, nullptr, {.first_layer = n - 1, .end_layer = n, .first = false, .last = true});
      std::map<std::string, std::string> rename;
      std::map<std::string, at::Tensor> source;
      for (const auto& item : part->named_parameters()) {
        std::string from = item.key();
        if (k > 0) {
          const std::string head = names.mtp + std::to_string(k - 1) + ".";
          if (from.starts_with(last_layer))
            from = head + "block." + from.substr(last_layer.size());
          else if (from.starts_with(names.norm))
            from = head + names.head_norm + from.substr(names.norm.size());
        }
        rename[item.key()] = from;
        source[item.key()] = params.at(from);
      }
      models::load_parameters(*part, source, "mtp model");
      part->to(dtype);
      heads.push_back(part);
      to_mtp_name.push_back(rename);
    }
  }

  // main loss + sum_k weight_k x head k's loss against the targets k places further on.
  at::Tensor loss(const at::Tensor& tokens, const at::Tensor& targets,
                  const std::vector<double>& weights) {
    const auto hidden = trunk->forward_part(tokens);
    auto total =
        at::cross_entropy_loss(heads[0]->forward_part(hidden).flatten(0, 1), targets.flatten());
    const int64_t s = targets.size(1);
    for (size_t k = 1; k < heads.size(); ++k) {
      if (weights[k - 1] == 0) continue;
      const int64_t shift = static_cast<int64_t>(k);
      const auto logits = heads[k]->forward_part(hidden).narrow(1, 0, s - shift);
      total = total + weights[k - 1] *
                          at::cross_entropy_loss(logits.flatten(0, 1),
                                                 targets.narrow(1, shift, s - shift).flatten());
    }
    return total;
  }

  // The gradients, summed per MTP-model name (the trunk's and every copy of the unembedding).
  std::map<std::string, at::Tensor> grads() const {
    std::map<std::string, at::Tensor> out;
    auto add = [&](const std::string& name, const at::Tensor& g) {
      if (!g.defined()) return;
      auto it = out.find(name);
      if (it == out.end())
        out.emplace(name, g.clone());
      else
        it->second += g;
    };
    for (const auto& item : trunk->named_parameters()) add(item.key(), item.value().grad());
    for (size_t k = 0; k < heads.size(); ++k)
      for (const auto& item : heads[k]->named_parameters())
        add(to_mtp_name[k].at(item.key()), item.value().grad());
    return out;
  }
};

std::pair<at::Tensor, at::Tensor> batch_of(int64_t vocab, int64_t b, int64_t s, uint64_t seed) {
  auto gen = loom::core::make_generator(seed);
  const auto window = at::randint(vocab, {b, s + 1}, gen, at::kLong);
  return {window.narrow(1, 0, s).contiguous(), window.narrow(1, 1, s).contiguous()};
}

double relative(const at::Tensor& got, const at::Tensor& want) {
  return (got - want).norm().item<double>() / want.norm().item<double>();
}

}  // namespace

// Both families, 2 heads with weights 0.5 and 2, fp64: the loss equals the plain models' within
// 1e-12 relative (the same arithmetic, summed in another order), and every gradient within
// 1e-10: the heads' blocks and norms, the trunk, and the unembedding, which the main head and
// both extra heads use. Each head alone (its weight 1, the other 0) adds exactly its own
// shifted-target loss; in eval mode the loss is the next-token loss alone.
TEST(Mtp, EachHeadsLossIsItsShiftedTargetLoss) {
  for (auto family : {models::Family::kGpt2, models::Family::kLlama}) {
    SCOPED_TRACE(models::to_string(family));
    auto model = models::make_model(small_config(family, 2));
    models::init_parameters(*model, 11);
    model->to(at::kDouble);
    model->train();
    const std::vector<double> weights{0.5, 2.0};
    model->set_mtp_loss_weights(weights);
    PlainPieces plain(*model, at::kDouble);
    const auto [tokens, targets] = batch_of(97, 3, 24, 5);

    const auto loss = model->loss(tokens, targets);
    const auto head_losses = model->take_mtp_losses();  // the forward's, unweighted
    ASSERT_TRUE(head_losses.defined());
    EXPECT_FALSE(model->take_mtp_losses().defined());  // taken
    const auto want = plain.loss(tokens, targets, weights);
    EXPECT_LT(std::abs(loss.item<double>() - want.item<double>()), 1e-12 * want.item<double>());
    loss.backward();
    want.backward();
    const auto want_grads = plain.grads();
    for (const auto& item : model->named_parameters()) {
      ASSERT_TRUE(item.value().grad().defined()) << item.key();
      ASSERT_TRUE(want_grads.count(item.key())) << item.key();
      EXPECT_LT(relative(item.value().grad(), want_grads.at(item.key())), 1e-10) << item.key();
    }

    // One head at a time: loss(e_k) - loss(0) is head k's loss.
    torch::NoGradGuard no_grad;
    model->set_mtp_loss_weights({0.0, 0.0});
    const double main = model->loss(tokens, targets).item<double>();
    for (int64_t k = 1; k <= 2; ++k) {
      std::vector<double> one{0.0, 0.0};
      one[static_cast<size_t>(k - 1)] = 1.0;
      model->set_mtp_loss_weights(one);
      const double with_head = model->loss(tokens, targets).item<double>();
      const int64_t s = 24;
      const auto logits = plain.heads[static_cast<size_t>(k)]
                              ->forward_part(plain.trunk->forward_part(tokens))
                              .narrow(1, 0, s - k);
      const double head =
          at::cross_entropy_loss(logits.flatten(0, 1), targets.narrow(1, k, s - k).flatten())
              .item<double>();
      EXPECT_NEAR(with_head - main, head, 1e-12 * head) << "head " << k;
      EXPECT_NEAR(head_losses[k - 1].item<double>(), head, 1e-12 * head) << "head " << k;
    }
    model->eval();
    const double eval_loss = model->loss(tokens, targets).item<double>();
    EXPECT_NEAR(eval_loss, main, 1e-12 * main);
  }
}

// The memory the heads save: gpt2 with a 8192-token vocabulary and 4 heads (fp32, batch 8 x 64
// tokens: each head's logits S = 16 MiB; a cross-entropy keeps its log-softmax, one S, for
// backward). Peaks of loss + backward with 1 head trained (the others' weights 0) and with 4:
// all at once (the plain models above, every head's graph alive until backward) the 3 more heads
// keep 3 S more (bound: more than 2 S); one after another (loom) the peak stays where it was,
// give or take the heads' own parameters and gradients (bound: less than S / 2; measured 1.8 MiB).
TEST(Mtp, HeadsRunOneAfterAnotherInLessMemory) {
  loom::core::install_memory_tracking();
  auto config = small_config(models::Family::kGpt2, 4);
  config.vocab_size = 8192;
  config.n_layers = 2;
  auto model = models::make_model(config);
  models::init_parameters(*model, 3);
  model->train();
  PlainPieces plain(*model, at::kFloat);
  const auto [tokens, targets] = batch_of(config.vocab_size, 8, 64, 9);
  const std::vector<double> weights(4, 1.0);
  // Warm-up (one-time allocations of the kernels), gradients dropped again.
  model->loss(tokens, targets).backward();
  plain.loss(tokens, targets, weights).backward();
  model->zero_grad();
  plain.trunk->zero_grad();
  for (auto& head : plain.heads) head->zero_grad();
  auto peak_of = [&](auto&& step) {
    const int64_t before = loom::core::memory_counters().current_bytes;
    loom::core::reset_peak_memory();
    step();
    return loom::core::memory_counters().peak_bytes - before;
  };
  const std::vector<double> one_head{1.0, 0.0, 0.0, 0.0};
  std::map<std::string, int64_t> peak;
  for (const auto* w : {&one_head, &weights}) {
    const auto tag = w == &weights ? std::string("4") : std::string("1");
    model->set_mtp_loss_weights(*w);
    peak["loom " + tag] = peak_of([&] { model->loss(tokens, targets).backward(); });
    peak["plain " + tag] = peak_of([&] { plain.loss(tokens, targets, *w).backward(); });
    model->zero_grad();
    plain.trunk->zero_grad();
    for (auto& head : plain.heads) head->zero_grad();
  }
  const double mib = 1048576.0, s = 8.0 * 64 * static_cast<double>(config.vocab_size) * 4;
  if (std::getenv("LOOM_TEST_VERBOSE"))
    fmt::print(
        "peak above start (MiB): one at a time {:.1f} (1 head) {:.1f} (4 heads); all at "
        "once {:.1f} / {:.1f}; one head's logits {:.1f}\n",
        peak["loom 1"] / mib, peak["loom 4"] / mib, peak["plain 1"] / mib, peak["plain 4"] / mib,
        s / mib);
  EXPECT_LT(static_cast<double>(peak["loom 4"] - peak["loom 1"]), s / 2);
  EXPECT_GT(static_cast<double>(peak["plain 4"] - peak["plain 1"]), 2 * s);
  EXPECT_LT(peak["loom 4"], peak["plain 4"]);
}

// checkpoint_sum with a listed parameter: w is used outside (x w) and inside both functions;
// its gradient equals plain autograd's, and its post-accumulate-grad hook (what data
// parallelism and ZeRO count) runs once per backward. Without the list the recompute
// accumulates into w itself (twice more), as checkpoint() always did.
TEST(CheckpointSum, ReturnsListedParametersGradientsThroughOneAccumulation) {
  auto gen = loom::core::make_generator(2);
  auto w = at::randn({4, 4}, gen, at::kDouble).requires_grad_();
  auto w_plain = w.detach().clone().requires_grad_();
  const auto x = at::randn({3, 4}, gen, at::kDouble);
  const std::vector<mem::CheckpointFn> fns{
      [&w](const std::vector<at::Tensor>& in) { return at::tanh(at::mm(in[0], w)).sum(); },
      [&w](const std::vector<at::Tensor>& in) { return at::mm(in[0], w).pow(2).sum() * 0.5; }};
  for (const bool listed : {true, false}) {
    SCOPED_TRACE(listed ? "listed" : "not listed");
    w.mutable_grad() = at::Tensor();
    w_plain.mutable_grad() = at::Tensor();
    int calls = 0;
    loom::parallel::GradReadyHooks hooks;
    hooks.add(w, "w", [&calls] { ++calls; });
    mem::CheckpointOptions options;
    if (listed) options.parameters = {w};
    const auto h = at::mm(x, w);
    const auto out = mem::checkpoint_sum(fns, {h}, options);
    out.backward();
    const auto hp = at::mm(x, w_plain);
    (at::tanh(at::mm(hp, w_plain)).sum() + at::mm(hp, w_plain).pow(2).sum() * 0.5).backward();
    EXPECT_NEAR(out.item<double>(),
                (at::tanh(at::mm(at::mm(x, w_plain), w_plain)).sum() +
                 at::mm(at::mm(x, w_plain), w_plain).pow(2).sum() * 0.5)
                    .item<double>(),
                1e-12);
    EXPECT_TRUE(at::allclose(w.grad(), w_plain.grad(), 1e-12, 1e-12));
    EXPECT_EQ(calls, listed ? 1 : 3);
  }
  EXPECT_TRUE(contains(error_of([] { mem::checkpoint_sum({}, {}); }), "no functions"));
}

// Self-speculative decoding. A random fp64 model: the same tokens as greedy decoding (few drafts
// accepted). A model trained for a while on a repeating 7-token pattern, whose heads learn it:
// the same tokens again, in at least 2 tokens per forward (4 heads: up to 5), also past the
// context, where each token is one forward, as in plain decoding.
TEST(Mtp, SpeculativeDecodingGivesGreedyTokensInFewerForwards) {
  {
    auto model = models::make_model(small_config(models::Family::kLlama, 2));
    models::init_parameters(*model, 4);
    model->to(at::kDouble);
    models::GenerateOptions options{.max_new_tokens = 30, .temperature = 0, .context = 48};
    const std::vector<int64_t> prompt{1, 2, 3, 4, 5};
    models::SpeculativeStats stats;
    EXPECT_EQ(models::generate_speculative(*model, prompt, options, &stats),
              models::generate(*model, prompt, options));
    EXPECT_EQ(stats.tokens, 30);
    EXPECT_LE(stats.accepted, stats.drafted);
    EXPECT_EQ(stats.forwards + stats.accepted, 30);
  }
  auto config = small_config(models::Family::kGpt2, 4);
  config.vocab_size = 16;
  config.d_model = 32;
  config.n_layers = 2;
  config.d_ff = 64;
  auto model = models::make_model(config);
  models::init_parameters(*model, 8);
  model->train();
  torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-2));
  const std::vector<int64_t> cycle{3, 9, 4, 1, 12, 7, 5};
  auto gen = loom::core::make_generator(6);
  for (int step = 0; step < 150; ++step) {
    const auto offsets = at::randint(7, {8, 1}, gen, at::kLong);
    const auto window =
        at::tensor(cycle).index_select(0, ((offsets + at::arange(33)) % 7).flatten()).view({8, 33});
    adam.zero_grad();
    model->loss(window.narrow(1, 0, 32), window.narrow(1, 1, 32)).backward();
    adam.step();
  }
  const std::vector<int64_t> prompt{4, 1, 12, 7};
  for (const int64_t context : {int64_t{64}, int64_t{24}}) {
    SCOPED_TRACE(fmt::format("context {}", context));
    models::GenerateOptions options{.max_new_tokens = 40, .temperature = 0, .context = context};
    models::SpeculativeStats stats;
    const auto got = models::generate_speculative(*model, prompt, options, &stats);
    EXPECT_EQ(got, models::generate(*model, prompt, options));
    EXPECT_EQ(stats.forwards + stats.accepted, 40);
    if (std::getenv("LOOM_TEST_VERBOSE"))
      fmt::print("context {}: {} forwards, {} of {} drafted accepted\n", context, stats.forwards,
                 stats.accepted, stats.drafted);
    if (context == 64) {
      EXPECT_GE(stats.tokens_per_forward(), 2.0);
    }
  }
  EXPECT_TRUE(model->is_training());  // put back as it was
}

// save_hf writes the main model as Hugging Face's, and the heads beside it under loom's names;
// load_hf reads the main model back. The parameter count includes the heads; the pipeline's
// last stage is charged for them.
TEST(Mtp, HeadsExportBesideTheModelAndCount) {
  const auto config = small_config(models::Family::kGpt2, 2);
  auto model = models::make_model(config);
  models::init_parameters(*model, 1);
  int64_t numel = 0;
  for (const auto& p : model->parameters()) numel += p.numel();
  EXPECT_EQ(config.num_parameters(), numel);
  auto plain = config;
  plain.mtp_heads = 0;
  EXPECT_EQ(config.num_parameters() - plain.num_parameters(), 2 * config.mtp_head_parameters());
  TempDir dir;
  models::save_hf(*model, dir.path());
  const auto heads = loom::core::load_safetensors(dir.path() / models::kMtpHeadsFile);
  EXPECT_EQ(heads.metadata.at("mtp_heads"), "2");
  std::map<std::string, at::Tensor> params;
  for (const auto& item : model->named_parameters()) params.emplace(item.key(), item.value());
  int64_t head_tensors = 0;
  for (const auto& [name, p] : params) {
    if (name.find(".mtp.") == std::string::npos) continue;
    ++head_tensors;
    ASSERT_TRUE(heads.tensors.count(name)) << name;
    EXPECT_TRUE(at::equal(heads.tensors.at(name), p.detach())) << name;
  }
  EXPECT_EQ(static_cast<int64_t>(heads.tensors.size()), head_tensors);
  const auto back = models::load_hf(dir.path());
  EXPECT_EQ(back->config().mtp_heads, 0);
  const auto [tokens, targets] = batch_of(97, 2, 16, 3);
  torch::NoGradGuard no_grad;
  model->eval();
  EXPECT_TRUE(at::allclose(back->forward(tokens), model->forward(tokens), 1e-5, 1e-5));

  models::CostShape shape{.micro_batch = 2, .seq_len = 16};
  for (const char* kind : {"uniform", "params", "flops"}) {
    const auto with = models::layer_costs(config, kind, shape);
    const auto without = models::layer_costs(plain, kind, shape);
    EXPECT_GT(with.last_time, without.last_time) << kind;
    EXPECT_GT(with.last_bytes, without.last_bytes) << kind;
    EXPECT_EQ(with.layer_time, without.layer_time) << kind;
  }
}

// Bad input names the value and what is valid.
TEST(Mtp, BadInputIsRefused) {
  auto config = small_config(models::Family::kGpt2, -1);
  auto msg = error_of([&] { config.validate(); });
  EXPECT_TRUE(contains(msg, "mtp_heads = -1") && contains(msg, "[0, 16]")) << msg;
  config.mtp_heads = 2;
  auto model = models::make_model(config);
  msg = error_of([&] { model->set_mtp_loss_weights({1.0}); });
  EXPECT_TRUE(contains(msg, "1 given for 2 heads")) << msg;
  msg = error_of([&] { model->set_mtp_loss_weights({1.0, -0.5}); });
  EXPECT_TRUE(contains(msg, "-0.5") && contains(msg, "head 2")) << msg;
  // Sequences no longer than the heads reach.
  model->train();
  msg = error_of([&] { model->loss(at::zeros({1, 2}, at::kLong), at::zeros({1, 2}, at::kLong)); });
  EXPECT_TRUE(contains(msg, "more than 2 tokens") && contains(msg, "got 2")) << msg;
  // Logits from elsewhere: the trunk of the forward that made them is needed.
  msg = error_of([&] {
    model->loss_from_logits(at::zeros({1, 4, 97}), at::zeros({1, 4}, at::kLong));
  });
  EXPECT_TRUE(contains(msg, "forward_part and loss_from_logits in turn")) << msg;
  // A last pipeline stage without layers has no trunk to give the heads.
  msg = error_of([&] {
    models::make_model(config, nullptr, {.first_layer = 3, .end_layer = 3, .first = false});
  });
  EXPECT_TRUE(contains(msg, "must hold at least that layer") && contains(msg, "no layers")) << msg;
  // Speculative decoding: greedy only, and only with heads.
  const std::vector<int64_t> prompt{1, 2};
  msg = error_of([&] {
    models::generate_speculative(*model, prompt, {.max_new_tokens = 2, .temperature = 0.7});
  });
  EXPECT_TRUE(contains(msg, "temperature must be 0 (got 0.7)")) << msg;
  auto plain = config;
  plain.mtp_heads = 0;
  auto without = models::make_model(plain);
  msg = error_of([&] {
    models::generate_speculative(*without, prompt, {.max_new_tokens = 2, .temperature = 0});
  });
  EXPECT_TRUE(contains(msg, "has none (train it with --mtp N)")) << msg;
  msg = error_of([&] { without->forward_heads(at::zeros({1, 2}, at::kLong)); });
  EXPECT_TRUE(contains(msg, "mtp_heads is 0")) << msg;
}
