#include "loom/train/runtime.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>

#include "loom/core/autocast.h"
#include "loom/core/error.h"
#include "loom/parallel/tensor/tp_group.h"
#include "loom/train/checkpoint.h"
#include "loom/train/grad_clip.h"
#include "loom/train/optimizer.h"

namespace loom::train {

OptimizerEngine::ParamPiece OptimizerEngine::param_piece(size_t /*chunk*/,
                                                         const std::string& name) {
  LOOM_CHECK(false,
             "the optimizer engine ({}) does not say where parameter '{}' lives "
             "(OptimizerEngine::param_piece); a strategy that edits weights between steps, as "
             "pruning does, needs it",
             describe(), name);
  return {};
}

namespace {

// The built-ins and the flag that turns each on (a --strategy naming one is refused with this).
const std::vector<std::pair<std::string, std::string>>& builtin_flags() {
  static const std::vector<std::pair<std::string, std::string>> flags = {
      {"pipeline", "--pp N"},
      {"tensor-parallel", "--tp N"},
      {"context-parallel", "--cp N"},
      {"activation-checkpointing", "--activation-checkpointing full|selective"},
      {"activation-offload", "--offload-activations"},
      {"data-parallel", "running with dp > 1 (and --zero 0)"},
      {"zero", "--zero 1|2|3"},
      {"optimizer-offload", "--offload-optimizer"},
      {"prune", "--prune-to S or --prune-pattern N:M"},
      {"profile", "--profile-steps A:B"},
  };
  return flags;
}

// Micro-batches one after another through the whole model (every chunk is the model).
class SequentialRunner final : public StepRunner {
 public:
  at::Tensor run(RunContext& run, const BatchFn& batch_of, const Phases& phases,
                 StepResult& /*result*/) override {
    auto& model = *run.chunks.front();
    const int64_t accum = run.config.grad_accum;
    // Summed on the device: reading each micro-batch's loss would stall a GPU's stream.
    auto loss_sum = at::zeros({}, at::TensorOptions(at::kDouble).device(run.device));
    for (int64_t k = 0; k < accum; ++k) {
      const MicroBatch mb{0, k, k == accum - 1};
      phases.before_forward(mb);
      const auto batch = batch_of(k);
      at::Tensor loss;
      {
        core::Bf16Autocast autocast(run.config.precision == "bf16", run.device.type());
        loss = model.loss(batch.inputs, batch.targets);
      }
      phases.before_backward(mb);
      // Each micro-batch is an equal share of the global batch: scale so gradients are the mean.
      (loss / static_cast<double>(accum)).backward();
      phases.after_backward(mb);
      loss_sum += loss.detach().to(at::kDouble);
    }
    return loss_sum / static_cast<double>(accum);
  }

  double evaluate(RunContext& run, int64_t begin, int64_t end, int64_t windows_per_rank,
                  const Phases& phases) override {
    auto& model = *run.chunks.front();
    const int64_t micro =
        std::max<int64_t>(1, run.config.micro_batch_size(run.size(dist::Dim::dp)));
    // Collective forwards (ZeRO-3 gathers): every rank runs as many forwards as the one with
    // the most windows; a rank with fewer repeats window 0 and counts nothing from it.
    const int64_t forwards = run.collective_forward ? (windows_per_rank + micro - 1) / micro
                                                    : (end - begin + micro - 1) / micro;
    auto sum = at::zeros({}, at::TensorOptions(at::kDouble).device(run.device));
    for (int64_t i = 0; i < forwards; ++i) {
      const int64_t first = begin + i * micro;
      const int64_t count = std::max<int64_t>(0, std::min(micro, end - first));
      auto batch =
          run.val_sampler->sequential_batch(count > 0 ? first : 0, std::max<int64_t>(count, 1));
      if (!run.device.is_cpu()) {
        batch.inputs = batch.inputs.to(run.device);
        batch.targets = batch.targets.to(run.device);
      }
      phases.before_forward({0, i, i == forwards - 1, /*training=*/false});
      // In double on the device: one host read at the end, not one per batch.
      sum += model.loss(batch.inputs, batch.targets).to(at::kDouble) * static_cast<double>(count);
    }
    return sum.item<double>();
  }
};

// AdamW on whole parameters, the same on every replica (the default engine).
class ReplicatedAdamW final : public OptimizerEngine {
 public:
  explicit ReplicatedAdamW(RunContext& run)
      : run_(run), adamw_(run.named_parameters(), run.adamw, run.decays) {
    adamw_.set_backend(ops::parse_adamw_backend(run.config.adamw));
  }

  std::string describe() const override {
    return fmt::format("AdamW ({}), {} tensors with weight decay {}, {} without",
                       ops::to_string(adamw_.backend()), adamw_.num_decayed(),
                       run_.config.weight_decay, adamw_.num_not_decayed());
  }

  parallel::tensor::PartialGradSync::GradPiece grad_piece(size_t chunk,
                                                          const std::string& name) override {
    for (auto& item : run_.chunks.at(chunk)->named_parameters()) {
      if (item.key() != name) continue;
      auto& p = item.value();
      if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
      // A 1-D view: what the caller writes lands in the gradient.
      if (!p.grad().is_contiguous()) p.mutable_grad() = p.grad().contiguous();
      return {p.grad().view({-1}), 0};
    }
    LOOM_CHECK(false, "model chunk {} has no parameter '{}'", chunk, name);
    return {};
  }

  ParamPiece param_piece(size_t chunk, const std::string& name) override {
    for (auto& item : run_.chunks.at(chunk)->named_parameters()) {
      if (item.key() != name) continue;
      const auto p = item.value().detach();
      LOOM_CHECK(p.is_contiguous(), "parameter '{}' is not contiguous", name);
      return {p.view({-1}), 0, false};
    }
    LOOM_CHECK(false, "model chunk {} has no parameter '{}'", chunk, name);
    return {};
  }

  at::Tensor local_grad_squares() override {
    std::vector<const models::CausalLM*> parts;
    for (const auto& chunk : run_.chunks) parts.push_back(chunk.get());
    return train::local_grad_squares(parts);
  }

  // Kept for the update, which multiplies each gradient by it as it reads it: no pass of its
  // own over the gradients.
  void scale_gradients(const at::Tensor& factor) override {
    pending_scale_ = pending_scale_.defined() ? pending_scale_ * factor : factor;
  }

  // A step that failed between the clip and the update (a non-finite norm) left its factor.
  void begin_step() override { pending_scale_ = at::Tensor(); }

  void step(double lr) override {
    adamw_.step(lr, pending_scale_);
    pending_scale_ = at::Tensor();
  }
  void zero_grad() override {
    adamw_.zero_grad();
    pending_scale_ = at::Tensor();
  }
  int64_t steps_taken() const override { return adamw_.steps_taken(); }

  void add_memory(core::MemoryReport& m) const override {
    std::vector<at::Tensor> params, grads, state;
    for (const auto& [name, p] : run_.named_parameters()) {
      params.push_back(p);
      grads.push_back(p.grad());
    }
    for (const auto& [name, t] : adamw_.state()) state.push_back(t);
    m.parameters += core::storage_bytes(params);
    m.gradients += core::storage_bytes(grads);
    m.optimizer += core::storage_bytes(state);
  }

  core::NamedTensors per_parameter_state() const override { return adamw_.state(); }

  void load_per_parameter_state(const std::map<std::string, at::Tensor>& state,
                                const std::string& source) override {
    LOOM_CHECK(state.count("step"), "{} has no optimizer step count", source);
    for (const auto& [name, p] : run_.named_parameters())
      LOOM_CHECK(state.count(name + ".exp_avg"), "{} has no optimizer entry '{}.exp_avg'", source,
                 name);
    adamw_.load_state(state);
  }

 private:
  RunContext& run_;
  AdamW adamw_;
  at::Tensor pending_scale_;  // scale_gradients' factor, not yet applied
};

}  // namespace

core::NamedTensors RunContext::named_parameters(size_t chunk) const {
  core::NamedTensors out;
  for (const auto& item : chunks.at(chunk)->named_parameters())
    out.emplace_back(item.key(), item.value());
  return out;
}

core::NamedTensors RunContext::named_parameters() const {
  core::NamedTensors out;
  for (size_t c = 0; c < chunks.size(); ++c)
    for (auto& kv : named_parameters(c)) out.push_back(std::move(kv));
  return out;
}

std::vector<std::string> user_strategy_names() {
  std::vector<std::string> out;
  for (const auto& name : strategy_names())
    if (std::none_of(builtin_flags().begin(), builtin_flags().end(),
                     [&](const auto& b) { return b.first == name; }))
      out.push_back(name);
  return out;
}

std::vector<StrategySpec> strategy_specs(const TrainConfig& config, const dist::Mesh& mesh) {
  std::vector<StrategySpec> specs;
  std::vector<StrategySpec> user;
  for (const auto& text : config.strategies) {
    auto spec = StrategySpec::parse(text);
    for (const auto& [name, flag] : builtin_flags())
      LOOM_CHECK(spec.name != name,
                 "--strategy '{}': '{}' is built in and turned on by {}, not by --strategy", text,
                 name, flag);
    const auto registered = user_strategy_names();
    LOOM_CHECK(
        std::find(registered.begin(), registered.end(), spec.name) != registered.end(),
        "--strategy '{}': '{}' is not a registered strategy; registered: {} (the "
        "program registers them: docs/strategies.md)",
        text, spec.name,
        registered.empty() ? std::string("none") : fmt::format("{}", fmt::join(registered, ", ")));
    for (const auto& other : user)
      LOOM_CHECK(other.name != spec.name, "--strategy '{}' is given twice ('{}' and '{}')",
                 spec.name, other.text, text);
    user.push_back(std::move(spec));
  }
  auto add = [&](const std::string& name) {
    specs.push_back(StrategySpec{{name, {}, name, "--strategy"}});
  };
  if (mesh.size(dist::Dim::pp) > 1) add("pipeline");
  if (mesh.size(dist::Dim::tp) > 1) add("tensor-parallel");
  if (mesh.size(dist::Dim::cp) > 1) add("context-parallel");
  if (config.activation_checkpointing != "none") add("activation-checkpointing");
  if (config.offload_activations) add("activation-offload");
  if (config.zero > 0) {
    specs.push_back(
        StrategySpec{{"zero", {{"stage", std::to_string(config.zero)}}, "zero", "--zero"}});
  } else if (mesh.size(dist::Dim::dp) > 1) {
    // Plain data parallelism, unless a registered strategy synchronizes the dp ranks its own
    // way (checked by the runtime once the strategies exist).
    add("data-parallel");
  }
  if (config.offload_optimizer) add("optimizer-offload");
  if (config.prune.enabled()) add("prune");
  if (!config.profile_steps.empty()) add("profile");
  for (auto& spec : user) specs.push_back(std::move(spec));
  return specs;
}

Runtime::Runtime(const TrainConfig& config, dist::MeshPtr mesh,
                 models::CustomModelFactory custom_model)
    : ctx_(config, std::move(mesh)) {
  ctx_.custom_model = std::move(custom_model);
  for (const auto& spec : strategy_specs(config, *ctx_.mesh))
    strategies_.push_back(make_strategy(spec));
  // A registered strategy that synchronizes the dp ranks itself replaces plain data parallelism.
  const bool user_syncs = std::any_of(strategies_.begin(), strategies_.end(), [](const auto& s) {
    return s->name() != "data-parallel" && s->name() != "zero" &&
           s->traits().syncs_data_parallel_gradients;
  });
  if (user_syncs)
    std::erase_if(strategies_, [](const auto& s) { return s->name() == "data-parallel"; });
  std::stable_sort(strategies_.begin(), strategies_.end(), [](const auto& a, const auto& b) {
    return static_cast<int>(a->slot()) < static_cast<int>(b->slot());
  });
  for (const auto& s : strategies_) ctx_.strategies.push_back(s.get());
  // What no pair may share, checked for every strategy (registered ones included).
  const Strategy* syncs = nullptr;
  const Strategy* owns = nullptr;
  const Strategy* shards = nullptr;
  for (const auto& s : strategies_) {
    const auto t = s->traits();
    if (t.syncs_data_parallel_gradients) {
      LOOM_CHECK(!syncs,
                 "strategies '{}' and '{}' both synchronize gradients across the data-parallel "
                 "ranks; a run can use one of them",
                 syncs ? syncs->name() : "", s->name());
      syncs = s.get();
    }
    if (t.owns_optimizer) {
      LOOM_CHECK(!owns, "strategies '{}' and '{}' both install the optimizer; a run has one",
                 owns ? owns->name() : "", s->name());
      owns = s.get();
    }
    if (t.shards_gradients) shards = s.get();
  }
  for (const auto& s : strategies_)
    LOOM_CHECK(!shards || !s->traits().needs_full_gradients,
               "strategy '{}' needs whole gradients after the sync, but strategy '{}' keeps only "
               "a 1/dp shard of each: use them in separate runs",
               s->name(), shards ? shards->name() : "");
  for (const auto& s : strategies_) s->validate(ctx_, ctx_.strategies);
}

Runtime::~Runtime() = default;

std::vector<std::string> Runtime::strategy_names() const {
  std::vector<std::string> out;
  for (const auto& s : strategies_) out.push_back(s->name());
  return out;
}

const Strategy* Runtime::find_strategy(const std::string& name) const {
  for (const auto& s : strategies_)
    if (s->name() == name) return s.get();
  return nullptr;
}

void Runtime::build_model(const models::ModelConfig& model_config) {
  ctx_.model_config = model_config;
  // loom's models are built sharded over the tp group (tp 1: unsharded, the vocabulary still
  // padded to --pad-vocab-multiple).
  ctx_.tp_group = std::make_shared<parallel::tensor::TpGroup>(
      ctx_.mesh->comm_ptr(dist::Dim::tp),
      parallel::tensor::TpOptions{ctx_.config.sequence_parallel,
                                  ctx_.config.vocab_padding_multiple()});
  ctx_.plan = ModelPlan{};
  ctx_.plan.stage_bounds = {0, model_config.n_layers};
  for (const auto& s : strategies_) s->plan_model(ctx_);
  ctx_.chunks.clear();
  if (ctx_.custom_model) {
    // The module initializes itself: the same generator state on every rank gives every rank
    // the same values.
    torch::manual_seed(ctx_.config.seed);
    auto model = ctx_.custom_model(ctx_.tp_group);
    LOOM_CHECK(model != nullptr, "the custom model's factory returned nothing");
    ctx_.model_config = model->config();
    ctx_.plan.stage_bounds = {0, ctx_.model_config.n_layers};
    ctx_.chunks.push_back(std::move(model));
    return;
  }
  for (const auto& part : ctx_.plan.parts)
    ctx_.chunks.push_back(part.whole(model_config.n_layers)
                              ? models::make_model(model_config, ctx_.tp_group)
                              : models::make_model(model_config, ctx_.tp_group, part));
}

void Runtime::apply() {
  for (const auto& s : strategies_) s->apply(ctx_);
  if (!ctx_.optimizer) ctx_.optimizer = std::make_unique<ReplicatedAdamW>(ctx_);
  if (!ctx_.runner) ctx_.runner = std::make_unique<SequentialRunner>();
}

StepRunner::Phases Runtime::phases() {
  StepRunner::Phases p;
  p.before_forward = [this](const MicroBatch& mb) {
    // Dropout masks are keyed by the step and the micro-batch's first sample in the global
    // batch, so they are the same at any layout (parallel/tensor/random.h).
    if (mb.training && ctx_.tp_group) {
      const int64_t dp = ctx_.mesh->size(dist::Dim::dp);
      ctx_.tp_group->dropout().set_micro_batch(
          ctx_.step, ctx_.config.first_sample(ctx_.mesh->coord(dist::Dim::dp), dp, mb.index));
    }
    for (const auto& s : strategies_) s->before_forward(ctx_, mb);
  };
  p.before_backward = [this](const MicroBatch& mb) {
    for (const auto& s : strategies_) s->before_backward(ctx_, mb);
  };
  p.after_backward = [this](const MicroBatch& mb) {
    for (auto it = strategies_.rbegin(); it != strategies_.rend(); ++it)
      (*it)->after_backward(ctx_, mb);
  };
  return p;
}

void Runtime::begin_step() {
  ctx_.optimizer->begin_step();
  for (const auto& s : strategies_) s->begin_step(ctx_);
}

at::Tensor Runtime::run_micro_batches(const StepRunner::BatchFn& batch_of, StepResult& result) {
  return ctx_.runner->run(ctx_, batch_of, phases(), result);
}

void Runtime::finish_gradient_sync(StepResult& result) {
  for (auto it = strategies_.rbegin(); it != strategies_.rend(); ++it)
    (*it)->finish_gradient_sync(ctx_, result);
}

at::Tensor Runtime::clip_gradients(double max_norm) {
  torch::NoGradGuard no_grad;
  // The squares and, beside them, how many ranks clip this step: summed over the same groups, so
  // the exemption (exempts_step_from_clipping) is every rank's or none's — a rank that restored
  // a hook's state differently must not leave its replicas unclipped while others clip.
  bool exempt = false;
  for (const auto& s : strategies_) exempt = exempt || s->exempts_step_from_clipping(ctx_);
  auto sq = ctx_.optimizer->local_grad_squares().reshape({1});
  auto sums = at::cat({sq, at::full({1}, exempt ? 0.0 : 1.0, sq.options())});
  std::vector<dist::Communicator*> groups;
  for (const auto& s : strategies_) s->grad_norm_groups(ctx_, groups);
  for (auto* g : groups)
    if (g->size() > 1) g->all_reduce(sums, dist::ReduceOp::Sum);
  auto norm = sums[0].sqrt();
  if (max_norm <= 0) return norm;
  const auto clipping = sums[1] > 0;
  if (norm.device().is_cpu()) {
    const double n = norm.item<double>();
    if (clipping.item<bool>() && n > max_norm)
      ctx_.optimizer->scale_gradients(at::scalar_tensor(max_norm / (n + 1e-6), at::kDouble));
  } else {
    // min(1, max / (norm + eps)) computed where the norm is (1 when exempt): no branch on it.
    ctx_.optimizer->scale_gradients(
        at::where(clipping, (max_norm / (norm + 1e-6)).clamp_max(1.0), at::ones_like(norm)));
  }
  return norm;
}

void Runtime::optimizer_step(double lr, StepResult& result) {
  for (const auto& s : strategies_) s->before_optimizer_step(ctx_, lr);
  ctx_.optimizer->step(lr);
  bool cleared = false;
  for (const auto& s : strategies_) cleared = s->zero_grad(ctx_) || cleared;
  if (!cleared) ctx_.optimizer->zero_grad();
  result.comm_wait_s += ctx_.optimizer->comm_wait_seconds();
  ++ctx_.step;
  for (const auto& s : strategies_) s->after_optimizer_step(ctx_);
}

double Runtime::evaluate(int64_t begin, int64_t end, int64_t windows_per_rank) {
  const double sum = ctx_.runner->evaluate(ctx_, begin, end, windows_per_rank, phases());
  for (const auto& s : strategies_) s->after_evaluation(ctx_);
  return sum;
}

void Runtime::save_state(nlohmann::json& state, core::NamedTensors& tensors) {
  for (const auto& s : strategies_) s->save_state(ctx_, state, tensors);
}

void Runtime::save_rank_state(core::NamedTensors& tensors,
                              std::map<std::string, std::string>& metadata) {
  for (const auto& s : strategies_) s->save_rank_state(ctx_, tensors, metadata);
}

void Runtime::load_state(const CheckpointContents& checkpoint) {
  for (const auto& s : strategies_) s->load_state(ctx_, checkpoint);
}

void Runtime::add_memory(core::MemoryReport& report) const {
  ctx_.optimizer->add_memory(report);
  for (const auto& s : strategies_) s->add_memory(ctx_, report);
}

void Runtime::add_metrics(const StepResult& result, nlohmann::json& record) const {
  for (const auto& s : strategies_) s->add_metrics(ctx_, result, record);
}

std::vector<std::string> Runtime::describe() const {
  std::vector<std::string> out;
  for (const auto& s : strategies_) {
    auto line = s->describe(ctx_);
    if (!line.empty()) out.push_back(std::move(line));
  }
  return out;
}

}  // namespace loom::train
