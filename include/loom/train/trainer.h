#pragma once
// The training loop: builds the data, the model and the runtime a TrainConfig describes,
// validates all of it before the first step, then trains, evaluates, checkpoints and resumes.
// How the work is spread (data, tensor, pipeline parallelism, ZeRO, checkpointing, offload, a
// user's registered strategies) is the runtime's (runtime.h): each step is data -> the
// strategies' phases -> optimizer -> metrics -> checkpoints, and the Trainer names no parallel
// dimension. Losses are reduced so every rank reports the mean over the whole global batch, and
// rank 0 alone writes metrics and the checkpoint's shared files.
#include <chrono>
#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "loom/core/memory.h"
#include "loom/data/sampler.h"
#include "loom/data/tokenizer.h"
#include "loom/dist/mesh.h"
#include "loom/models/causal_lm.h"
#include "loom/models/custom_model.h"
#include "loom/train/checkpoint.h"
#include "loom/train/checkpoint_writer.h"
#include "loom/train/config.h"
#include "loom/train/lr_schedule.h"
#include "loom/train/metrics.h"
#include "loom/train/runtime.h"
#include "loom/train/step_result.h"

namespace loom::parallel::zero {
class ZeroOptimizer;
}

namespace loom::train {

// loom-pretrain's exit status after a preemption signal stopped training: 75 (EX_TEMPFAIL from
// sysexits.h, "try again later"), which a job script can tell from success and from failure.
inline constexpr int kPreemptedExitCode = 75;

class Trainer {
 public:
  // Everything that can be wrong with the configuration, the strategies' composition, the data
  // files, the HF directory, the checkpoint to resume or the save directory is reported here, as
  // loom::Error, before any training happens. `mesh` null: one process. Every rank of the mesh
  // must construct its Trainer with the same config.
  explicit Trainer(TrainConfig config, dist::MeshPtr mesh = nullptr);
  // Trains a model of your own (models/custom_model.h) instead of --model/--preset: the factory
  // builds it on every rank. Data parallelism, ZeRO-1/2/3, activation checkpointing (of the
  // blocks it declares), offload and registered strategies apply; --tp, --pp, --init-from-hf,
  // --export-hf and --dropout are refused with a message saying why.
  Trainer(TrainConfig config, dist::MeshPtr mesh, models::CustomModelFactory custom_model);
  ~Trainer();  // puts back the memory cap that was there before --memory-cap-mb

  // Trains from the current step to config.steps, logging progress, evaluating and saving as
  // configured. Returns the last step's result. While it runs, the signals of
  // config.preempt_signals are caught: when one reaches any rank, every rank finishes the step
  // in flight, the ranks agree on it, the checkpoint is written (with a save directory) and fit
  // returns early, preempted_by() naming the signal.
  StepResult fit();
  // The signal that stopped the last fit() (0: it ran to the end).
  int preempted_by() const { return preempted_by_; }
  // One optimizer step over one global batch.
  StepResult train_step();
  // Mean next-token loss over the first `batches` x batch_size sequential windows of each
  // validation source (fewer if it is shorter), the windows split across the dp ranks: the mean
  // over all windows scored; each source's own mean is in val_loss_by_source() after.
  double evaluate(int64_t batches);
  // The last evaluate()'s mean per --val-data source, in the order given.
  const std::vector<std::pair<std::string, double>>& val_loss_by_source() const {
    return val_by_source_;
  }
  // Writes a checkpoint of the current state into config.save_dir (every rank calls this). It
  // first waits for a background write in flight. `in_background`: returns once the collective
  // part is done and rank 0 holds copies of what it writes; rank 0 writes the files on a thread
  // of its own (checkpoint_writer.h) while the caller trains on; the next save, fit's end or
  // wait_for_checkpoint() waits for it (a custom loop must call it, or save again, before the
  // Trainer goes: only then does every rank learn whether the write worked). Otherwise it
  // returns once the checkpoint is complete.
  std::filesystem::path save_checkpoint(bool in_background = false);
  // Waits for a background write in flight (none: returns at once); every rank learns whether it
  // worked (rank 0 rethrows its error, the others throw naming it). Collective.
  void wait_for_checkpoint();

  int64_t step() const { return run().step; }
  // The model; with --pp > 1, this rank's first model part (chunks() has them all).
  models::CausalLM& model() { return *run().chunks.front(); }
  // The model parts this rank holds: the whole model, or with --pp its pipeline chunks (one per
  // virtual stage, chunk c being global stage c * pp + pp rank).
  const std::vector<std::shared_ptr<models::CausalLM>>& chunks() const { return run().chunks; }
  const TrainConfig& config() const { return config_; }
  const models::ModelConfig& model_config() const { return run().model_config; }
  const data::Tokenizer& tokenizer() const { return *tokenizer_; }
  const dist::Mesh& mesh() const { return *mesh_; }
  // The runtime: its strategies (strategy_names(), find_strategy) and what they publish
  // (context().find<T>(key): "pipeline.partition", "pipeline.executor", "data_parallel", "zero",
  // "context-parallel.group").
  const Runtime& runtime() const { return *runtime_; }
  // The ZeRO engine of this rank's first chunk, with --zero 1-3 (else null).
  const parallel::zero::ZeroOptimizer* zero() const;
  // Every parameter in its single-process shape, assembled from tp shards, ZeRO-3 shards or
  // pipeline stages (sharded ones as new tensors; replicated ones may alias the live
  // parameters). On the model's device at pp 1, on the host when gathered from pipeline stages.
  // Collective: every rank calls it.
  std::map<std::string, at::Tensor> gather_parameters();
  // This rank's memory now: parameters, gradients and optimizer state counted from their
  // tensors, peak activations from the last step (0 before the first).
  core::MemoryReport memory_report() const;

 private:
  const RunContext& run() const { return runtime_->context(); }
  RunContext& run() { return runtime_->context(); }
  // Construction, in order (trainer_setup.cpp).
  void check_mesh_and_device();
  // Every source of --data and --val-data reads one tokenizer (its files, byte for byte).
  void check_one_tokenizer(const std::vector<data::DataSourceSpec>& train,
                           const std::vector<data::DataSourceSpec>& val) const;
  // `data_tokens`: the training data's tokens, which a resumed run must have the same of.
  models::ModelConfig resolve_model_config(std::optional<CheckpointContents>& resume,
                                           int64_t data_tokens);
  // What the built model must fit: the data's vocabulary, --seq-len, --attention fused.
  void check_model_fits(const models::ModelConfig& model_config) const;
  // Seeds the model's dropout stream (loom's models), or LibTorch's default CPU generator, which
  // a custom model's dropout draws from (seeded per dp rank and pp stage, saved in checkpoints,
  // replayed by checkpointing).
  void seed_dropout();
  at::Generator dropout_generator();  // custom models only
  void log_setup() const;
  // Checkpoints (trainer_checkpoint.cpp).
  void load_checkpoint_parameters(CheckpointContents& resume);
  void load_checkpoint_state(CheckpointContents& resume);
  core::NamedTensors local_full_state(bool optimizer) const;
  CheckpointSelection rank_selection(const std::filesystem::path& dir) const;
  std::string write_stage3_parameters(const std::filesystem::path& file, const std::string& prefix,
                                      const core::NamedTensors& extra,
                                      const std::map<std::string, std::string>& metadata);
  std::pair<std::map<std::string, at::Tensor>, core::NamedTensors> collect_for_rank0(
      bool optimizer, const core::NamedTensors& extra_optimizer);
  void export_hf();
  // After rank 0 wrote something (checkpoint, export) while the others waited: every rank
  // learns whether it worked; rank 0 rethrows its error, the others throw naming `what`.
  void share_rank0_outcome(const std::exception_ptr& failure, const std::string& what);
  // After every rank tried something of its own (`error` empty when it worked): a rank that
  // failed throws its error, the others throw naming how many failed and `what` they could not
  // do, so none waits in a collective for a rank that gave up. Collective over the world.
  void share_outcome(const std::string& error, const std::string& what);
  // `value` reduced over every rank of the world (itself at one rank): one all-reduce.
  int reduce_over_world(int value, dist::ReduceOp op);
  // The multi-token heads' own losses of the step's batch, the same on every rank (empty without
  // heads). Reads the device; collective over the world when there are heads.
  std::vector<double> mtp_losses();
  // With a mixture: each source's training loss in step `step` (StepResult::source_losses) from
  // the rows' losses the models recorded, the same on every rank. Reads the device; collective
  // over the world.
  std::vector<double> source_losses(int64_t step);
  void log_progress(const StepResult& r, double tokens_per_s, double eta_s) const;
  // A mixture's step record: each source's samples in the step and epochs drawn so far.
  void add_source_metrics(nlohmann::json& record) const;
  data::Batch on_device(data::Batch batch) const;
  double elapsed_s() const;
  int64_t data_rank() const { return mesh_->coord(dist::Dim::dp); }
  int64_t data_ranks() const { return mesh_->size(dist::Dim::dp); }
  bool is_rank0() const { return mesh_->rank() == 0; }

  TrainConfig config_;
  dist::MeshPtr mesh_;
  models::CustomModelFactory custom_model_;
  std::unique_ptr<Runtime> runtime_;
  std::unique_ptr<data::Tokenizer> tokenizer_;
  std::filesystem::path tokenizer_dir_;
  std::unique_ptr<data::WindowSampler> train_sampler_;
  // One per --val-data source, each scored apart (evaluate); the last scores by source.
  std::vector<std::unique_ptr<data::WindowSampler>> val_samplers_;
  std::vector<std::pair<std::string, double>> val_by_source_;
  LrSchedule schedule_;
  MetricsWriter metrics_;
  int64_t last_peak_activations_ = 0;
  int64_t previous_memory_cap_ = 0;  // restored by the destructor
  // Wall time of the run so far: what earlier processes spent (from the checkpoint) plus this
  // one's since construction, so elapsed_s keeps counting across a resume.
  double elapsed_before_ = 0;
  std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
  at::Device device_{at::kCPU};
  double flops_per_token_ = 0;
  double peak_flops_ = 0;                // 0: unknown, no MFU
  int preempted_by_ = 0;                 // the signal that stopped the last fit(), or 0
  bool save_in_flight_ = false;          // every rank: a background write has not been waited for
  std::filesystem::path in_flight_dir_;  // every rank: the checkpoint that write is for
  CheckpointWriter writer_;              // last: destroyed first, waiting for a write in flight
};

// Rebuilds the model a checkpoint (directory or save directory) holds, parameters loaded, in the
// run's precision (fp32 parameters; fp64 for a --precision fp64 run).
std::shared_ptr<models::CausalLM> load_model_from_checkpoint(const std::filesystem::path& path);
std::shared_ptr<models::CausalLM> load_model_from_checkpoint(const CheckpointContents& ckpt);

}  // namespace loom::train

namespace loom {
// The memory report of a trainer's rank (Trainer::memory_report()).
inline core::MemoryReport memory_report(const train::Trainer& trainer) {
  return trainer.memory_report();
}
}  // namespace loom
