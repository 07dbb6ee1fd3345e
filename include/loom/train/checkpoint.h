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
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

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

// The file in a checkpoint holding what only world rank `rank` of `world` had
// (Strategy::save_rank_state): "rank-state-<rank>-of-<world>.safetensors".
std::string rank_state_name(int64_t rank, int64_t world);

// Writes DIR/step-<step> and points DIR/latest at it. `extra_files` are copied into the
// checkpoint (a tokenizer's meta.json, say); `moved_files` are moved into it (files other ranks
// wrote, such as ZeRO optimizer shards), checksummed like the rest; one named model.safetensors
// takes the place of `model` (ZeRO-3 writes it unit by unit). Keeps the newest
// `keep_last` checkpoints (0 = all). Returns the checkpoint's directory.
std::filesystem::path save_checkpoint(const std::filesystem::path& dir, int64_t step,
                                      const core::NamedTensors& model,
                                      const core::NamedTensors& optimizer, nlohmann::json state,
                                      const std::vector<std::filesystem::path>& extra_files = {},
                                      int keep_last = 2,
                                      const std::vector<std::filesystem::path>& moved_files = {});

// Which tensors of a checkpoint a caller loads, and in what form it keeps them. Keys are
// "model/<parameter>" and "optimizer/<entry>" (the AdamW state "<parameter>.exp_avg",
// ".exp_avg_sq", ".master", the step count "step", the RNG states). Tensors are read and
// assembled one at a time, each handed to `keep` before the next is read: a rank that keeps only
// its own shards never holds the whole model or its optimizer state (the Trainer's resume).
struct CheckpointSelection {
  std::function<bool(const std::string& key)> wanted;  // null: every tensor
  // Called with each wanted tensor in its single-process shape as soon as it is whole; what it
  // returns is what the contents keep (a rank's shard, as a tensor of its own). Null: the whole
  // tensor.
  std::function<at::Tensor(const std::string& key, at::Tensor whole)> keep;
};

// `path` is either a save directory (its `latest` is used) or one checkpoint directory. Reads
// state.json and verifies every checksum; loads no tensor. Throws loom::Error naming the file
// that is missing or corrupt.
CheckpointContents open_checkpoint(const std::filesystem::path& path);

// Loads the selected tensors into `ckpt.model` and `ckpt.optimizer`. A checkpoint of a model
// split over tp or pp (state.json's "model_shards": one file per writer rank, each tensor with
// its shard spec) gives single-process tensors, each assembled from every tp rank's piece (a
// replicated one from any copy); the shard specs of all its tensors go into `ckpt.specs`.
// Throws loom::Error naming a missing piece.
void load_checkpoint_tensors(CheckpointContents& ckpt, const CheckpointSelection& select = {});

// Selects the parameters alone ("model/..."): what loading a model for evaluation or generation
// needs.
CheckpointSelection model_parameters_only();

// open_checkpoint, then load_checkpoint_tensors.
CheckpointContents load_checkpoint(const std::filesystem::path& path,
                                   const CheckpointSelection& select = {});

// Adds to `out.optimizer` the AdamW state ("<param>.exp_avg", ".exp_avg_sq", ".master") that
// `select` wants, rebuilt from the ZeRO shards state.json lists under "zero_shards" (not done by
// load_checkpoint_tensors: only a resume in another layout needs it): each engine's flat dp
// shards cut back into parameters (their metadata names them and their shard specs), then joined
// across tp and handed to `select.keep`. So a ZeRO run resumes in any layout, ZeRO or not. Holds
// the wanted entries of every tp rank at once. Call it after load_checkpoint_tensors: checkpoints
// written before ZeRO shards carried their parameters' shard specs take them from `out.specs`.
// A missing dp or tp shard, or a shard without its moments or of the wrong length, is a
// loom::Error naming it.
void assemble_zero_shards(CheckpointContents& out, const CheckpointSelection& select = {});

// A checkpoint directory as given, or the one a save directory's `latest` names. Throws
// loom::Error when `path` is neither.
std::filesystem::path resolve_checkpoint(const std::filesystem::path& path);

// The checkpoint `latest` names, if there is one.
std::optional<std::filesystem::path> latest_checkpoint(const std::filesystem::path& dir);

}  // namespace loom::train
