#include "loom/train/trainer.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <set>
#include <tuple>

#include "loom/core/autocast.h"
#include "loom/core/error.h"
#include "loom/core/files.h"
#include "loom/core/format.h"
#include "loom/core/rng.h"
#include "loom/dist/gather_tensors.h"
#include "loom/models/hf.h"
#include "loom/models/layer_costs.h"
#include "loom/ops/cuda.h"
#include "loom/parallel/tensor/partial_grads.h"
#include "loom/train/checkpoint.h"
#include "loom/train/grad_clip.h"
#include "loom/train/mfu.h"

namespace loom::train {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// The checkpoint entry holding data-parallel rank r's dropout generator (TpGroup::generator(),
// the same on the tp ranks of a replica); with a pipeline, each stage has its own (stage 0's
// under the plain name, so a run resumed without a pipeline continues stage 0's stream).
std::string rng_key(int64_t dp_rank, int64_t pp_rank = 0) {
  const auto base = dp_rank == 0 ? std::string("rng.cpu") : fmt::format("rng.cpu.dp{}", dp_rank);
  return pp_rank > 0 ? fmt::format("{}.pp{}", base, pp_rank) : base;
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

// Every parameter of a rank's model parts (names are unique across them).
core::NamedTensors named_parameters(const std::vector<std::shared_ptr<models::CausalLM>>& parts) {
  core::NamedTensors out;
  for (const auto& part : parts)
    for (auto& kv : named_parameters(*part)) out.push_back(std::move(kv));
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

// The file holding the model shards (and AdamW moments) of pipeline rank p, tensor-parallel
// rank t (written by data-parallel replica 0).
std::string model_shard_name(int64_t pp_rank, int64_t tp_rank) {
  return fmt::format("model-pp{:03d}-tp{:03d}.safetensors", pp_rank, tp_rank);
}

// Where a rank's coordinates put it, for ZeRO shard file names.
struct ShardCoords {
  int64_t dp_rank = 0, dp = 1, tp_rank = 0, tp = 1, pp_rank = 0, pp = 1, chunk = 0;
};

ShardCoords coords_of(const dist::Mesh& mesh, int64_t chunk) {
  return {mesh.coord(dist::Dim::dp),
          mesh.size(dist::Dim::dp),
          mesh.coord(dist::Dim::tp),
          mesh.size(dist::Dim::tp),
          mesh.coord(dist::Dim::pp),
          mesh.size(dist::Dim::pp),
          chunk};
}

// The file holding one ZeRO optimizer shard inside a checkpoint: dp rank r's (of chunk c of
// pipeline rank p, tensor-parallel rank t, when those exist).
std::string zero_shard_name(const ShardCoords& c) {
  if (c.tp == 1 && c.pp == 1)
    return fmt::format("zero-dp{:05d}-of-{:05d}.safetensors", c.dp_rank, c.dp);
  return fmt::format("zero-pp{:03d}-c{}-tp{:03d}-dp{:05d}-of-pp{}-tp{}-dp{}.safetensors", c.pp_rank,
                     c.chunk, c.tp_rank, c.dp_rank, c.pp, c.tp, c.dp);
}

std::map<std::string, at::Tensor> tensor_map(const models::CausalLM& model) {
  std::map<std::string, at::Tensor> out;
  for (const auto& item : model.named_parameters()) out.emplace(item.key(), item.value());
  return out;
}

}  // namespace

std::shared_ptr<models::CausalLM> load_model_from_checkpoint(const fs::path& path) {
  return load_model_from_checkpoint(load_checkpoint(path, model_parameters_only()));
}

std::shared_ptr<models::CausalLM> load_model_from_checkpoint(const CheckpointContents& ckpt) {
  auto config = models::ModelConfig::from_json(ckpt.state.value("model_config", json()));
  auto model = models::make_model(config);
  // An fp64 run's checkpoint loads as an fp64 model (not rounded to fp32 on the way in).
  const auto train_config = ckpt.state.value("train_config", json());
  if (train_config.value("precision", std::string("fp32")) == "fp64") model->to(at::kDouble);
  models::load_parameters(*model, ckpt.model, ckpt.dir.string());
  return model;
}

namespace {

// Forward + backward seconds of `part` (built on `tp`) on a micro-batch, the median of a few
// runs after a warm-up.
double time_part(const models::ModelConfig& config, const parallel::tensor::TpGroupPtr& tp,
                 models::ModelPart part, int64_t micro, int64_t seq_len) {
  auto model = models::make_model(config, tp, part);
  models::init_parameters(*model, 1);
  auto tokens = at::zeros({micro, seq_len}, at::kLong);
  const int64_t local_seq = tp->sequence_parallel() ? seq_len / tp->size() : seq_len;
  auto hidden = at::zeros({micro, local_seq, config.d_model}).normal_(0, 1);
  std::vector<double> times;
  for (int rep = 0; rep < 4; ++rep) {
    const auto start = std::chrono::steady_clock::now();
    auto input = part.first ? tokens : hidden.clone().requires_grad_(true);
    auto out = model->forward_part(input);
    (part.last ? model->loss_from_logits(out, tokens) : out.sum()).backward();
    if (rep > 0)
      times.push_back(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

}  // namespace

void Trainer::build_pipeline_parts(const models::ModelConfig& model_config,
                                   const parallel::tensor::TpGroupPtr& tp_group) {
  namespace pl = parallel::pipeline;
  const pl::PipelineShape shape{pp_size(), config_.virtual_stages, config_.grad_accum};
  const int64_t micro = config_.micro_batch_size(dp_size());
  // Micro-batches a chunk holds at once: all of them (GPipe), at most pp (1F1B), about
  // pp + (pp - 1) / v per chunk (interleaved: vp + p - 1 over the rank's v chunks).
  const int64_t v = config_.virtual_stages, pp = pp_size();
  const int64_t in_flight = config_.schedule == "gpipe" ? config_.grad_accum
                            : v > 1 ? std::min(config_.grad_accum, (v * pp + pp - 1 + v - 1) / v)
                                    : std::min(config_.grad_accum, pp);
  models::CostShape cost_shape{micro, config_.seq_len, tp_size(), in_flight};
  pl::LayerCosts costs;
  if (config_.pp_partition == "measured") {
    // One block, the embedding and the head timed on this rank, averaged over all ranks so
    // every rank computes the same split.
    costs = models::layer_costs(model_config, "uniform", cost_shape);
    auto one = model_config;
    one.n_layers = 1;
    const double layer = time_part(one, tp_group, {0, 1, false, false}, micro, config_.seq_len);
    const double with_embed = time_part(one, tp_group, {0, 1, true, false}, micro, config_.seq_len);
    const double with_head = time_part(one, tp_group, {0, 1, false, true}, micro, config_.seq_len);
    auto t = at::tensor(
        {layer, std::max(0.0, with_embed - layer), std::max(0.0, with_head - layer)}, at::kDouble);
    mesh_->world().all_reduce(t, dist::ReduceOp::Avg);
    std::fill(costs.layer_time.begin(), costs.layer_time.end(), t[0].item<double>());
    costs.first_time = t[1].item<double>();
    costs.last_time = t[2].item<double>();
    costs.kind = "measured";
  } else {
    costs = models::layer_costs(model_config, config_.pp_partition, cost_shape);
  }
  std::vector<pl::DeviceSpec> devices;
  if (config_.pp_devices.empty()) {
    devices = pl::uniform_devices(pp_size());
  } else if (config_.pp_devices == "measured") {
    // Each rank times one block; a pipeline rank is as fast as the slowest rank of its stage
    // (its tp and dp peers), and speeds are relative to the fastest stage.
    auto one = model_config;
    one.n_layers = 1;
    const double mine = time_part(one, tp_group, {0, 1, false, false}, micro, config_.seq_len);
    auto times = at::zeros({mesh_->world_size()}, at::kDouble);
    auto t = at::full({1}, mine, at::kDouble);
    mesh_->world().all_gather(times, t);
    std::vector<double> stage_time(static_cast<size_t>(pp_size()), 0.0);
    for (int64_t r = 0; r < mesh_->world_size(); ++r) {
      const auto p = static_cast<size_t>(mesh_->coords_of(r)[static_cast<size_t>(dist::Dim::pp)]);
      stage_time[p] = std::max(stage_time[p], times[r].item<double>());
    }
    const double fastest = *std::min_element(stage_time.begin(), stage_time.end());
    for (int64_t p = 0; p < pp_size(); ++p) {
      pl::DeviceSpec d;
      d.name = fmt::format("measured {:.3g} ms/block", 1e3 * stage_time[static_cast<size_t>(p)]);
      d.speed = fastest / stage_time[static_cast<size_t>(p)];
      devices.push_back(d);
    }
  } else {
    devices = pl::load_device_file(config_.pp_devices, pp_size());
  }
  partition_ = pl::partition_layers(costs, shape, devices);
  for (int64_t c = 0; c < config_.virtual_stages; ++c) {
    const int64_t stage = shape.stage_of(pp_rank(), c);
    models::ModelPart part{partition_->first_layer(stage), partition_->end_layer(stage), stage == 0,
                           stage == shape.stages() - 1};
    chunks_.push_back(models::make_model(model_config, tp_group, part));
  }
  model_ = chunks_.front();
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
  LOOM_CHECK(config_.pp == pp_size(),
             "--pp {} does not match the mesh, whose pipeline-parallel size is {} ({})", config_.pp,
             pp_size(), mesh_->shape().describe());
  if (pp_size() > 1) {
    LOOM_CHECK(config_.zero <= 2,
               "--zero 3 with --pp {}: ZeRO-3 over a pipeline is not supported yet; use --zero 1 "
               "or 2 (optimizer state and gradients sharded along dp), or --pp 1",
               pp_size());
    // The schedule must be able to run this pipeline: checked (and played out, so a custom
    // schedule that would deadlock fails here) before anything is built.
    parallel::pipeline::simulate(*parallel::pipeline::make_schedule(config_.schedule),
                                 {pp_size(), config_.virtual_stages, config_.grad_accum});
  }
  device_ = at::Device(config_.device);
  if (device_.is_cuda()) {
    if (!device_.has_index()) device_ = at::Device(at::kCUDA, 0);
    const int devices = ops::cuda_device_count();
    LOOM_CHECK(device_.index() < devices,
               "--device {}: there is no such CUDA device ({} visible; this loom was built {} "
               "CUDA)",
               config_.device, devices, ops::built_with_cuda() ? "with" : "without");
    LOOM_CHECK(mesh_->world_size() == 1,
               "--device {} trains in one process for now; this run has {} ranks ({}). "
               "Multi-rank GPU training needs the mesh's groups on NCCL, which the Trainer does "
               "not wire yet: use --device cpu, or one process",
               config_.device, mesh_->world_size(), mesh_->shape().describe());
    LOOM_CHECK(config_.zero == 0, "--zero {} with --device {}: ZeRO runs on the CPU only so far",
               config_.zero, config_.device);
    LOOM_CHECK(!config_.offload_activations && config_.memory_cap_mb == 0,
               "--offload-activations and --memory-cap-mb run on the CPU only so far (given with "
               "--device {})",
               config_.device);
    // Dropout masks are drawn on the host (layout-invariant, tp-sliced) and would be copied to
    // the device every layer, and attention dropout takes the math path.
    LOOM_CHECK(
        config_.dropout == 0,
        "--dropout {} with --device {}: dropout on a GPU is not supported yet (its masks are "
        "drawn on the host); use --dropout 0",
        config_.dropout, config_.device);
  }
  if (config_.attention == "fused") {
    // What the kernel needs, named by flag before anything is built (the kernel itself would
    // only refuse at the first forward).
    LOOM_CHECK(device_.is_cuda(),
               "--attention fused runs loom's CUDA kernel: it needs --device "
               "cuda (the device is {})",
               config_.device);
    LOOM_CHECK(config_.precision == "bf16",
               "--attention fused computes in bf16: it needs --precision bf16 (it is {})",
               config_.precision);
  }
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
    resume = open_checkpoint(config_.resume);  // its tensors load once the model is built
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
    LOOM_CHECK(config_.layers == 0 || config_.layers == model_config.n_layers,
               "--layers {} with --init-from-hf: the model has the directory's {} layers",
               config_.layers, model_config.n_layers);
  } else {
    model_config = models::ModelConfig::preset(config_.preset);
    LOOM_CHECK(models::to_string(model_config.family) == config_.model,
               "--preset {} is a {} preset but --model is {}", config_.preset,
               models::to_string(model_config.family), config_.model);
    if (config_.layers > 0) model_config.n_layers = config_.layers;
    model_config.vocab_size =
        config_.vocab_size > 0 ? config_.vocab_size : tokenizer_->vocab_size();
  }
  if (!resume) model_config.dropout = config_.dropout;
  model_config.validate();
  LOOM_CHECK(config_.attention != "fused" || model_config.head_dim() == 64 ||
                 model_config.head_dim() == 128,
             "--attention fused: the kernel has head dims 64 and 128, and this model's is {} "
             "(d_model {} / {} heads); use --attention auto",
             model_config.head_dim(), model_config.d_model, model_config.n_heads);
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
  if (pp_size() == 1) {
    model_ = models::make_model(model_config, tp_group);  // checks heads and widths against tp
    chunks_ = {model_};
  } else {
    build_pipeline_parts(model_config, tp_group);
  }
  // fp64 runs hold parameters (and so activations, gradients and optimizer state) in fp64, from
  // the same initial values as an fp32 run; converted before anything is loaded into them, so a
  // resumed fp64 checkpoint is not rounded to fp32 on the way.
  if (config_.precision == "fp64")
    for (auto& chunk : chunks_) chunk->to(at::kDouble);
  if (resume) {
    // This rank's part of the checkpoint, tensor by tensor: its chunks' parameters and their
    // optimizer state as its tp shards, the step counts and RNG states. Ranks read different
    // tensors, so one may fail alone: all learn of it here (before ZeRO takes the parameters
    // over, and before any collective).
    std::string error;
    try {
      load_checkpoint_tensors(*resume, rank_selection(resume->dir));
      for (auto& chunk : chunks_)
        models::load_parameter_shards(*chunk, resume->model, resume->dir.string());
    } catch (const std::exception& e) {
      error = e.what();
    }
    resume->model.clear();  // copied into the parameters
    share_outcome(error, fmt::format("load their part of checkpoint '{}'", resume->dir.string()));
  } else if (!config_.init_from_hf.empty()) {
    const auto hf_tensors = tensor_map(*models::load_hf(config_.init_from_hf));
    for (auto& chunk : chunks_) models::load_parameters(*chunk, hf_tensors, config_.init_from_hf);
  } else {
    for (auto& chunk : chunks_) models::init_parameters(*chunk, config_.seed);
  }
  for (auto& chunk : chunks_) {
    chunk->to(device_);
    chunk->set_attention_backend(ops::parse_attention_backend(config_.attention));
    chunk->train();  // bf16 runs too keep fp32 parameters: autocast lowers the compute only
    chunk->set_activation_checkpointing(
        models::parse_activation_checkpointing(config_.activation_checkpointing));
    if (config_.offload_activations)
      chunk->set_activation_offload(std::make_shared<parallel::memory::ActivationOffloader>());
  }
  flops_per_token_ = model_flops_per_token(model_config, config_.seq_len);
  peak_flops_ = config_.peak_tflops * 1e12;
  if (peak_flops_ == 0 && device_.is_cuda()) {
    const auto name = ops::cuda_device_name(device_.index());
    peak_flops_ = peak_flops_for_device(name).value_or(0.0);
    if (peak_flops_ == 0)
      spdlog::warn("no bf16 peak is known for device '{}': pass --peak-tflops to get MFU", name);
  }
  const AdamWOptions adamw{config_.beta1, config_.beta2, 1e-8, config_.weight_decay};
  if (config_.zero > 0) {
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
    // One engine per pipeline chunk (each finishes its backwards at its own time).
    for (const auto& chunk : chunks_) {
      auto options = zero_options;
      const auto tied_copy = chunk->tied_embedding_copy();
      const bool tied_first = pp_size() > 1 && model_config.tie_embeddings && chunk->part().first;
      // The tied embedding's two copies get their own buckets, laid out alike on both stages,
      // whose shards are summed; the copy is left out of the norm (its first is counted).
      if (tied_first || !tied_copy.empty()) options.own_bucket = {chunk->embedding_weight_name()};
      if (tp_size() > 1 || !tied_copy.empty()) {
        const int64_t tp = tp_size();
        options.norm_weight = [part = chunk.get(), tp, tied_copy](const std::string& name) {
          if (name == tied_copy) return 0.0;
          const auto& spec = part->shard_spec(name);
          return 1.0 / static_cast<double>(spec.sharded() ? spec.replicas(tp) : tp);
        };
      }
      zero_.push_back(std::make_unique<parallel::zero::ZeroOptimizer>(
          named_parameters(*chunk), mesh_->comm_ptr(dist::Dim::dp), options,
          config_.zero == 3 ? units : std::vector<parallel::zero::ZeroUnit>{}));
    }
    if (config_.zero == 3)
      model_->add_block_wrapper([zero = zero_.front().get()](int64_t layer, const at::Tensor& x,
                                                             const models::CausalLM::BlockFn& run) {
        return zero->run_unit(static_cast<size_t>(layer), [&] { return run(x); });
      });
  } else {
    if (dp_size() > 1) {
      parallel::data::DataParallelOptions dp_options;
      dp_options.bucket_mb = config_.bucket_mb;
      dp_options.hook = parallel::data::make_comm_hook(config_.comm_hook);
      // One per chunk: a pipeline finishes each chunk's last backward at its own time, and that
      // chunk's buckets are reduced from then on while the other chunks still compute.
      for (const auto& chunk : chunks_)
        dp_.push_back(std::make_unique<parallel::data::DataParallel>(
            named_parameters(*chunk), mesh_->comm_ptr(dist::Dim::dp), dp_options));
    }
    optimizer_ = std::make_unique<AdamW>(named_parameters(chunks_), adamw);
  }
  for (const auto& chunk : chunks_)
    partial_grads_.push_back(std::make_unique<parallel::tensor::PartialGradSync>(
        named_parameters(*chunk), chunk->shard_specs(), tp_group));
  if (!resume) {
    // Dropout draws from the model's generator: seed it, so that two runs with the same flags
    // are the same run (a resume restores its saved state instead). Data-parallel ranks draw
    // different masks for their different samples; the tp ranks of a replica draw alike.
    auto& gen = model_->tp().generator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    uint64_t seed = core::mix_seed({config_.seed, core::stable_hash("dropout")});
    if (dp_size() > 1)
      seed = core::mix_seed(
          {config_.seed, core::stable_hash("dropout"), static_cast<uint64_t>(dp_rank())});
    if (pp_size() > 1)
      seed = core::mix_seed(
          {seed, core::stable_hash("pipeline stage"), static_cast<uint64_t>(pp_rank())});
    gen.set_current_seed(seed);
  } else {
    const auto saved = TrainConfig::from_json(resume->state.value("train_config", json()));
    // The optimizer state: ZeRO shards of the same layout load rank by rank, exactly; anything
    // else (another layout, ZeRO to replicated or back) goes through the whole per-parameter
    // state the rank's selection kept (its tp shards; ZeRO then takes its segments).
    const auto saved_bounds =
        resume->state.value("pipeline_bounds", std::vector<int64_t>{0, model_config.n_layers});
    const auto bounds =
        partition_ ? partition_->bounds : std::vector<int64_t>{0, model_config.n_layers};
    const bool same_zero_layout = !zero_.empty() && saved.zero == config_.zero &&
                                  saved.dp == dp_size() && saved.tp == tp_size() &&
                                  saved.pp == pp_size() &&
                                  saved.virtual_stages == config_.virtual_stages &&
                                  saved_bounds == bounds && saved.bucket_mb == config_.bucket_mb &&
                                  saved.pad_vocab_multiple == config_.pad_vocab_multiple;
    if (saved.zero != config_.zero || (saved.zero > 0 && !same_zero_layout))
      spdlog::info(
          "checkpoint '{}' holds {} optimizer state of dp {} x tp {} x pp {}; resharding it for "
          "{} at dp {} x tp {} x pp {}",
          resume->dir.string(), saved.zero > 0 ? fmt::format("ZeRO-{}", saved.zero) : "replicated",
          saved.dp, saved.tp, saved.pp,
          config_.zero > 0 ? fmt::format("ZeRO-{}", config_.zero) : "replicated AdamW", dp_size(),
          tp_size(), pp_size());
    // A rank that cannot load its state tells the others, which would otherwise wait for it in
    // the first collective.
    std::string error;
    try {
      if (same_zero_layout) {
        for (size_t c = 0; c < zero_.size(); ++c) {
          const auto shard_file =
              resume->dir / zero_shard_name(coords_of(*mesh_, static_cast<int64_t>(c)));
          LOOM_CHECK(std::filesystem::exists(shard_file),
                     "checkpoint '{}' has no ZeRO optimizer shard for dp rank {} of {}: '{}' is "
                     "missing",
                     resume->dir.string(), dp_rank(), dp_size(), shard_file.string());
          auto shard = core::load_safetensors(shard_file);
          zero_[c]->load_state(shard.tensors, shard.metadata, shard_file.string());
        }
      } else {
        // ZeRO shards of another layout: cut back into per-parameter state first (this rank's
        // parameters' only, as its tp shards).
        if (saved.zero > 0) assemble_zero_shards(*resume, rank_selection(resume->dir));
        const auto& opt_state = resume->optimizer;
        const auto source =
            fmt::format("checkpoint '{}'{}", resume->dir.string(),
                        saved.zero > 0 && !resume->state.contains("zero_shards")
                            ? " (its ZeRO shards predate resharding: resume it in the layout "
                              "that wrote it)"
                            : "");
        if (zero_.empty()) {
          LOOM_CHECK(opt_state.count("step"), "{} has no optimizer step count", source);
          for (const auto& chunk : chunks_)
            for (const auto& item : chunk->named_parameters())
              LOOM_CHECK(opt_state.count(item.key() + ".exp_avg"),
                         "{} has no optimizer entry '{}.exp_avg'", source, item.key());
          optimizer_->load_state(opt_state);
        } else {
          auto step = opt_state.find("step");
          LOOM_CHECK(step != opt_state.end(), "{} has no optimizer step count", source);
          for (auto& z : zero_)
            z->load_param_state(opt_state, step->second.item<int64_t>(), source);
        }
      }
    } catch (const std::exception& e) {
      error = e.what();
    }
    share_outcome(error, fmt::format("load their optimizer state from '{}'", resume->dir.string()));
    step_ = resume->step;
    auto& gen = model_->tp().generator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    auto rng = resume->optimizer.find(rng_key(dp_rank(), pp_rank()));
    if (rng != resume->optimizer.end()) {
      gen.set_state(rng->second);
    } else {
      const auto saved = TrainConfig::from_json(resume->state.value("train_config", json()));
      LOOM_CHECK(dp_rank() > 0 || saved.pp != pp_size(), "checkpoint '{}' has no RNG state",
                 resume->dir.string());
      // Resuming at more data-parallel ranks, or another pipeline split, than the checkpoint
      // was written with: this rank had no generator then. Dropout masks differ from any
      // earlier run from here on.
      spdlog::warn(
          "checkpoint '{}' has no RNG state for dp rank {} (pp rank {}); seeding it afresh",
          resume->dir.string(), dp_rank(), pp_rank());
      gen.set_current_seed(core::mix_seed(
          {config_.seed, core::stable_hash("dropout"), static_cast<uint64_t>(dp_rank()),
           static_cast<uint64_t>(pp_rank()), static_cast<uint64_t>(step_)}));
    }
    elapsed_before_ = resume->state.value("elapsed_s", 0.0);
    LOOM_CHECK(step_ <= config_.steps, "checkpoint '{}' is at step {}, past --steps {}",
               resume->dir.string(), step_, config_.steps);
    spdlog::info("resumed from {} at step {}", resume->dir.string(), step_);
  }
  // Replicas start equal however they were initialized (the init is layout-invariant; this
  // also covers a user-modified model).
  for (auto& dp : dp_) dp->broadcast_parameters();
  if (pp_size() > 1) {
    pipeline_ = std::make_unique<parallel::pipeline::PipelineExecutor>(
        mesh_->comm_ptr(dist::Dim::pp),
        parallel::pipeline::PipelineShape{pp_size(), config_.virtual_stages, config_.grad_accum},
        parallel::pipeline::make_schedule(config_.schedule), model_->parameters().front().device());
    // The first and last stages hold the two copies of a tied embedding; their gradients are
    // summed between them every step. Collective over the pipeline group.
    const bool tied = model_config.tie_embeddings;
    const bool holds_copy = pp_rank() == 0 || pp_rank() == pp_size() - 1;
    if (tied)
      tied_group_ = mesh_->comm(dist::Dim::pp)
                        .split(holds_copy ? 0 : -1, static_cast<int>(pp_rank()), "tied-embedding");
  }
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
  if (!dp_.empty()) {
    size_t buckets = 0;
    for (const auto& dp : dp_) buckets += dp->buckets().size();
    spdlog::info(
        "parallel: {} | each rank {} sequences per step in {} micro-batches of {} | {} "
        "gradient buckets (<= {} MiB), comm hook {}",
        mesh_->shape().describe(), config_.batch_size / dp_size(), config_.grad_accum,
        config_.micro_batch_size(dp_size()), buckets, config_.bucket_mb,
        dp_.front()->hook().name());
  }
  if (pipeline_)
    spdlog::info("pipeline: {} | schedule {} | {} stages, partitioned by {} cost:{}",
                 pipeline_->shape().describe(), config_.schedule, pipeline_->shape().stages(),
                 config_.pp_partition, partition_->describe());
  if (tp_size() > 1)
    spdlog::info(
        "tensor parallel: tp {}{} | {} of {} heads, {} of {} MLP columns and {} of {} vocabulary "
        "rows (padded from {}) per rank | {} partial gradients summed across ranks per step",
        tp_size(), config_.sequence_parallel ? " + sequence parallel" : "",
        model_config.n_heads / tp_size(), model_config.n_heads, model_config.d_ff / tp_size(),
        model_config.d_ff, model_->padded_vocab() / tp_size(), model_->padded_vocab(),
        model_config.vocab_size, partial_grads_.front()->num_params());
  if (!zero_.empty())
    spdlog::info("ZeRO stage {}: {} flat {} over dp {} | optimizer state{}{} sharded{}{}",
                 config_.zero, zero_.front()->num_buckets(),
                 config_.zero == 3 ? "units" : "buckets", dp_size(),
                 config_.zero >= 2 ? ", gradients" : "", config_.zero == 3 ? ", parameters" : "",
                 config_.offload_optimizer ? " | optimizer on the host" : "",
                 dp_size() == 1 ? " (one rank: nothing to split)" : "");
  if (config_.activation_checkpointing != "none")
    spdlog::info("activation checkpointing: {}{}", config_.activation_checkpointing,
                 config_.offload_activations ? ", block inputs offloaded to the host" : "");
  int64_t zero_decayed = 0, zero_not_decayed = 0;
  for (const auto& z : zero_) {
    zero_decayed += z->num_decayed();
    zero_not_decayed += z->num_not_decayed();
  }
  spdlog::info(
      "optimizer: AdamW, {} tensors with weight decay {}, {} without | lr {} -> {} "
      "(warmup {}, cosine) | precision {}",
      zero_.empty() ? optimizer_->num_decayed() : zero_decayed, config_.weight_decay,
      zero_.empty() ? optimizer_->num_not_decayed() : zero_not_decayed, config_.lr, config_.min_lr,
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

// ZeRO-3 gathers the parameters as this rank's model holds them: tp shards, the vocabulary
// padded (to --pad-vocab-multiple, even at tp 1): joined over tp (collective over tp) and cut
// back to the single-process shapes every checkpoint and export holds.
namespace {
std::map<std::string, at::Tensor> unpadded(const models::CausalLM& model,
                                           std::map<std::string, at::Tensor> params) {
  for (auto& [name, t] : params) t = models::gather_shard(model, name, t);
  return params;
}
}  // namespace

std::map<std::string, at::Tensor> Trainer::gather_parameters() {
  if (config_.zero == 3) return unpadded(*model_, zero_.front()->gather_parameters());
  if (!pipeline_) return models::gather_parameters(*model_);
  std::map<std::string, at::Tensor> out;
  // The tied embedding's two copies are equal: the first one received is kept.
  for (auto& [name, t] :
       dist::all_gather_named_tensors(mesh_->comm(dist::Dim::pp), local_full_state(false)))
    out.emplace(name, t);
  return out;
}

core::NamedTensors Trainer::local_full_state(bool optimizer) const {
  core::NamedTensors out;
  for (const auto& chunk : chunks_)
    for (auto& kv : models::gather_parameters(*chunk)) out.push_back(std::move(kv));
  if (!optimizer) return out;
  for (auto [key, tensor] : optimizer_->state()) {
    for (const auto& chunk : chunks_) {
      const auto param = param_of_state_key(key, *chunk);
      if (param.empty()) continue;
      tensor = models::gather_shard(*chunk, param, tensor);
      break;
    }
    out.emplace_back("optimizer/" + key, tensor);
  }
  return out;
}

std::string Trainer::write_stage3_parameters(const fs::path& file, const std::string& prefix,
                                             const core::NamedTensors& extra,
                                             const std::map<std::string, std::string>& metadata) {
  // Single-process shapes (no prefix) exist only at tp 1, where cutting the padded vocabulary
  // back needs no collective.
  const bool whole = prefix.empty();
  LOOM_CHECK(!whole || tp_size() == 1, "stage 3 writes single-process tensors at tp 1 only");
  const bool writes = dp_rank() == 0;
  std::unique_ptr<core::SafetensorsWriter> writer;
  std::string error;
  if (writes) {
    try {
      std::vector<core::SafetensorsWriter::Entry> entries;
      for (const auto& item : model_->named_parameters()) {
        auto shape = item.value().sizes().vec();
        if (whole) shape = model_->shard_spec(item.key()).full_shape(shape);
        entries.push_back({prefix + item.key(), item.value().scalar_type(), shape});
      }
      for (const auto& [key, t] : extra) entries.push_back({key, t.scalar_type(), t.sizes().vec()});
      writer = std::make_unique<core::SafetensorsWriter>(file, entries, metadata);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  // A failed write stops the writing, not the gathers the other ranks wait in.
  zero_.front()->for_each_gathered_parameter(
      /*only_rank=*/0, [&](const std::string& name, const at::Tensor& value) {
        if (!error.empty()) return;
        try {
          writer->write(prefix + name, whole ? models::gather_shard(*model_, name, value) : value);
        } catch (const std::exception& e) {
          error = e.what();
        }
      });
  if (writes && error.empty()) {
    try {
      for (const auto& [key, t] : extra) writer->write(key, t);
      writer->finish();
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  return error;
}

CheckpointSelection Trainer::rank_selection(const fs::path& dir) const {
  // This rank's parameters: the chunk holding each and its local shape.
  struct Held {
    const models::CausalLM* chunk;
    std::vector<int64_t> local_shape;
  };
  auto held = std::make_shared<std::map<std::string, Held>>();
  for (const auto& chunk : chunks_)
    for (const auto& item : chunk->named_parameters())
      held->emplace(item.key(), Held{chunk.get(), item.value().sizes().vec()});
  // The parameter a checkpoint key belongs to ("" for entries of none: step counts, RNG states).
  auto param_of = [](const std::string& key) -> std::string {
    if (key.starts_with("model/")) return key.substr(6);
    if (!key.starts_with("optimizer/")) return {};
    for (const char* suffix : {".exp_avg_sq", ".exp_avg", ".master"})
      if (key.ends_with(suffix)) return key.substr(10, key.size() - 10 - std::strlen(suffix));
    return {};
  };
  CheckpointSelection select;
  select.wanted = [held, param_of](const std::string& key) {
    const auto param = param_of(key);
    return param.empty() || held->count(param) > 0;  // not another stage's parameter's
  };
  select.keep = [held, param_of, dir](const std::string& key, at::Tensor whole) {
    const auto param = param_of(key);
    auto it = held->find(param);
    if (it == held->end()) return whole;
    const auto& [chunk, local_shape] = it->second;
    const auto& spec = chunk->shard_spec(param);
    const auto full_shape = spec.full_shape(local_shape);
    LOOM_CHECK(whole.sizes() == at::IntArrayRef(full_shape),
               "'{}': tensor '{}' has shape {} but the model needs {}", dir.string(),
               key.substr(key.find('/') + 1), whole.sizes(), at::IntArrayRef(full_shape));
    if (!spec.sharded()) return whole;
    // A tensor of its own (a piece of a view would keep the whole one alive until the end).
    auto piece = spec.shard(whole, chunk->tp().rank(), chunk->tp().size());
    return piece.is_alias_of(whole) && piece.numel() < whole.numel() ? piece.clone() : piece;
  };
  return select;
}

std::pair<std::map<std::string, at::Tensor>, core::NamedTensors> Trainer::collect_for_rank0(
    bool optimizer, const core::NamedTensors& extra_optimizer) {
  std::pair<std::map<std::string, at::Tensor>, core::NamedTensors> out;
  // Replica 0's tp ranks assemble single-process tensors (the other replicas hold the same).
  if (dp_rank() != 0) return out;
  auto mine = local_full_state(optimizer);
  for (const auto& [key, t] : extra_optimizer) mine.emplace_back("optimizer/" + key, t);
  if (pipeline_) {
    // Every stage's tp rank 0 sends rank 0 its stages (the other tp ranks hold copies).
    if (mesh_->coord(dist::Dim::tp) != 0) mine.clear();
    mine = dist::gather_named_tensors(mesh_->comm(dist::Dim::pp), 0, mine);
  }
  if (!is_rank0()) return out;
  std::set<std::string> seen;  // the tied embedding (and its moments) come twice, equal
  for (auto& [name, t] : mine) {
    if (!seen.insert(name).second) continue;
    if (name.starts_with("optimizer/"))
      out.second.emplace_back(name.substr(std::string("optimizer/").size()), std::move(t));
    else
      out.first.emplace(name, std::move(t));
  }
  return out;
}

Trainer::~Trainer() {
  if (config_.memory_cap_mb > 0) core::set_memory_cap(previous_memory_cap_);
}

core::MemoryReport Trainer::memory_report() const {
  core::MemoryReport m;
  if (!zero_.empty()) {
    for (const auto& engine : zero_) {
      const auto z = engine->memory();
      m.parameters += z.parameters;
      m.gradients += z.gradients;
      m.optimizer += z.optimizer;
    }
  } else {
    std::vector<at::Tensor> params, grads, state;
    for (const auto& chunk : chunks_)
      for (const auto& p : chunk->parameters()) {
        params.push_back(p);
        grads.push_back(p.grad());
      }
    for (const auto& dp : dp_)
      for (const auto& b : dp->buckets()) grads.push_back(b.buffer);
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
  for (auto& z : zero_) z->reset_comm_stats();
  StepResult r;
  double local_loss = 0;
  at::Tensor device_loss;  // on a GPU: read together with the gradient norm
  if (pipeline_) {
    // Every micro-batch's gradients accumulate; each chunk's buckets are reduced during its last
    // micro-batch's backward.
    for (auto& dp : dp_) dp->set_sync(false);
    const auto batch_of = [&](int64_t k) {
      return train_sampler_->random_batch(step_, shard.first + k * micro, micro);
    };
    r.pipeline = pipeline_->run(
        [&](int64_t chunk, int64_t k, const at::Tensor& input) {
          auto& part = *chunks_[static_cast<size_t>(chunk)];
          core::Bf16Autocast autocast(config_.precision == "bf16", device_.type());
          const bool needs_batch = part.part().first || part.part().last;
          const auto batch = needs_batch ? batch_of(k) : data::Batch{};
          auto out = part.forward_part(part.part().first ? batch.inputs : input);
          if (!part.part().last) return out;
          // Each micro-batch is an equal share of the global batch: scale so gradients are the
          // mean.
          return part.loss_from_logits(out, batch.targets) /
                 static_cast<double>(config_.grad_accum);
        },
        [&](int64_t chunk, int64_t k) {
          const bool last = k == config_.grad_accum - 1;
          if (!dp_.empty()) dp_[static_cast<size_t>(chunk)]->set_sync(last);
          if (!zero_.empty()) zero_[static_cast<size_t>(chunk)]->set_sync(last);
        },
        [&](int64_t chunk, int64_t) {
          if (!zero_.empty()) zero_[static_cast<size_t>(chunk)]->finish_gradient_sync();
        });
    // The last stage's losses (scaled by 1 / micro-batches: their sum is the mean), to every
    // stage.
    auto loss_t = at::zeros({1}, at::kDouble);
    if (pipeline_->has_last_stage())
      for (double l : r.pipeline.outputs) loss_t += l;
    mesh_->comm(dist::Dim::pp).broadcast(loss_t, static_cast<int>(pp_size() - 1));
    local_loss = loss_t.item<double>();
  } else {
    // Summed on the device: reading each micro-batch's loss would stall a GPU's stream.
    auto loss_sum = at::zeros({}, at::TensorOptions(at::kDouble).device(device_));
    for (int64_t k = 0; k < config_.grad_accum; ++k) {
      const bool last = k == config_.grad_accum - 1;
      for (auto& dp : dp_) dp->set_sync(last);  // sync on the last micro-batch only
      for (auto& z : zero_) {
        z->set_sync(last);
        z->prepare_forward();
      }
      auto batch = on_device(train_sampler_->random_batch(step_, shard.first + k * micro, micro));
      at::Tensor loss;
      {
        core::Bf16Autocast autocast(config_.precision == "bf16", device_.type());
        loss = model_->loss(batch.inputs, batch.targets);
      }
      // Each micro-batch is an equal share of the global batch: scale so gradients are the mean.
      (loss / static_cast<double>(config_.grad_accum)).backward();
      for (auto& z : zero_) z->finish_gradient_sync();
      loss_sum += loss.detach().to(at::kDouble);
    }
    loss_sum /= static_cast<double>(config_.grad_accum);
    if (device_.is_cuda()) {
      device_loss = loss_sum;
    } else {
      local_loss = loss_sum.item<double>();
    }
  }
  if (measure) {
    r.peak_activation_bytes = core::memory_counters(device).peak_bytes - baseline;
    last_peak_activations_ = r.peak_activation_bytes;
  }
  if (!dp_.empty() || !zero_.empty()) {
    for (auto& dp : dp_) {
      dp->finish_gradient_sync();
      r.comm_wait_s += dp->last_sync().wait_seconds;
    }
    // Equal shares: the global mean is the mean of the ranks' means.
    auto loss_t = at::full({1}, local_loss, at::kDouble);
    mesh_->comm(dist::Dim::dp).all_reduce(loss_t, dist::ReduceOp::Avg);
    local_loss = loss_t.item<double>();
  }
  // The tied embedding's two copies (first and last stage) each got part of its gradient.
  if (tied_group_) sum_tied_embedding_grads();
  // Replicated parameters used on sequence shards and shared key/value heads: sum their parts.
  // ZeRO keeps a shard of each gradient: the tp ranks hold alike-laid-out shards and sum the
  // pieces in them.
  for (size_t c = 0; c < partial_grads_.size(); ++c) {
    if (zero_.empty()) {
      partial_grads_[c]->sync();
    } else {
      partial_grads_[c]->sync([zero = zero_[c].get()](const std::string& name) {
        auto [values, offset] = zero->grad_shard_of(name);
        return parallel::tensor::PartialGradSync::GradPiece{values, offset};
      });
    }
  }
  if (zero_.size() == 1 && tp_size() == 1 && pp_size() == 1) {
    r.grad_norm = zero_.front()->clip_grad_norm(config_.grad_clip);
  } else if (!zero_.empty()) {
    // Each engine's squares summed over dp; then over tp (replicated parameters weighted to
    // count once) and over the pipeline.
    double sq = 0;
    for (auto& z : zero_) sq += z->grad_norm_squared();
    auto total = at::full({1}, sq, at::kDouble);
    if (tp_size() > 1) mesh_->comm(dist::Dim::tp).all_reduce(total, dist::ReduceOp::Sum);
    if (pp_size() > 1) mesh_->comm(dist::Dim::pp).all_reduce(total, dist::ReduceOp::Sum);
    r.grad_norm = std::sqrt(total.item<double>());
    if (config_.grad_clip > 0 && r.grad_norm > config_.grad_clip)
      for (auto& z : zero_) z->scale_gradients(config_.grad_clip / (r.grad_norm + 1e-6));
  } else if (device_.is_cuda()) {
    // One process on a GPU: the norm and the clip stay on the device, and the step's one host
    // sync reads the loss and the norm together.
    std::vector<at::Tensor> params;
    for (const auto& [name, p] : named_parameters(chunks_)) params.push_back(p);
    auto norm = clip_grad_norm_on_device(params, config_.grad_clip);
    const auto both = at::stack({device_loss, norm.to(at::kDouble)}).cpu();
    local_loss = both[0].item<double>();
    r.grad_norm = both[1].item<double>();
  } else {
    std::vector<const models::CausalLM*> parts;
    for (const auto& chunk : chunks_) parts.push_back(chunk.get());
    r.grad_norm =
        clip_grad_norm(parts, config_.grad_clip, pipeline_ ? &mesh_->comm(dist::Dim::pp) : nullptr);
  }
  // A non-finite gradient would poison the weights and moments: stop before the update.
  LOOM_CHECK(std::isfinite(r.grad_norm),
             "gradient norm is {} at step {} (loss {}): lower --lr or use --grad-clip; the "
             "parameters were not updated",
             r.grad_norm, step_ + 1, local_loss);
  r.lr = schedule_.at(step_);
  if (!zero_.empty()) {
    r.comm_wait_s = 0;
    for (auto& z : zero_) {
      z->step(r.lr);
      z->zero_grad();
      r.comm_wait_s += z->comm_stats().wait_seconds;
    }
  } else {
    optimizer_->step(r.lr);
    if (!dp_.empty()) {
      // In place: the gradients are views of the communication buckets.
      for (auto& dp : dp_) dp->zero_grad();
    } else {
      optimizer_->zero_grad();
    }
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
  core::Bf16Autocast autocast(config_.precision == "bf16", device_.type());
  double sum = 0;
  if (pipeline_) {
    // Micro-batches through the stages, forwards only; the last stage's sums go to every stage.
    const int64_t forwards = (end - begin + micro - 1) / micro;
    for (auto& chunk : chunks_) chunk->eval();
    const auto stats = pipeline_->run_forward(
        [&](int64_t chunk, int64_t i, const at::Tensor& input) {
          auto& part = *chunks_[static_cast<size_t>(chunk)];
          const int64_t first = begin + i * micro;
          const int64_t count = std::min(micro, end - first);
          const bool needs_batch = part.part().first || part.part().last;
          const auto batch =
              needs_batch ? val_sampler_->sequential_batch(first, count) : data::Batch{};
          auto out = part.forward_part(part.part().first ? batch.inputs : input);
          if (!part.part().last) return out;
          return part.loss_from_logits(out, batch.targets) * static_cast<double>(count);
        },
        forwards);
    for (auto& chunk : chunks_) chunk->train();
    auto sum_t = at::zeros({1}, at::kDouble);
    if (pipeline_->has_last_stage())
      for (double v : stats.outputs) sum_t += v;
    mesh_->comm(dist::Dim::pp).broadcast(sum_t, static_cast<int>(pp_size() - 1));
    sum = sum_t.item<double>();
  } else {
    // At ZeRO-3 every forward gathers parameters across the dp ranks, so every rank runs as many
    // forwards as the one with the most windows; a rank with fewer repeats window 0 and counts
    // nothing from it.
    const bool collective_forward = config_.zero == 3;
    auto sum_t = at::zeros({}, at::TensorOptions(at::kDouble).device(device_));
    const int64_t forwards =
        collective_forward ? (per_rank + micro - 1) / micro : (end - begin + micro - 1) / micro;
    for (int64_t i = 0; i < forwards; ++i) {
      const int64_t first = begin + i * micro;
      const int64_t count = std::max<int64_t>(0, std::min(micro, end - first));
      auto batch = on_device(
          val_sampler_->sequential_batch(count > 0 ? first : 0, std::max<int64_t>(count, 1)));
      for (auto& z : zero_) z->prepare_forward();
      // In double on the device: one host read at the end, not one per batch.
      sum_t +=
          model_->loss(batch.inputs, batch.targets).to(at::kDouble) * static_cast<double>(count);
    }
    sum = sum_t.item<double>();
    for (auto& z : zero_) z->release_parameters();
  }
  model_->train();
  if (dp_size() > 1) {
    auto sum_t = at::full({1}, sum, at::kDouble);
    mesh_->comm(dist::Dim::dp).all_reduce(sum_t, dist::ReduceOp::Sum);
    sum = sum_t.item<double>();
  }
  return sum / static_cast<double>(windows);
}

void Trainer::sum_tied_embedding_grads() {
  torch::NoGradGuard no_grad;
  for (size_t c = 0; c < chunks_.size(); ++c) {
    const auto& chunk = chunks_[c];
    if (!chunk->part().first && chunk->tied_embedding_copy().empty()) continue;
    if (!zero_.empty()) {
      // Its own bucket on both stages: this rank's shards cover the same elements.
      auto shard = zero_[c]->own_bucket_grad_shard(chunk->embedding_weight_name());
      tied_group_->all_reduce(shard, dist::ReduceOp::Sum);
      continue;
    }
    for (auto& item : chunk->named_parameters()) {
      if (item.key() != chunk->embedding_weight_name()) continue;
      auto& p = item.value();
      if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
      tied_group_->all_reduce(p.grad(), dist::ReduceOp::Sum);
    }
  }
}

fs::path Trainer::save_checkpoint() {
  LOOM_CHECK(!config_.save_dir.empty(), "saving a checkpoint needs --save-dir");
  // Data-parallel replicas hold the same state, except each rank's dropout generator: those
  // are gathered, then rank 0 writes everything while the others wait for the outcome.
  core::NamedTensors rng_states;
  {
    auto& gen = model_->tp().generator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    rng_states.emplace_back(rng_key(0, pp_rank()), gen.get_state());
  }
  if (dp_size() > 1) {
    const auto mine = rng_states.front().second.contiguous();
    auto all = at::empty({dp_size(), mine.numel()}, mine.options());
    mesh_->comm(dist::Dim::dp).all_gather(all, mine);
    for (int64_t r = 1; r < dp_size(); ++r)
      rng_states.emplace_back(rng_key(r, pp_rank()), all[r].clone());
  }
  // Checkpoints hold single-process tensors, whatever tp is: the tp ranks of replica 0 assemble
  // them (the other replicas hold the same values and skip the work and the memory). With ZeRO
  // the parameters are assembled from the dp ranks (stage 3) and each rank writes its own
  // optimizer shard, which rank 0 moves into the checkpoint with the rest.
  std::map<std::string, at::Tensor> params;
  core::NamedTensors opt_state;
  // A model split over tp or pp is written as one file per (pp, tp) rank of replica 0, each
  // holding that rank's shards (parameters, AdamW moments, RNG states) with their shard specs:
  // no rank ever holds the whole model to save it, and a loader reassembles any layout.
  const bool sharded_files = tp_size() * pp_size() > 1;
  core::NamedTensors my_shard;
  std::map<std::string, std::string> my_specs;
  if (sharded_files) {
    const int64_t steps = zero_.empty() ? 0 : zero_.front()->steps_taken();
    opt_state.emplace_back(
        "step", zero_.empty() ? optimizer_->state().front().second : at::tensor(steps, at::kLong));
    if (dp_rank() == 0) {
      my_specs["loom.tp_rank"] = std::to_string(mesh_->coord(dist::Dim::tp));
      my_specs["loom.tp_size"] = std::to_string(tp_size());
      auto add_spec = [&](const std::string& key, const models::CausalLM& part,
                          const std::string& param) {
        const auto& spec = part.shard_spec(param);
        if (spec.sharded())
          my_specs[key] = fmt::format("{},{},{},{},{}", spec.dim, spec.full, spec.padded,
                                      spec.parts, spec.units);
      };
      auto add = [&](const std::string& key, const models::CausalLM& part, const std::string& param,
                     const at::Tensor& t) {
        my_shard.emplace_back(key, t.detach());
        add_spec(key, part, param);
      };
      // Stage 3 holds 1/dp of each parameter: write_stage3_parameters gathers them below.
      for (const auto& chunk : chunks_)
        for (const auto& item : chunk->named_parameters()) {
          if (config_.zero == 3)
            add_spec("model/" + item.key(), *chunk, item.key());
          else
            add("model/" + item.key(), *chunk, item.key(), item.value());
        }
      if (zero_.empty())
        for (const auto& [key, t] : optimizer_->state())
          for (const auto& chunk : chunks_) {
            const auto param = param_of_state_key(key, *chunk);
            if (param.empty()) continue;
            add("optimizer/" + key, *chunk, param, t);
            break;
          }
      for (const auto& [key, t] : rng_states) my_shard.emplace_back("optimizer/" + key, t);
    }
    rng_states.clear();
  } else if (config_.zero == 3) {
    // model.safetensors is written unit by unit below (write_stage3_parameters).
    opt_state.emplace_back("step", at::tensor(zero_.front()->steps_taken(), at::kLong));
  } else if (!zero_.empty()) {
    // Stages 1-2 hold whole parameters (tp shards): collected like plain data parallelism's;
    // the optimizer state stays in the per-rank shards.
    std::tie(params, opt_state) = collect_for_rank0(false, rng_states);
    rng_states.clear();
    opt_state.emplace_back("step", at::tensor(zero_.front()->steps_taken(), at::kLong));
  } else {
    // With a pipeline every stage's state (its RNG states included) travels to rank 0.
    std::tie(params, opt_state) = collect_for_rank0(true, rng_states);
    rng_states.clear();
  }
  const auto dir = checkpoint_dir(config_.save_dir, step_);
  std::vector<fs::path> shard_files;
  std::vector<std::string> model_files, zero_files;
  if (!zero_.empty() || sharded_files) {
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
    std::string error;
    try {
      for (size_t c = 0; c < zero_.size(); ++c) {
        // Where the engine sits, so a loader can cut its shards back into parameters.
        auto meta = zero_[c]->state_metadata();
        meta["loom.group"] = fmt::format("pp{}-c{}", pp_rank(), c);
        meta["loom.tp_rank"] = std::to_string(mesh_->coord(dist::Dim::tp));
        meta["loom.tp_size"] = std::to_string(tp_size());
        json specs = json::object();  // how each split (or padded) parameter maps to the whole
        for (const auto& item : chunks_[c]->named_parameters()) {
          const auto& spec = chunks_[c]->shard_spec(item.key());
          if (spec.sharded())
            specs[item.key()] = fmt::format("{},{},{},{},{}", spec.dim, spec.full, spec.padded,
                                            spec.parts, spec.units);
        }
        meta["loom.specs"] = specs.dump();
        core::save_safetensors(
            staging / zero_shard_name(coords_of(*mesh_, static_cast<int64_t>(c))),
            zero_[c]->state(), meta);
      }
      if (sharded_files && dp_rank() == 0 && config_.zero != 3)
        core::save_safetensors(staging / model_shard_name(pp_rank(), mesh_->coord(dist::Dim::tp)),
                               my_shard, my_specs);
    } catch (const std::exception& e) {
      error = e.what();
    }
    // Every rank takes part in stage 3's gathers, whatever happened above.
    if (config_.zero == 3) {
      const auto stage3_error =
          sharded_files ? write_stage3_parameters(
                              staging / model_shard_name(pp_rank(), mesh_->coord(dist::Dim::tp)),
                              "model/", my_shard, my_specs)
                        : write_stage3_parameters(staging / "model.safetensors", "", {}, {});
      if (error.empty()) error = stage3_error;
      if (!sharded_files) shard_files.push_back(staging / "model.safetensors");
    }
    share_outcome(error, fmt::format("write their checkpoint shards for step {} into '{}'", step_,
                                     staging.string()));
    for (int64_t p = 0; p < pp_size(); ++p)
      for (int64_t c = 0; c < static_cast<int64_t>(zero_.size()); ++c)
        for (int64_t t = 0; t < tp_size(); ++t)
          for (int64_t r = 0; r < dp_size(); ++r) {
            zero_files.push_back(zero_shard_name({r, dp_size(), t, tp_size(), p, pp_size(), c}));
            shard_files.push_back(staging / zero_files.back());
          }
    if (sharded_files)
      for (int64_t p = 0; p < pp_size(); ++p)
        for (int64_t t = 0; t < tp_size(); ++t) {
          model_files.push_back(model_shard_name(p, t));
          shard_files.push_back(staging / model_files.back());
        }
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
      if (partition_) state["pipeline_bounds"] = partition_->bounds;
      if (!model_files.empty()) state["model_shards"] = model_files;
      if (!zero_files.empty()) state["zero_shards"] = zero_files;
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

void Trainer::share_outcome(const std::string& error, const std::string& what) {
  auto failed = at::full({1}, error.empty() ? 0 : 1, at::kInt);
  if (mesh_->world_size() > 1) mesh_->world().all_reduce(failed, dist::ReduceOp::Sum);
  LOOM_CHECK(error.empty(), "{}", error);
  LOOM_CHECK(failed.item<int>() == 0, "{} rank(s) could not {} (their errors say why)",
             failed.item<int>(), what);
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

data::Batch Trainer::on_device(data::Batch batch) const {
  if (device_.is_cpu()) return batch;
  // Pinned, the copies run on the stream without holding the host.
  batch.inputs = batch.inputs.pin_memory().to(device_, /*non_blocking=*/true);
  batch.targets = batch.targets.pin_memory().to(device_, /*non_blocking=*/true);
  return batch;
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
    // The peak is per device: the run's is the mesh's devices together.
    last.mfu =
        mfu(tokens_per_s, flops_per_token_, peak_flops_ * static_cast<double>(mesh_->world_size()));
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
    if (last.mfu) record["mfu"] = *last.mfu;
    if (pipeline_)
      record["pipeline"] = {{"bubble", last.pipeline.bubble_fraction()},
                            {"wait_s", last.pipeline.wait_seconds},
                            {"max_in_flight", last.pipeline.max_in_flight}};
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
    if (config_.zero == 3)
      params = unpadded(*model_,
                        zero_.front()->gather_parameters(/*only_rank=*/0));  // collective over dp
    else
      params = collect_for_rank0(false, {}).first;
    std::exception_ptr failure;
    if (is_rank0()) {
      try {
        auto whole = models::make_model(model_->config());
        models::load_parameters(*whole, params, "the trained model");
        models::save_hf(*whole, config_.export_hf);
        spdlog::info("exported Hugging Face model to {}{}", config_.export_hf,
                     config_.precision == "fp64"
                         ? " (the fp64 parameters rounded to float32: Hugging Face models are "
                           "float32 or narrower)"
                         : "");
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
