#pragma once
// GPT-2: learned positions, pre-LayerNorm blocks, GELU (tanh approximation, as OpenAI's and
// Hugging Face's "gelu_new"), tied input/output embeddings. Submodule and parameter names are
// Hugging Face's GPT2LMHeadModel names (transformer.h.0.attn.c_attn.weight, ...), except that
// loom stores every projection as [out, in] like nn.Linear (HF's Conv1D stores [in, out]).
// With tensor parallelism, attention is split by heads (c_attn column-parallel, q/k/v part by
// part; c_proj row-parallel), the MLP column -> row, and the tied embedding/head by
// vocabulary rows.
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/normalization.h>

#include "loom/models/causal_lm.h"
#include "loom/parallel/tensor/layers.h"

namespace loom::models {

class Gpt2Block : public torch::nn::Module {
 public:
  // layer: the block's index in the whole model (what its dropout masks are keyed by);
  // execution: the owning model's settings (null: plain execution, no recompute).
  Gpt2Block(const ModelConfig& config, parallel::tensor::TpGroupPtr tp, int64_t layer,
            BlockExecutionPtr execution = nullptr);
  // x: [batch, seq, d_model] (with sequence parallelism, this rank's chunk of the sequence).
  at::Tensor forward(const at::Tensor& x);
  // The same, with dropout masks keyed as layer `layer` (a block shared across layers runs at
  // each of them), and a document mask's first keys (CausalLM::set_document_mask) or none.
  at::Tensor forward(const at::Tensor& x, int64_t layer, const at::Tensor& first_key = {});

 private:
  const ModelConfig config_;
  parallel::tensor::TpGroupPtr tp_;
  const int64_t layer_;
  BlockExecutionPtr execution_;
  torch::nn::LayerNorm ln_1_{nullptr}, ln_2_{nullptr};
  std::shared_ptr<parallel::tensor::ColumnParallelLinear> c_attn_, c_fc_;
  std::shared_ptr<parallel::tensor::RowParallelLinear> attn_c_proj_, mlp_c_proj_;
  // With ModelConfig::ffn_blocks > 1, the MLP's linears instead.
  std::shared_ptr<parallel::tensor::BlockDiagonalLinear> fc_blocks_, proj_blocks_;
  // With ModelConfig::ffn_rank > 0, the MLP's linears instead.
  std::shared_ptr<parallel::tensor::LowRankColumnLinear> fc_low_;
  std::shared_ptr<parallel::tensor::LowRankRowLinear> proj_low_;
};

class Gpt2 : public CausalLM {
 public:
  explicit Gpt2(const ModelConfig& config, parallel::tensor::TpGroupPtr tp = nullptr,
                ModelPart part = {});
  ParamInit init_for(const std::string& name) const override;
  std::string embedding_weight_name() const override { return "transformer.wte.weight"; }

 protected:
  at::Tensor embed(const at::Tensor& tokens) override;
  at::Tensor run_layers(const at::Tensor& x) override;
  at::Tensor head(const at::Tensor& x) override;
  at::Tensor mtp_hidden(int64_t index, const at::Tensor& trunk,
                        const at::Tensor& first_key) override;
  at::Tensor unembed(const at::Tensor& normed) override;
  at::Tensor final_norm(const at::Tensor& x) override;
  at::Tensor unembedding_shard() override;

 private:
  std::shared_ptr<parallel::tensor::VocabParallelEmbedding> wte_;  // first and last parts
  torch::nn::Embedding wpe_{nullptr};                              // first part
  std::vector<std::shared_ptr<Gpt2Block>> h_;                      // as CausalLM::blocks()
  torch::nn::LayerNorm ln_f_{nullptr};                             // last part
  // Multi-token heads (last part): "transformer.mtp.<i>.block" and "transformer.mtp.<i>.ln_f".
  std::vector<std::shared_ptr<Gpt2Block>> mtp_blocks_;
  std::vector<torch::nn::LayerNorm> mtp_norms_;
};

}  // namespace loom::models
