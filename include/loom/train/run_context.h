#pragma once
// What the strategies of a run share: the configuration, the mesh, the model chunks this rank
// holds, the optimizer engine and the step runner. The runtime owns one RunContext per run and
// hands it to every strategy phase; nothing a strategy needs is global.
#include <ATen/core/Tensor.h>

#include <any>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "loom/core/memory.h"
#include "loom/core/safetensors.h"
#include "loom/data/sampler.h"
#include "loom/dist/mesh.h"
#include "loom/models/causal_lm.h"
#include "loom/models/custom_model.h"
#include "loom/ops/adamw.h"
#include "loom/parallel/tensor/partial_grads.h"
#include "loom/train/config.h"
#include "loom/train/strategy.h"

namespace loom::parallel::zero {
class ZeroOptimizer;
}

namespace loom::train {

// What updates the parameters from their gradients. The runtime installs a replicated AdamW
// unless a strategy (ZeRO) installs its own.
class OptimizerEngine {
 public:
  virtual ~OptimizerEngine() = default;
  // "AdamW, 12 tensors with weight decay 0.1, 9 without", for the log.
  virtual std::string describe() const = 0;
  // Where parameter `name` of chunk `chunk` keeps its gradient after the sync: the whole
  // .grad(), or this rank's piece of it (ZeRO). Strategies that fix gradients up after the sync
  // (tp partial sums, the tied embedding) go through this.
  virtual parallel::tensor::PartialGradSync::GradPiece grad_piece(size_t chunk,
                                                                  const std::string& name) = 0;
  // This rank's part of parameter `name`'s values, as a 1-D view to modify in place between
  // steps (a strategy that edits weights after the step, as pruning does, writes here): the
  // whole parameter, or under ZeRO-3 this rank's dp shard of it (maybe empty) and the element of
  // the flattened parameter where it starts. `dp_shard`: the dp ranks hold disjoint pieces.
  struct ParamPiece {
    at::Tensor values;
    int64_t offset = 0;
    bool dp_shard = false;
  };
  // The default says the engine does not offer it (a strategy that needs it names itself).
  virtual ParamPiece param_piece(size_t chunk, const std::string& name);
  // This rank's sum of squared gradients (accumulation dtype, a 0-dim float64 tensor on the
  // parameters' device) with values several tp ranks hold weighted to count once, and the tied
  // embedding's second copy left out; an engine holding dp shards sums over dp itself.
  virtual at::Tensor local_grad_squares() = 0;
  // Multiplies every gradient by `factor` (a 0-dim tensor, on the gradients' device): at once,
  // or inside the next step() as it reads them (the replicated engine: no pass of its own). Either
  // way step() applies the scaled gradients; a strategy reading gradients between the clip and
  // the step (before_optimizer_step) must not count on seeing the factor in them.
  virtual void scale_gradients(const at::Tensor& factor) = 0;
  // At the start of every step (a retried one included): drop what an unfinished step left.
  virtual void begin_step() {}
  virtual void step(double lr) = 0;
  virtual void zero_grad() = 0;
  virtual int64_t steps_taken() const = 0;
  virtual double comm_wait_seconds() const { return 0; }
  // Parameters, gradients and optimizer state as this rank holds them.
  virtual void add_memory(core::MemoryReport& report) const = 0;
  // Per-parameter state as checkpoints store it ("<param>.exp_avg", ..., "step"), this rank's
  // tp shards; empty for an engine whose state is flat dp shards (sharded_state()).
  virtual core::NamedTensors per_parameter_state() const = 0;
  // Loads per-parameter state (any layout's, cut to this rank's tp shards); `source` names the
  // checkpoint in errors.
  virtual void load_per_parameter_state(const std::map<std::string, at::Tensor>& state,
                                        const std::string& source) = 0;
  // The flat dp-sharded engines, one per model chunk (ZeRO); empty for a replicated engine.
  virtual std::vector<parallel::zero::ZeroOptimizer*> sharded_state() const { return {}; }
};

// How the forwards and backwards of one step run over this rank's micro-batches: in order
// (the runtime's default), or as a pipeline schedule (the pipeline strategy's).
class StepRunner {
 public:
  virtual ~StepRunner() = default;
  struct Phases {
    std::function<void(const MicroBatch&)> before_forward, before_backward, after_backward;
  };
  // This rank's micro-batch k of the step.
  using BatchFn = std::function<data::Batch(int64_t k)>;
  // Runs the step; returns the loss as the mean over this rank's share of the batch, a 0-dim
  // float64 tensor (on the device: not read here). Records its own stats in `result`.
  virtual at::Tensor run(RunContext& run, const BatchFn& batch_of, const Phases& phases,
                         StepResult& result) = 0;
  // Evaluation: the sum over windows [begin, end) of their mean token loss (each window's loss
  // times its count), forwards only, under no-grad. `windows_per_rank` is the most any dp rank
  // evaluates (collective forwards need every rank to run as many).
  virtual double evaluate(RunContext& run, int64_t begin, int64_t end, int64_t windows_per_rank,
                          const Phases& phases) = 0;
};

// The model chunks this rank builds: one per pipeline stage it holds (the whole model by
// default). The pipeline strategy's plan_model fills it.
struct ModelPlan {
  std::vector<models::ModelPart> parts{models::ModelPart{}};
  // Layer boundaries of the global stages ({0, n_layers}: one stage); recorded in checkpoints.
  std::vector<int64_t> stage_bounds;
};

class RunContext {
 public:
  RunContext(const TrainConfig& config, dist::MeshPtr mesh)
      : config(config), mesh(std::move(mesh)) {}

  const TrainConfig config;
  dist::MeshPtr mesh;
  // The strategies of the run, in slot order (the runtime's).
  std::vector<const Strategy*> strategies;

  models::ModelConfig model_config;
  // Set when the run trains a user's own module (custom_model.h) instead of a loom preset.
  models::CustomModelFactory custom_model;
  parallel::tensor::TpGroupPtr tp_group;
  ModelPlan plan;
  // This rank's model chunks, as ModelPlan::parts.
  std::vector<std::shared_ptr<models::CausalLM>> chunks;
  at::Device device{at::kCPU};

  // AdamW's hyperparameters and which parameters decay, for whichever engine is installed.
  ops::AdamWOptions adamw;
  std::function<bool(const std::string&, const at::Tensor&)> decays;
  // Set by a strategy that keeps optimizer state on the host (read by the engine's owner).
  bool offload_optimizer = false;
  // Set by a strategy whose forwards are collective over dp (ZeRO-3 gathers): every dp rank
  // must run as many forwards, in evaluation too.
  bool collective_forward = false;

  std::unique_ptr<OptimizerEngine> optimizer;
  std::unique_ptr<StepRunner> runner;
  data::WindowSampler* train_sampler = nullptr;
  data::WindowSampler* val_sampler = nullptr;
  int64_t step = 0;  // optimizer steps completed

  // Objects a strategy publishes for others (tests, tools, user code) to read by key, e.g. the
  // pipeline's "pipeline.partition". find<T> returns null when absent or of another type.
  template <typename T>
  void publish(const std::string& key, const T* object) {
    published_[key] = object;
  }
  template <typename T>
  const T* find(const std::string& key) const {
    auto it = published_.find(key);
    if (it == published_.end()) return nullptr;
    auto* p = std::any_cast<const T*>(&it->second);
    return p ? *p : nullptr;
  }

  int64_t size(dist::Dim d) const { return mesh->size(d); }
  int64_t coord(dist::Dim d) const { return mesh->coord(d); }
  // Every parameter of this rank's chunks (names are unique across them).
  core::NamedTensors named_parameters() const;
  core::NamedTensors named_parameters(size_t chunk) const;

 private:
  std::map<std::string, std::any> published_;
};

}  // namespace loom::train
