#include "loom/models/llama.h"

#include <ATen/ATen.h>

#include <cmath>

#include "loom/core/error.h"
#include "loom/ops/precision.h"
#include "loom/ops/swiglu.h"
#include "loom/parallel/tensor/mappings.h"

namespace loom::models {

namespace nn = torch::nn;
namespace pt = parallel::tensor;

namespace {

// A bias-free column-parallel projection to `heads` heads (0: rows split evenly).
std::shared_ptr<pt::ColumnParallelLinear> column(int64_t in, int64_t out, int64_t heads,
                                                 const pt::TpGroupPtr& tp, const char* what) {
  return std::make_shared<pt::ColumnParallelLinear>(
      in, out, tp, pt::ColumnParallelOptions{.bias = false, .units = heads}, what);
}

// HF's rotate_half: (x1, x2) -> (-x2, x1) over the two halves of the head dimension.
at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

// Norms and rotations run in at least fp32 (bf16 inputs are upcast; fp64 stays fp64).
at::ScalarType compute_type(const at::Tensor& x) {
  return ops::accumulation_dtype(x.scalar_type());
}

at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  // x: [B, H, T, hd]; cos/sin: [T, hd] (broadcast over batch and heads).
  auto xf = x.to(compute_type(x));
  return (xf * cos + rotate_half(xf) * sin).to(x.scalar_type());
}
}  // namespace

RmsNorm::RmsNorm(int64_t dim, double eps) : eps_(eps) {
  weight_ = register_parameter("weight", at::ones({dim}));
}

at::Tensor RmsNorm::forward(const at::Tensor& x) {
  return ops::math_add_norm(x, {}, params()).normed;
}

LlamaBlock::LlamaBlock(const ModelConfig& config, pt::TpGroupPtr tp, int64_t layer,
                       BlockExecutionPtr execution)
    : config_(config), tp_(std::move(tp)), layer_(layer), execution_(std::move(execution)) {
  const int64_t d = config.d_model, hd = config.head_dim();
  input_layernorm_ =
      register_module("input_layernorm", std::make_shared<RmsNorm>(d, config.norm_eps));
  auto attn = register_module("self_attn", std::make_shared<nn::Module>());
  q_proj_ = attn->register_module(
      "q_proj", column(d, config.n_heads * hd, config.n_heads, tp_, "self_attn.q_proj"));
  k_proj_ = attn->register_module(
      "k_proj", column(d, config.n_kv_heads * hd, config.n_kv_heads, tp_, "self_attn.k_proj"));
  v_proj_ = attn->register_module(
      "v_proj", column(d, config.n_kv_heads * hd, config.n_kv_heads, tp_, "self_attn.v_proj"));
  o_proj_ = attn->register_module(
      "o_proj", std::make_shared<pt::RowParallelLinear>(config.n_heads * hd, d, tp_, false,
                                                        config.n_heads, "self_attn.o_proj"));
  post_attention_layernorm_ =
      register_module("post_attention_layernorm", std::make_shared<RmsNorm>(d, config.norm_eps));
  auto mlp = register_module("mlp", std::make_shared<nn::Module>());
  if (config.ffn_blocks > 1) {
    const auto blocks = [&](int64_t in, int64_t out, const std::string& what) {
      return std::make_shared<pt::BlockDiagonalLinear>(in, out, config.ffn_blocks, tp_, false,
                                                       what);
    };
    gate_blocks_ = mlp->register_module("gate_proj", blocks(d, config.d_ff, "mlp.gate_proj"));
    up_blocks_ = mlp->register_module("up_proj", blocks(d, config.d_ff, "mlp.up_proj"));
    down_blocks_ = mlp->register_module("down_proj", blocks(config.d_ff, d, "mlp.down_proj"));
    return;
  }
  if (config.ffn_rank > 0) {
    const auto column = [&](const std::string& what) {
      return std::make_shared<pt::LowRankColumnLinear>(d, config.d_ff, config.ffn_rank, tp_, false,
                                                       what);
    };
    gate_low_ = mlp->register_module("gate_proj", column("mlp.gate_proj"));
    up_low_ = mlp->register_module("up_proj", column("mlp.up_proj"));
    down_low_ = mlp->register_module(
        "down_proj", std::make_shared<pt::LowRankRowLinear>(config.d_ff, d, config.ffn_rank, tp_,
                                                            false, "mlp.down_proj"));
    return;
  }
  gate_proj_ = mlp->register_module("gate_proj", column(d, config.d_ff, 0, tp_, "mlp.gate_proj"));
  up_proj_ = mlp->register_module("up_proj", column(d, config.d_ff, 0, tp_, "mlp.up_proj"));
  down_proj_ = mlp->register_module(
      "down_proj",
      std::make_shared<pt::RowParallelLinear>(config.d_ff, d, tp_, false, 0, "mlp.down_proj"));
}

at::Tensor LlamaBlock::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return forward(x, cos, sin, layer_);
}

at::Tensor LlamaBlock::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                               int64_t layer, const at::Tensor& first_key) {
  auto& tp = *tp_;
  const int64_t hd = config_.head_dim();
  const int64_t heads = config_.n_heads / tp.size();
  const int64_t kv_heads = std::max<int64_t>(1, config_.n_kv_heads / tp.size());
  const double p = is_training() ? config_.dropout : 0.0;
  const auto norms = execution_ ? execution_->norm : ops::NormBackend::kAuto;
  // The whole sequence.
  auto hn =
      pt::enter_tp_region(ops::add_norm(norms, x, {}, input_layernorm_->params()).normed, tp, 1);
  const int64_t b = hn.size(0), t = hn.size(1);
  auto q = q_proj_->forward(hn).view({b, t, heads, hd}).transpose(1, 2);
  auto k = k_proj_->forward(hn).view({b, t, kv_heads, hd}).transpose(1, 2);
  auto v = v_proj_->forward(hn).view({b, t, kv_heads, hd}).transpose(1, 2);
  auto y = causal_attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, p, tp_, execution_,
                            layer, first_key);
  y = y.transpose(1, 2).reshape({b, t, heads * hd});
  // Like Hugging Face's Llama, dropout (if any) acts on attention probabilities only.
  // The residual add and the second norm in one op (one read of the residual stream where fused).
  const auto [out, normed] =
      ops::add_norm(norms, x, o_proj_->forward(y), post_attention_layernorm_->params());
  // silu(gate) * up in one op (one read of each where fused).
  const auto activation = execution_ ? execution_->activation : ops::ActivationBackend::kAuto;
  if (gate_blocks_) {
    // Each rank's blocks take its slice of the features: all-gathers, no all-reduce.
    auto m = pt::enter_feature_blocks(normed, tp, 1);
    m = down_blocks_->forward(
        ops::swiglu(activation, gate_blocks_->forward(m), up_blocks_->forward(m)));
    return out + pt::exit_feature_blocks(m, tp, 1);
  }
  auto m = pt::enter_tp_region(normed, tp, 1);
  if (gate_low_)
    return out +
           down_low_->forward(ops::swiglu(activation, gate_low_->forward(m), up_low_->forward(m)));
  return out +
         down_proj_->forward(ops::swiglu(activation, gate_proj_->forward(m), up_proj_->forward(m)));
}

Llama::Llama(const ModelConfig& config, pt::TpGroupPtr tp, ModelPart part)
    : CausalLM(config, std::move(tp), part) {
  LOOM_CHECK(config.family == Family::kLlama, "Llama built from a {} config",
             to_string(config.family));
  const auto& p = this->part();
  auto body = register_module("model", std::make_shared<nn::Module>());
  // With tied embeddings the last part of a split model keeps its own copy for the head.
  if (p.first || (p.last && config.tie_embeddings))
    embed_tokens_ = body->register_module(
        "embed_tokens",
        std::make_shared<pt::VocabParallelEmbedding>(config.vocab_size, config.d_model, tp_ptr()));
  auto layers = body->register_module("layers", std::make_shared<nn::Module>());
  std::vector<std::shared_ptr<nn::Module>> blocks;
  for (const int64_t layer : held_blocks()) {
    layers_.push_back(std::make_shared<LlamaBlock>(config, tp_ptr(), layer, execution()));
    blocks.push_back(layers_.back());
  }
  register_blocks("model.layers", layers, std::move(blocks));
  if (p.last) {
    norm_ =
        body->register_module("norm", std::make_shared<RmsNorm>(config.d_model, config.norm_eps));
    if (!config.tie_embeddings)
      lm_head_ = register_module(
          "lm_head",
          std::make_shared<pt::ColumnParallelLinear>(
              config.d_model, config.vocab_size, tp_ptr(),
              pt::ColumnParallelOptions{.bias = false, .padded_out = padded_vocab()}, "lm_head"));
  }
  if (p.last && config.mtp_heads > 0) {
    std::vector<std::shared_ptr<nn::Module>> heads;
    for (int64_t i = 0; i < config.mtp_heads; ++i) {
      auto head = std::make_shared<nn::Module>();
      // Keyed (dropout masks) as layers after the last one.
      mtp_blocks_.push_back(head->register_module(
          "block",
          std::make_shared<LlamaBlock>(config, tp_ptr(), config.n_layers + i, mtp_execution())));
      mtp_norms_.push_back(head->register_module(
          "norm", std::make_shared<RmsNorm>(config.d_model, config.norm_eps)));
      heads.push_back(std::move(head));
    }
    register_mtp_heads(body->register_module("mtp", std::make_shared<nn::Module>()),
                       std::move(heads));
  }

  // Rotary tables: angle(t, i) = t * inv_freq(i), duplicated over both halves.
  auto angles =
      at::outer(at::arange(config.max_seq_len, at::kDouble), rope_inverse_frequencies(config));
  angles = at::cat({angles, angles}, -1);
  rope_cos_ = angles.cos();
  rope_sin_ = angles.sin();
}

at::Tensor Llama::embed(const at::Tensor& tokens) {
  return embed_tokens_->forward(tokens);
}

std::pair<at::Tensor, at::Tensor> Llama::rope_tables(const at::Tensor& input) {
  const int64_t t = full_seq_len(input);
  const auto dtype = compute_type(input);
  if (!rope_cos_used_.defined() || rope_cos_used_.device() != input.device() ||
      rope_cos_used_.scalar_type() != dtype) {
    // Made once: a copy from pageable host memory every forward would wait for the GPU.
    rope_cos_used_ = rope_cos_.to(input.device(), dtype);
    rope_sin_used_ = rope_sin_.to(input.device(), dtype);
  }
  // Under context parallelism this rank's tokens sit at positions of two chunks.
  const auto positions =
      context_parallel_size() > 1 ? token_positions(0, t, t, input.device()) : at::Tensor();
  auto cos = positions.defined() ? rope_cos_used_.index_select(0, positions)
                                 : rope_cos_used_.narrow(0, 0, t);
  auto sin = positions.defined() ? rope_sin_used_.index_select(0, positions)
                                 : rope_sin_used_.narrow(0, 0, t);
  return {cos, sin};
}

at::Tensor Llama::run_layers(const at::Tensor& input) {
  const auto tables = rope_tables(input);
  const auto cos = tables.first, sin = tables.second;
  auto x = input;
  // The rotary tables need no gradient: the blocks may hold them (see CausalLM::BlockFn).
  const int64_t first = part().first_layer, layers = part().end_layer - first;
  for (int64_t i = 0; i < layers; ++i) {
    auto block = layers_[block_index(i)];
    // Dropout keyed by the layer it runs as, not the block: a shared block's uses differ.
    x = run_block(i, x,
                  [block, cos, sin, layer = first + i, fk = first_key()](const at::Tensor& in) {
                    return block->forward(in, cos, sin, layer, fk);
                  });
  }
  return x;
}

at::Tensor Llama::head(const at::Tensor& x) {
  return unembed(final_norm(x));
}

at::Tensor Llama::final_norm(const at::Tensor& x) {
  return ops::add_norm(execution()->norm, x, {}, norm_->params()).normed;
}

at::Tensor Llama::unembedding_shard() {
  if (!lm_head_) return embed_tokens_->weight;
  return lm_head_->bias.defined() ? at::Tensor() : lm_head_->weight;
}

at::Tensor Llama::unembed(const at::Tensor& normed) {
  auto h = pt::enter_tp_region(normed, tp(), 1);
  return lm_head_ ? lm_head_->forward(h) : at::matmul(h, embed_tokens_->weight.t());
}

at::Tensor Llama::mtp_hidden(int64_t index, const at::Tensor& trunk, const at::Tensor& first_key) {
  const auto i = static_cast<size_t>(index);
  const auto [cos, sin] = rope_tables(trunk);
  auto& block = *mtp_blocks_.at(i);
  return ops::add_norm(mtp_execution()->norm,
                       block.forward(trunk, cos, sin, config().n_layers + index, first_key), {},
                       mtp_norms_.at(i)->params())
      .normed;
}

ParamInit Llama::init_for(const std::string& name) const {
  using K = ParamInit::Kind;
  if (name.find("norm.weight") != std::string::npos) return {K::kOnes};
  const double residual = 0.02 / std::sqrt(2.0 * static_cast<double>(config().n_layers));
  // Low-rank factors: each N(0, s^2) with rank s^4 = std^2 (their product: the dense std).
  if (name.ends_with(".u") || name.ends_with(".v")) {
    const double dense = name.find("down_proj.") != std::string::npos ? residual : 0.02;
    return {K::kNormal, std::sqrt(dense / std::sqrt(static_cast<double>(config().ffn_rank)))};
  }
  if (name.ends_with("o_proj.weight") || name.ends_with("down_proj.weight"))
    return {K::kNormal, residual};
  if (name.ends_with(".weight")) return {K::kNormal, 0.02};
  fail("Llama has no initialization rule for parameter '{}'", name);
}

at::Tensor rope_inverse_frequencies(const ModelConfig& config) {
  const int64_t hd = config.head_dim();
  auto inv_freq =
      at::pow(config.rope_theta, -at::arange(0, hd, 2, at::kDouble) / static_cast<double>(hd));
  const auto& rs = config.rope_scaling;
  if (rs.type == "linear") return inv_freq / rs.factor;
  if (rs.type != "llama3") return inv_freq;
  // Llama 3.1: frequencies whose wavelength exceeds what the original context resolved
  // (original_max_seq_len / low_freq_factor) slow down by `factor`; those that complete many turns
  // within it (wavelength below original_max_seq_len / high_freq_factor) stay; in between, a
  // linear blend in original_max_seq_len / wavelength.
  auto* f = inv_freq.data_ptr<double>();
  const double original = static_cast<double>(rs.original_max_seq_len);
  for (int64_t i = 0; i < inv_freq.numel(); ++i) {
    const double wavelength = 2 * M_PI / f[i];
    if (wavelength > original / rs.low_freq_factor) {
      f[i] /= rs.factor;
    } else if (wavelength >= original / rs.high_freq_factor) {
      const double blend =
          (original / wavelength - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor);
      f[i] = (1 - blend) * f[i] / rs.factor + blend * f[i];
    }
  }
  return inv_freq;
}

}  // namespace loom::models
