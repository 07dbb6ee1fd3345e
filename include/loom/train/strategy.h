#pragma once
// A Strategy is one way of spreading or saving the work of training: tensor, pipeline and data
// parallelism, ZeRO, activation checkpointing and offload are built-in ones, and a user's own
// registers by name (--strategy NAME[:key=value,...]). The runtime (runtime.h) composes the
// strategies of a run in one documented order (docs/architecture.md): it asks each to check the
// composition, to plan and transform the model, to take part in every optimizer step through the
// phases below, to add its state to checkpoints, and to report its memory and metrics.
// Everything a strategy needs arrives through the RunContext (run_context.h).
#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "loom/core/memory.h"
#include "loom/core/option_spec.h"
#include "loom/core/safetensors.h"
#include "loom/dist/mesh.h"

namespace loom::train {

class RunContext;
struct StepResult;
struct CheckpointContents;

// Where a strategy sits in the composition. Model transforms run in increasing order (the
// pipeline splits the model first, then tensor parallelism shards each stage, ..., and the
// data-parallel layer wraps whatever parameters a rank ends up holding); the gradient phases after
// backward run in decreasing order, innermost wrapper first (as Megatron-Core's finalize: the dp
// reduction finishes before tp's and the pipeline's gradient fix-ups read the gradients).
enum class StrategySlot : int {
  kPipeline = 100,
  kTensor = 200,
  kContext = 250,
  kActivationCheckpointing = 300,
  kActivationOffload = 400,
  kUser = 500,  // where a registered strategy sits unless it says otherwise
  kData = 600,
  kOptimizerOffload = 700,
};

// What a strategy is, for composition checks and for the log.
struct StrategyTraits {
  // Mesh dimensions it communicates over.
  std::vector<dist::Dim> mesh_dims;
  // The TrainConfig fields (flag names) and strategy options it reads.
  std::vector<std::string> config_keys;
  // It makes gradients agree across the data-parallel ranks (or decides they need not): at most
  // one strategy of a composition may; with dp > 1 and none, plain data parallelism is added.
  bool syncs_data_parallel_gradients = false;
  // After gradient sync, whole per-parameter gradients exist only as dp shards (ZeRO-2/3).
  bool shards_gradients = false;
  // It reads whole per-parameter gradients after the sync: incompatible with shards_gradients.
  bool needs_full_gradients = false;
  // It installs the optimizer engine (RunContext::optimizer); at most one may.
  bool owns_optimizer = false;
};

// One micro-batch of one model chunk, as the step phases see it.
struct MicroBatch {
  int64_t chunk = 0;     // which of this rank's model chunks (pipeline: virtual stage)
  int64_t index = 0;     // 0 .. grad_accum - 1
  bool last = false;     // the step's last micro-batch for this chunk
  bool training = true;  // false: an evaluation forward (no backward follows)
};

class Strategy {
 public:
  virtual ~Strategy() = default;
  // The registered name ("data-parallel", "zero-2", "local-sgd", ...), used in every error that
  // names this strategy.
  virtual std::string name() const = 0;
  virtual StrategySlot slot() const { return StrategySlot::kUser; }
  virtual StrategyTraits traits() const { return {}; }

  // Checks the configuration and the whole composition (`all`, in slot order, itself included)
  // before any model is built or collective runs; throws loom::Error naming what is wrong (for
  // an incompatible pair: both strategies and why).
  virtual void validate(const RunContext& /*run*/,
                        const std::vector<const Strategy*>& /*all*/) const {}

  // Before the model is built: how it is split (RunContext::plan).
  virtual void plan_model(RunContext& /*run*/) {}
  // After the parameters are initialized or loaded: shard or wrap the model chunks, install the
  // optimizer engine, build communication state.
  virtual void apply(RunContext& /*run*/) {}

  // The step's phases, in the order the runtime calls them.
  virtual void begin_step(RunContext& /*run*/) {}
  virtual void before_forward(RunContext& /*run*/, const MicroBatch& /*mb*/) {}
  virtual void before_backward(RunContext& /*run*/, const MicroBatch& /*mb*/) {}
  virtual void after_backward(RunContext& /*run*/, const MicroBatch& /*mb*/) {}
  // After every backward of the step: finish this strategy's gradient communication
  // (decreasing slot order). Time blocked on it goes into result.comm_wait_s.
  virtual void finish_gradient_sync(RunContext& /*run*/, StepResult& /*result*/) {}
  // The communicators over which the optimizer engine's local sum of squared gradients is
  // summed to give the global gradient norm (the engine already counts a value held by several
  // ranks of such a group once).
  virtual void grad_norm_groups(RunContext& /*run*/, std::vector<dist::Communicator*>& /*groups*/) {
  }
  // Whether this step's gradients are not to be clipped by their global norm (its norm is still
  // computed and reported): a preconditioned momentum compression's compressed steps. The same
  // answer on every rank.
  virtual bool exempts_step_from_clipping(const RunContext& /*run*/) const { return false; }
  // After the clip: the gradients may not show its factor yet (OptimizerEngine::scale_gradients).
  virtual void before_optimizer_step(RunContext& /*run*/, double /*lr*/) {}
  // Returns true when it cleared the gradients itself (the engine's zero_grad is then skipped).
  virtual bool zero_grad(RunContext& /*run*/) { return false; }
  virtual void after_optimizer_step(RunContext& /*run*/) {}
  // After an evaluation's forwards (before_forward ran for each, with training false).
  virtual void after_evaluation(RunContext& /*run*/) {}

  // Checkpoints: entries of state.json and tensors of optimizer.safetensors this strategy owns.
  // Tensors are saved from rank 0 (replicas hold the same), under keys the strategy chooses
  // (prefix them with its name). Collective: every rank calls save_state.
  virtual void save_state(RunContext& /*run*/, nlohmann::json& /*state*/,
                          std::vector<std::pair<std::string, at::Tensor>>& /*tensors*/) {}
  // On resume, after the model and optimizer state are loaded.
  virtual void load_state(RunContext& /*run*/, const CheckpointContents& /*checkpoint*/) {}
  // State only this rank holds (a compressor's error feedback): the Trainer writes every rank's
  // tensors and metadata into a file of its own in the checkpoint (rank_state_name(world rank,
  // world size)); load_state finds it in checkpoint.dir. Keys and metadata keys prefixed with
  // the strategy's name. Collective: every rank calls it.
  virtual void save_rank_state(RunContext& /*run*/, core::NamedTensors& /*tensors*/,
                               std::map<std::string, std::string>& /*metadata*/) {}

  // Reports: memory this strategy holds beyond the parameters, gradients and optimizer state the
  // engine counts; fields for the step's metrics line; one log line describing it (empty: none).
  virtual void add_memory(const RunContext& /*run*/, core::MemoryReport& /*report*/) const {}
  virtual void add_metrics(const RunContext& /*run*/, const StepResult& /*result*/,
                           nlohmann::json& /*record*/) const {}
  virtual std::string describe(const RunContext& /*run*/) const { return {}; }
};
using StrategyPtr = std::unique_ptr<Strategy>;

// "NAME[:key=value,...]" as given to --strategy (core/option_spec.h: the typed getters and
// check_keys).
struct StrategySpec : core::OptionSpec {
  // Throws loom::Error naming the spec and what is valid.
  static StrategySpec parse(const std::string& text);
};

// The registry of strategies a user chooses by name. Built-ins (what the flags --tp, --pp,
// --zero, ... turn on) are registered too, so `--strategy zero-2` and `--zero 2` are the same.
using StrategyFactory = std::function<StrategyPtr(const StrategySpec& spec)>;
void register_strategy(const std::string& name, StrategyFactory factory);
std::vector<std::string> strategy_names();
// Throws loom::Error naming the registered strategies when there is none called spec.name.
StrategyPtr make_strategy(const StrategySpec& spec);

namespace detail {
struct StrategyRegistration {
  StrategyRegistration(const std::string& name, StrategyFactory factory) {
    register_strategy(name, std::move(factory));
  }
};
}  // namespace detail

}  // namespace loom::train

// Registers strategy `Type` (constructible from a StrategySpec) as `name` at static
// initialization, and defines the symbol `loom_link_strategy_<Id>`. Use it once, in a .cpp file.
// A linker drops an object file of a static library that nothing references, registration and
// all: a binary that links such a library writes LOOM_LINK_STRATEGY(Id) once at namespace scope
// in one of its own .cpp files (e.g. next to main), which references that symbol so the object is
// kept. In a shared library or in the binary's own sources nothing more is needed.
#define LOOM_REGISTER_STRATEGY(Id, Type, name)                                              \
  static const ::loom::train::detail::StrategyRegistration loom_strategy_registration_##Id( \
      name, [](const ::loom::train::StrategySpec& spec) -> ::loom::train::StrategyPtr {     \
        return std::make_unique<Type>(spec);                                                \
      });                                                                                   \
  extern "C" int loom_link_strategy_##Id() {                                                \
    return 1;                                                                               \
  }

#define LOOM_LINK_STRATEGY(Id)              \
  extern "C" int loom_link_strategy_##Id(); \
  [[maybe_unused]] static const int loom_strategy_linked_##Id = loom_link_strategy_##Id()
