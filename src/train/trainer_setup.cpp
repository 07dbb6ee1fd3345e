// The Trainer's construction steps that are not the loop: the mesh and device checks, the model
// shape (preset, Hugging Face directory or checkpoint), the dropout generator's seed and the
// setup log.
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <ATen/Context.h>

#include <mutex>
#include <set>

#include "loom/core/error.h"
#include "loom/core/files.h"
#include "loom/core/json.h"
#include "loom/core/rng.h"
#include "loom/dist/backend_plan.h"
#include "loom/dist/process_info.h"
#include "loom/models/hf.h"
#include "loom/ops/cuda.h"
#include "loom/parallel/data/comm_hook.h"
#include "loom/train/trainer.h"

namespace loom::train {

using nlohmann::json;

void Trainer::check_mesh_and_device() {
  // The flags describe the mesh the ranks were started with: each size must match it.
  const auto shape = mesh_->shape().describe();
  LOOM_CHECK(config_.dp == 0 || config_.dp == data_ranks(),
             "--dp {} does not match the mesh, whose data-parallel size is {} ({})", config_.dp,
             data_ranks(), shape);
  LOOM_CHECK(config_.batch_size % (data_ranks() * config_.grad_accum) == 0,
             "--batch-size {} cannot be split evenly: dp {} x --grad-accum {} = {} must divide "
             "it (the batch size is the global batch, whatever the layout)",
             config_.batch_size, data_ranks(), config_.grad_accum,
             data_ranks() * config_.grad_accum);
  LOOM_CHECK(config_.tp == mesh_->size(dist::Dim::tp),
             "--tp {} does not match the mesh, whose tensor-parallel size is {} ({})", config_.tp,
             mesh_->size(dist::Dim::tp), shape);
  LOOM_CHECK(config_.cp == mesh_->size(dist::Dim::cp),
             "--cp {} does not match the mesh, whose context-parallel size is {} ({})", config_.cp,
             mesh_->size(dist::Dim::cp), shape);
  LOOM_CHECK(config_.pp == mesh_->size(dist::Dim::pp),
             "--pp {} does not match the mesh, whose pipeline-parallel size is {} ({})", config_.pp,
             mesh_->size(dist::Dim::pp), shape);
  // The ranks of a node spread over its GPUs (dist::rank_cuda_device), as Runtime::mesh
  // planned their groups' transports; multi-rank runs communicate on those devices.
  const int cuda_index = dist::rank_cuda_device(config_.device, dist::process_info().local_rank,
                                                ops::cuda_device_count(), ops::built_with_cuda());
  device_ = cuda_index >= 0 ? at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(cuda_index))
                            : at::Device(at::kCPU);
  if (device_.is_cuda()) ops::set_current_cuda_device(cuda_index);
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
}

models::ModelConfig Trainer::resolve_model_config(std::optional<CheckpointContents>& resume,
                                                  int64_t data_tokens) {
  if (custom_model_) {
    // Its shape is its own; what loom would build or load for it does not apply.
    LOOM_CHECK(config_.init_from_hf.empty() && config_.export_hf.empty(),
               "--init-from-hf and --export-hf read and write GPT-2 or Llama in Hugging Face's "
               "layout; this run trains a custom model (its checkpoints hold its parameters by "
               "name)");
    LOOM_CHECK(config_.dropout == 0,
               "--dropout {} applies to loom's models; a custom model has its own dropout (which "
               "draws from LibTorch's default generator: seeded per dp rank, saved in checkpoints "
               "and replayed by activation checkpointing)",
               config_.dropout);
    LOOM_CHECK(config_.ffn_blocks == 1 && config_.ffn_rank == 0,
               "--ffn-blocks {} / --ffn-rank {} apply to loom's GPT-2 and Llama MLPs; a custom "
               "model defines its own layers",
               config_.ffn_blocks, config_.ffn_rank);
    LOOM_CHECK(config_.mtp == 0,
               "--mtp {} adds loom's GPT-2 or Llama blocks as heads; a custom model defines its "
               "own layers",
               config_.mtp);
    LOOM_CHECK(config_.d_ff == 0,
               "--d-ff {} sets the width of loom's GPT-2 and Llama MLPs; a custom model defines "
               "its own layers",
               config_.d_ff);
    LOOM_CHECK(config_.share_layers.empty() || config_.share_layers == "none",
               "--share-layers '{}' shares loom's GPT-2 and Llama blocks; a custom model defines "
               "its own layers",
               config_.share_layers);
  }
  // 1-bit Adam steps with the variance frozen where the exact warm-up ends (comm_hook.h).
  if (const auto hook = parallel::data::make_comm_hook(config_.comm_hook);
      auto* momentum = dynamic_cast<parallel::data::MomentumCompressionHook*>(hook.get())) {
    const auto* warm = dynamic_cast<parallel::data::DenseWarmupHook*>(&momentum->inner());
    const int64_t warmup = warm != nullptr ? warm->warmup() : 0;
    if (config_.freeze_variance_after != warmup || warmup == 0)
      spdlog::warn(
          "--comm-hook {} with --freeze-variance-after {}: 1-bit Adam wants a dense warm-up "
          "(warmup=W) and the optimizer's variance frozen after the same W steps, so that the "
          "variance is never fed compressed gradients{}",
          config_.comm_hook, config_.freeze_variance_after,
          momentum->preconditioning().enabled ? " and the optimizer divides by the variance the "
                                                "hook preconditioned with"
                                              : "");
  }
  // Model shape: Hugging Face directory, checkpoint being resumed, or preset.
  models::ModelConfig model_config;
  if (!config_.resume.empty()) {
    resume = open_checkpoint(config_.resume);  // its tensors load once the model is built
    model_config = models::ModelConfig::from_json(resume->state.value("model_config", json()));
    const auto saved = TrainConfig::from_json(resume->state.value("train_config", json()));
    config_.check_resumable_from(saved);
    if (config_.sampling == "auto") config_.sampling = saved.sampling;
    // Against the shape the checkpoint holds (older checkpoints have no --d-ff of their own).
    LOOM_CHECK(config_.d_ff == 0 || config_.d_ff == model_config.d_ff,
               "--d-ff {} differs from the checkpoint's MLP width {}: the model's shape comes "
               "from the checkpoint",
               config_.d_ff, model_config.d_ff);
    // The layout may change on resume: the same training continues, equal up to float rounding
    // (sums over the batch are taken in another order), not bit for bit.
    if (saved.dp != 0 && saved.dp != data_ranks())
      spdlog::warn(
          "resuming at dp {} a run checkpointed at dp {}: it continues the same training up to "
          "float rounding, not bit for bit",
          data_ranks(), saved.dp);
    if (saved.tp != config_.tp || saved.sequence_parallel != config_.sequence_parallel)
      spdlog::warn(
          "resuming at tp {}{} a run checkpointed at tp {}{}: it continues the same training up "
          "to float rounding, not bit for bit",
          config_.tp, config_.sequence_parallel ? " with sequence parallelism" : "", saved.tp,
          saved.sequence_parallel ? " with sequence parallelism" : "");
    if (saved.comm_hook != config_.comm_hook)
      spdlog::warn("resuming with --comm-hook {} a run trained with {}", config_.comm_hook,
                   saved.comm_hook);
    const auto saved_tokens =
        resume->state.contains("data_tokens")
            ? core::json_int64(resume->state["data_tokens"], "state.json data_tokens")
            : int64_t{-1};
    LOOM_CHECK(saved_tokens == data_tokens,
               "cannot resume bit-exactly: the checkpoint was trained on {} tokens of data, but "
               "--data '{}' holds {}",
               saved_tokens, config_.data, data_tokens);
  } else if (custom_model_) {
    return model_config;  // known once the factory has built it
  } else {
    return config_.new_model_config(tokenizer_->vocab_size());
  }
  if (!custom_model_) model_config.validate();
  return model_config;
}

void Trainer::check_one_tokenizer(const std::vector<data::DataSourceSpec>& train,
                                  const std::vector<data::DataSourceSpec>& val) const {
  // What makes two tokenizers the same: their kind, size, document start and files' bytes.
  const auto fingerprint = [](const data::Tokenizer& tok) {
    std::string f =
        fmt::format("{} {} {}", tok.kind(), tok.vocab_size(), tok.document_start().value_or(-1));
    for (const auto& file : tok.files())
      f += fmt::format(" {}:{:08x}", file.name, core::file_crc32(file.source));
    return f;
  };
  const auto ours = fingerprint(*tokenizer_);
  namespace fs = std::filesystem;
  std::set<fs::path> seen = {tokenizer_dir_};
  for (const auto* sources : {&train, &val})
    for (const auto& source : *sources)
      for (const auto& path : source.paths) {
        const auto dir = fs::absolute(path).parent_path();
        if (!seen.insert(dir).second) continue;
        const auto other = data::load_tokenizer(dir);
        LOOM_CHECK(fingerprint(*other) == ours,
                   "data source '{}' ({}) was prepared with another tokenizer than '{}': {} ({} "
                   "ids) against {} ({} ids) — the sources of a run must share one tokenizer "
                   "(the same meta.json and tokenizer files)",
                   source.name, dir.string(), tokenizer_dir_.string(), other->kind(),
                   other->vocab_size(), tokenizer_->kind(), tokenizer_->vocab_size());
      }
}

void Trainer::check_model_fits(const models::ModelConfig& model_config) const {
  LOOM_CHECK(config_.attention != "fused" || model_config.head_dim() == 64 ||
                 model_config.head_dim() == 128,
             "--attention fused: the kernel has head dims 64 and 128, and this model's is {} "
             "(d_model {} / {} heads); use --attention auto",
             model_config.head_dim(), model_config.d_model, model_config.n_heads);
  LOOM_CHECK(config_.seq_len <= model_config.max_seq_len,
             "--seq-len {} exceeds the model's max_seq_len {}", config_.seq_len,
             model_config.max_seq_len);
  // A tokenizer read from files names ids up to its vocabulary; a model with fewer rows could
  // neither learn nor generate the rest. (Byte data is checked id by id below: tests and small
  // runs use a few byte values with small vocabularies.)
  LOOM_CHECK(tokenizer_->kind() == "byte" || tokenizer_->vocab_size() <= model_config.vocab_size,
             "the {} tokenizer of {} has {} ids, more than the model's vocabulary of {}: raise "
             "--vocab-size to at least {} (or leave it at 0 to take the tokenizer's)",
             tokenizer_->kind(), tokenizer_dir_.string(), tokenizer_->vocab_size(),
             model_config.vocab_size, tokenizer_->vocab_size());
  std::vector<const data::WindowSampler*> samplers = {train_sampler_.get()};
  for (const auto& s : val_samplers_) samplers.push_back(s.get());
  for (const auto* sampler : samplers)
    for (const auto& source : sampler->sources())
      for (const auto& shard : source.shards) shard->check_vocab(model_config.vocab_size);
}

at::Generator Trainer::dropout_generator() {
  LOOM_CHECK(custom_model_,
             "dropout_generator: loom's own models draw no dropout from a generator");
  // torch::dropout on a device draws from that device's default generator.
  return at::globalContext().defaultGenerator(device_);
}

void Trainer::seed_dropout() {
  if (!custom_model_) {
    // loom's models: counter-based masks (ops/dropout.h), one seed on every rank; the runtime
    // gives each micro-batch its position (step, first sample), so masks follow the samples,
    // whatever the layout, and a resume needs nothing saved beyond the step.
    model().tp().dropout().reseed(core::mix_seed({config_.seed, core::stable_hash("dropout")}));
    return;
  }
  // A custom module draws its dropout from LibTorch's default generator: seed it, so that two
  // runs with the same flags are the same run (a resume restores its saved state after this).
  // Data-parallel ranks draw different masks for their different samples; each pipeline stage
  // has its own stream.
  auto gen = dropout_generator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  uint64_t seed = core::mix_seed({config_.seed, core::stable_hash("dropout")});
  if (data_ranks() > 1)
    seed = core::mix_seed(
        {config_.seed, core::stable_hash("dropout"), static_cast<uint64_t>(data_rank())});
  if (mesh_->size(dist::Dim::pp) > 1)
    seed = core::mix_seed({seed, core::stable_hash("pipeline stage"),
                           static_cast<uint64_t>(mesh_->coord(dist::Dim::pp))});
  gen.set_current_seed(seed);
}

void Trainer::log_setup() const {
  const auto& m = model_config();
  if (custom_model_) {
    int64_t n = 0;
    for (const auto& p : run().chunks.front()->parameters()) n += p.numel();
    spdlog::info("model: custom | {:.2f}M parameters | {} blocks | vocab {}", n / 1e6,
                 run().chunks.front()->blocks().size(), m.vocab_size);
  } else {
    spdlog::info(
        "model: {} | {:.2f}M parameters | d_model {} | layers {}{} | heads {}/{} kv | vocab {}",
        models::to_string(m.family), m.num_parameters() / 1e6, m.d_model, m.n_layers,
        m.share_layers.empty()
            ? std::string()
            : fmt::format(" ({} distinct block{}, shared '{}')", m.unique_blocks(),
                          m.unique_blocks() == 1 ? "" : "s", m.share_layers),
        m.n_heads, m.n_kv_heads,
        run().chunks.front()->padded_vocab() == m.vocab_size
            ? std::to_string(m.vocab_size)
            : fmt::format("{} (padded to {})", m.vocab_size, run().chunks.front()->padded_vocab()));
  }
  spdlog::info(
      "data: {} tokens in {} | tokenizer {} | batch {} x {} tokens ({} micro-batches "
      "of {}) | {} threads",
      train_sampler_->tokens(), config_.data, tokenizer_->kind(), config_.batch_size,
      config_.seq_len, config_.grad_accum, config_.micro_batch_size(), at::get_num_threads());
  const auto& sampler = *train_sampler_;
  if (sampler.sources().size() > 1 || sampler.sources().front().shards.size() > 1)
    for (size_t s = 0; s < sampler.sources().size(); ++s) {
      const auto& source = sampler.sources()[s];
      spdlog::info("data source '{}': weight {:.3f}, {} shard{}, {} tokens, {} windows an epoch",
                   source.name, source.weight, source.shards.size(),
                   source.shards.size() == 1 ? "" : "s", source.tokens(),
                   sampler.sampling() == data::Sampling::kEpoch
                       ? std::to_string(sampler.windows_per_epoch(static_cast<int64_t>(s)))
                       : std::string("(random draw)"));
    }
  const auto names = runtime_->strategy_names();
  spdlog::info("strategies: {}", names.empty() ? std::string("none (one process)")
                                               : fmt::format("{}", fmt::join(names, " -> ")));
  for (const auto& line : runtime_->describe()) spdlog::info("{}", line);
  spdlog::info("optimizer: {} | lr {} -> {} (warmup {}, cosine) | precision {}",
               run().optimizer->describe(), config_.lr, config_.min_lr, config_.warmup_steps,
               config_.precision);
  spdlog::info("{}", memory_report().describe());
}

}  // namespace loom::train
