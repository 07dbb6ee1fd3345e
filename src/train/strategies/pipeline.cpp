// pipeline: the model's layers split into pp stages (virtual_stages chunks per rank with the
// interleaved schedule), balanced by layer cost over the ranks' speeds and memory; each step's
// micro-batches run through the stages as the schedule orders them, activations and gradients
// point to point. See docs/pipeline.md.
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <optional>
#include <set>

#include <fmt/ranges.h>

#include "builtin.h"
#include "loom/core/autocast.h"
#include "loom/core/error.h"
#include "loom/dist/coalesced.h"
#include "loom/models/layer_costs.h"
#include "loom/models/layer_sharing.h"
#include "loom/parallel/pipeline/executor.h"
#include "loom/parallel/pipeline/partition.h"
#include "loom/plan/layer_seconds.h"
#include "loom/train/run_context.h"
#include "loom/train/step_result.h"

namespace loom::train::strategies {

namespace {

namespace pl = parallel::pipeline;

// Forward + backward seconds of `part` (built on `tp`) on a micro-batch on `device`, the median
// of a few runs after a warm-up.
double time_part(const models::ModelConfig& config, const parallel::tensor::TpGroupPtr& tp,
                 models::ModelPart part, int64_t micro, int64_t seq_len, at::Device device) {
  auto model = models::make_model(config, tp, part);
  models::init_parameters(*model, 1);
  model->to(device);
  const auto on_device = at::TensorOptions().device(device);
  auto tokens = at::zeros({micro, seq_len}, on_device.dtype(at::kLong));
  const int64_t local_seq = tp->sequence_parallel() ? seq_len / tp->size() : seq_len;
  auto hidden = at::randn({micro, local_seq, config.d_model}, on_device);
  std::vector<double> times;
  for (int rep = 0; rep < 4; ++rep) {
    const auto start = std::chrono::steady_clock::now();
    auto input = part.first ? tokens : hidden.clone().requires_grad_(true);
    auto loss =
        part.last ? model->part_loss(input, tokens, tokens) : model->forward_part(input).sum();
    loss.backward();
    // A GPU runs ahead of the host: the copy of the loss to the host is queued behind the
    // backward's kernels on the same stream, so reading it waits for them.
    loss.item<double>();
    if (rep > 0)
      times.push_back(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// Micro-batches through this rank's stages in the schedule's order.
class PipelineRunner final : public StepRunner {
 public:
  // Shares the executor and the last run's stats with the strategy (the runner lives in the
  // RunContext, which may outlive it).
  PipelineRunner(std::shared_ptr<pl::PipelineExecutor> executor,
                 std::shared_ptr<pl::PipelineStats> last)
      : executor_ptr_(std::move(executor)), last_ptr_(std::move(last)) {}

  at::Tensor run(RunContext& run, const BatchFn& batch_of, const Phases& phases,
                 StepResult& /*result*/) override {
    const int64_t accum = run.config.grad_accum;
    last_ = executor_.run(
        [&](int64_t chunk, int64_t k, const at::Tensor& input) {
          auto& part = *run.chunks[static_cast<size_t>(chunk)];
          phases.before_forward({chunk, k, k == accum - 1});
          core::Bf16Autocast autocast(run.config.precision == "bf16", run.device.type());
          // A document mask needs the micro-batch's tokens on every stage.
          const bool needs_batch =
              part.part().first || part.part().last || part.document_mask().has_value();
          const auto batch = needs_batch ? batch_of(k) : data::Batch{};
          const auto& in = part.part().first ? batch.inputs : input;
          if (!part.part().last) return part.forward_part(in, batch.inputs);
          // Each micro-batch is an equal share of the global batch: scale so gradients are the
          // mean.
          return part.part_loss(in, batch.inputs, batch.targets) / static_cast<double>(accum);
        },
        [&](int64_t chunk, int64_t k) {
          phases.before_backward({chunk, k, k == accum - 1});
        },
        [&](int64_t chunk, int64_t k) {
          phases.after_backward({chunk, k, k == accum - 1});
        });
    // The last stage's losses (scaled by 1 / micro-batches: their sum is the mean), to every
    // stage.
    auto loss = at::zeros({1}, at::TensorOptions(at::kDouble).device(run.device));
    if (executor_.has_last_stage())
      for (double l : last_.outputs) loss += l;
    run.mesh->comm(dist::Dim::pp).broadcast(loss, static_cast<int>(run.size(dist::Dim::pp) - 1));
    return loss.reshape({});
  }

  double evaluate(RunContext& run, int64_t begin, int64_t end, int64_t windows_per_rank,
                  const Phases& phases) override {
    // Micro-batches through the stages, forwards only; the last stage's sums go to every stage.
    const int64_t micro =
        std::max<int64_t>(1, run.config.micro_batch_size(run.size(dist::Dim::dp)));
    // Collective forwards (ZeRO-3 gathers over dp): every replica runs as many as the one with
    // the most windows; one with fewer repeats window 0 and counts nothing from it.
    const int64_t forwards = run.collective_forward ? (windows_per_rank + micro - 1) / micro
                                                    : (end - begin + micro - 1) / micro;
    const auto stats = executor_.run_forward(
        [&](int64_t chunk, int64_t i, const at::Tensor& input) {
          auto& part = *run.chunks[static_cast<size_t>(chunk)];
          phases.before_forward({chunk, i, i == forwards - 1, /*training=*/false});
          const int64_t first = begin + i * micro;
          const int64_t count = std::max<int64_t>(0, std::min(micro, end - first));
          const bool needs_batch =
              part.part().first || part.part().last || part.document_mask().has_value();
          const auto batch = needs_batch ? run.val_sampler->sequential_batch(
                                               count > 0 ? first : 0, std::max<int64_t>(count, 1))
                                         : data::Batch{};
          const auto in = part.part().first ? batch.inputs.to(run.device) : input;
          if (!part.part().last) return part.forward_part(in, batch.inputs);
          return part.part_loss(in, batch.inputs, batch.targets.to(run.device)) *
                 static_cast<double>(count);
        },
        forwards);
    auto sum = at::zeros({1}, at::TensorOptions(at::kDouble).device(run.device));
    if (executor_.has_last_stage())
      for (double v : stats.outputs) sum += v;
    run.mesh->comm(dist::Dim::pp).broadcast(sum, static_cast<int>(run.size(dist::Dim::pp) - 1));
    return sum.item<double>();
  }

 private:
  std::shared_ptr<pl::PipelineExecutor> executor_ptr_;
  std::shared_ptr<pl::PipelineStats> last_ptr_;
  pl::PipelineExecutor& executor_ = *executor_ptr_;
  pl::PipelineStats& last_ = *last_ptr_;
};

class PipelineStrategy final : public Strategy {
 public:
  explicit PipelineStrategy(const StrategySpec& spec) { spec.check_keys({}); }
  std::string name() const override { return "pipeline"; }
  StrategySlot slot() const override { return StrategySlot::kPipeline; }
  StrategyTraits traits() const override {
    return {{dist::Dim::pp},
            {"pp", "schedule", "virtual_stages", "grad_accum", "pp_partition", "pp_devices"}};
  }

  void validate(const RunContext& run, const std::vector<const Strategy*>& /*all*/) const override {
    LOOM_CHECK(!run.custom_model,
               "strategy 'pipeline' (--pp {}) splits loom's GPT-2 and Llama into stages of "
               "layers; a custom model does not say how to split it into stages: use --pp 1",
               run.size(dist::Dim::pp));
    // The schedule must be able to run this pipeline: checked (and played out, so a custom
    // schedule that would deadlock fails here) before anything is built.
    pl::simulate(*pl::make_schedule(run.config.schedule), shape(run));
  }

  void plan_model(RunContext& run) override {
    const auto& config = run.config;
    const auto& model_config = run.model_config;
    const auto shape = this->shape(run);
    const int64_t micro = config.micro_batch_size(run.size(dist::Dim::dp));
    // Micro-batches a chunk holds at once, from the schedule itself (its busiest rank's, over
    // that rank's chunks).
    const auto simulated = pl::simulate(*pl::make_schedule(config.schedule), shape);
    const int64_t most =
        *std::max_element(simulated.max_in_flight.begin(), simulated.max_in_flight.end());
    const int64_t in_flight = (most + config.virtual_stages - 1) / config.virtual_stages;
    // A rank's tokens: context parallelism leaves each rank seq_len / cp of every sequence (its
    // ring attention does more attention work than a block on those tokens alone; the layers all
    // have the same share of it, so the split does not change).
    const int64_t tokens = config.seq_len / run.size(dist::Dim::cp);
    models::CostShape cost_shape{micro, tokens, run.size(dist::Dim::tp), in_flight};
    // A machine profile (loom-plan's) as --pp-devices: the cost model gives each pipeline
    // rank's speed and memory, and with --pp-partition model each layer's cost too: the split
    // loom-plan predicts for this layout (plan::pipeline_costs, as plan::predict takes it).
    std::optional<plan::PipelineCosts> modelled;
    LOOM_CHECK(config.pp_partition != "model" || !config.pp_devices.empty(),
               "--pp-partition model needs a machine profile as --pp-devices (a loom-plan "
               "--measure file or h100-node / h200-node)");
    // A device file of speeds is not a machine: say so, rather than what a profile lacks.
    LOOM_CHECK(config.pp_partition != "model" ||
                   plan::MachineProfile::is_profile(config.pp_devices) ||
                   !pl::is_device_file(config.pp_devices),
               "--pp-partition model needs a machine profile as --pp-devices (a loom-plan "
               "--measure file or h100-node / h200-node); '{}' is a device file of speeds",
               config.pp_devices);
    if (config.pp_partition == "model" ||
        (!config.pp_devices.empty() && config.pp_devices != "measured" &&
         plan::MachineProfile::is_profile(config.pp_devices))) {
      plan::Layout layout;
      layout.dp = run.size(dist::Dim::dp), layout.tp = run.size(dist::Dim::tp);
      layout.pp = run.size(dist::Dim::pp), layout.cp = run.size(dist::Dim::cp);
      layout.zero = config.zero;
      layout.micro_batches = config.grad_accum;
      layout.virtual_stages = config.virtual_stages;
      layout.schedule = config.schedule;
      layout.checkpointing = config.activation_checkpointing;
      layout.sequence_parallel = config.sequence_parallel;
      modelled =
          plan::pipeline_costs({model_config, config.batch_size, config.seq_len, config.precision},
                               layout, plan::MachineProfile::named(config.pp_devices), in_flight);
    }
    pl::LayerCosts costs;
    auto one = model_config;
    one.n_layers = 1;
    one.share_layers.clear();  // one block, timed alone
    if (config.pp_partition == "measured") {
      // One block, the embedding and the head timed on this rank, averaged over all ranks so
      // every rank computes the same split.
      costs = models::layer_costs(model_config, "uniform", cost_shape);
      const double layer =
          time_part(one, run.tp_group, {0, 1, false, false}, micro, tokens, run.device);
      const double with_embed =
          time_part(one, run.tp_group, {0, 1, true, false}, micro, tokens, run.device);
      const double with_head =
          time_part(one, run.tp_group, {0, 1, false, true}, micro, tokens, run.device);
      auto t =
          at::tensor({layer, std::max(0.0, with_embed - layer), std::max(0.0, with_head - layer)},
                     at::kDouble);
      run.mesh->world().all_reduce(t, dist::ReduceOp::Avg);
      std::fill(costs.layer_time.begin(), costs.layer_time.end(), t[0].item<double>());
      costs.first_time = t[1].item<double>();
      costs.last_time = t[2].item<double>();
      costs.kind = "measured";
    } else if (config.pp_partition == "model") {
      costs = modelled->costs;
    } else {
      costs = models::layer_costs(model_config, config.pp_partition, cost_shape);
    }
    std::vector<pl::DeviceSpec> devices;
    const int64_t pp = run.size(dist::Dim::pp);
    if (config.pp_devices.empty()) {
      devices = pl::uniform_devices(pp);
    } else if (config.pp_devices == "measured") {
      // Each rank times one block; a pipeline rank is as fast as the slowest rank of its stage
      // (its tp and dp peers), and speeds are relative to the fastest stage.
      const double mine =
          time_part(one, run.tp_group, {0, 1, false, false}, micro, tokens, run.device);
      auto times = at::zeros({run.mesh->world_size()}, at::kDouble);
      auto t = at::full({1}, mine, at::kDouble);
      run.mesh->world().all_gather(times, t);
      std::vector<double> stage_time(static_cast<size_t>(pp), 0.0);
      for (int64_t r = 0; r < run.mesh->world_size(); ++r) {
        const auto p =
            static_cast<size_t>(run.mesh->coords_of(r)[static_cast<size_t>(dist::Dim::pp)]);
        stage_time[p] = std::max(stage_time[p], times[r].item<double>());
      }
      const double fastest = *std::min_element(stage_time.begin(), stage_time.end());
      for (int64_t p = 0; p < pp; ++p) {
        pl::DeviceSpec d;
        d.name = fmt::format("measured {:.3g} ms/block", 1e3 * stage_time[static_cast<size_t>(p)]);
        d.speed = fastest / stage_time[static_cast<size_t>(p)];
        devices.push_back(d);
      }
    } else if (modelled) {
      devices = modelled->devices;
    } else {
      devices = pl::load_device_file(config.pp_devices, pp);
    }
    partition_ = pl::partition_layers(costs, shape, devices);
    if (modelled) {
      // Each rank read the profile itself: all must have split alike (files that differ
      // between nodes would build mismatched stages).
      auto bounds = at::tensor(partition_->bounds, at::kLong);
      auto most = bounds.clone(), least = -bounds;  // the minimum as the maximum of negatives
      run.mesh->world().all_reduce(most, dist::ReduceOp::Max);
      run.mesh->world().all_reduce(least, dist::ReduceOp::Max);
      LOOM_CHECK(at::equal(most, -least),
                 "--pp-devices '{}': the ranks split the layers differently ({} here): each "
                 "must read the same machine profile",
                 config.pp_devices, fmt::join(partition_->bounds, ", "));
    }
    run.plan.parts.clear();
    for (int64_t c = 0; c < config.virtual_stages; ++c) {
      const int64_t stage = shape.stage_of(run.coord(dist::Dim::pp), c);
      run.plan.parts.push_back({partition_->first_layer(stage), partition_->end_layer(stage),
                                stage == 0, stage == shape.stages() - 1});
    }
    run.plan.stage_bounds = partition_->bounds;
    run.publish("pipeline.partition", &*partition_);
  }

  void apply(RunContext& run) override {
    executor_ = std::make_shared<pl::PipelineExecutor>(
        run.mesh->comm_ptr(dist::Dim::pp), shape(run), pl::make_schedule(run.config.schedule),
        run.chunks.front()->parameters().front().device(),
        pl::parse_activation_codec(run.config.compress_activations));
    run.runner = std::make_unique<PipelineRunner>(executor_, last_);
    run.publish("pipeline.executor", executor_.get());
    make_shared_groups(run);
  }

  // Parameters several stages hold (a tied embedding on the first and last, a block shared by
  // layers on several) got part of their gradient on each: sum them where the engine keeps them
  // (whole, or alike-laid-out ZeRO shards), so every copy takes the same update.
  void finish_gradient_sync(RunContext& run, StepResult& /*result*/) override {
    torch::NoGradGuard no_grad;
    for (auto& group : shared_) {
      std::vector<at::Tensor> sums;
      std::vector<std::vector<at::Tensor>> copies;  // per name, the other local chunks' pieces
      for (const auto& [name, chunks] : group.names) {
        auto sum = run.optimizer->grad_piece(chunks.front(), name).values;
        copies.emplace_back();
        for (size_t k = 1; k < chunks.size(); ++k) {
          auto piece = run.optimizer->grad_piece(chunks[k], name).values;
          sum.add_(piece);
          copies.back().push_back(piece);
        }
        sums.push_back(sum);
      }
      if (group.comm) {
        // One all-reduce per dtype (the pieces of one dtype laid end to end).
        std::map<at::ScalarType, std::vector<at::Tensor>> by_dtype;
        for (const auto& t : sums) by_dtype[t.scalar_type()].push_back(t);
        for (const auto& [dtype, parts] : by_dtype) dist::all_reduce_coalesced(*group.comm, parts);
      }
      for (size_t i = 0; i < sums.size(); ++i)
        for (auto& piece : copies[i]) piece.copy_(sums[i]);
    }
  }

  void grad_norm_groups(RunContext& run, std::vector<dist::Communicator*>& groups) override {
    groups.push_back(&run.mesh->comm(dist::Dim::pp));
  }

  void save_state(RunContext& /*run*/, nlohmann::json& state, core::NamedTensors& /*t*/) override {
    state["pipeline_bounds"] = partition_->bounds;
  }

  void add_metrics(const RunContext& /*run*/, const StepResult& /*result*/,
                   nlohmann::json& record) const override {
    record["pipeline"] = {{"bubble", last_->bubble_fraction()},
                          {"wait_s", last_->wait_seconds},
                          {"max_in_flight", last_->max_in_flight},
                          {"bytes_sent", last_->bytes_sent}};
    // What --compress-activations saved: the tensors' own bytes over the bytes sent.
    if (last_->bytes_sent > 0)
      record["pipeline"]["activation_compression_ratio"] =
          last_->uncompressed_bytes / last_->bytes_sent;
  }

  std::string describe(const RunContext& run) const override {
    const auto codec = executor_->codec();
    return fmt::format("pipeline: {} | schedule {} | {} stages, partitioned by {} cost:{}{}",
                       executor_->shape().describe(), run.config.schedule,
                       executor_->shape().stages(), run.config.pp_partition, partition_->describe(),
                       codec == pl::ActivationCodec::kNone
                           ? std::string()
                           : " | activations and their gradients sent as " + pl::to_string(codec));
  }

 private:
  static pl::PipelineShape shape(const RunContext& run) {
    return {run.size(dist::Dim::pp), run.config.virtual_stages, run.config.grad_accum};
  }
  std::optional<pl::Partition> partition_;
  std::shared_ptr<pl::PipelineExecutor> executor_;
  std::shared_ptr<pl::PipelineStats> last_ = std::make_shared<pl::PipelineStats>();
  // Parameters held by several stages, grouped by the pipeline ranks holding them.
  struct SharedGroup {
    std::vector<int64_t> ranks;
    dist::CommunicatorPtr comm;  // over `ranks`; null when they are this rank alone
    // Sorted by name (the same order on every rank of the group): the local chunks holding it.
    std::map<std::string, std::vector<size_t>> names;
  };
  std::vector<SharedGroup> shared_;

  // Every pipeline rank derives the same groups from the model config and the partition, and
  // splits the pipeline communicator once per group of two or more ranks, in one order
  // (collective over the pipeline group).
  void make_shared_groups(RunContext& run) {
    const auto sh = shape(run);
    const auto& bounds = partition_->bounds;
    const int64_t stages = sh.stages();
    auto ranks_of = [&](const std::vector<int64_t>& held) {
      std::set<int64_t> ranks;
      for (const int64_t stage : held) ranks.insert(sh.rank_of(stage));
      return std::vector<int64_t>(ranks.begin(), ranks.end());
    };
    // Every shared parameter's holders: the tied embedding's, each block's.
    std::set<std::vector<int64_t>> all;
    if (run.model_config.tie_embeddings) all.insert(ranks_of({0, stages - 1}));
    const auto owners = run.model_config.layer_owners();
    for (const int64_t block : models::held_blocks(owners, 0, run.model_config.n_layers)) {
      std::vector<int64_t> held;
      for (int64_t s = 0; s < stages; ++s) {
        const auto in_stage = models::held_blocks(owners, bounds[static_cast<size_t>(s)],
                                                  bounds[static_cast<size_t>(s) + 1]);
        if (std::find(in_stage.begin(), in_stage.end(), block) != in_stage.end()) held.push_back(s);
      }
      if (held.size() > 1) all.insert(ranks_of(held));
    }
    // This rank's shared parameters, by the ranks holding them.
    std::map<std::vector<int64_t>, std::map<std::string, std::vector<size_t>>> mine;
    for (size_t c = 0; c < run.chunks.size(); ++c)
      for (const auto& name : run.chunks[c]->shared_across_parts()) {
        const auto ranks = ranks_of(run.chunks[c]->stages_holding(name, bounds));
        LOOM_CHECK(all.count(ranks) == 1,
                   "pipeline: parameter '{}' is held by pipeline ranks [{}], which no shared "
                   "group derived from the model config has",
                   name, fmt::join(ranks, ", "));
        mine[ranks][name].push_back(c);
      }
    const int64_t me = run.coord(dist::Dim::pp);
    for (const auto& ranks : all) {
      const bool member = std::find(ranks.begin(), ranks.end(), me) != ranks.end();
      dist::CommunicatorPtr comm;
      if (ranks.size() > 1)
        comm = run.mesh->comm(dist::Dim::pp)
                   .split(member ? 0 : -1, static_cast<int>(me), "shared-parameters");
      if (member && mine.count(ranks) == 1) shared_.push_back({ranks, comm, mine.at(ranks)});
    }
  }
};

}  // namespace

void register_pipeline() {
  register_strategy("pipeline", [](const StrategySpec& spec) -> StrategyPtr {
    return std::make_unique<PipelineStrategy>(spec);
  });
}

}  // namespace loom::train::strategies
