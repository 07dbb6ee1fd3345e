#include "loom/models/causal_lm.h"

#include <ATen/ATen.h>
#include <torch/torch.h>

#include "loom/core/error.h"
#include "loom/core/format.h"
#include "loom/core/rng.h"
#include "loom/models/gpt2.h"
#include "loom/models/llama.h"

namespace loom::models {

void CausalLM::check_tokens(const at::Tensor& tokens) const {
  LOOM_CHECK(tokens.dim() == 2, "model input must be [batch, seq] token ids; got shape {}",
             tokens.sizes());
  LOOM_CHECK(tokens.scalar_type() == at::kLong, "model input must be int64 token ids; got {}",
             c10::toString(tokens.scalar_type()));
  LOOM_CHECK(tokens.size(1) <= config_.max_seq_len,
             "sequence length {} exceeds the model's max_seq_len {}", tokens.size(1),
             config_.max_seq_len);
}

std::shared_ptr<CausalLM> make_model(const ModelConfig& config) {
  if (config.family == Family::kGpt2) return std::make_shared<Gpt2>(config);
  return std::make_shared<Llama>(config);
}

void init_parameters(CausalLM& model, uint64_t seed) {
  torch::NoGradGuard no_grad;
  for (const auto& item : model.named_parameters()) {
    const auto& name = item.key();
    auto param = item.value();
    const auto rule = model.init_for(name);
    switch (rule.kind) {
      case ParamInit::Kind::kZeros:
        param.zero_();
        break;
      case ParamInit::Kind::kOnes:
        param.fill_(1.0);
        break;
      case ParamInit::Kind::kNormal: {
        // Drawn in fp32 on the CPU so the values are the same for every dtype and device.
        auto gen = core::make_generator(core::mix_seed({seed, core::stable_hash(name)}));
        auto values = at::empty(param.sizes(), at::kFloat).normal_(0.0, rule.std, gen);
        param.copy_(values);
        break;
      }
    }
  }
}

void load_parameters(CausalLM& model, const std::map<std::string, at::Tensor>& tensors,
                     const std::string& source) {
  torch::NoGradGuard no_grad;
  for (auto& item : model.named_parameters()) {
    auto it = tensors.find(item.key());
    LOOM_CHECK(it != tensors.end(), "'{}' has no tensor '{}'", source, item.key());
    LOOM_CHECK(it->second.sizes() == item.value().sizes(),
               "'{}': tensor '{}' has shape {} but the model needs {}", source, item.key(),
               it->second.sizes(), item.value().sizes());
    item.value().copy_(it->second);
  }
}

at::Tensor next_token_loss(const at::Tensor& logits, const at::Tensor& targets) {
  LOOM_CHECK(logits.dim() == 3 && targets.dim() == 2 && logits.size(0) == targets.size(0) &&
                 logits.size(1) == targets.size(1),
             "loss: logits {} and targets {} do not match ([B, T, V] and [B, T])", logits.sizes(),
             targets.sizes());
  return at::cross_entropy_loss(logits.reshape({-1, logits.size(2)}).to(at::kFloat),
                                targets.reshape({-1}));
}

}  // namespace loom::models
