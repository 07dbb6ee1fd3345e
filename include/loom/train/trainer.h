#pragma once
// The training loop: builds the model, data and optimizer a TrainConfig describes, validates
// all of it before the first step, then trains, evaluates, checkpoints and resumes. Given a
// mesh with dp > 1, each rank trains on its share of every global batch and gradients are
// averaged across the dp group (parallel/data); losses are reduced so every rank reports the
// mean over the whole global batch, and rank 0 alone writes metrics and checkpoints.
#include <chrono>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>

#include "loom/core/memory.h"
#include "loom/data/sampler.h"
#include "loom/data/tokenizer.h"
#include "loom/dist/mesh.h"
#include "loom/models/causal_lm.h"
#include "loom/parallel/data/data_parallel.h"
#include "loom/parallel/pipeline/executor.h"
#include "loom/parallel/pipeline/partition.h"
#include "loom/parallel/tensor/partial_grads.h"
#include "loom/parallel/zero/zero_optimizer.h"
#include "loom/train/checkpoint.h"
#include "loom/train/config.h"
#include "loom/train/lr_schedule.h"
#include "loom/train/metrics.h"
#include "loom/train/optimizer.h"

namespace loom::train {

struct StepResult {
  int64_t step = 0;  // optimizer steps completed, this one included
  double loss = 0;   // mean over the whole batch (all micro-batches)
  double grad_norm = 0;
  double lr = 0;
  double seconds = 0;
  double comm_wait_s = 0;  // time the step blocked on gradient communication (dp > 1)
  // Peak bytes allocated during the step's forwards and backwards above what was allocated
  // when it began (activations, temporaries, and at ZeRO-3 the gathered units).
  int64_t peak_activation_bytes = 0;
  // Model FLOPs utilization of the step (mfu.h), when the device's peak is known (a GPU in
  // the table, or --peak-tflops).
  std::optional<double> mfu;
  // With --pp > 1: this rank's pipeline run (time blocked on its neighbours, most
  // micro-batches in flight).
  parallel::pipeline::PipelineStats pipeline;
};

class Trainer {
 public:
  // Everything that can be wrong with the configuration, the data files, the HF directory, the
  // checkpoint to resume or the save directory is reported here, as loom::Error, before any
  // training happens. `mesh` null: one process. Every rank of the mesh must construct its
  // Trainer with the same config.
  explicit Trainer(TrainConfig config, dist::MeshPtr mesh = nullptr);
  ~Trainer();  // puts back the memory cap that was there before --memory-cap-mb

  // Trains from the current step to config.steps, logging progress, evaluating and saving as
  // configured. Returns the last step's result.
  StepResult fit();
  // One optimizer step over one global batch.
  StepResult train_step();
  // Mean next-token loss over the first `batches` x batch_size sequential windows of the
  // validation data (fewer if it is shorter), the windows split across the dp ranks.
  double evaluate(int64_t batches);
  // Writes a checkpoint of the current state into config.save_dir (rank 0 writes; every rank
  // calls this and returns once it is written).
  std::filesystem::path save_checkpoint();

  int64_t step() const { return step_; }
  // The model; with --pp > 1, this rank's first model part (chunks() has them all).
  models::CausalLM& model() { return *model_; }
  // The model parts this rank holds: the whole model, or with --pp its pipeline chunks (one per
  // virtual stage, chunk c being global stage c * pp + pp rank).
  const std::vector<std::shared_ptr<models::CausalLM>>& chunks() const { return chunks_; }
  // With --pp > 1: the schedule's executor and the layer split (else null).
  const parallel::pipeline::PipelineExecutor* pipeline() const { return pipeline_.get(); }
  const parallel::pipeline::Partition* partition() const {
    return partition_ ? &*partition_ : nullptr;
  }
  const TrainConfig& config() const { return config_; }
  const models::ModelConfig& model_config() const { return model_->config(); }
  const data::Tokenizer& tokenizer() const { return *tokenizer_; }
  const dist::Mesh& mesh() const { return *mesh_; }
  // The gradient synchronization, when dp > 1 without ZeRO (else null); with --pp, that of
  // this rank's first model chunk.
  const parallel::data::DataParallel* data_parallel() const {
    return dp_.empty() ? nullptr : dp_.front().get();
  }
  // The ZeRO engine, with --zero 1-3 (else null); with --pp, that of this rank's first chunk.
  const parallel::zero::ZeroOptimizer* zero() const {
    return zero_.empty() ? nullptr : zero_.front().get();
  }
  // Every parameter in its single-process shape, assembled from tp shards, ZeRO-3 shards or
  // pipeline stages (sharded ones as new tensors; replicated ones may alias the live
  // parameters). Collective: every rank calls it.
  std::map<std::string, at::Tensor> gather_parameters();
  // This rank's memory now: parameters, gradients and optimizer state counted from their
  // tensors, peak activations from the last step (0 before the first).
  core::MemoryReport memory_report() const;

 private:
  // The parameters of this rank's chunks in single-process shapes (collective over tp), and
  // with `optimizer` their AdamW state as the checkpoint stores it, keys prefixed
  // "optimizer/".
  core::NamedTensors local_full_state(bool optimizer) const;
  // What this rank loads of a checkpoint in `dir` to resume: its chunks' parameters (checked
  // against their single-process shapes) and AdamW state, each cut to its tp shard, and the
  // entries of no parameter (step counts, RNG states); no other stage's tensors.
  CheckpointSelection rank_selection(const std::filesystem::path& dir) const;
  // Stage 3: this rank's parameters gathered over dp one unit at a time and written into `file`
  // by dp rank 0 (the others take part in the gathers only), so no rank holds the whole model to
  // save it: as single-process tensors (`prefix` "", tp 1 only) or as this rank's tp shards
  // under `prefix` (with `metadata` holding their specs), then the `extra` tensors. Collective
  // over dp. Returns the error dp rank 0 met (after every gather ran); empty when it worked.
  std::string write_stage3_parameters(const std::filesystem::path& file, const std::string& prefix,
                                      const core::NamedTensors& extra,
                                      const std::map<std::string, std::string>& metadata);
  // What rank 0 writes without ZeRO: every parameter (and the optimizer state, with
  // `extra_optimizer` entries added), collected over tp and the pipeline; empty elsewhere.
  // Collective over replica 0.
  std::pair<std::map<std::string, at::Tensor>, core::NamedTensors> collect_for_rank0(
      bool optimizer, const core::NamedTensors& extra_optimizer);
  // Sums the two copies' gradients of a tied embedding (first and last pipeline stage).
  void sum_tied_embedding_grads();
  void build_pipeline_parts(const models::ModelConfig& model_config,
                            const parallel::tensor::TpGroupPtr& tp_group);
  void log_progress(const StepResult& r, double tokens_per_s, double eta_s) const;
  // After rank 0 wrote something (checkpoint, export) while the others waited: every rank
  // learns whether it worked; rank 0 rethrows its error, the others throw naming `what`.
  void share_rank0_outcome(const std::exception_ptr& failure, const std::string& what);
  // After every rank tried something of its own (`error` empty when it worked): a rank that
  // failed throws its error, the others throw naming how many failed and `what` they could not
  // do, so none waits in a collective for a rank that gave up. Collective over the world.
  void share_outcome(const std::string& error, const std::string& what);

  int64_t dp_size() const { return mesh_->size(dist::Dim::dp); }
  int64_t dp_rank() const { return mesh_->coord(dist::Dim::dp); }
  int64_t tp_size() const { return mesh_->size(dist::Dim::tp); }
  int64_t pp_size() const { return mesh_->size(dist::Dim::pp); }
  int64_t pp_rank() const { return mesh_->coord(dist::Dim::pp); }
  bool is_rank0() const { return mesh_->rank() == 0; }

  TrainConfig config_;
  dist::MeshPtr mesh_;
  std::vector<std::unique_ptr<parallel::data::DataParallel>> dp_;                  // one per chunk
  std::vector<std::unique_ptr<parallel::zero::ZeroOptimizer>> zero_;               // one per chunk
  std::vector<std::unique_ptr<parallel::tensor::PartialGradSync>> partial_grads_;  // per chunk
  std::unique_ptr<parallel::pipeline::PipelineExecutor> pipeline_;
  std::optional<parallel::pipeline::Partition> partition_;
  dist::CommunicatorPtr tied_group_;  // pp ranks 0 and pp - 1, when embeddings are tied
  std::unique_ptr<data::Tokenizer> tokenizer_;
  std::filesystem::path tokenizer_dir_;
  std::shared_ptr<data::TokenShard> train_shard_, val_shard_;
  std::unique_ptr<data::WindowSampler> train_sampler_, val_sampler_;
  std::shared_ptr<models::CausalLM> model_;
  std::vector<std::shared_ptr<models::CausalLM>> chunks_;
  std::unique_ptr<AdamW> optimizer_;
  LrSchedule schedule_;
  MetricsWriter metrics_;
  int64_t step_ = 0;
  int64_t last_peak_activations_ = 0;
  int64_t previous_memory_cap_ = 0;  // restored by the destructor
  // Wall time of the run so far: what earlier processes spent (from the checkpoint) plus this
  // one's since construction, so elapsed_s keeps counting across a resume.
  double elapsed_before_ = 0;
  std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
  double elapsed_s() const;
  // Where the model trains (--device) and what its FLOPs are measured against.
  at::Device device_{at::kCPU};
  double flops_per_token_ = 0;
  double peak_flops_ = 0;  // 0: unknown, no MFU
  // The batch on the training device (pinned and copied without blocking the host on a GPU).
  data::Batch on_device(data::Batch batch) const;
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
