#pragma once
// A Hugging Face model directory's config.json as a ModelConfig (transformers' GPT2Config and
// LlamaConfig keys). Apart from hf.h so that reading a config needs no tensor library.
#include <filesystem>

#include "loom/models/config.h"

namespace loom::models {

// Reads dir/config.json; throws loom::Error for a missing file, an unsupported model_type, a
// missing key or one of the wrong type (naming it), or a shape ModelConfig::validate refuses.
ModelConfig read_hf_config(const std::filesystem::path& dir);

}  // namespace loom::models
