#include "loom/train/trainer.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <limits>

#include "loom/core/autocast.h"
#include "loom/core/error.h"
#include "loom/core/files.h"
#include "loom/core/preemption.h"
#include "loom/models/hf.h"
#include "loom/ops/attention.h"
#include "loom/ops/cuda.h"
#include "loom/ops/linear_cross_entropy.h"
#include "loom/parallel/zero/zero_optimizer.h"
#include "loom/train/builtin_strategies.h"
#include "loom/train/mfu.h"
#include "loom/train/optimizer.h"

namespace loom::train {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::string format_duration(double seconds) {
  const auto s = static_cast<int64_t>(seconds + 0.5);
  if (s >= 3600) return fmt::format("{}h{:02d}m", s / 3600, (s % 3600) / 60);
  if (s >= 60) return fmt::format("{}m{:02d}s", s / 60, s % 60);
  return fmt::format("{}s", s);
}

}  // namespace

Trainer::Trainer(TrainConfig config, dist::MeshPtr mesh)
    : Trainer(std::move(config), std::move(mesh), {}) {}

Trainer::Trainer(TrainConfig config, dist::MeshPtr mesh, models::CustomModelFactory custom_model)
    : config_(std::move(config)),
      mesh_(mesh ? std::move(mesh) : dist::Mesh::single_process()),
      custom_model_(std::move(custom_model)) {
  config_.validate();
  // Before anything is allocated, so that memory reports count every tensor of the run.
  core::install_memory_tracking();
  register_builtin_strategies();
  check_mesh_and_device();
  config_.dp = data_ranks();  // checkpoints record the layout that was actually used
  // The strategies and their composition are checked before anything is built or read.
  runtime_ = std::make_unique<Runtime>(config_, mesh_, custom_model_);
  schedule_ = {config_.lr, config_.min_lr, config_.warmup_steps, config_.schedule_steps()};
  schedule_.validate();

  // Data and tokenizer: a data directory written by loom-prepare describes its tokenizer; every
  // source's must be the same.
  const auto train_sources = data::parse_data_sources(config_.data, "--data");
  const auto val_sources = config_.val_data.empty()
                               ? std::vector<data::DataSourceSpec>()
                               : data::parse_data_sources(config_.val_data, "--val-data");
  tokenizer_dir_ = fs::absolute(train_sources.front().paths.front()).parent_path();
  tokenizer_ = data::load_tokenizer(tokenizer_dir_);
  check_one_tokenizer(train_sources, val_sources);
  auto opened = data::open_sources(train_sources);
  int64_t data_tokens = 0;
  for (const auto& source : opened) data_tokens += source.tokens();
  std::optional<CheckpointContents> resume;
  const auto model_config = resolve_model_config(resume, data_tokens);
  if (config_.sampling == "auto") config_.sampling = "epoch";  // a new run (a resume took its own)
  train_sampler_ = std::make_unique<data::WindowSampler>(
      std::move(opened), config_.seq_len, config_.seed, data::parse_sampling(config_.sampling),
      config_.batch_size);
  // Validation reads each source's windows in order (the draw settings are not used).
  for (const auto& source : data::open_sources(val_sources))
    val_samplers_.push_back(std::make_unique<data::WindowSampler>(
        std::vector<data::SamplerSource>{source}, config_.seq_len, config_.seed,
        data::Sampling::kEpoch, 1));
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

  auto& run = this->run();
  run.device = device_;
  run.adamw = {config_.beta1, config_.beta2, 1e-8, config_.weight_decay,
               config_.freeze_variance_after};
  run.decays = default_decays;
  run.train_sampler = train_sampler_.get();
  run.val_sampler = val_samplers_.empty() ? nullptr : val_samplers_.front().get();
  runtime_->build_model(model_config);
  check_model_fits(run.model_config);  // a custom model's shape is known once it is built
  // fp64 runs hold parameters (and so activations, gradients and optimizer state) in fp64, from
  // the same initial values as an fp32 run; converted before anything is loaded into them, so a
  // resumed fp64 checkpoint is not rounded to fp32 on the way.
  if (config_.precision == "fp64")
    for (auto& chunk : run.chunks) chunk->to(at::kDouble);
  if (resume) {
    load_checkpoint_parameters(*resume);
  } else if (!config_.init_from_hf.empty()) {
    std::map<std::string, at::Tensor> hf_tensors;
    for (const auto& item : models::load_hf(config_.init_from_hf)->named_parameters())
      hf_tensors.emplace(item.key(), item.value());
    for (auto& chunk : run.chunks)
      models::load_parameters(*chunk, hf_tensors, config_.init_from_hf);
  } else {
    for (auto& chunk : run.chunks) models::init_parameters(*chunk, config_.seed);
  }
  // On a GPU, --attention auto times loom's kernel against SDPA once per shape and keeps the
  // choices beside the checkpoints: a resumed run reads them and makes the same ones; a new run
  // in the same directory measures again.
  std::shared_ptr<ops::AttentionChooser> chooser;
  // --doc-mask: each document begins at the tokenizer's document-start token.
  std::optional<int64_t> document_start;
  if (config_.doc_mask) document_start = data::document_start_for_mask(*tokenizer_, tokenizer_dir_);
  if (device_.is_cuda() && config_.attention == "auto")
    chooser = std::make_shared<ops::AttentionChooser>(
        config_.save_dir.empty() ? std::string()
                                 : (std::filesystem::path(config_.save_dir) /
                                    fmt::format("attention_choice.rank{}.json", mesh_->rank()))
                                       .string(),
        ops::AttentionChooser::Timer(), /*read_existing=*/!config_.resume.empty());
  for (auto& chunk : run.chunks) {
    chunk->to(device_);
    chunk->set_attention_backend(ops::parse_attention_backend(config_.attention));
    chunk->set_attention_chooser(chooser);
    chunk->set_loss_backend(ops::parse_loss_backend(config_.loss));
    chunk->set_loss_chunk_rows(ops::parse_chunk_rows(config_.loss_chunk_rows));
    chunk->set_norm_backend(ops::parse_norm_backend(config_.norm));
    chunk->set_activation_backend(ops::parse_activation_backend(config_.swiglu));
    chunk->set_z_loss(config_.z_loss);
    if (config_.doc_mask) chunk->set_document_mask(document_start);
    if (!config_.mtp_weights.empty()) chunk->set_mtp_loss_weights(config_.mtp_weights);
    chunk->train();  // bf16 runs too keep fp32 parameters: autocast lowers the compute only
  }
  if (custom_model_) {
    // 6 FLOPs per parameter per token (forward and backward); its attention, if any, unknown.
    int64_t n = 0;
    for (const auto& p : model().parameters()) n += p.numel();
    flops_per_token_ = 6.0 * static_cast<double>(n);
  } else {
    flops_per_token_ = model_flops_per_token(model_config, config_.seq_len);
  }
  peak_flops_ = config_.peak_tflops * 1e12;
  if (peak_flops_ == 0 && device_.is_cuda()) {
    const auto name = ops::cuda_device_name(device_.index());
    peak_flops_ = peak_flops_for_device(name).value_or(0.0);
    if (peak_flops_ == 0)
      spdlog::warn("no bf16 peak is known for device '{}': pass --peak-tflops to get MFU", name);
  }
  // The strategies shard and wrap what was built and loaded, and install the optimizer.
  runtime_->apply();
  seed_dropout();
  if (resume) load_checkpoint_state(*resume);
  if (!config_.metrics_out.empty() && is_rank0())
    metrics_ = MetricsWriter(config_.metrics_out, resume ? run.step : -1);
  log_setup();
  // The cap simulates a smaller device for training itself: the model was built (whole, even
  // at stage 3) before it applies. On a GPU it caps the device (LibTorch's caching allocator),
  // not the host, which holds what offload moves there.
  if (config_.memory_cap_mb > 0) {
    const auto bytes = static_cast<int64_t>(config_.memory_cap_mb * 1024.0 * 1024.0);
    if (device_.is_cuda()) {
      ops::set_cuda_memory_cap(device_.index(), bytes);
    } else {
      previous_memory_cap_ = core::memory_cap();
      core::set_memory_cap(bytes, "--memory-cap-mb");
    }
  }
}

Trainer::~Trainer() {
  if (config_.memory_cap_mb <= 0) return;
  try {
    if (device_.is_cuda())
      ops::set_cuda_memory_cap(device_.index(), 0);
    else
      core::set_memory_cap(previous_memory_cap_);
  } catch (const std::exception& e) {  // a destructor must not throw (a failed CUDA context)
    spdlog::warn("could not lift --memory-cap-mb: {}", e.what());
  }
}

const parallel::zero::ZeroOptimizer* Trainer::zero() const {
  return run().find<parallel::zero::ZeroOptimizer>("zero");
}

core::MemoryReport Trainer::memory_report() const {
  core::MemoryReport m;
  runtime_->add_memory(m);
  m.peak_activations = last_peak_activations_;
  const auto& params = run().chunks.front()->parameters();
  const auto device = params.empty() ? at::Device(at::kCPU) : params.front().device();
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
  const int64_t micro = config_.micro_batch_size(data_ranks());
  const int64_t step = run().step;
  // Activations: the peak above what the step starts with (parameters, gradients, state).
  const bool measure = device_.is_cuda() || core::memory_tracking_installed();
  const int64_t baseline = measure ? core::memory_counters(device_).current_bytes : 0;
  if (measure) core::reset_peak_memory(device_);
  StepResult r;
  const double sent_before = mesh_->bytes_sent();
  // What a failed step may have left in the heads' loss means is not this step's.
  for (auto& chunk : run().chunks) chunk->take_mtp_losses();
  // A mixture's per-source losses: the models record their rows' losses for this step.
  const bool by_source = train_sampler_->sources().size() > 1;
  for (auto& chunk : run().chunks) {
    chunk->take_row_losses();
    chunk->set_record_row_losses(by_source);
  }
  runtime_->begin_step();
  at::Tensor loss;
  try {
    loss = runtime_->run_micro_batches(
        [&](int64_t k) {
          // Sample indices are global (this rank's share of the global batch), so the data does
          // not depend on the layout.
          return on_device(train_sampler_->training_batch(
              step, config_.first_sample(data_rank(), data_ranks(), k), micro));
        },
        r);
  } catch (const c10::OutOfMemoryError& e) {
    // Under a cap the user set, say which cap bit (a host cap already names its flag).
    if (!device_.is_cuda() || config_.memory_cap_mb <= 0) throw;
    const std::string what = e.what();
    fail(
        "step {}: out of memory on {} under --memory-cap-mb {} (the cap counts what LibTorch's "
        "CUDA caching allocator reserves; raise it, or lower --batch-size, or add "
        "--activation-checkpointing full): {}",
        step + 1, device_.str(), config_.memory_cap_mb, what.substr(0, what.find('\n')));
  }
  if (measure) {
    r.peak_activation_bytes = core::memory_counters(device_).peak_bytes - baseline;
    last_peak_activations_ = r.peak_activation_bytes;
  }
  runtime_->finish_gradient_sync(r);
  if (data_ranks() > 1) {
    // Equal shares: the global mean is the mean of the ranks' means.
    loss = loss.reshape({1}).to(device_);  // an NCCL group reduces device tensors only
    mesh_->comm(dist::Dim::dp).all_reduce(loss, dist::ReduceOp::Avg);
    loss = loss.reshape({});
  }
  const auto norm = runtime_->clip_gradients(config_.grad_clip);
  // One host read for the loss and the norm together (on a GPU, the step's only sync).
  const auto both = at::stack({loss.to(norm.device()), norm}).cpu();
  r.loss = both[0].item<double>();
  r.grad_norm = both[1].item<double>();
  r.mtp_losses = mtp_losses();  // the stream is in sync now: reading them waits for nothing
  if (by_source) r.source_losses = source_losses(step);
  // A non-finite gradient would poison the weights and moments: stop before the update. (On a
  // GPU the clip already scaled the gradients; they are not applied either.)
  LOOM_CHECK(std::isfinite(r.grad_norm),
             "gradient norm is {} at step {} (loss {}): lower --lr or use --grad-clip; the "
             "parameters were not updated",
             r.grad_norm, step + 1, r.loss);
  r.lr = schedule_.at(step);
  runtime_->optimizer_step(r.lr, r);
  r.step = run().step;
  r.comm_bytes = mesh_->bytes_sent() - sent_before;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return r;
}

double Trainer::evaluate(int64_t batches) {
  LOOM_CHECK(!val_samplers_.empty(), "evaluation needs --val-data");
  torch::NoGradGuard no_grad;
  for (auto& chunk : run().chunks) chunk->eval();
  val_by_source_.clear();
  double total_sum = 0;
  int64_t total_windows = 0;
  for (const auto& sampler : val_samplers_) {
    // Whole batches of batch_size windows (the same windows whatever --grad-accum and the layout
    // are), each dp rank taking a contiguous share, run in micro-batches to bound memory.
    run().val_sampler = sampler.get();  // what the runners read the windows from
    const int64_t windows =
        std::min(batches * config_.batch_size, sampler->num_sequential_windows());
    const int64_t per_rank = (windows + data_ranks() - 1) / data_ranks();
    const int64_t begin = std::min(windows, data_rank() * per_rank);
    const int64_t end = std::min(windows, begin + per_rank);
    double sum = 0;
    {
      core::Bf16Autocast autocast(config_.precision == "bf16", device_.type());
      sum = runtime_->evaluate(begin, end, per_rank);
    }
    if (data_ranks() > 1) {
      auto sum_t = at::full({1}, sum, at::TensorOptions(at::kDouble).device(device_));
      mesh_->comm(dist::Dim::dp).all_reduce(sum_t, dist::ReduceOp::Sum);
      sum = sum_t.item<double>();
    }
    val_by_source_.emplace_back(sampler->sources().front().name,
                                sum / static_cast<double>(windows));
    total_sum += sum;
    total_windows += windows;
  }
  run().val_sampler = val_samplers_.front().get();
  for (auto& chunk : run().chunks) chunk->train();
  return total_sum / static_cast<double>(total_windows);
}

void Trainer::add_source_metrics(json& record) const {
  const auto& sampler = *train_sampler_;
  if (sampler.sources().size() < 2) return;
  const int64_t after = step() * config_.batch_size;
  const auto before = sampler.samples_drawn(after - config_.batch_size);
  const auto total = sampler.samples_drawn(after);
  json sources = json::object();
  for (size_t s = 0; s < total.size(); ++s)
    sources[sampler.sources()[s].name] = {
        {"samples", total[s] - before[s]},
        {"tokens", (total[s] - before[s]) * config_.seq_len},
        {"epochs", static_cast<double>(total[s]) /
                       static_cast<double>(sampler.windows_per_epoch(static_cast<int64_t>(s)))}};
  record["sources"] = std::move(sources);
}

void Trainer::log_progress(const StepResult& r, double tokens_per_s, double eta_s) const {
  std::string by_source;
  for (size_t i = 0; i < r.source_losses.size(); ++i)
    if (std::isfinite(r.source_losses[i]))
      by_source += fmt::format("{}{} {:.4f}", by_source.empty() ? " (" : ", ",
                               train_sampler_->sources()[i].name, r.source_losses[i]);
  if (!by_source.empty()) by_source += ")";
  spdlog::info(
      "step {:>5}/{} | loss {:.4f}{}{} | lr {:.2e} | grad norm {:.3f} | {:.0f} tok/s | ETA {}",
      r.step, config_.steps, r.loss,
      r.mtp_losses.empty() ? std::string()
                           : fmt::format(" (heads {:.4f})", fmt::join(r.mtp_losses, " ")),
      by_source, r.lr, r.grad_norm, tokens_per_s, format_duration(eta_s));
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
  const int64_t first_step = step();
  StepResult last;
  last.step = step();
  // Signals are only recorded while the loop runs; it looks at them between steps.
  std::optional<core::PreemptionWatch> watch;
  if (const auto signals = core::parse_preemption_signals(config_.preempt_signals);
      !signals.empty())
    watch.emplace(signals);
  preempted_by_ = 0;
  // A failure in the steps after a background save (a non-finite loss, a rank's error) ends the
  // job (run_tool aborts it) with this Trainer alive: rank 0 first finishes the write in flight,
  // as a synchronous save would have. (A peer's abort can still cut it short.)
  struct FinishWriteOnThrow {
    CheckpointWriter& writer;
    int uncaught = std::uncaught_exceptions();
    ~FinishWriteOnThrow() {
      if (std::uncaught_exceptions() > uncaught && writer.pending()) writer.finish_quietly();
    }
  } finish_write_on_throw{writer_};
  // What checkpoints cost this run: the training loop waits for each save.
  const double written_before = writer_.total_seconds();
  auto last_save = start;
  int64_t saves = 0;
  double save_s = 0;
  double last_save_s = -1;  // the last save's seconds, until a record has said them; -1: none
  const auto timed_save = [&] {
    const auto t0 = std::chrono::steady_clock::now();
    save_checkpoint(config_.async_save);
    last_save = std::chrono::steady_clock::now();
    const double s = std::chrono::duration<double>(last_save - t0).count();
    saves += 1;
    save_s += s;
    return s;
  };
  // The last background write is waited for (every rank learns its outcome) before fit returns.
  const auto report_saves = [&] {
    const auto t0 = std::chrono::steady_clock::now();
    wait_for_checkpoint();
    save_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (saves == 0) return;
    const double run_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (config_.async_save)
      spdlog::info(
          "checkpoints: {} written; training waited {:.2f} s for them, {:.1f} % of this run's "
          "{:.1f} s; rank 0 wrote their files in {:.2f} s in the background",
          saves, save_s, 100.0 * save_s / run_s, run_s, writer_.total_seconds() - written_before);
    else
      spdlog::info("checkpoints: {} written in {:.2f} s, {:.1f} % of this run's {:.1f} s", saves,
                   save_s, 100.0 * save_s / run_s, run_s);
  };
  while (step() < config_.steps) {
    last = train_step();
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const double avg_step = elapsed / static_cast<double>(step() - first_step);
    const double tokens_per_s = tokens_per_step / last.seconds;
    // The peak is per device: the run's is the mesh's devices together.
    last.mfu =
        mfu(tokens_per_s, flops_per_token_, peak_flops_ * static_cast<double>(mesh_->world_size()));
    LOOM_CHECK(std::isfinite(last.loss), "loss became {} at step {}: lower --lr or use --grad-clip",
               last.loss, step());
    json record = {{"step", last.step},
                   {"loss", last.loss},
                   {"lr", last.lr},
                   {"grad_norm", last.grad_norm},
                   {"tokens_per_s", tokens_per_s},
                   {"comm_wait_s", last.comm_wait_s},
                   {"comm_bytes", last.comm_bytes},
                   {"memory", memory_report().to_json()},
                   {"elapsed_s", elapsed_s()}};
    if (last.mfu) record["mfu"] = *last.mfu;
    if (!last.mtp_losses.empty()) record["mtp_losses"] = last.mtp_losses;
    if (!last.source_losses.empty()) {
      record["loss_by_source"] = json::object();
      for (size_t i = 0; i < last.source_losses.size(); ++i)
        if (std::isfinite(last.source_losses[i]))
          record["loss_by_source"][train_sampler_->sources()[i].name] = last.source_losses[i];
    }
    // Once per process, in its first record: what was run (scripts/plot labels curves by it).
    if (step() == first_step + 1)
      record["run"] = {
          {"flags", config_.to_json()}, {"world_size", mesh_->world_size()}, {"dp", data_ranks()}};
    runtime_->add_metrics(last, record);
    add_source_metrics(record);
    const bool final_step = step() == config_.steps;
    if (!val_samplers_.empty() &&
        ((config_.eval_every > 0 && step() % config_.eval_every == 0) || final_step)) {
      const double val = evaluate(config_.eval_batches);
      record["val_loss"] = val;
      std::string by_source;
      if (val_by_source_.size() > 1) {
        record["val_loss_by_source"] = json::object();
        for (const auto& [name, loss] : val_by_source_) {
          record["val_loss_by_source"][name] = loss;
          by_source += fmt::format(" | {} {:.4f}", name, loss);
        }
      }
      spdlog::info("step {:>5}/{} | validation loss {:.4f}{}", step(), config_.steps, val,
                   by_source);
    }
    // By seconds, the ranks agree: one whose clock says "due" makes every rank save.
    const bool due_by_time =
        config_.save_every_s > 0 &&
        reduce_over_world(
            std::chrono::duration<double>(std::chrono::steady_clock::now() - last_save).count() >=
                    config_.save_every_s
                ? 1
                : 0,
            dist::ReduceOp::Max) != 0;
    const bool save =
        !config_.save_dir.empty() &&
        ((config_.save_every > 0 && step() % config_.save_every == 0) || due_by_time || final_step);
    // The record goes out before the save: a run resumed from this step's checkpoint keeps it.
    // What a save cost is in the next step's record (and the summary at the end).
    if (last_save_s >= 0) record["previous_checkpoint_s"] = last_save_s;
    last_save_s = -1;
    metrics_.write(record);
    if (step() % config_.log_every == 0 || final_step || step() == first_step + 1)
      log_progress(last, tokens_per_s, avg_step * static_cast<double>(config_.steps - step()));
    if (save) last_save_s = timed_save();
    // A signal may reach only some ranks, or reach them in different steps: the largest signal
    // number any rank has seen makes every rank stop after the same step.
    if (watch && (preempted_by_ = reduce_over_world(watch->received(), dist::ReduceOp::Max)) != 0) {
      if (!config_.save_dir.empty() && !save) timed_save();
      if (config_.save_dir.empty())
        spdlog::warn("{} after step {}: stopping without a checkpoint (no --save-dir)",
                     core::signal_name(preempted_by_), step());
      else
        spdlog::info(
            "{} after step {}: checkpoint written to '{}'; stopping (resume with --resume)",
            core::signal_name(preempted_by_), step(), config_.save_dir);
      report_saves();
      return last;
    }
  }
  report_saves();
  if (!config_.export_hf.empty()) export_hf();
  return last;
}

std::vector<double> Trainer::mtp_losses() {
  const int64_t heads = run().model_config.mtp_heads;
  if (heads == 0) return {};
  // The part holding the heads (on the last pipeline stage) has them; every rank adds its share
  // over the world (tp ranks hold copies of one value, dp ranks their samples' means), so no
  // rank needs to know where the heads are. On the host: the world communicator takes host
  // tensors whatever the devices.
  auto share = at::zeros({heads}, at::kDouble);
  for (auto& chunk : run().chunks)
    if (const auto means = chunk->take_mtp_losses(); means.defined())
      share += means.cpu() / static_cast<double>(data_ranks() * model().tp().size());
  if (mesh_->world_size() > 1) mesh_->world().all_reduce(share, dist::ReduceOp::Sum);
  return {share.data_ptr<double>(), share.data_ptr<double>() + heads};
}

std::vector<double> Trainer::source_losses(int64_t step) {
  // Rows of micro-batch k are samples first_sample(k) + [0, micro) of the step's batch; the
  // part holding the head recorded one entry per micro-batch, in order. Every rank adds its
  // loss sums and token counts per source over the world (parts without the head, and tp ranks
  // other than 0, add nothing; context-parallel ranks their part of each row).
  const auto& sources = train_sampler_->sources();
  const auto n = static_cast<int64_t>(sources.size());
  const int64_t micro = config_.micro_batch_size(data_ranks());
  // The built-in schedules run each stage's forwards in micro-batch order, so record k is
  // micro-batch k's (a registered schedule must too: docs/pipeline.md).
  auto sums = at::zeros({2 * n}, at::kDouble);  // loss sums, then token counts
  auto* s = sums.data_ptr<double>();
  std::string problem;  // shared before the all-reduce: no rank waits in it for one that failed
  for (auto& chunk : run().chunks) {
    const auto records = chunk->take_row_losses();
    chunk->set_record_row_losses(false);
    if (records.empty() || !problem.empty()) continue;
    if (static_cast<int64_t>(records.size()) != config_.grad_accum) {
      problem = fmt::format(
          "per-source losses: {} micro-batch losses were recorded for {} "
          "micro-batches",
          records.size(), config_.grad_accum);
      continue;
    }
    for (int64_t k = 0; k < config_.grad_accum && problem.empty(); ++k) {
      const auto& rec = records[static_cast<size_t>(k)];
      const auto rows = rec.sums.cpu().contiguous();
      if (rows.numel() != micro) {
        problem =
            fmt::format("per-source losses: {} rows recorded, {} expected", rows.numel(), micro);
        break;
      }
      const double* row_sum = rows.data_ptr<double>();
      const int64_t first = config_.first_sample(data_rank(), data_ranks(), k);
      for (int64_t r = 0; r < micro; ++r) {
        const int64_t source = train_sampler_->window(step, first + r).source;
        s[source] += row_sum[r];
        s[n + source] += static_cast<double>(rec.tokens_per_row);
      }
    }
  }
  share_outcome(problem, "measure the per-source losses");
  if (mesh_->world_size() > 1) mesh_->world().all_reduce(sums, dist::ReduceOp::Sum);
  std::vector<double> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    out[static_cast<size_t>(i)] =
        s[n + i] > 0 ? s[i] / s[n + i] : std::numeric_limits<double>::quiet_NaN();
  return out;
}

int Trainer::reduce_over_world(int value, dist::ReduceOp op) {
  auto tensor = at::full({1}, value, at::kInt);
  if (mesh_->world_size() > 1) mesh_->world().all_reduce(tensor, op);
  return tensor.item<int>();
}

}  // namespace loom::train
