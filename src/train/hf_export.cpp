#include "loom/train/hf_export.h"

#include <cmath>

#include "loom/core/error.h"
#include "loom/models/hf.h"
#include "loom/train/checkpoint.h"
#include "loom/train/trainer.h"

namespace loom::train {

void write_hf_export(const models::CausalLM& model, const data::Tokenizer& tokenizer,
                     const std::filesystem::path& dir, double shard_mb, at::ScalarType dtype) {
  LOOM_CHECK(shard_mb >= 1e-6 && shard_mb <= 1e9,
             "Hugging Face export: the largest weight file is {} MB; it must be from 1e-6 (one "
             "byte) to 1e9 MB",
             shard_mb);
  models::HfSaveOptions options;
  options.dtype = dtype;
  options.max_shard_bytes = std::llround(shard_mb * 1e6);
  if (const auto start = tokenizer.document_start())
    options.bos_token_id = options.eos_token_id = *start;
  models::save_hf(model, dir, options);
  data::export_tokenizer_for_hf(tokenizer, dir);
}

std::filesystem::path export_checkpoint_to_hf(const std::filesystem::path& checkpoint,
                                              const std::filesystem::path& dir, double shard_mb,
                                              at::ScalarType dtype) {
  const auto ckpt = load_checkpoint(checkpoint, model_parameters_only());
  const auto model = load_model_from_checkpoint(ckpt);
  write_hf_export(*model, *data::load_tokenizer(ckpt.dir), dir, shard_mb, dtype);
  return ckpt.dir;
}

}  // namespace loom::train
