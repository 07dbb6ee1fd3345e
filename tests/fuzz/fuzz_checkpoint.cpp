// A checkpoint from someone else: state.json, the `latest` pointer, and the metadata of model,
// tensor-parallel and ZeRO shard files. The harness puts the input's files into a save
// directory and, so that the fuzzer gets past the integrity check to the metadata behind it,
// rewrites the CRC-32 that state.json lists for each file present to the real one (the check
// itself is tested in tests/test_train.cpp).
#include <ATen/ATen.h>

#include <nlohmann/json.hpp>

#include "fuzz_util.h"
#include "loom/core/files.h"
#include "loom/train/checkpoint.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace loom;
  namespace fs = std::filesystem;
  // state.json, latest, then the safetensors files state.json may name.
  static const char* kFiles[] = {"model.safetensors",         "optimizer.safetensors",
                                 "model-pp0-tp0.safetensors", "model-pp0-tp1.safetensors",
                                 "zero-dp0.safetensors",      "zero-dp1.safetensors"};
  const auto parts = fuzz::split_files(data, size, 2 + std::size(kFiles));
  const auto save_dir = fuzz::scratch_dir() / "save";
  const auto ckpt = save_dir / "step-00000001";
  std::error_code ec;
  loom::core::remove_tree(save_dir, ec);
  fs::create_directories(ckpt);
  fuzz::write_bytes(save_dir / "latest", parts[1]);
  for (size_t i = 0; i < std::size(kFiles); ++i)
    if (!parts[2 + i].empty()) fuzz::write_bytes(ckpt / kFiles[i], parts[2 + i]);
  std::string state(parts[0]);
  auto json = nlohmann::json::parse(state, nullptr, /*allow_exceptions=*/false);
  if (json.is_object() && json.contains("checksums") && json["checksums"].is_object()) {
    for (auto& [file, crc] : json["checksums"].items()) {
      std::error_code ec;
      if (file.find('/') == std::string::npos && fs::is_regular_file(ckpt / file, ec))
        crc = core::file_crc32(ckpt / file);
    }
    state = json.dump();
  }
  fuzz::write_bytes(ckpt / "state.json", state);

  train::CheckpointContents contents;
  if (!fuzz::accepts([&] { contents = train::open_checkpoint(save_dir); })) return 0;
  fuzz::require(fs::equivalent(contents.dir, ckpt), "opened a checkpoint outside the save dir");
  if (!fuzz::accepts([&] { train::load_checkpoint_tensors(contents); })) return 0;
  if (contents.state.contains("zero_shards"))
    fuzz::accepts([&] { train::assemble_zero_shards(contents); });
  return 0;
}
