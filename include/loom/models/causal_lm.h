#pragma once
// The interface every loom language model implements, and what is common to all of them:
// construction from a config, layout-invariant initialization, and the next-token loss.
#include <torch/nn/module.h>

#include <map>
#include <memory>
#include <string>

#include "loom/models/config.h"

namespace loom::models {

// How one parameter is initialized.
struct ParamInit {
  enum class Kind { kZeros, kOnes, kNormal } kind = Kind::kNormal;
  double std = 0.0;  // for kNormal
};

class CausalLM : public torch::nn::Module {
 public:
  explicit CausalLM(ModelConfig config) : config_(std::move(config)) { config_.validate(); }
  const ModelConfig& config() const { return config_; }

  // tokens: [batch, seq] int64 ids < vocab_size, seq <= max_seq_len.
  // Returns logits [batch, seq, vocab_size] in the model's parameter dtype.
  virtual at::Tensor forward(const at::Tensor& tokens) = 0;

  // The rule for the parameter with this fully-qualified name (as named_parameters() spells
  // it). Throws loom::Error for a name the model does not own.
  virtual ParamInit init_for(const std::string& name) const = 0;

 protected:
  void check_tokens(const at::Tensor& tokens) const;

 private:
  ModelConfig config_;
};

// GPT-2 or Llama, by config.family. Parameters hold LibTorch's default initialization, which
// depends on construction order: call init_parameters for loom's layout-invariant values.
std::shared_ptr<CausalLM> make_model(const ModelConfig& config);

// Layout-invariant initialization: each parameter is drawn from its own generator seeded by
// (seed, fully-qualified name), so its values never depend on how the model is split or on
// the order in which parameters were created.
void init_parameters(CausalLM& model, uint64_t seed);

// Copies tensors[name] into every parameter (cast to its dtype). A missing name or a shape
// that differs is a loom::Error naming `source` (the file or directory they came from).
void load_parameters(CausalLM& model, const std::map<std::string, at::Tensor>& tensors,
                     const std::string& source);

// Mean cross-entropy of logits [B, T, V] against targets [B, T], computed in fp32.
at::Tensor next_token_loss(const at::Tensor& logits, const at::Tensor& targets);

}  // namespace loom::models
