#include "loom/train/trainer.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include <cmath>
#include <mutex>

#include "loom/core/error.h"
#include "loom/core/files.h"
#include "loom/core/format.h"
#include "loom/core/rng.h"
#include "loom/models/hf.h"
#include "loom/parallel/tensor/partial_grads.h"
#include "loom/train/checkpoint.h"
#include "loom/train/grad_clip.h"

namespace loom::train {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// The checkpoint entry holding data-parallel rank r's dropout generator (TpGroup::generator(),
// the same on the tp ranks of a replica).
std::string rng_key(int64_t dp_rank) {
  return dp_rank == 0 ? "rng.cpu" : fmt::format("rng.cpu.dp{}", dp_rank);
}

std::string format_duration(double seconds) {
  const auto s = static_cast<int64_t>(seconds + 0.5);
  if (s >= 3600) return fmt::format("{}h{:02d}m", s / 3600, (s % 3600) / 60);
  if (s >= 60) return fmt::format("{}m{:02d}s", s / 60, s % 60);
  return fmt::format("{}s", s);
}

core::NamedTensors named_parameters(const models::CausalLM& model) {
  core::NamedTensors out;
  for (const auto& item : model.named_parameters()) out.emplace_back(item.key(), item.value());
  return out;
}

// The parameter an optimizer-state entry ("<param>.exp_avg", ...) belongs to; empty for the
// step count and RNG states.
std::string param_of_state_key(const std::string& key, const models::CausalLM& model) {
  for (const char* suffix : {".exp_avg_sq", ".exp_avg", ".master"}) {
    if (!key.ends_with(suffix)) continue;
    auto name = key.substr(0, key.size() - std::string(suffix).size());
    if (model.shard_specs().count(name)) return name;
  }
  return {};
}

// The file holding dp rank r's ZeRO optimizer shard inside a checkpoint.
std::string zero_shard_name(int64_t dp_rank, int64_t dp_size) {
  return fmt::format("zero-dp{:05d}-of-{:05d}.safetensors", dp_rank, dp_size);
}

std::map<std::string, at::Tensor> tensor_map(const models::CausalLM& model) {
  std::map<std::string, at::Tensor> out;
  for (const auto& item : model.named_parameters()) out.emplace(item.key(), item.value());
  return out;
}

// Enables CPU autocast to bf16 for its lifetime (and restores the previous state).
class Bf16Autocast {
 public:
  explicit Bf16Autocast(bool enabled)
      : enabled_(enabled), was_enabled_(at::autocast::is_autocast_enabled(at::kCPU)) {
    if (!enabled_) return;
    previous_dtype_ = at::autocast::get_autocast_dtype(at::kCPU);
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    at::autocast::set_autocast_enabled(at::kCPU, true);
  }
  ~Bf16Autocast() {
    if (!enabled_) return;
    at::autocast::set_autocast_enabled(at::kCPU, was_enabled_);
    at::autocast::set_autocast_dtype(at::kCPU, previous_dtype_);
    at::autocast::clear_cache();
  }
  Bf16Autocast(const Bf16Autocast&) = delete;
  Bf16Autocast& operator=(const Bf16Autocast&) = delete;

 private:
  bool enabled_, was_enabled_;
  at::ScalarType previous_dtype_ = at::kBFloat16;
};

}  // namespace

std::shared_ptr<models::CausalLM> load_model_from_checkpoint(const fs::path& path) {
  return load_model_from_checkpoint(load_checkpoint(path));
}

std::shared_ptr<models::CausalLM> load_model_from_checkpoint(const CheckpointContents& ckpt) {
  auto config = models::ModelConfig::from_json(ckpt.state.value("model_config", json()));
  auto model = models::make_model(config);
  models::load_parameters(*model, ckpt.model, ckpt.dir.string());
  return model;
}

Trainer::Trainer(TrainConfig config, dist::MeshPtr mesh)
    : config_(std::move(config)), mesh_(mesh ? std::move(mesh) : dist::Mesh::single_process()) {
  config_.validate();
  // Before anything is allocated, so that memory reports count every tensor of the run.
  core::install_memory_tracking();
  LOOM_CHECK(config_.dp == 0 || config_.dp == dp_size(),
             "--dp {} does not match the mesh, whose data-parallel size is {} ({})", config_.dp,
             dp_size(), mesh_->shape().describe());
  LOOM_CHECK(config_.batch_size % (dp_size() * config_.grad_accum) == 0,
             "--batch-size {} cannot be split evenly: dp {} x --grad-accum {} = {} must divide "
             "it (the batch size is the global batch, whatever the layout)",
             config_.batch_size, dp_size(), config_.grad_accum, dp_size() * config_.grad_accum);
  LOOM_CHECK(config_.tp == tp_size(),
             "--tp {} does not match the mesh, whose tensor-parallel size is {} ({})", config_.tp,
             tp_size(), mesh_->shape().describe());
  config_.dp = dp_size();  // checkpoints record the layout that was actually used
  schedule_ = {config_.lr, config_.min_lr, config_.warmup_steps, config_.schedule_steps()};
  schedule_.validate();

  // Data and tokenizer: a data directory written by loom-prepare describes its tokenizer.
  train_shard_ = std::make_shared<data::TokenShard>(config_.data);
  tokenizer_dir_ = fs::absolute(config_.data).parent_path();
  tokenizer_ = data::load_tokenizer(tokenizer_dir_);
  if (!config_.val_data.empty()) val_shard_ = std::make_shared<data::TokenShard>(config_.val_data);

  // Model shape: Hugging Face directory, checkpoint being resumed, or preset.
  models::ModelConfig model_config;
  std::optional<CheckpointContents> resume;
  if (!config_.resume.empty()) {
    resume = load_checkpoint(config_.resume);
    model_config = models::ModelConfig::from_json(resume->state.value("model_config", json()));
    const auto saved = TrainConfig::from_json(resume->state.value("train_config", json()));
    config_.check_resumable_from(saved);
    // The layout may change on resume: the same training continues, equal up to float rounding
    // (sums over the batch are taken in another order), not bit for bit.
    if (saved.dp != 0 && saved.dp != dp_size())
      spdlog::warn(
          "resuming at dp {} a run checkpointed at dp {}: it continues the same training up to "
          "float rounding, not bit for bit",
          dp_size(), saved.dp);
    if (saved.tp != tp_size() || saved.sequence_parallel != config_.sequence_parallel)
      spdlog::warn(
          "resuming at tp {}{} a run checkpointed at tp {}{}: it continues the same training up "
          "to float rounding, not bit for bit",
          tp_size(), config_.sequence_parallel ? " with sequence parallelism" : "", saved.tp,
          saved.sequence_parallel ? " with sequence parallelism" : "");
    if (saved.comm_hook != config_.comm_hook)
      spdlog::warn("resuming with --comm-hook {} a run trained with {}", config_.comm_hook,
                   saved.comm_hook);
    const auto saved_tokens = resume->state.value("data_tokens", int64_t{-1});
    LOOM_CHECK(saved_tokens == train_shard_->size(),
               "cannot resume bit-exactly: the checkpoint was trained on {} tokens of data, but "
               "--data '{}' holds {}",
               saved_tokens, config_.data, train_shard_->size());
  } else if (!config_.init_from_hf.empty()) {
    model_config = models::read_hf_config(config_.init_from_hf);
  } else {
    model_config = models::ModelConfig::preset(config_.preset);
    LOOM_CHECK(models::to_string(model_config.family) == config_.model,
               "--preset {} is a {} preset but --model is {}", config_.preset,
               models::to_string(model_config.family), config_.model);
    model_config.vocab_size =
        config_.vocab_size > 0 ? config_.vocab_size : tokenizer_->vocab_size();
  }
  if (!resume) model_config.dropout = config_.dropout;
  model_config.validate();
  LOOM_CHECK(config_.seq_len <= model_config.max_seq_len,
             "--seq-len {} exceeds the model's max_seq_len {}", config_.seq_len,
             model_config.max_seq_len);
  train_shard_->check_vocab(model_config.vocab_size);
  train_sampler_ =
      std::make_unique<data::WindowSampler>(train_shard_, config_.seq_len, config_.seed);
  if (val_shard_) {
    val_shard_->check_vocab(model_config.vocab_size);
    val_sampler_ = std::make_unique<data::WindowSampler>(val_shard_, config_.seq_len, config_.seed);
  }
  if (!config_.save_dir.empty()) {
    core::ensure_writable_dir(config_.save_dir);
    // Starting afresh in a directory that holds another run's checkpoints would mix the two.
    const auto previous = latest_checkpoint(config_.save_dir);
    LOOM_CHECK(resume || !previous,
               "--save-dir '{}' already holds checkpoints (latest: {}); pass --resume {} to "
               "continue that run, or choose an empty directory",
               config_.save_dir, previous ? previous->filename().string() : "", config_.save_dir);
  }
  if (!config_.export_hf.empty()) core::ensure_writable_dir(config_.export_hf);

  auto tp_group = std::make_shared<parallel::tensor::TpGroup>(
      mesh_->comm_ptr(dist::Dim::tp),
      parallel::tensor::TpOptions{config_.sequence_parallel, config_.pad_vocab_multiple});
  model_ = models::make_model(model_config, tp_group);  // checks heads and widths against tp
  if (!config_.init_from_hf.empty() && !resume)
    models::load_parameters(*model_, tensor_map(*models::load_hf(config_.init_from_hf)),
                            config_.init_from_hf);
  else
    models::init_parameters(*model_, config_.seed);
  // Checkpoints hold single-process tensors: each rank takes its shards (before ZeRO takes the
  // parameters over).
  if (resume) models::load_parameters(*model_, resume->model, resume->dir.string());
  model_->train();  // bf16 runs too keep fp32 parameters: autocast lowers the compute only
  model_->set_activation_checkpointing(
      models::parse_activation_checkpointing(config_.activation_checkpointing));
  if (config_.offload_activations)
    model_->set_activation_offload(std::make_shared<parallel::memory::ActivationOffloader>());
  const AdamWOptions adamw{config_.beta1, config_.beta2, 1e-8, config_.weight_decay};
  if (config_.zero > 0) {
    LOOM_CHECK(tp_size() == 1,
               "--zero {} with --tp {}: ZeRO over a tensor-parallel model is not supported yet "
               "(it comes with 3D parallelism); use --zero 0 with --tp, or --tp 1",
               config_.zero, tp_size());
    LOOM_CHECK(config_.comm_hook == "avg",
               "--comm-hook {} compresses plain data parallelism's all-reduce; ZeRO "
               "reduce-scatters gradients in their own dtype (use --comm-hook avg, or --zero 0)",
               config_.comm_hook);
    parallel::zero::ZeroOptions zero_options;
    zero_options.stage = static_cast<int>(config_.zero);
    zero_options.bucket_mb = config_.bucket_mb;
    zero_options.adamw = adamw;
    zero_options.decays = default_decays;
    zero_options.offload_optimizer = config_.offload_optimizer;
    // Stage 3 gathers one transformer block at a time; the rest (embeddings, final norm) is
    // the root unit.
    std::vector<parallel::zero::ZeroUnit> units;
    for (const auto& [prefix, block] : model_->blocks()) {
      parallel::zero::ZeroUnit unit{prefix, {}};
      for (const auto& p : block->named_parameters()) unit.params.push_back(prefix + "." + p.key());
      units.push_back(std::move(unit));
    }
    zero_ = std::make_unique<parallel::zero::ZeroOptimizer>(
        named_parameters(*model_), mesh_->comm_ptr(dist::Dim::dp), zero_options, units);
    if (config_.zero == 3)
      model_->add_block_wrapper([zero = zero_.get()](int64_t layer, const at::Tensor& x,
                                                     const models::CausalLM::BlockFn& run) {
        return zero->run_unit(static_cast<size_t>(layer), [&] { return run(x); });
      });
  } else {
    if (dp_size() > 1) {
      parallel::data::DataParallelOptions dp_options;
      dp_options.bucket_mb = config_.bucket_mb;
      dp_options.hook = parallel::data::make_comm_hook(config_.comm_hook);
      dp_ = std::make_unique<parallel::data::DataParallel>(
          named_parameters(*model_), mesh_->comm_ptr(dist::Dim::dp), dp_options);
    }
    optimizer_ = std::make_unique<AdamW>(named_parameters(*model_), adamw);
  }
  partial_grads_ = std::make_unique<parallel::tensor::PartialGradSync>(
      named_parameters(*model_), model_->shard_specs(), tp_group);
  if (!resume) {
    // Dropout draws from the model's generator: seed it, so that two runs with the same flags
    // are the same run (a resume restores its saved state instead). Data-parallel ranks draw
    // different masks for their different samples; the tp ranks of a replica draw alike.
    auto& gen = model_->tp().generator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_current_seed(dp_size() > 1
                             ? core::mix_seed({config_.seed, core::stable_hash("dropout"),
                                               static_cast<uint64_t>(dp_rank())})
                             : core::mix_seed({config_.seed, core::stable_hash("dropout")}));
  } else {
    const auto saved = TrainConfig::from_json(resume->state.value("train_config", json()));
    if (zero_) {
      LOOM_CHECK(saved.zero == config_.zero && saved.dp == dp_size(),
                 "checkpoint '{}' was written at --zero {} with dp {}; this run is --zero {} "
                 "with dp {}. ZeRO optimizer shards resume only at the stage and dp size that "
                 "wrote them",
                 resume->dir.string(), saved.zero, saved.dp, config_.zero, dp_size());
      const auto shard_file = resume->dir / zero_shard_name(dp_rank(), dp_size());
      LOOM_CHECK(std::filesystem::exists(shard_file),
                 "checkpoint '{}' has no ZeRO optimizer shard for dp rank {} of {}: '{}' is "
                 "missing",
                 resume->dir.string(), dp_rank(), dp_size(), shard_file.string());
      // A rank that cannot read its shard tells the others, which would otherwise wait for it
      // in the first collective.
      std::string error;
      try {
        auto shard = core::load_safetensors(shard_file);
        zero_->load_state(shard.tensors, shard.metadata, shard_file.string());
      } catch (const std::exception& e) {
        error = e.what();
      }
      auto failed = at::full({1}, error.empty() ? 0 : 1, at::kInt);
      mesh_->world().all_reduce(failed, dist::ReduceOp::Sum);
      LOOM_CHECK(error.empty(), "{}", error);
      LOOM_CHECK(failed.item<int>() == 0,
                 "{} rank(s) could not load their ZeRO optimizer shard from '{}' (their errors say "
                 "why)",
                 failed.item<int>(), resume->dir.string());
    } else {
      LOOM_CHECK(saved.zero == 0,
                 "checkpoint '{}' holds ZeRO-{} optimizer shards (dp {}); resume it with --zero "
                 "{} at dp {}",
                 resume->dir.string(), saved.zero, saved.dp, saved.zero, saved.dp);
      auto opt_state = resume->optimizer;
      for (auto& [key, tensor] : opt_state) {
        const auto param = param_of_state_key(key, *model_);
        if (param.empty()) continue;
        const auto& spec = model_->shard_spec(param);
        if (spec.sharded()) tensor = spec.shard(tensor, model_->tp().rank(), model_->tp().size());
      }
      optimizer_->load_state(opt_state);
    }
    step_ = resume->step;
    auto& gen = model_->tp().generator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    auto rng = resume->optimizer.find(rng_key(dp_rank()));
    if (rng != resume->optimizer.end()) {
      gen.set_state(rng->second);
    } else {
      LOOM_CHECK(dp_rank() > 0, "checkpoint '{}' has no RNG state", resume->dir.string());
      // Resuming at more data-parallel ranks than the checkpoint was written with: this rank
      // had no generator then. Dropout masks differ from any earlier run from here on.
      spdlog::warn("checkpoint '{}' has no RNG state for dp rank {}; seeding it afresh",
                   resume->dir.string(), dp_rank());
      gen.set_current_seed(
          core::mix_seed({config_.seed, core::stable_hash("dropout"),
                          static_cast<uint64_t>(dp_rank()), static_cast<uint64_t>(step_)}));
    }
    elapsed_before_ = resume->state.value("elapsed_s", 0.0);
    LOOM_CHECK(step_ <= config_.steps, "checkpoint '{}' is at step {}, past --steps {}",
               resume->dir.string(), step_, config_.steps);
    spdlog::info("resumed from {} at step {}", resume->dir.string(), step_);
  }
  // Replicas start equal however they were initialized (the init is layout-invariant; this
  // also covers a user-modified model).
  if (dp_) dp_->broadcast_parameters();
  if (!config_.metrics_out.empty() && is_rank0())
    metrics_ = MetricsWriter(config_.metrics_out, resume ? step_ : -1);

  spdlog::info(
      "model: {} | {:.2f}M parameters | d_model {} | layers {} | heads {}/{} kv | vocab {}",
      models::to_string(model_config.family), model_config.num_parameters() / 1e6,
      model_config.d_model, model_config.n_layers, model_config.n_heads, model_config.n_kv_heads,
      model_config.vocab_size);
  spdlog::info(
      "data: {} tokens in {} | tokenizer {} | batch {} x {} tokens ({} micro-batches "
      "of {}) | {} threads",
      train_shard_->size(), config_.data, tokenizer_->kind(), config_.batch_size, config_.seq_len,
      config_.grad_accum, config_.micro_batch_size(), at::get_num_threads());
  if (dp_)
    spdlog::info(
        "parallel: {} | each rank {} sequences per step in {} micro-batches of {} | {} "
        "gradient buckets (<= {} MiB), comm hook {}",
        mesh_->shape().describe(), config_.batch_size / dp_size(), config_.grad_accum,
        config_.micro_batch_size(dp_size()), dp_->buckets().size(), config_.bucket_mb,
        dp_->hook().name());
  if (tp_size() > 1)
    spdlog::info(
        "tensor parallel: tp {}{} | {} of {} heads, {} of {} MLP columns and {} of {} vocabulary "
        "rows (padded from {}) per rank | {} partial gradients summed across ranks per step",
        tp_size(), config_.sequence_parallel ? " + sequence parallel" : "",
        model_config.n_heads / tp_size(), model_config.n_heads, model_config.d_ff / tp_size(),
        model_config.d_ff, model_->padded_vocab() / tp_size(), model_->padded_vocab(),
        model_config.vocab_size, partial_grads_->num_params());
  if (zero_)
    spdlog::info("ZeRO stage {}: {} flat {} over dp {} | optimizer state{}{} sharded{}{}",
                 config_.zero, zero_->num_buckets(), config_.zero == 3 ? "units" : "buckets",
                 dp_size(), config_.zero >= 2 ? ", gradients" : "",
                 config_.zero == 3 ? ", parameters" : "",
                 config_.offload_optimizer ? " | optimizer on the host" : "",
                 dp_size() == 1 ? " (one rank: nothing to split)" : "");
  if (config_.activation_checkpointing != "none")
    spdlog::info("activation checkpointing: {}{}", config_.activation_checkpointing,
                 config_.offload_activations ? ", block inputs offloaded to the host" : "");
  spdlog::info(
      "optimizer: AdamW, {} tensors with weight decay {}, {} without | lr {} -> {} "
      "(warmup {}, cosine) | precision {}",
      zero_ ? zero_->num_decayed() : optimizer_->num_decayed(), config_.weight_decay,
      zero_ ? zero_->num_not_decayed() : optimizer_->num_not_decayed(), config_.lr, config_.min_lr,
      config_.warmup_steps, config_.precision);
  spdlog::info("{}", memory_report().describe());
  // The cap simulates a smaller device for training itself: the model was built (whole, even
  // at stage 3) before it applies.
  if (config_.memory_cap_mb > 0) {
    previous_memory_cap_ = core::memory_cap();
    core::set_memory_cap(static_cast<int64_t>(config_.memory_cap_mb * 1024.0 * 1024.0),
                         "--memory-cap-mb");
  }
}

std::map<std::string, at::Tensor> Trainer::gather_parameters() {
  return zero_ ? zero_->gather_parameters() : models::gather_parameters(*model_);
}

Trainer::~Trainer() {
  if (config_.memory_cap_mb > 0) core::set_memory_cap(previous_memory_cap_);
}

core::MemoryReport Trainer::memory_report() const {
  core::MemoryReport m;
  if (zero_) {
    const auto z = zero_->memory();
    m.parameters = z.parameters;
    m.gradients = z.gradients;
    m.optimizer = z.optimizer;
  } else {
    std::vector<at::Tensor> params, grads, state;
    for (const auto& p : model_->parameters()) {
      params.push_back(p);
      grads.push_back(p.grad());
    }
    if (dp_)
      for (const auto& b : dp_->buckets()) grads.push_back(b.buffer);
    for (const auto& [name, t] : optimizer_->state()) state.push_back(t);
    m.parameters = core::storage_bytes(params);
    m.gradients = core::storage_bytes(grads);
    m.optimizer = core::storage_bytes(state);
  }
  m.peak_activations = last_peak_activations_;
  const auto device =
      model_->parameters().empty() ? at::Device(at::kCPU) : model_->parameters().front().device();
  m.device = device.str();
  if (device.is_cuda() || core::memory_tracking_installed()) {
    const auto counters = core::memory_counters(device);
    m.current_total = counters.current_bytes;
    m.peak_total = counters.peak_bytes;
  }
  return m;
}

StepResult Trainer::train_step() {
  const auto start = std::chrono::steady_clock::now();
  const int64_t micro = config_.micro_batch_size(dp_size());
  // This rank's share of the global batch; sample indices are global, so the data does not
  // depend on the layout.
  const auto shard = data::shard_batch(config_.batch_size, dp_rank(), dp_size());
  // Activations: the peak above what the step starts with (parameters, gradients, state).
  const auto device = model_->parameters().front().device();
  const bool measure = device.is_cuda() || core::memory_tracking_installed();
  const int64_t baseline = measure ? core::memory_counters(device).current_bytes : 0;
  if (measure) core::reset_peak_memory(device);
  if (zero_) zero_->reset_comm_stats();
  double loss_sum = 0;
  for (int64_t k = 0; k < config_.grad_accum; ++k) {
    const bool last = k == config_.grad_accum - 1;
    if (dp_) dp_->set_sync(last);  // sync on the last micro-batch only
    if (zero_) {
      zero_->set_sync(last);
      zero_->prepare_forward();
    }
    auto batch = train_sampler_->random_batch(step_, shard.first + k * micro, micro);
    at::Tensor loss;
    {
      Bf16Autocast autocast(config_.precision == "bf16");
      loss = model_->loss(batch.inputs, batch.targets);
    }
    // Each micro-batch is an equal share of the global batch: scale so gradients are the mean.
    (loss / static_cast<double>(config_.grad_accum)).backward();
    if (zero_) zero_->finish_gradient_sync();
    loss_sum += loss.item<double>();
  }
  StepResult r;
  if (measure) {
    r.peak_activation_bytes = core::memory_counters(device).peak_bytes - baseline;
    last_peak_activations_ = r.peak_activation_bytes;
  }
  double local_loss = loss_sum / static_cast<double>(config_.grad_accum);
  if (dp_ || zero_) {
    if (dp_) dp_->finish_gradient_sync();
    r.comm_wait_s = dp_ ? dp_->last_sync().wait_seconds : zero_->comm_stats().wait_seconds;
    // Equal shares: the global mean is the mean of the ranks' means.
    auto loss_t = at::full({1}, local_loss, at::kDouble);
    mesh_->comm(dist::Dim::dp).all_reduce(loss_t, dist::ReduceOp::Avg);
    local_loss = loss_t.item<double>();
  }
  // Replicated parameters used on sequence shards and shared key/value heads: sum their parts.
  partial_grads_->sync();
  r.grad_norm =
      zero_ ? zero_->clip_grad_norm(config_.grad_clip) : clip_grad_norm(*model_, config_.grad_clip);
  // A non-finite gradient would poison the weights and moments: stop before the update.
  LOOM_CHECK(std::isfinite(r.grad_norm),
             "gradient norm is {} at step {} (loss {}): lower --lr or use --grad-clip; the "
             "parameters were not updated",
             r.grad_norm, step_ + 1, local_loss);
  r.lr = schedule_.at(step_);
  if (zero_) {
    zero_->step(r.lr);
    zero_->zero_grad();
    r.comm_wait_s = zero_->comm_stats().wait_seconds;
  } else {
    optimizer_->step(r.lr);
    if (dp_)
      dp_->zero_grad();  // in place: the gradients are views of the communication buckets
    else
      optimizer_->zero_grad();
  }
  ++step_;
  r.step = step_;
  r.loss = local_loss;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return r;
}

double Trainer::evaluate(int64_t batches) {
  LOOM_CHECK(val_sampler_ != nullptr, "evaluation needs --val-data");
  torch::NoGradGuard no_grad;
  model_->eval();
  // Whole batches of batch_size windows (the same windows whatever --grad-accum and the layout
  // are), each dp rank taking a contiguous share, run in micro-batches to bound memory.
  const int64_t micro = std::max<int64_t>(1, config_.micro_batch_size(dp_size()));
  const int64_t windows =
      std::min(batches * config_.batch_size, val_sampler_->num_sequential_windows());
  const int64_t per_rank = (windows + dp_size() - 1) / dp_size();
  const int64_t begin = std::min(windows, dp_rank() * per_rank);
  const int64_t end = std::min(windows, begin + per_rank);
  Bf16Autocast autocast(config_.precision == "bf16");
  double sum = 0;
  // At ZeRO-3 every forward gathers parameters across the dp ranks, so every rank runs as many
  // forwards as the one with the most windows; a rank with fewer repeats window 0 and counts
  // nothing from it.
  const bool collective_forward = zero_ && zero_->stage() == 3;
  const int64_t forwards =
      collective_forward ? (per_rank + micro - 1) / micro : (end - begin + micro - 1) / micro;
  for (int64_t i = 0; i < forwards; ++i) {
    const int64_t first = begin + i * micro;
    const int64_t count = std::max<int64_t>(0, std::min(micro, end - first));
    auto batch = val_sampler_->sequential_batch(count > 0 ? first : 0, std::max<int64_t>(count, 1));
    if (zero_) zero_->prepare_forward();
    const double loss = model_->loss(batch.inputs, batch.targets).item<double>();
    sum += loss * static_cast<double>(count);
  }
  if (zero_) zero_->release_parameters();
  model_->train();
  if (dp_size() > 1) {
    auto sum_t = at::full({1}, sum, at::kDouble);
    mesh_->comm(dist::Dim::dp).all_reduce(sum_t, dist::ReduceOp::Sum);
    sum = sum_t.item<double>();
  }
  return sum / static_cast<double>(windows);
}

fs::path Trainer::save_checkpoint() {
  LOOM_CHECK(!config_.save_dir.empty(), "saving a checkpoint needs --save-dir");
  // Data-parallel replicas hold the same state, except each rank's dropout generator: those
  // are gathered, then rank 0 writes everything while the others wait for the outcome.
  core::NamedTensors rng_states;
  {
    auto& gen = model_->tp().generator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    rng_states.emplace_back(rng_key(0), gen.get_state());
  }
  if (dp_size() > 1) {
    const auto mine = rng_states.front().second.contiguous();
    auto all = at::empty({dp_size(), mine.numel()}, mine.options());
    mesh_->comm(dist::Dim::dp).all_gather(all, mine);
    for (int64_t r = 1; r < dp_size(); ++r) rng_states.emplace_back(rng_key(r), all[r].clone());
  }
  // Checkpoints hold single-process tensors, whatever tp is: the tp ranks of replica 0 assemble
  // them (the other replicas hold the same values and skip the work and the memory). With ZeRO
  // the parameters are assembled from the dp ranks (stage 3) and each rank writes its own
  // optimizer shard, which rank 0 moves into the checkpoint with the rest.
  std::map<std::string, at::Tensor> params;
  core::NamedTensors opt_state;
  if (zero_) {
    params = zero_->gather_parameters(/*only_rank=*/0);
    opt_state.emplace_back("step", at::tensor(zero_->steps_taken(), at::kLong));
  } else if (dp_rank() == 0) {
    params = models::gather_parameters(*model_);
    opt_state = optimizer_->state();
    for (auto& [key, tensor] : opt_state) {
      const auto param = param_of_state_key(key, *model_);
      if (!param.empty()) tensor = models::gather_shard(*model_, param, tensor);
    }
  }
  const auto dir = checkpoint_dir(config_.save_dir, step_);
  std::vector<fs::path> shard_files;
  if (zero_) {
    const auto staging = fs::path(config_.save_dir) / (dir.filename().string() + ".zero-staging");
    std::exception_ptr failure;
    if (is_rank0()) {
      try {
        std::error_code ec;
        fs::remove_all(staging, ec);  // leftovers of an interrupted save
        fs::create_directories(staging, ec);
        LOOM_CHECK(!ec, "cannot create '{}': {}", staging.string(), ec.message());
      } catch (...) {
        failure = std::current_exception();
      }
    }
    share_rank0_outcome(failure, fmt::format("prepare '{}'", staging.string()));
    int failed = 0;
    std::string error;
    try {
      core::save_safetensors(staging / zero_shard_name(dp_rank(), dp_size()), zero_->state(),
                             zero_->state_metadata());
    } catch (const std::exception& e) {
      failed = 1;
      error = e.what();
    }
    auto any = at::full({1}, failed, at::kInt);
    mesh_->world().all_reduce(any, dist::ReduceOp::Sum);
    LOOM_CHECK(failed == 0, "{}", error);
    LOOM_CHECK(any.item<int>() == 0,
               "{} rank(s) failed to write their ZeRO optimizer shard for step {} into '{}'",
               any.item<int>(), step_, staging.string());
    for (int64_t r = 0; r < dp_size(); ++r)
      shard_files.push_back(staging / zero_shard_name(r, dp_size()));
  }
  std::exception_ptr failure;
  if (is_rank0()) {
    try {
      for (auto& kv : rng_states) opt_state.push_back(std::move(kv));
      json state = {{"model_config", model_->config().to_json()},
                    {"train_config", config_.to_json()},
                    {"data_tokens", train_shard_->size()},
                    {"elapsed_s", elapsed_s()},
                    {"tokenizer", tokenizer_->kind()}};
      std::vector<fs::path> extras;
      for (const char* f : {"meta.json", "vocab.json", "merges.txt"})
        extras.push_back(tokenizer_dir_ / f);
      core::NamedTensors named(params.begin(), params.end());
      train::save_checkpoint(config_.save_dir, step_, named, opt_state, state, extras, 2,
                             shard_files);
      if (!shard_files.empty()) {
        std::error_code ec;
        fs::remove_all(shard_files.front().parent_path(), ec);
      }
      spdlog::info("saved checkpoint {}", dir.string());
    } catch (...) {
      failure = std::current_exception();
    }
  }
  share_rank0_outcome(failure,
                      fmt::format("write checkpoint step {} into '{}'", step_, config_.save_dir));
  return dir;
}

void Trainer::share_rank0_outcome(const std::exception_ptr& failure, const std::string& what) {
  if (mesh_->world_size() > 1) {
    // However long the write takes, the others wait for it (not the watchdog's limit), and they
    // learn whether it failed rather than hanging in the next collective.
    auto outcome = at::full({1}, failure ? 1 : 0, at::kInt);
    dist::ScopedTimeout patient(mesh_->world(), dist::Seconds(24 * 3600.0));
    mesh_->world().broadcast(outcome, 0);
    LOOM_CHECK(is_rank0() || outcome.item<int>() == 0, "rank 0 failed to {} (its error says why)",
               what);
  }
  if (failure) std::rethrow_exception(failure);
}

void Trainer::log_progress(const StepResult& r, double tokens_per_s, double eta_s) const {
  spdlog::info("step {:>5}/{} | loss {:.4f} | lr {:.2e} | grad norm {:.3f} | {:.0f} tok/s | ETA {}",
               r.step, config_.steps, r.loss, r.lr, r.grad_norm, tokens_per_s,
               format_duration(eta_s));
}

double Trainer::elapsed_s() const {
  return elapsed_before_ +
         std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count();
}

StepResult Trainer::fit() {
  const auto start = std::chrono::steady_clock::now();
  const double tokens_per_step = static_cast<double>(config_.batch_size * config_.seq_len);
  const int64_t first_step = step_;
  StepResult last;
  last.step = step_;
  while (step_ < config_.steps) {
    last = train_step();
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const double avg_step = elapsed / static_cast<double>(step_ - first_step);
    const double tokens_per_s = tokens_per_step / last.seconds;
    LOOM_CHECK(std::isfinite(last.loss), "loss became {} at step {}: lower --lr or use --grad-clip",
               last.loss, step_);
    json record = {{"step", last.step},
                   {"loss", last.loss},
                   {"lr", last.lr},
                   {"grad_norm", last.grad_norm},
                   {"tokens_per_s", tokens_per_s},
                   {"comm_wait_s", last.comm_wait_s},
                   {"memory", memory_report().to_json()},
                   {"elapsed_s", elapsed_s()}};
    const bool final_step = step_ == config_.steps;
    if (val_sampler_ &&
        ((config_.eval_every > 0 && step_ % config_.eval_every == 0) || final_step)) {
      const double val = evaluate(config_.eval_batches);
      record["val_loss"] = val;
      spdlog::info("step {:>5}/{} | validation loss {:.4f}", step_, config_.steps, val);
    }
    metrics_.write(record);
    if (step_ % config_.log_every == 0 || final_step || step_ == first_step + 1)
      log_progress(last, tokens_per_s, avg_step * static_cast<double>(config_.steps - step_));
    if (!config_.save_dir.empty() &&
        ((config_.save_every > 0 && step_ % config_.save_every == 0) || final_step))
      save_checkpoint();
  }
  if (!config_.export_hf.empty()) {
    // Assembled from the shards by replica 0's tp ranks, written by rank 0 as the
    // single-process model.
    std::map<std::string, at::Tensor> params;
    if (zero_)
      params = zero_->gather_parameters(/*only_rank=*/0);  // collective over dp
    else if (dp_rank() == 0)
      params = models::gather_parameters(*model_);
    std::exception_ptr failure;
    if (is_rank0()) {
      try {
        auto whole = models::make_model(model_->config());
        models::load_parameters(*whole, params, "the trained model");
        models::save_hf(*whole, config_.export_hf);
        spdlog::info("exported Hugging Face model to {}", config_.export_hf);
      } catch (...) {
        failure = std::current_exception();
      }
    }
    share_rank0_outcome(failure,
                        fmt::format("export the Hugging Face model to '{}'", config_.export_hf));
  }
  return last;
}

}  // namespace loom::train
