#include "loom/models/gpt2.h"

#include <ATen/ATen.h>

#include <cmath>

#include "loom/core/error.h"
#include "loom/ops/attention.h"

namespace loom::models {

namespace nn = torch::nn;

Gpt2Block::Gpt2Block(const ModelConfig& config) : config_(config) {
  const int64_t d = config.d_model;
  auto ln = [&] { return nn::LayerNorm(nn::LayerNormOptions({d}).eps(config.norm_eps)); };
  ln_1_ = register_module("ln_1", ln());
  auto attn = register_module("attn", std::make_shared<nn::Module>());
  c_attn_ = attn->register_module("c_attn", nn::Linear(d, 3 * d));
  attn_c_proj_ = attn->register_module("c_proj", nn::Linear(d, d));
  ln_2_ = register_module("ln_2", ln());
  auto mlp = register_module("mlp", std::make_shared<nn::Module>());
  c_fc_ = mlp->register_module("c_fc", nn::Linear(d, config.d_ff));
  mlp_c_proj_ = mlp->register_module("c_proj", nn::Linear(config.d_ff, d));
}

at::Tensor Gpt2Block::forward(const at::Tensor& x) {
  const int64_t b = x.size(0), t = x.size(1), h = config_.n_heads, hd = config_.head_dim();
  const double p = is_training() ? config_.dropout : 0.0;
  // [B, T, 3D] -> three [B, H, T, hd]
  auto qkv = c_attn_->forward(ln_1_->forward(x)).view({b, t, 3, h, hd}).permute({2, 0, 3, 1, 4});
  auto y = ops::attention(qkv[0], qkv[1], qkv[2], {.causal = true, .dropout = p});
  y = y.transpose(1, 2).reshape({b, t, h * hd});
  auto out = x + at::dropout(attn_c_proj_->forward(y), p, is_training());
  auto m = mlp_c_proj_->forward(at::gelu(c_fc_->forward(ln_2_->forward(out)), "tanh"));
  return out + at::dropout(m, p, is_training());
}

Gpt2::Gpt2(const ModelConfig& config) : CausalLM(config) {
  LOOM_CHECK(config.family == Family::kGpt2, "Gpt2 built from a {} config",
             to_string(config.family));
  auto body = register_module("transformer", std::make_shared<nn::Module>());
  wte_ = body->register_module("wte", nn::Embedding(config.vocab_size, config.d_model));
  wpe_ = body->register_module("wpe", nn::Embedding(config.max_seq_len, config.d_model));
  h_ = body->register_module("h", nn::ModuleList());
  for (int64_t i = 0; i < config.n_layers; ++i) h_->push_back(std::make_shared<Gpt2Block>(config));
  ln_f_ = body->register_module(
      "ln_f", nn::LayerNorm(nn::LayerNormOptions({config.d_model}).eps(config.norm_eps)));
}

at::Tensor Gpt2::forward(const at::Tensor& tokens) {
  check_tokens(tokens);
  const auto positions = at::arange(tokens.size(1), tokens.options());
  auto x = wte_->forward(tokens) + wpe_->forward(positions);
  x = at::dropout(x, is_training() ? config().dropout : 0.0, is_training());
  for (const auto& block : *h_) x = block->as<Gpt2Block>()->forward(x);
  // Tied output head: logits = x · wteᵀ.
  return at::matmul(ln_f_->forward(x), wte_->weight.t());
}

ParamInit Gpt2::init_for(const std::string& name) const {
  using K = ParamInit::Kind;
  const bool is_norm = name.find(".ln_") != std::string::npos;
  if (name.ends_with(".bias")) return {K::kZeros};
  if (is_norm && name.ends_with(".weight")) return {K::kOnes};
  // GPT-2's scaled init of the projections that write into the residual stream.
  if (name.ends_with("c_proj.weight"))
    return {K::kNormal, 0.02 / std::sqrt(2.0 * static_cast<double>(config().n_layers))};
  if (name.ends_with(".weight")) return {K::kNormal, 0.02};
  fail("GPT-2 has no initialization rule for parameter '{}'", name);
}

}  // namespace loom::models
