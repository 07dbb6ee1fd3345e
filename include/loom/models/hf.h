#pragma once
// Hugging Face format: a directory with config.json and model.safetensors (or shards and their
// index), using the parameter names and config keys of transformers' GPT2LMHeadModel and
// LlamaForCausalLM, so a model trained in loom loads there with from_pretrained(dir) and back.
#include <filesystem>
#include <memory>
#include <optional>

#include "loom/models/causal_lm.h"
#include "loom/models/hf_config.h"

namespace loom::models {

// Builds the model that config.json describes and loads its weights: model.safetensors, or the
// files a model.safetensors.index.json maps each tensor to (a sharded checkpoint, as the hub
// holds every large model). The files are memory-mapped and each tensor copied once, into the
// model. Every parameter must be present with the right shape; extra tensors are an error too,
// as is an index naming a file outside `dir` or a tensor its file does not hold.
std::shared_ptr<CausalLM> load_hf(const std::filesystem::path& dir);

// Where save_hf puts a model's multi-token prediction heads (ModelConfig::mtp_heads), which the
// Hugging Face model has no place for: loom's parameter names and layouts, the head count in
// the file's metadata ("mtp_heads"). load_hf reads the main model and leaves this file alone.
inline constexpr const char* kMtpHeadsFile = "mtp_heads.safetensors";

// The index of a sharded Hugging Face checkpoint.
inline constexpr const char* kHfIndexFile = "model.safetensors.index.json";

struct HfSaveOptions {
  at::ScalarType dtype = at::kFloat;  // float32, bfloat16 or float16
  // Weight files of at most this many bytes (transformers' "5GB", as most of the hub's models
  // are cut): a model that fits is one model.safetensors, a larger one
  // model-0000i-of-0000n.safetensors with kHfIndexFile. A tensor larger than this gets a file of
  // its own.
  int64_t max_shard_bytes = 5'000'000'000;
  // The tokenizer's ids, written to config.json and generation_config.json when known.
  std::optional<int64_t> bos_token_id, eos_token_id;
};

// Writes config.json, the weights (one file or shards with their index, as max_shard_bytes
// says), generation_config.json when token ids are given, and kMtpHeadsFile when the model has
// multi-token heads. Creates dir; weight files of an earlier export that this one did not write
// are removed, so the directory holds one model.
void save_hf(const CausalLM& model, const std::filesystem::path& dir,
             const HfSaveOptions& options = {});
inline void save_hf(const CausalLM& model, const std::filesystem::path& dir, at::ScalarType dtype) {
  save_hf(model, dir, HfSaveOptions{.dtype = dtype});
}

}  // namespace loom::models
