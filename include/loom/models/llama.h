#pragma once
// Llama: RMSNorm, rotary position embeddings (RoPE, Hugging Face's rotate-half layout),
// SwiGLU MLP, grouped-query attention, no biases, untied output head by default. Parameter
// names are Hugging Face's LlamaForCausalLM names (model.layers.0.self_attn.q_proj.weight, ...).
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include "loom/models/causal_lm.h"

namespace loom::models {

class RmsNorm : public torch::nn::Module {
 public:
  RmsNorm(int64_t dim, double eps);
  at::Tensor forward(const at::Tensor& x);

 private:
  double eps_;
  at::Tensor weight_;
};

class LlamaBlock : public torch::nn::Module {
 public:
  explicit LlamaBlock(const ModelConfig& config);
  // cos, sin: [seq, head_dim] rotary tables.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

 private:
  const ModelConfig config_;
  std::shared_ptr<RmsNorm> input_layernorm_, post_attention_layernorm_;
  torch::nn::Linear q_proj_{nullptr}, k_proj_{nullptr}, v_proj_{nullptr}, o_proj_{nullptr};
  torch::nn::Linear gate_proj_{nullptr}, up_proj_{nullptr}, down_proj_{nullptr};
};

class Llama : public CausalLM {
 public:
  explicit Llama(const ModelConfig& config);
  at::Tensor forward(const at::Tensor& tokens) override;
  ParamInit init_for(const std::string& name) const override;

 private:
  torch::nn::Embedding embed_tokens_{nullptr};
  torch::nn::ModuleList layers_{nullptr};
  std::shared_ptr<RmsNorm> norm_;
  torch::nn::Linear lm_head_{nullptr};  // null when tied to embed_tokens
  at::Tensor rope_cos_, rope_sin_;      // [max_seq_len, head_dim], fp32, not parameters
};

}  // namespace loom::models
