// loom-export-hf: a loom checkpoint, saved under any parallel layout, as a Hugging Face
// directory (config.json, safetensors weights, the tokenizer's files).
#include <spdlog/spdlog.h>

#include "loom/apps/cli.h"
#include "loom/loom.h"

int main(int argc, char** argv) {
  CLI::App app{"Write a loom checkpoint as a Hugging Face model directory.", "loom-export-hf"};
  std::string checkpoint, out, dtype = "float32";
  double shard_mb = 5000;
  app.add_option("--checkpoint", checkpoint,
                 "A checkpoint directory, or a save directory (its newest checkpoint)")
      ->required();
  app.add_option("--out", out, "The Hugging Face directory to write (created)")->required();
  app.add_option("--dtype", dtype, "Weights as float32, bfloat16 or float16")
      ->check(CLI::IsMember({"float32", "bfloat16", "float16"}))
      ->capture_default_str();
  app.add_option("--shard-mb", shard_mb,
                 "Largest weight file in MB (10^6 bytes); a larger model is written as shards "
                 "with model.safetensors.index.json")
      ->capture_default_str();
  return loom::apps::run_app(app, argc, argv, [&] {
    loom::core::setup_logging("info");
    const auto type = dtype == "bfloat16"  ? at::kBFloat16
                      : dtype == "float16" ? at::kHalf
                                           : at::kFloat;
    const auto read = loom::train::export_checkpoint_to_hf(checkpoint, out, shard_mb, type);
    spdlog::info("exported {} to {} ({})", read.string(), out, dtype);
  });
}
