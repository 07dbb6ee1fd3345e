#pragma once
// Reader and writer for the safetensors format (Hugging Face): an 8-byte little-endian header
// length, a JSON header {name: {dtype, shape, data_offsets}, "__metadata__": {...}}, then the
// raw little-endian tensor bytes. Used for Hugging Face weights and for loom's checkpoints.
#include <ATen/core/Tensor.h>

#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace loom::core {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

struct SafetensorsContents {
  std::map<std::string, at::Tensor> tensors;  // CPU tensors, owning their memory
  std::map<std::string, std::string> metadata;
};

// Writes atomically (temporary name + rename). Supported dtypes: F64, F32, F16, BF16, I64, I32,
// I16, U8, I8, BOOL. Names must be unique. Throws loom::Error naming the path on failure.
void save_safetensors(const std::filesystem::path& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata = {});

// Throws loom::Error naming the path and the problem for a missing, truncated or malformed file.
SafetensorsContents load_safetensors(const std::filesystem::path& path);

}  // namespace loom::core
