#pragma once
// Training checkpoints: model + optimizer + schedule position + data position + RNG.
//
// Layout of a save directory:
//   DIR/step-00000100/model.safetensors      parameters, by fully-qualified name (a model split
//                                            over tp or pp: empty, and model-ppP-tpT.safetensors
//                                            hold each rank's shards with their specs)
//   DIR/step-00000100/optimizer.safetensors  AdamW moments, fp32 masters, step count, RNG state
//   DIR/step-00000100/state.json             step, configs, and the CRC-32 of every file
//   DIR/latest                               name of the newest complete checkpoint
// A checkpoint is written into DIR/step-N.tmp, checksummed, then renamed, and `latest` is
// replaced atomically afterwards: a kill at any moment leaves the previous checkpoint loadable.
#include <ATen/core/Tensor.h>

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>

#include "loom/core/safetensors.h"
#include "loom/parallel/tensor/shard_spec.h"

namespace loom::train {

struct CheckpointContents {
  int64_t step = 0;
  nlohmann::json state;  // everything state.json holds (configs, step, ...)
  std::map<std::string, at::Tensor> model;
  std::map<std::string, at::Tensor> optimizer;
  std::filesystem::path dir;
  // The shard specs of the model's tensors, from the model shard files (split layouts only).
  std::map<std::string, parallel::tensor::ShardSpec> specs;
};

// DIR/step-<step, 8 digits>: where the checkpoint of `step` goes.
std::filesystem::path checkpoint_dir(const std::filesystem::path& dir, int64_t step);

// Writes DIR/step-<step> and points DIR/latest at it. `extra_files` are copied into the
// checkpoint (a tokenizer's meta.json, say); `moved_files` are moved into it (files other ranks
// wrote, such as ZeRO optimizer shards), checksummed like the rest. Keeps the newest
// `keep_last` checkpoints (0 = all). Returns the checkpoint's directory.
std::filesystem::path save_checkpoint(const std::filesystem::path& dir, int64_t step,
                                      const core::NamedTensors& model,
                                      const core::NamedTensors& optimizer, nlohmann::json state,
                                      const std::vector<std::filesystem::path>& extra_files = {},
                                      int keep_last = 2,
                                      const std::vector<std::filesystem::path>& moved_files = {});

// `path` is either a save directory (its `latest` is used) or one checkpoint directory.
// Verifies every checksum; throws loom::Error naming the file that is missing or corrupt. A
// checkpoint of a model split over tp or pp (state.json's "model_shards": one file per writer
// rank, each tensor with its shard spec) comes back assembled into single-process tensors.
CheckpointContents load_checkpoint(const std::filesystem::path& path);

// Reassembles `out.model` and `out.optimizer` from the shard files state.json lists under
// "model_shards" (checksums already verified): each sharded tensor from every tp rank's piece,
// a replicated one from any copy. Throws loom::Error naming a missing piece.
// The shard specs of the model's tensors are put into `specs` (by parameter name).
void assemble_shards(const std::filesystem::path& ckpt, CheckpointContents& out,
                     std::map<std::string, parallel::tensor::ShardSpec>* specs = nullptr);

// Adds to `out.optimizer` the whole AdamW state ("<param>.exp_avg", ".exp_avg_sq", ".master")
// rebuilt from the ZeRO shards state.json lists under "zero_shards" (not done by
// load_checkpoint: only a resume in another layout needs it): each engine's flat dp shards cut
// back into parameters (their metadata names them and their shard specs), then joined across
// tp. So a ZeRO run resumes in any layout, ZeRO or not. A missing dp or tp shard, or a shard
// without its moments or of the wrong length, is a loom::Error naming it.
void assemble_zero_shards(const std::filesystem::path& ckpt, CheckpointContents& out);

// A checkpoint directory as given, or the one a save directory's `latest` names. Throws
// loom::Error when `path` is neither.
std::filesystem::path resolve_checkpoint(const std::filesystem::path& path);

// The checkpoint `latest` names, if there is one.
std::optional<std::filesystem::path> latest_checkpoint(const std::filesystem::path& dir);

}  // namespace loom::train
