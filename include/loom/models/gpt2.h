#pragma once
// GPT-2: learned positions, pre-LayerNorm blocks, GELU (tanh approximation, as OpenAI's and
// Hugging Face's "gelu_new"), tied input/output embeddings. Submodule and parameter names are
// Hugging Face's GPT2LMHeadModel names (transformer.h.0.attn.c_attn.weight, ...), except that
// loom stores every projection as [out, in] like nn.Linear (HF's Conv1D stores [in, out]).
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include "loom/models/causal_lm.h"

namespace loom::models {

class Gpt2Block : public torch::nn::Module {
 public:
  explicit Gpt2Block(const ModelConfig& config);
  at::Tensor forward(const at::Tensor& x);

 private:
  const ModelConfig config_;
  torch::nn::LayerNorm ln_1_{nullptr}, ln_2_{nullptr};
  torch::nn::Linear c_attn_{nullptr}, attn_c_proj_{nullptr}, c_fc_{nullptr}, mlp_c_proj_{nullptr};
};

class Gpt2 : public CausalLM {
 public:
  explicit Gpt2(const ModelConfig& config);
  at::Tensor forward(const at::Tensor& tokens) override;
  ParamInit init_for(const std::string& name) const override;

 private:
  torch::nn::Embedding wte_{nullptr}, wpe_{nullptr};
  torch::nn::ModuleList h_{nullptr};
  torch::nn::LayerNorm ln_f_{nullptr};
};

}  // namespace loom::models
