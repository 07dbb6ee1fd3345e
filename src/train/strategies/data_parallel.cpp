// data-parallel: every dp rank holds the whole (stage of the) model and trains on its share of
// the batch; gradients are averaged across the ranks in buckets, each bucket's all-reduce
// starting during the backward of the step's last micro-batch (parallel/data).
#include <fmt/format.h>

#include "builtin.h"
#include "loom/parallel/data/data_parallel.h"
#include "loom/train/comm_hook_state.h"
#include "loom/train/run_context.h"
#include "loom/train/step_result.h"

namespace loom::train::strategies {

namespace {

class DataParallelStrategy final : public Strategy {
 public:
  explicit DataParallelStrategy(const StrategySpec& spec) { spec.check_keys({}); }
  std::string name() const override { return "data-parallel"; }
  StrategySlot slot() const override { return StrategySlot::kData; }
  StrategyTraits traits() const override {
    StrategyTraits t;
    t.mesh_dims = {dist::Dim::dp};
    t.config_keys = {"bucket_mb", "comm_hook"};
    t.syncs_data_parallel_gradients = true;
    return t;
  }

  void apply(RunContext& run) override {
    parallel::data::DataParallelOptions options;
    options.bucket_mb = run.config.bucket_mb;
    // One per chunk: a pipeline finishes each chunk's last backward at its own time, and that
    // chunk's buckets are reduced from then on while the other chunks still compute. Each with a
    // hook of its own: a hook may carry state per bucket (int8's error feedback).
    for (size_t c = 0; c < run.chunks.size(); ++c) {
      options.hook = parallel::data::make_comm_hook(run.config.comm_hook, run.adamw);
      hooks_.push_back(options.hook);
      dp_.push_back(std::make_unique<parallel::data::DataParallel>(
          run.named_parameters(c), run.mesh->comm_ptr(dist::Dim::dp), options));
    }
    hook_state_ = std::make_unique<CommHookState>("data-parallel", hooks_);
    // Replicas start equal however they were initialized (the init is layout-invariant; this
    // also covers a user-modified model).
    for (auto& dp : dp_) dp->broadcast_parameters();
    run.publish("data_parallel", dp_.front().get());
  }

  bool exempts_step_from_clipping(const RunContext& /*run*/) const override {
    return hook_state_->exempts_step_from_clipping();
  }
  void begin_step(RunContext& run) override {
    // Gradients accumulate over the micro-batches; each chunk's last one turns the sync on.
    for (auto& dp : dp_) dp->set_sync(false);
    for (auto& hook : hooks_) hook->begin_step(run.step);
  }
  void before_backward(RunContext& /*run*/, const MicroBatch& mb) override {
    dp_.at(static_cast<size_t>(mb.chunk))->set_sync(mb.last);
  }
  void finish_gradient_sync(RunContext& /*run*/, StepResult& result) override {
    for (auto& dp : dp_) {
      dp->finish_gradient_sync();
      result.comm_wait_s += dp->last_sync().wait_seconds;
    }
  }
  // Error feedback is per rank: each rank's buckets' carried errors go into its own file.
  void save_rank_state(RunContext& run, core::NamedTensors& tensors,
                       std::map<std::string, std::string>& metadata) override {
    hook_state_->save(run, layout(run), reshard(run), buckets(), tensors, metadata);
  }
  void load_state(RunContext& run, const CheckpointContents& checkpoint) override {
    hook_state_->load(run, checkpoint, layout(run), reshard(run), buckets());
    // Resharded state is laid out for this rank's buckets now, so that a checkpoint written
    // before the next reduction holds it (a no-op otherwise).
    for (size_t c = 0; c < dp_.size(); ++c)
      for (const auto& b : dp_[c]->buckets())
        hooks_[c]->lay_out_resharded(b.index, b.numel(), run.coord(dist::Dim::dp),
                                     run.size(dist::Dim::dp));
  }
  void add_metrics(const RunContext& /*run*/, const StepResult& /*result*/,
                   nlohmann::json& record) const override {
    double sent = 0, fp32 = 0;
    for (const auto& dp : dp_) {
      sent += dp->last_sync().bytes_sent;
      fp32 += dp->last_sync().fp32_bytes;
    }
    record_grad_sync(record, sent, fp32);
  }
  bool zero_grad(RunContext& /*run*/) override {
    // In place: the gradients are views of the communication buckets.
    for (auto& dp : dp_) dp->zero_grad();
    return true;
  }

  std::string describe(const RunContext& run) const override {
    size_t buckets = 0;
    for (const auto& dp : dp_) buckets += dp->buckets().size();
    const int64_t dp_size = run.size(dist::Dim::dp);
    return fmt::format(
        "data-parallel: {} | each rank {} sequences per step in {} micro-batches of {} | {} "
        "gradient buckets (<= {} MiB), comm hook {}",
        run.mesh->shape().describe(), run.config.batch_size / dp_size, run.config.grad_accum,
        run.config.micro_batch_size(dp_size), buckets, run.config.bucket_mb,
        dp_.front()->hook().name());
  }

 private:
  // What a rank's error feedback belongs to: the hook, the mesh, and each chunk's bucket sizes.
  std::string layout(const RunContext& run) const {
    return fmt::format("{} on {}{}", run.config.comm_hook, run.mesh->shape().describe(),
                       bucket_sizes());
  }
  // The same but for the number of dp ranks, with this rank's place in the other dimensions (the
  // ranks whose errors it may take over: same buckets, same slices of the model), and its dp
  // coordinate: error feedback is resharded across numbers of dp ranks.
  CommHookState::Reshard reshard(const RunContext& run) const {
    std::string key = run.config.comm_hook;
    for (auto d : {dist::Dim::tp, dist::Dim::cp, dist::Dim::pp})
      key += fmt::format(" {} {} rank {}", dist::to_string(d), run.size(d), run.coord(d));
    return {key + bucket_sizes(), run.coord(dist::Dim::dp), run.size(dist::Dim::dp)};
  }
  CommHookState::Buckets buckets() const {
    CommHookState::Buckets out;
    for (const auto& dp : dp_) {
      auto& chunk = out.emplace_back();
      for (const auto& b : dp->buckets()) chunk.push_back(parallel::data::shape_of(b));
    }
    return out;
  }
  std::string bucket_sizes() const {
    std::string out;
    for (size_t c = 0; c < dp_.size(); ++c) {
      out += fmt::format("; chunk {} buckets", c);
      for (const auto& b : dp_[c]->buckets()) out += fmt::format(" {}", b.numel());
    }
    return out;
  }

  std::vector<std::unique_ptr<parallel::data::DataParallel>> dp_;  // one per chunk
  std::vector<std::shared_ptr<parallel::data::CommHook>> hooks_;   // theirs
  std::unique_ptr<CommHookState> hook_state_;                      // their checkpointed state
};

}  // namespace

void register_data_parallel() {
  register_strategy("data-parallel", [](const StrategySpec& spec) -> StrategyPtr {
    return std::make_unique<DataParallelStrategy>(spec);
  });
}

}  // namespace loom::train::strategies
