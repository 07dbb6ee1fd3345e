// zero: ZeRO-1/2/3 along dp. Its engine replaces the replicated AdamW and plain data
// parallelism: gradients are reduce-scattered into flat shards, each rank steps AdamW on its
// shard, and stage 3 keeps only a shard of the parameters, gathering one block at a time for each
// forward and backward. See docs/zero.md.
#include <fmt/format.h>

#include <algorithm>

#include "builtin.h"
#include "loom/core/error.h"
#include "loom/parallel/zero/zero_optimizer.h"
#include "loom/train/comm_hook_state.h"
#include "loom/train/grad_clip.h"
#include "loom/train/run_context.h"
#include "loom/train/step_result.h"

namespace loom::train::strategies {

namespace {

using parallel::zero::ZeroOptimizer;

class ZeroEngine final : public OptimizerEngine {
 public:
  ZeroEngine(std::vector<std::unique_ptr<ZeroOptimizer>> engines, at::Device device)
      : engines_(std::move(engines)), device_(device) {}

  std::string describe() const override {
    int64_t decayed = 0, not_decayed = 0;
    for (const auto& z : engines_) {
      decayed += z->num_decayed();
      not_decayed += z->num_not_decayed();
    }
    return fmt::format("AdamW on ZeRO-{} shards, {} tensors with weight decay, {} without",
                       engines_.front()->stage(), decayed, not_decayed);
  }
  parallel::tensor::PartialGradSync::GradPiece grad_piece(size_t chunk,
                                                          const std::string& name) override {
    auto [values, offset] = engines_.at(chunk)->grad_shard_of(name);
    return {values, offset};
  }
  ParamPiece param_piece(size_t chunk, const std::string& name) override {
    auto& z = *engines_.at(chunk);
    auto [values, offset] = z.param_piece_of(name);
    return {values, offset, z.stage() == 3};
  }
  at::Tensor local_grad_squares() override {
    // Each engine's squares are summed over dp inside it.
    double sq = 0;
    for (auto& z : engines_) sq += z->grad_norm_squared();
    // On the gradients' device: the runtime sums it over the tp and pp groups (NCCL: device
    // tensors only).
    return at::scalar_tensor(sq, at::TensorOptions(at::kDouble).device(device_));
  }
  void scale_gradients(const at::Tensor& factor) override {
    const double f = factor.item<double>();
    for (auto& z : engines_) z->scale_gradients(f);
  }
  void step(double lr) override {
    for (auto& z : engines_) z->step(lr);
  }
  void zero_grad() override {
    for (auto& z : engines_) z->zero_grad();
  }
  int64_t steps_taken() const override { return engines_.front()->steps_taken(); }
  double comm_wait_seconds() const override {
    double s = 0;
    for (const auto& z : engines_) s += z->comm_stats().wait_seconds;
    return s;
  }
  void add_memory(core::MemoryReport& m) const override {
    for (const auto& z : engines_) {
      const auto zm = z->memory();
      m.parameters += zm.parameters;
      m.gradients += zm.gradients;
      m.optimizer += zm.optimizer;
    }
  }
  core::NamedTensors per_parameter_state() const override { return {}; }
  void load_per_parameter_state(const std::map<std::string, at::Tensor>& state,
                                const std::string& source) override {
    auto step = state.find("step");
    LOOM_CHECK(step != state.end(), "{} has no optimizer step count", source);
    for (auto& z : engines_) z->load_param_state(state, step->second.item<int64_t>(), source);
  }
  std::vector<ZeroOptimizer*> sharded_state() const override {
    std::vector<ZeroOptimizer*> out;
    for (const auto& z : engines_) out.push_back(z.get());
    return out;
  }
  std::vector<std::unique_ptr<ZeroOptimizer>>& engines() { return engines_; }

 private:
  std::vector<std::unique_ptr<ZeroOptimizer>> engines_;  // one per model chunk
  at::Device device_;
};

class ZeroStrategy final : public Strategy {
 public:
  explicit ZeroStrategy(const StrategySpec& spec) : stage_(spec.get_int("stage", 1)) {
    spec.check_keys({"stage"});
    LOOM_CHECK(stage_ >= 1 && stage_ <= 3, "strategy 'zero': stage {} is not 1, 2 or 3", stage_);
  }
  std::string name() const override { return "zero"; }
  StrategySlot slot() const override { return StrategySlot::kData; }
  StrategyTraits traits() const override {
    StrategyTraits t;
    t.mesh_dims = {dist::Dim::dp};
    t.config_keys = {"zero", "bucket_mb", "offload_optimizer", "zero3_reshard_after_forward",
                     "comm_hook"};
    t.syncs_data_parallel_gradients = true;
    t.owns_optimizer = true;
    t.shards_gradients = stage_ >= 2;
    return t;
  }

  void validate(const RunContext& run, const std::vector<const Strategy*>& /*all*/) const override {
    parallel::data::make_comm_hook(
        run.config.comm_hook);  // a bad spec, named before any collective
  }

  void apply(RunContext& run) override {
    const int stage = static_cast<int>(stage_);
    parallel::zero::ZeroOptions base;
    base.stage = stage;
    base.bucket_mb = run.config.bucket_mb;
    base.adamw = run.adamw;
    base.decays = run.decays;
    base.offload_optimizer = run.offload_optimizer;
    base.reshard_after_forward = run.config.zero3_reshard_after_forward;
    // A pipeline runs a chunk's micro-batches interleaved with other chunks' work: its gradients
    // accumulate whole and are reduce-scattered once, after the chunk's last micro-batch.
    // A momentum compression's reduction is a momentum update: once per step.
    base.reduce_once =
        (stage == 3 && run.size(dist::Dim::pp) > 1) ||
        (stage >= 2 &&
         parallel::data::make_comm_hook(run.config.comm_hook, run.adamw)->reduces_once_per_step());
    std::vector<std::unique_ptr<ZeroOptimizer>> engines;
    // One engine per model chunk (each finishes its backwards at its own time).
    for (size_t c = 0; c < run.chunks.size(); ++c) {
      const auto& chunk = run.chunks[c];
      auto options = base;
      // One hook per engine: a hook keeps its error feedback by bucket index.
      options.hook = parallel::data::make_comm_hook(run.config.comm_hook, run.adamw);
      hooks_.push_back(options.hook);
      // Parameters other stages hold too (a tied embedding, shared blocks) get buckets laid out
      // alike on every stage (stage 3: their blocks' units), whose shards the pipeline sums;
      // the copies are left out of the norm (the stage holding the first use counts it).
      options.own_bucket = chunk->shared_across_parts();
      const bool has_copy = std::any_of(options.own_bucket.begin(), options.own_bucket.end(),
                                        [&](const auto& name) { return chunk->is_copy(name); });
      if (run.size(dist::Dim::tp) > 1 || has_copy)
        options.norm_weight = [part = chunk.get()](const std::string& name) {
          return grad_norm_weight(*part, name);
        };
      // Stage 3 gathers one transformer block at a time; the rest (embeddings, final norm) is
      // the root unit.
      std::vector<parallel::zero::ZeroUnit> units;
      if (stage == 3)
        for (const auto& [prefix, block] : chunk->blocks()) {
          parallel::zero::ZeroUnit unit{prefix, {}};
          for (const auto& p : block->named_parameters())
            unit.params.push_back(prefix + "." + p.key());
          units.push_back(std::move(unit));
        }
      engines.push_back(std::make_unique<ZeroOptimizer>(
          run.named_parameters(c), run.mesh->comm_ptr(dist::Dim::dp), options, units));
      if (stage == 3)
        chunk->add_block_wrapper(
            [zero = engines.back().get()](int64_t layer, const at::Tensor& x,
                                          const models::CausalLM::BlockFn& block) {
              return zero->run_unit(static_cast<size_t>(layer), [&] { return block(x); });
            });
    }
    hook_state_ = std::make_unique<CommHookState>("zero", hooks_, /*reduce_scatter=*/true);
    run.collective_forward = stage == 3;
    auto engine = std::make_unique<ZeroEngine>(std::move(engines), run.device);
    engine_ = engine.get();
    run.publish<ZeroOptimizer>("zero", engine_->engines().front().get());
    run.optimizer = std::move(engine);
  }

  bool exempts_step_from_clipping(const RunContext& /*run*/) const override {
    return hook_state_->exempts_step_from_clipping();
  }
  void begin_step(RunContext& run) override {
    for (auto& z : engine_->engines()) z->reset_comm_stats();
    for (auto& hook : hooks_) hook->begin_step(run.step);
  }
  void before_forward(RunContext& /*run*/, const MicroBatch& mb) override {
    engine_->engines().at(static_cast<size_t>(mb.chunk))->prepare_forward();
  }
  void before_backward(RunContext& /*run*/, const MicroBatch& mb) override {
    engine_->engines().at(static_cast<size_t>(mb.chunk))->set_sync(mb.last);
  }
  void after_backward(RunContext& /*run*/, const MicroBatch& mb) override {
    engine_->engines().at(static_cast<size_t>(mb.chunk))->finish_gradient_sync();
  }
  void after_evaluation(RunContext& /*run*/) override {
    for (auto& z : engine_->engines()) z->release_parameters();
  }
  void add_metrics(const RunContext& /*run*/, const StepResult& /*result*/,
                   nlohmann::json& record) const override {
    double sent = 0, fp32 = 0;
    for (const auto& z : engine_->engines()) {
      sent += z->comm_stats().grad_bytes_sent;
      fp32 += z->comm_stats().grad_fp32_bytes;
    }
    record_grad_sync(record, sent, fp32);
  }
  // A compressing hook's error feedback, per rank (beside the optimizer's shards).
  void save_rank_state(RunContext& run, core::NamedTensors& tensors,
                       std::map<std::string, std::string>& metadata) override {
    hook_state_->save(run, layout(run), reshard(run), buckets(), tensors, metadata);
  }
  void load_state(RunContext& run, const CheckpointContents& checkpoint) override {
    hook_state_->load(run, checkpoint, layout(run), reshard(run), buckets());
    // Resharded state is cut into this rank's shards now, so that a checkpoint written before
    // the next reduction holds it (a no-op otherwise).
    const auto& engines = engine_->engines();
    for (size_t c = 0; c < engines.size(); ++c)
      for (size_t b = 0; b < engines[c]->num_buckets(); ++b)
        hooks_[c]->lay_out_resharded(static_cast<int64_t>(b), engines[c]->bucket_padded_numel(b),
                                     run.coord(dist::Dim::dp), run.size(dist::Dim::dp));
  }

  std::string describe(const RunContext& run) const override {
    const auto& z = *engine_->engines().front();
    const int64_t dp = run.size(dist::Dim::dp);
    return fmt::format("ZeRO stage {}: {} flat {} over dp {} | optimizer state{}{} sharded{}{}{}",
                       z.stage(), z.num_buckets(), z.stage() == 3 ? "units" : "buckets", dp,
                       z.stage() >= 2 ? ", gradients" : "", z.stage() == 3 ? ", parameters" : "",
                       z.stage() == 3 && !run.config.zero3_reshard_after_forward
                           ? " | units stay gathered across the step's micro-batches"
                           : "",
                       run.offload_optimizer ? " | optimizer on the host" : "",
                       dp == 1 ? " (one rank: nothing to split)" : "");
  }

 private:
  // What a rank's error feedback belongs to: the hook, the stage, the mesh, each engine's shards.
  std::string layout(const RunContext& run) const {
    std::string out = fmt::format("{} at ZeRO-{} on {}, buckets <= {} MiB", run.config.comm_hook,
                                  stage_, run.mesh->shape().describe(), run.config.bucket_mb);
    for (const auto& z : engine_->engines())
      out += fmt::format("; {} buckets of {} parameters", z->num_buckets(), z->num_params());
    return out;
  }

  CommHookState::Buckets buckets() const {
    CommHookState::Buckets out;
    for (const auto& z : engine_->engines()) {
      auto& chunk = out.emplace_back();
      for (size_t b = 0; b < z->num_buckets(); ++b) chunk.push_back(z->bucket_shape(b));
    }
    return out;
  }

  // The same but for the number of dp ranks, with this rank's place in the other dimensions and
  // the buckets' parameter counts (the same at any dp size): error feedback is resharded across
  // numbers of dp ranks.
  CommHookState::Reshard reshard(const RunContext& run) const {
    std::string key = fmt::format("{} at ZeRO-{}", run.config.comm_hook, stage_);
    for (auto d : {dist::Dim::tp, dist::Dim::cp, dist::Dim::pp})
      key += fmt::format(" {} {} rank {}", dist::to_string(d), run.size(d), run.coord(d));
    for (const auto& z : engine_->engines()) {
      key += "; buckets";
      for (size_t b = 0; b < z->num_buckets(); ++b)
        key += fmt::format(" {}", z->bucket_params_numel(b));
    }
    return {key, run.coord(dist::Dim::dp), run.size(dist::Dim::dp)};
  }

  int64_t stage_;
  ZeroEngine* engine_ = nullptr;                                  // owned by the RunContext
  std::vector<std::shared_ptr<parallel::data::CommHook>> hooks_;  // one per engine
  std::unique_ptr<CommHookState> hook_state_;
};

}  // namespace

void register_zero() {
  register_strategy("zero", [](const StrategySpec& spec) -> StrategyPtr {
    return std::make_unique<ZeroStrategy>(spec);
  });
}

}  // namespace loom::train::strategies
