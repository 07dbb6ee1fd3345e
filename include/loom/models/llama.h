#pragma once
// Llama: RMSNorm, rotary position embeddings (RoPE, Hugging Face's rotate-half layout),
// SwiGLU MLP, grouped-query attention, no biases, untied output head by default. Parameter
// names are Hugging Face's LlamaForCausalLM names (model.layers.0.self_attn.q_proj.weight, ...).
// With tensor parallelism, q/k/v are column-parallel by heads (key/value heads replicated over
// tp / n_kv_heads ranks when there are fewer of them than ranks), o_proj row-parallel,
// gate/up column-parallel with the same split (so SiLU(gate) * up stays local), down_proj
// row-parallel, and the embedding and head split by vocabulary rows.

#include "loom/models/causal_lm.h"
#include "loom/parallel/tensor/layers.h"

namespace loom::models {

class RmsNorm : public torch::nn::Module {
 public:
  RmsNorm(int64_t dim, double eps);
  // ATen's operations (ops::math_add_norm); blocks call ops::add_norm with params() instead.
  at::Tensor forward(const at::Tensor& x);
  ops::NormParams params() const { return {ops::NormKind::kRmsNorm, weight_, {}, eps_}; }

 private:
  double eps_;
  at::Tensor weight_;
};

class LlamaBlock : public torch::nn::Module {
 public:
  // layer: the block's index in the whole model (what its dropout masks are keyed by);
  // execution: the owning model's settings (null: plain execution, no recompute).
  LlamaBlock(const ModelConfig& config, parallel::tensor::TpGroupPtr tp, int64_t layer,
             BlockExecutionPtr execution = nullptr);
  // x: [batch, seq, d_model] (with sequence parallelism, this rank's chunk of the sequence);
  // cos, sin: [seq, head_dim] rotary tables for the whole sequence.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
  // The same, with dropout masks keyed as layer `layer` (a block shared across layers runs at
  // each of them), and a document mask's first keys (CausalLM::set_document_mask) or none.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                     int64_t layer, const at::Tensor& first_key = {});

 private:
  const ModelConfig config_;
  parallel::tensor::TpGroupPtr tp_;
  const int64_t layer_;
  BlockExecutionPtr execution_;
  std::shared_ptr<RmsNorm> input_layernorm_, post_attention_layernorm_;
  std::shared_ptr<parallel::tensor::ColumnParallelLinear> q_proj_, k_proj_, v_proj_;
  std::shared_ptr<parallel::tensor::ColumnParallelLinear> gate_proj_, up_proj_;
  std::shared_ptr<parallel::tensor::RowParallelLinear> o_proj_, down_proj_;
  // With ModelConfig::ffn_blocks > 1, the MLP's linears instead.
  std::shared_ptr<parallel::tensor::BlockDiagonalLinear> gate_blocks_, up_blocks_, down_blocks_;
  // With ModelConfig::ffn_rank > 0, the MLP's linears instead.
  std::shared_ptr<parallel::tensor::LowRankColumnLinear> gate_low_, up_low_;
  std::shared_ptr<parallel::tensor::LowRankRowLinear> down_low_;
};

class Llama : public CausalLM {
 public:
  explicit Llama(const ModelConfig& config, parallel::tensor::TpGroupPtr tp = nullptr,
                 ModelPart part = {});
  ParamInit init_for(const std::string& name) const override;
  std::string embedding_weight_name() const override { return "model.embed_tokens.weight"; }

 protected:
  at::Tensor embed(const at::Tensor& tokens) override;
  at::Tensor run_layers(const at::Tensor& x) override;
  at::Tensor head(const at::Tensor& x) override;
  at::Tensor mtp_hidden(int64_t index, const at::Tensor& trunk,
                        const at::Tensor& first_key) override;
  at::Tensor unembed(const at::Tensor& normed) override;
  at::Tensor final_norm(const at::Tensor& x) override;
  at::Tensor unembedding_shard() override;
  std::string unembedding_weight_name() const override {
    return lm_head_ ? "lm_head.weight" : embedding_weight_name();
  }

 private:
  // The rotary tables' rows for the positions of `input`'s tokens, in its compute dtype.
  std::pair<at::Tensor, at::Tensor> rope_tables(const at::Tensor& input);

  // First part; also the last when tied.
  std::shared_ptr<parallel::tensor::VocabParallelEmbedding> embed_tokens_;
  std::vector<std::shared_ptr<LlamaBlock>> layers_;                  // as CausalLM::blocks()
  std::shared_ptr<RmsNorm> norm_;                                    // last part
  std::shared_ptr<parallel::tensor::ColumnParallelLinear> lm_head_;  // null when tied
  // Multi-token heads (last part): "model.mtp.<i>.block" and "model.mtp.<i>.norm".
  std::vector<std::shared_ptr<LlamaBlock>> mtp_blocks_;
  std::vector<std::shared_ptr<RmsNorm>> mtp_norms_;
  // Rotary tables [max_seq_len, head_dim], not parameters: computed in fp64 on the host, and
  // their copy in the compute dtype on the input's device (made at the first forward there).
  at::Tensor rope_cos_, rope_sin_, rope_cos_used_, rope_sin_used_;
};

// RoPE's inverse frequencies theta^(-2i / head_dim), i < head_dim / 2, in fp64, after the
// config's rope_scaling (ModelConfig::RopeScaling).
at::Tensor rope_inverse_frequencies(const ModelConfig& config);

}  // namespace loom::models
