// The memory strategies: activation checkpointing (recompute each block, or its attention core,
// in backward), activation offload (checkpointed block inputs wait on the host) and optimizer
// offload (the optimizer state and step on the host). See docs/memory.md.
#include <fmt/format.h>

#include "builtin.h"
#include "loom/core/error.h"
#include "loom/parallel/memory/activation_offload.h"
#include "loom/train/run_context.h"

namespace loom::train::strategies {

namespace {

bool has(const std::vector<const Strategy*>& all, const std::string& name) {
  for (const auto* s : all)
    if (s->name() == name) return true;
  return false;
}

class ActivationCheckpointing final : public Strategy {
 public:
  explicit ActivationCheckpointing(const StrategySpec& spec) { spec.check_keys({}); }
  std::string name() const override { return "activation-checkpointing"; }
  StrategySlot slot() const override { return StrategySlot::kActivationCheckpointing; }
  StrategyTraits traits() const override { return {{}, {"activation_checkpointing"}}; }
  void apply(RunContext& run) override {
    const auto mode = models::parse_activation_checkpointing(run.config.activation_checkpointing);
    for (auto& chunk : run.chunks) {
      // A custom model recomputes the blocks it declared; kSelective is loom's attention core.
      LOOM_CHECK(!run.custom_model || mode == models::ActivationCheckpointing::kFull,
                 "--activation-checkpointing {} recomputes the attention core of loom's blocks; "
                 "a custom model is recomputed block by block: use --activation-checkpointing "
                 "full",
                 run.config.activation_checkpointing);
      LOOM_CHECK(!run.custom_model || !chunk->blocks().empty(),
                 "strategy 'activation-checkpointing' on a custom model recomputes the blocks it "
                 "declares (CustomModelSpec::blocks, run through run_block); this one declares "
                 "none");
      chunk->set_activation_checkpointing(mode);
    }
  }
  std::string describe(const RunContext& run) const override {
    return fmt::format("activation checkpointing: {}", run.config.activation_checkpointing);
  }
};

class ActivationOffload final : public Strategy {
 public:
  explicit ActivationOffload(const StrategySpec& spec) { spec.check_keys({}); }
  std::string name() const override { return "activation-offload"; }
  StrategySlot slot() const override { return StrategySlot::kActivationOffload; }
  StrategyTraits traits() const override { return {{}, {"offload_activations"}}; }
  void validate(const RunContext& run, const std::vector<const Strategy*>& all) const override {
    // It moves the inputs full checkpointing keeps: without it there is nothing to move.
    LOOM_CHECK(
        has(all, "activation-checkpointing") && run.config.activation_checkpointing == "full",
        "strategy 'activation-offload' (--offload-activations) moves the block inputs that "
        "strategy 'activation-checkpointing' keeps: it needs --activation-checkpointing "
        "full (it is {})",
        run.config.activation_checkpointing);
  }
  void apply(RunContext& run) override {
    for (auto& chunk : run.chunks)
      chunk->set_activation_offload(std::make_shared<parallel::memory::ActivationOffloader>());
  }
  std::string describe(const RunContext&) const override {
    return "activation offload: checkpointed block inputs wait on the host, prefetched one block "
           "ahead";
  }
};

class OptimizerOffload final : public Strategy {
 public:
  explicit OptimizerOffload(const StrategySpec& spec) { spec.check_keys({}); }
  std::string name() const override { return "optimizer-offload"; }
  StrategySlot slot() const override { return StrategySlot::kOptimizerOffload; }
  StrategyTraits traits() const override { return {{}, {"offload_optimizer"}}; }
  void validate(const RunContext& run, const std::vector<const Strategy*>& all) const override {
    // Only ZeRO's engine keeps its state where it is told; the replicated AdamW does not.
    LOOM_CHECK(has(all, "zero"),
               "strategy 'optimizer-offload' (--offload-optimizer) moves the sharded optimizer "
               "state of strategy 'zero': it needs --zero 1, 2 or 3 (it is {})",
               run.config.zero);
  }
  // Its slot comes after ZeRO's, whose apply builds the engine: the flag is set at plan time,
  // which runs for every strategy before any apply.
  void plan_model(RunContext& run) override { run.offload_optimizer = true; }
  std::string describe(const RunContext&) const override {
    return "optimizer offload: optimizer state and step on the host";
  }
};

}  // namespace

void register_memory_strategies() {
  register_strategy("activation-checkpointing", [](const StrategySpec& spec) -> StrategyPtr {
    return std::make_unique<ActivationCheckpointing>(spec);
  });
  register_strategy("activation-offload", [](const StrategySpec& spec) -> StrategyPtr {
    return std::make_unique<ActivationOffload>(spec);
  });
  register_strategy("optimizer-offload", [](const StrategySpec& spec) -> StrategyPtr {
    return std::make_unique<OptimizerOffload>(spec);
  });
}

}  // namespace loom::train::strategies
