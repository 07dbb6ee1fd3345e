// tensor-parallel: each block's matrices split across the tp ranks (Megatron-style column/row
// parallel layers, vocabulary-parallel embedding and cross-entropy), optionally with sequence
// parallelism. loom's models are built on the run's TpGroup, so the split happens as they are
// built; this strategy makes the gradients that backward leaves partial whole, and counts each
// gradient value once in the global norm. See docs/tensor-parallel.md.
#include <fmt/format.h>

#include "builtin.h"
#include "loom/core/error.h"
#include "loom/parallel/tensor/partial_grads.h"
#include "loom/train/run_context.h"

namespace loom::train::strategies {

namespace {

class TensorParallelStrategy final : public Strategy {
 public:
  explicit TensorParallelStrategy(const StrategySpec& spec) { spec.check_keys({}); }
  std::string name() const override { return "tensor-parallel"; }
  StrategySlot slot() const override { return StrategySlot::kTensor; }
  StrategyTraits traits() const override {
    return {{dist::Dim::tp}, {"tp", "sequence_parallel", "pad_vocab_multiple"}};
  }

  void validate(const RunContext& run, const std::vector<const Strategy*>& /*all*/) const override {
    LOOM_CHECK(!run.custom_model,
               "strategy 'tensor-parallel' (--tp {}) splits loom's parallel layers "
               "(ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding) inside loom's "
               "models; a custom model of plain LibTorch modules cannot be split: use --tp 1",
               run.size(dist::Dim::tp));
  }

  void apply(RunContext& run) override {
    for (size_t c = 0; c < run.chunks.size(); ++c)
      partial_.push_back(std::make_unique<parallel::tensor::PartialGradSync>(
          run.named_parameters(c), run.chunks[c]->shard_specs(), run.tp_group));
  }

  // Replicated parameters used on sequence shards and shared key/value heads: sum their parts
  // where the engine keeps the gradient (whole, or ZeRO's shard: the tp ranks hold alike-laid-out
  // shards and sum the pieces in them).
  void finish_gradient_sync(RunContext& run, StepResult& /*result*/) override {
    for (size_t c = 0; c < partial_.size(); ++c)
      partial_[c]->sync(
          [&run, c](const std::string& name) { return run.optimizer->grad_piece(c, name); });
  }

  void grad_norm_groups(RunContext& run, std::vector<dist::Communicator*>& groups) override {
    groups.push_back(run.tp_group->comm());
  }

  std::string describe(const RunContext& run) const override {
    const auto& m = run.model_config;
    const int64_t tp = run.size(dist::Dim::tp);
    return fmt::format(
        "tensor parallel: tp {}{} | {} of {} heads, {} of {} MLP columns and {} of {} vocabulary "
        "rows (padded from {}) per rank | {} partial gradients summed across ranks per step",
        tp, run.config.sequence_parallel ? " + sequence parallel" : "", m.n_heads / tp, m.n_heads,
        m.d_ff / tp, m.d_ff, run.chunks.front()->padded_vocab() / tp,
        run.chunks.front()->padded_vocab(), m.vocab_size, partial_.front()->num_params());
  }

 private:
  std::vector<std::unique_ptr<parallel::tensor::PartialGradSync>> partial_;  // per chunk
};

}  // namespace

void register_tensor_parallel() {
  register_strategy("tensor-parallel", [](const StrategySpec& spec) -> StrategyPtr {
    return std::make_unique<TensorParallelStrategy>(spec);
  });
}

}  // namespace loom::train::strategies
