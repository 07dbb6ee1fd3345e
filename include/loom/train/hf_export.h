#pragma once
// A Hugging Face directory from what loom trained: the model (models::save_hf) and the
// tokenizer its data was prepared with, so that transformers' from_pretrained and
// AutoTokenizer.from_pretrained both load it. Used by loom-pretrain --export-hf at the end of a
// run and by loom-export-hf for any checkpoint.
#include <ATen/core/ScalarType.h>

#include <cstdint>
#include <filesystem>

#include "loom/data/tokenizer.h"
#include "loom/models/causal_lm.h"

namespace loom::train {

// Writes `model` (a single-process model: tp 1, whole) and `tokenizer` into `dir`: weight files
// of at most shard_mb MB (10^6 bytes; shards and an index beyond), in `dtype`; the tokenizer's
// document-start token as BOS and EOS in config.json and generation_config.json (in loom's
// shards that token is what follows a document's last one); the tokenizer's files
// (data::export_tokenizer_for_hf).
void write_hf_export(const models::CausalLM& model, const data::Tokenizer& tokenizer,
                     const std::filesystem::path& dir, double shard_mb = 5000,
                     at::ScalarType dtype = at::kFloat);

// loom-export-hf: the model of a checkpoint (a checkpoint directory or a save directory, saved
// under any parallel layout) and the tokenizer saved with it, written as write_hf_export does.
// An fp64 run's parameters are rounded to `dtype`. Returns the checkpoint directory read.
std::filesystem::path export_checkpoint_to_hf(const std::filesystem::path& checkpoint,
                                              const std::filesystem::path& dir,
                                              double shard_mb = 5000,
                                              at::ScalarType dtype = at::kFloat);

}  // namespace loom::train
