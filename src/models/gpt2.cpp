#include "loom/models/gpt2.h"

#include <ATen/ATen.h>

#include <cmath>

#include "loom/core/error.h"
#include "loom/ops/activation.h"
#include "loom/ops/norm.h"
#include "loom/parallel/tensor/mappings.h"
#include "loom/parallel/tensor/random.h"

namespace loom::models {

namespace nn = torch::nn;
namespace pt = parallel::tensor;

namespace {

ops::NormParams layer_norm_params(const nn::LayerNorm& ln) {
  return {ops::NormKind::kLayerNorm, ln->weight, ln->bias, ln->options.eps()};
}

ops::NormBackend norm_backend(const BlockExecutionPtr& execution) {
  return execution ? execution->norm : ops::NormBackend::kAuto;
}

}  // namespace

Gpt2Block::Gpt2Block(const ModelConfig& config, pt::TpGroupPtr tp, int64_t layer,
                     BlockExecutionPtr execution)
    : config_(config), tp_(std::move(tp)), layer_(layer), execution_(std::move(execution)) {
  const int64_t d = config.d_model;
  auto ln = [&] { return nn::LayerNorm(nn::LayerNormOptions({d}).eps(config.norm_eps)); };
  ln_1_ = register_module("ln_1", ln());
  auto attn = register_module("attn", std::make_shared<nn::Module>());
  c_attn_ = attn->register_module(
      "c_attn", std::make_shared<pt::ColumnParallelLinear>(
                    d, 3 * d, tp_, pt::ColumnParallelOptions{.parts = 3, .units = config.n_heads},
                    "attn.c_attn"));
  attn_c_proj_ = attn->register_module(
      "c_proj",
      std::make_shared<pt::RowParallelLinear>(d, d, tp_, true, config.n_heads, "attn.c_proj"));
  ln_2_ = register_module("ln_2", ln());
  auto mlp = register_module("mlp", std::make_shared<nn::Module>());
  if (config.ffn_blocks > 1) {
    fc_blocks_ =
        mlp->register_module("c_fc", std::make_shared<pt::BlockDiagonalLinear>(
                                         d, config.d_ff, config.ffn_blocks, tp_, true, "mlp.c_fc"));
    proj_blocks_ = mlp->register_module(
        "c_proj", std::make_shared<pt::BlockDiagonalLinear>(config.d_ff, d, config.ffn_blocks, tp_,
                                                            true, "mlp.c_proj"));
    return;
  }
  if (config.ffn_rank > 0) {
    fc_low_ =
        mlp->register_module("c_fc", std::make_shared<pt::LowRankColumnLinear>(
                                         d, config.d_ff, config.ffn_rank, tp_, true, "mlp.c_fc"));
    proj_low_ = mlp->register_module(
        "c_proj", std::make_shared<pt::LowRankRowLinear>(config.d_ff, d, config.ffn_rank, tp_, true,
                                                         "mlp.c_proj"));
    return;
  }
  c_fc_ = mlp->register_module(
      "c_fc", std::make_shared<pt::ColumnParallelLinear>(d, config.d_ff, tp_,
                                                         pt::ColumnParallelOptions{}, "mlp.c_fc"));
  mlp_c_proj_ = mlp->register_module("c_proj", std::make_shared<pt::RowParallelLinear>(
                                                   config.d_ff, d, tp_, true, 0, "mlp.c_proj"));
}

at::Tensor Gpt2Block::forward(const at::Tensor& x) {
  return forward(x, layer_);
}

at::Tensor Gpt2Block::forward(const at::Tensor& x, int64_t layer, const at::Tensor& first_key) {
  auto& tp = *tp_;
  const int64_t h = config_.n_heads / tp.size(), hd = config_.head_dim();
  const double p = is_training() ? config_.dropout : 0.0;
  const int64_t seq_dim = tp.sequence_parallel() ? 1 : -1;  // what residual dropout slices
  const auto norms = norm_backend(execution_);
  // [B, T, D], the whole sequence
  auto a = pt::enter_tp_region(ops::add_norm(norms, x, {}, layer_norm_params(ln_1_)).normed, tp, 1);
  const int64_t b = a.size(0), t = a.size(1);
  // [B, T, 3 * h * hd] (this rank's heads of q, then k, then v) -> [B, T, 3, h, hd]. Where
  // loom's CPU attention kernel runs, it adds the bias as it reads q, k, v (at::linear would
  // fill the GEMM's output with it first: one pass more each way).
  const bool bias_in_attention =
      c_attn_->bias.defined() && attention_takes_projection_bias(a, hd, p, execution_);
  auto qkv = (bias_in_attention ? c_attn_->forward_without_bias(a) : c_attn_->forward(a))
                 .view({b, t, 3, h, hd});
  auto y = causal_attention_packed(qkv, bias_in_attention ? c_attn_->bias : at::Tensor(), p, tp_,
                                   execution_, layer, first_key);
  y = y.transpose(1, 2).reshape({b, t, h * hd});
  // The residual add and ln_2 in one op (one read of the residual stream where fused).
  const auto [out, normed] =
      ops::add_norm(norms, x,
                    pt::sharded_dropout(attn_c_proj_->forward(y), p, is_training(), tp, seq_dim,
                                        ops::dropout_site(layer, ops::DropoutPlace::kAttention)),
                    layer_norm_params(ln_2_));
  if (fc_blocks_) {
    // Each rank's blocks take its slice of the features: all-gathers, no all-reduce.
    auto m = pt::enter_feature_blocks(normed, tp, 1);
    m = pt::exit_feature_blocks(proj_blocks_->forward(ops::gelu_tanh(fc_blocks_->forward(m))), tp,
                                1);
    return out + pt::sharded_dropout(m, p, is_training(), tp, seq_dim,
                                     ops::dropout_site(layer, ops::DropoutPlace::kMlp));
  }
  auto m = pt::enter_tp_region(normed, tp, 1);
  if (fc_low_) {
    m = proj_low_->forward(ops::gelu_tanh(fc_low_->forward(m)));
    return out + pt::sharded_dropout(m, p, is_training(), tp, seq_dim,
                                     ops::dropout_site(layer, ops::DropoutPlace::kMlp));
  }
  // On the CPU the fc bias enters with the activation (one pass fewer); elsewhere the GEMM adds
  // it, as before.
  m = c_fc_->bias.defined() && ops::bias_gelu_tanh_applies(m, c_fc_->bias)
          ? ops::bias_gelu_tanh(c_fc_->forward_without_bias(m), c_fc_->bias)
          : ops::gelu_tanh(c_fc_->forward(m));
  m = mlp_c_proj_->forward(m);
  return out + pt::sharded_dropout(m, p, is_training(), tp, seq_dim,
                                   ops::dropout_site(layer, ops::DropoutPlace::kMlp));
}

Gpt2::Gpt2(const ModelConfig& config, pt::TpGroupPtr tp, ModelPart part)
    : CausalLM(config, std::move(tp), part) {
  LOOM_CHECK(config.family == Family::kGpt2, "Gpt2 built from a {} config",
             to_string(config.family));
  const auto& p = this->part();
  auto body = register_module("transformer", std::make_shared<nn::Module>());
  // The last part of a split model keeps its own copy of the tied embedding for the head.
  if (p.first || p.last)
    wte_ = body->register_module("wte", std::make_shared<pt::VocabParallelEmbedding>(
                                            config.vocab_size, config.d_model, tp_ptr()));
  if (p.first)
    wpe_ = body->register_module("wpe", nn::Embedding(config.max_seq_len, config.d_model));
  auto h = body->register_module("h", std::make_shared<nn::Module>());
  std::vector<std::shared_ptr<nn::Module>> blocks;
  for (const int64_t layer : held_blocks()) {
    h_.push_back(std::make_shared<Gpt2Block>(config, tp_ptr(), layer, execution()));
    blocks.push_back(h_.back());
  }
  register_blocks("transformer.h", h, std::move(blocks));
  auto norm = [&] {
    return nn::LayerNorm(nn::LayerNormOptions({config.d_model}).eps(config.norm_eps));
  };
  if (p.last) ln_f_ = body->register_module("ln_f", norm());
  if (p.last && config.mtp_heads > 0) {
    std::vector<std::shared_ptr<nn::Module>> heads;
    for (int64_t i = 0; i < config.mtp_heads; ++i) {
      auto head = std::make_shared<nn::Module>();
      // Keyed (dropout masks) as layers after the last one.
      mtp_blocks_.push_back(head->register_module(
          "block",
          std::make_shared<Gpt2Block>(config, tp_ptr(), config.n_layers + i, mtp_execution())));
      mtp_norms_.push_back(head->register_module("ln_f", norm()));
      heads.push_back(std::move(head));
    }
    register_mtp_heads(body->register_module("mtp", std::make_shared<nn::Module>()),
                       std::move(heads));
  }
}

at::Tensor Gpt2::embed(const at::Tensor& tokens) {
  auto& tp = this->tp();
  // With sequence parallelism the token embeddings arrive reduce-scattered: this rank's chunk
  // of the sequence, to which its positions' embeddings are added.
  auto x = wte_->forward(tokens);
  const int64_t first = tp.sequence_parallel() ? tp.rank() * x.size(1) : 0;
  x = x + wpe_->forward(token_positions(first, x.size(1), full_seq_len(x), tokens.device()));
  return pt::sharded_dropout(x, config().dropout, is_training(), tp,
                             tp.sequence_parallel() ? 1 : -1,
                             ops::dropout_site(-1, ops::DropoutPlace::kInput));
}

at::Tensor Gpt2::run_layers(const at::Tensor& input) {
  auto x = input;
  const int64_t first = part().first_layer, layers = part().end_layer - first;
  for (int64_t i = 0; i < layers; ++i) {
    auto block = h_[block_index(i)];
    // Dropout keyed by the layer it runs as, not the block: a shared block's uses differ.
    x = run_block(i, x, [block, layer = first + i, fk = first_key()](const at::Tensor& in) {
      return block->forward(in, layer, fk);
    });
  }
  return x;
}

at::Tensor Gpt2::head(const at::Tensor& x) {
  return unembed(final_norm(x));
}

at::Tensor Gpt2::final_norm(const at::Tensor& x) {
  return ops::add_norm(execution()->norm, x, {}, layer_norm_params(ln_f_)).normed;
}

at::Tensor Gpt2::unembedding_shard() {
  return wte_->weight;
}

at::Tensor Gpt2::unembed(const at::Tensor& normed) {
  // Tied output head: logits = x · wteᵀ, this rank's vocabulary rows.
  return at::matmul(pt::enter_tp_region(normed, tp(), 1), wte_->weight.t());
}

at::Tensor Gpt2::mtp_hidden(int64_t index, const at::Tensor& trunk, const at::Tensor& first_key) {
  const auto i = static_cast<size_t>(index);
  auto& block = *mtp_blocks_.at(i);
  return ops::add_norm(mtp_execution()->norm,
                       block.forward(trunk, config().n_layers + index, first_key), {},
                       layer_norm_params(mtp_norms_.at(i)))
      .normed;
}

ParamInit Gpt2::init_for(const std::string& name) const {
  using K = ParamInit::Kind;
  const bool is_norm = name.find(".ln_") != std::string::npos;
  if (name.ends_with(".bias")) return {K::kZeros};
  if (is_norm && name.ends_with(".weight")) return {K::kOnes};
  // GPT-2's scaled init of the projections that write into the residual stream.
  const double residual = 0.02 / std::sqrt(2.0 * static_cast<double>(config().n_layers));
  // Low-rank factors: each N(0, s^2) with rank s^4 = std^2, so that their product has the dense
  // weight's standard deviation.
  if (name.ends_with(".u") || name.ends_with(".v")) {
    const double dense = name.find("c_proj.") != std::string::npos ? residual : 0.02;
    return {K::kNormal, std::sqrt(dense / std::sqrt(static_cast<double>(config().ffn_rank)))};
  }
  if (name.ends_with("c_proj.weight")) return {K::kNormal, residual};
  if (name.ends_with(".weight")) return {K::kNormal, 0.02};
  fail("GPT-2 has no initialization rule for parameter '{}'", name);
}

}  // namespace loom::models
