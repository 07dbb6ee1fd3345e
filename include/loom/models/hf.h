#pragma once
// Hugging Face format: a directory with config.json and model.safetensors, using the parameter
// names and config keys of transformers' GPT2LMHeadModel and LlamaForCausalLM, so a model
// trained in loom loads there with from_pretrained(dir) and back.
#include <filesystem>
#include <memory>

#include "loom/models/causal_lm.h"
#include "loom/models/hf_config.h"

namespace loom::models {

// Builds the model that config.json describes and loads model.safetensors into it. Every
// parameter must be present with the right shape; extra tensors are an error too.
std::shared_ptr<CausalLM> load_hf(const std::filesystem::path& dir);

// Where save_hf puts a model's multi-token prediction heads (ModelConfig::mtp_heads), which the
// Hugging Face model has no place for: loom's parameter names and layouts, the head count in
// the file's metadata ("mtp_heads"). load_hf reads the main model and leaves this file alone.
inline constexpr const char* kMtpHeadsFile = "mtp_heads.safetensors";

// Writes config.json and model.safetensors (fp32 unless `dtype` says otherwise), and
// kMtpHeadsFile when the model has multi-token heads. Creates dir.
void save_hf(const CausalLM& model, const std::filesystem::path& dir,
             at::ScalarType dtype = at::kFloat);

}  // namespace loom::models
