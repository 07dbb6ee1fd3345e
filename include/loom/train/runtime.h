#pragma once
// The runtime composes a run's strategies: it chooses the built-in ones the flags turn on (--pp,
// --tp, --activation-checkpointing, --offload-activations, --zero or plain data parallelism,
// --offload-optimizer) and adds the registered ones --strategy names, orders them by slot
// (strategy.h; docs/architecture.md), validates the composition, and then drives every phase:
// planning and building the model, applying the strategies, each step's micro-batches, gradient
// sync, the global gradient norm, the optimizer step, checkpoints and reports. The Trainer is a
// loop over these calls and names no parallel dimension.
#include <nlohmann/json.hpp>

#include <memory>
#include <string>
#include <vector>

#include "loom/train/run_context.h"
#include "loom/train/step_result.h"
#include "loom/train/strategy.h"

namespace loom::train {

// The strategy specs a configuration turns on, built-ins first, in the order given (the runtime
// sorts them by slot). Throws loom::Error for a --strategy that does not parse, or that names a
// built-in (those are turned on by their flags).
std::vector<StrategySpec> strategy_specs(const TrainConfig& config, const dist::Mesh& mesh);

// The registered strategies a --strategy may name (the registry's, built-ins left out).
std::vector<std::string> user_strategy_names();

class Runtime {
 public:
  // Makes the strategies (strategy_specs), sorts them by slot and validates the composition.
  // `custom_model`: a user's own module to train (empty: loom's model of the config).
  Runtime(const TrainConfig& config, dist::MeshPtr mesh,
          models::CustomModelFactory custom_model = {});
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  RunContext& context() { return ctx_; }
  const RunContext& context() const { return ctx_; }
  // In slot order.
  std::vector<std::string> strategy_names() const;
  const Strategy* find_strategy(const std::string& name) const;

  // Asks the strategies how to split the model (RunContext::plan) and builds this rank's
  // chunks on the run's tp group, uninitialized.
  void build_model(const models::ModelConfig& model_config);
  // After the chunks hold their initial or loaded values: the strategies' apply, then the
  // default engine (replicated AdamW) and runner (micro-batches in order) where none installed.
  void apply();

  // One step's phases.
  void begin_step();
  // The forwards and backwards; returns this rank's mean loss (0-dim float64, maybe on device).
  at::Tensor run_micro_batches(const StepRunner::BatchFn& batch_of, StepResult& result);
  void finish_gradient_sync(StepResult& result);
  // The global gradient norm (0-dim float64 on the parameters' device) and, when max_norm > 0
  // and it is above, every gradient scaled by max_norm / (norm + 1e-6). On a CPU the norm is
  // read to decide; on a GPU the scale min(1, max / (norm + eps)) is applied without a host read.
  at::Tensor clip_gradients(double max_norm);
  void optimizer_step(double lr, StepResult& result);
  // Evaluation through the runner (see StepRunner::evaluate).
  double evaluate(int64_t begin, int64_t end, int64_t windows_per_rank);

  // Checkpoints and reports, every strategy in slot order.
  void save_state(nlohmann::json& state, core::NamedTensors& tensors);
  void load_state(const CheckpointContents& checkpoint);
  void save_rank_state(core::NamedTensors& tensors, std::map<std::string, std::string>& metadata);
  void add_memory(core::MemoryReport& report) const;
  void add_metrics(const StepResult& result, nlohmann::json& record) const;
  // One line per strategy that describes itself.
  std::vector<std::string> describe() const;

 private:
  StepRunner::Phases phases();
  RunContext ctx_;
  std::vector<StrategyPtr> strategies_;
};

}  // namespace loom::train
