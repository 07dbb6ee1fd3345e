// context-parallel: each sequence split across the cp ranks (2 x cp chunks, rank i holding
// chunks i and 2 cp - 1 - i for causal load balance), attention as ring attention over the cp
// group, the loss the mean over the whole sequences on every cp rank. loom's models do the split
// once the group is set on them; this strategy sets it, sums the parts of every gradient that the
// cp ranks computed (each rank's backward covers its own tokens), and reports the ring's traffic.
// See docs/context-parallel.md.
#include <ATen/ATen.h>
#include <fmt/format.h>

#include <chrono>

#include "builtin.h"
#include "loom/core/error.h"
#include "loom/dist/coalesced.h"
#include "loom/parallel/context/context_group.h"
#include "loom/parallel/data/grad_bucket.h"
#include "loom/train/run_context.h"
#include "loom/train/step_result.h"

namespace loom::train::strategies {

namespace {

class ContextParallelStrategy final : public Strategy {
 public:
  explicit ContextParallelStrategy(const StrategySpec& spec) { spec.check_keys({}); }
  std::string name() const override { return "context-parallel"; }
  StrategySlot slot() const override { return StrategySlot::kContext; }
  StrategyTraits traits() const override { return {{dist::Dim::cp}, {"cp", "seq_len"}}; }

  void validate(const RunContext& run, const std::vector<const Strategy*>& /*all*/) const override {
    const int64_t cp = run.size(dist::Dim::cp);
    LOOM_CHECK(!run.custom_model,
               "strategy 'context-parallel' (cp {}) needs to know where each token sits in its "
               "sequence; a custom model does not say: use cp 1",
               cp);
    LOOM_CHECK(run.config.seq_len % (2 * cp) == 0,
               "strategy 'context-parallel' cuts each sequence into 2 x cp = {} chunks: --seq-len "
               "{} is not divisible by {}",
               2 * cp, run.config.seq_len, 2 * cp);
    const int64_t tp = run.size(dist::Dim::tp);
    LOOM_CHECK(!run.config.sequence_parallel || (run.config.seq_len / cp) % tp == 0,
               "--sequence-parallel splits each rank's {} tokens (--seq-len {} / cp {}) across tp "
               "{}: not divisible",
               run.config.seq_len / cp, run.config.seq_len, cp, tp);
  }

  void apply(RunContext& run) override {
    group_ = std::make_shared<parallel::context::ContextGroup>(run.mesh->comm_ptr(dist::Dim::cp));
    for (auto& chunk : run.chunks) chunk->set_context_parallel(group_);
    run.publish("context-parallel.group", group_.get());
  }

  void begin_step(RunContext& /*run*/) override { group_->stats().reset(); }

  // Each rank's backward gave its tokens' share of every gradient: sum the shares where the
  // engine keeps the gradient (whole, or ZeRO's dp shard, laid out alike on every cp rank).
  void finish_gradient_sync(RunContext& run, StepResult& result) override {
    const auto start = std::chrono::steady_clock::now();
    std::vector<at::Tensor> pieces;
    for (size_t c = 0; c < run.chunks.size(); ++c)
      for (const auto& [name, p] : run.named_parameters(c)) {
        if (!p.requires_grad()) continue;
        auto piece = run.optimizer->grad_piece(c, name).values;
        if (piece.numel() > 0) pieces.push_back(std::move(piece));
      }
    // Buckets of about --bucket-mb, one dtype each: one collective per bucket, not per parameter
    // (a parameter larger than that is reduced where it is).
    const auto cap = static_cast<int64_t>(run.config.bucket_mb * 1024 * 1024);
    for (const auto& bucket : parallel::data::assign_buckets(pieces, cap)) {
      std::vector<at::Tensor> parts;
      for (const size_t i : bucket) parts.push_back(pieces[i]);
      dist::all_reduce_coalesced(*group_->comm(), parts);
    }
    result.comm_wait_s +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }

  void add_metrics(const RunContext& /*run*/, const StepResult& /*result*/,
                   nlohmann::json& record) const override {
    const auto& s = group_->stats();
    record["context.ring_bytes_sent"] = s.bytes;
    record["context.ring_wait_s"] = s.wait_s;
    record["context.score_elements"] = s.score_elements;
  }

  std::string describe(const RunContext& run) const override {
    const int64_t cp = run.size(dist::Dim::cp);
    const auto [a, b] = group_->chunks_of(group_->rank());
    return fmt::format(
        "context parallel: cp {} | each sequence in {} chunks of {} tokens, this rank holds "
        "chunks {} and {} | ring attention over the cp group, gradients summed across it",
        cp, 2 * cp, run.config.seq_len / (2 * cp), a, b);
  }

 private:
  parallel::context::ContextGroupPtr group_;
};

}  // namespace

void register_context_parallel() {
  register_strategy("context-parallel", [](const StrategySpec& spec) -> StrategyPtr {
    return std::make_unique<ContextParallelStrategy>(spec);
  });
}

}  // namespace loom::train::strategies
