// loom-bench-train: training throughput of a loom GPT-2 or Llama, step by step, on the CPU or
// (--device cuda) a GPU. benchmarks/train_throughput.py is the same model and step in PyTorch's
// Python API, with the same flags and the same JSON line, so scripts/bench can put the two side by
// side (on the CPU). On a GPU, --precision bf16 computes under autocast with fp32 master weights,
// --attention picks the attention implementation (fused: loom's kernel; sdpa: PyTorch's; auto:
// the faster of the two per shape, measured once, as loom-pretrain), --adamw the optimizer's
// kernel (auto: PyTorch's fused AdamW with the clip's factor inside it), each
// step ends with a device synchronize (so the clock sees the GPU's work), and the line adds the
// MFU against the device's bf16 peak (train/mfu.h).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "loom/apps/cli.h"
#include "loom/core/autocast.h"
#include "loom/loom.h"
#include "loom/ops/attention_choice.h"
#include "loom/train/device_profile.h"
#include "loom/train/mfu.h"
#include "step_profile.h"

namespace {

struct Options {
  std::string preset = "gpt2-mini";
  int64_t d_model = 0, layers = 0, heads = 0;  // 0: the preset's
  int64_t vocab = 256;  // byte-level vocabulary, as the bundled corpus; keeps the head small
  int64_t pad_vocab_multiple = 0;  // 0: as loom-pretrain's auto (128 on CUDA, 1 on the CPU)
  int64_t seq_len = 128, batch_size = 16, steps = 30, warmup = 5;
  int64_t profile_steps = 0;         // > 0: that many more steps under op hooks (step_profile.h)
  int64_t kernel_profile_steps = 0;  // > 0: that many more under Kineto (train/device_profile.h)
  int threads = 2;
  uint64_t seed = 1337;
  std::string device = "cpu", precision = "fp32", attention = "auto", loss = "auto", norm = "auto",
              adamw = "auto", swiglu = "auto", loss_chunk_rows = "auto";
  double peak_tflops = 0;  // 0: from the GPU's name
};

loom::models::ModelConfig model_config(const Options& o) {
  auto c = loom::models::ModelConfig::preset(o.preset);
  const bool llama = c.family == loom::models::Family::kLlama;
  LOOM_CHECK(c.family == loom::models::Family::kGpt2 || llama,
             "--preset {} is neither a GPT-2 nor a Llama preset", o.preset);
  LOOM_CHECK(o.d_model == 0 || !llama,
             "--d-model {} changes GPT-2 presets only (a Llama preset's d_ff is its own)",
             o.d_model);
  if (o.d_model > 0) c.d_model = o.d_model;
  if (o.layers > 0) c.n_layers = o.layers;
  if (o.heads > 0) {
    c.n_heads = o.heads;
    if (!llama) c.n_kv_heads = o.heads;
  }
  if (!llama) c.d_ff = 4 * c.d_model;  // GPT-2's MLP width, also when --d-model changes it
  c.vocab_size = o.vocab;
  c.validate();
  LOOM_CHECK(o.seq_len > 0 && o.seq_len <= c.max_seq_len,
             "--seq-len {} must be in [1, {}] (the preset's max_seq_len)", o.seq_len,
             c.max_seq_len);
  LOOM_CHECK(o.batch_size > 0, "--batch-size {} must be positive", o.batch_size);
  LOOM_CHECK(o.steps > 0, "--steps {} must be positive", o.steps);
  LOOM_CHECK(o.warmup >= 0, "--warmup {} must be >= 0", o.warmup);
  LOOM_CHECK(o.threads > 0, "--threads {} must be positive", o.threads);
  LOOM_CHECK(o.profile_steps >= 0, "--profile {} must be >= 0", o.profile_steps);
  LOOM_CHECK(o.kernel_profile_steps >= 0, "--kernel-profile {} must be >= 0",
             o.kernel_profile_steps);
  LOOM_CHECK(o.precision == "fp32" || o.precision == "bf16",
             "--precision '{}' must be fp32 or bf16", o.precision);
  return c;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

void run(const Options& o) {
  const auto config = model_config(o);
  at::set_num_threads(o.threads);

  LOOM_CHECK(o.device == "cpu" || o.device.rfind("cuda", 0) == 0,
             "--device '{}' is not valid: cpu, cuda or cuda:N", o.device);
  const at::Device device(o.device);
  LOOM_CHECK(device.is_cpu() || loom::ops::cuda_device_count() > 0,
             "--device {}: no CUDA device is visible", o.device);
  const int64_t pad = o.pad_vocab_multiple > 0 ? o.pad_vocab_multiple : device.is_cuda() ? 128 : 1;
  auto model =
      loom::models::make_model(config, std::make_shared<loom::parallel::tensor::TpGroup>(
                                           nullptr, loom::parallel::tensor::TpOptions{false, pad}));
  loom::models::init_parameters(*model, o.seed);
  model->to(device);
  model->set_attention_backend(loom::ops::parse_attention_backend(o.attention));
  // --attention auto on a GPU measures loom's kernel against SDPA per shape, as loom-pretrain
  // does (choices kept in memory; reported with both times).
  std::shared_ptr<loom::ops::AttentionChooser> chooser;
  if (device.is_cuda() && o.attention == "auto") {
    chooser = std::make_shared<loom::ops::AttentionChooser>();
    model->set_attention_chooser(chooser);
  }
  model->set_loss_backend(loom::ops::parse_loss_backend(o.loss));
  model->set_loss_chunk_rows(loom::ops::parse_chunk_rows(o.loss_chunk_rows));
  model->set_norm_backend(loom::ops::parse_norm_backend(o.norm));
  model->set_activation_backend(loom::ops::parse_activation_backend(o.swiglu));
  model->train();
  loom::core::NamedTensors named;
  std::vector<at::Tensor> params;
  for (const auto& item : model->named_parameters()) {
    named.emplace_back(item.key(), item.value());
    params.push_back(item.value());
  }
  int64_t num_params = 0;
  for (const auto& p : params) num_params += p.numel();
  loom::train::AdamW optimizer(named,
                               {.beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1});
  optimizer.set_backend(loom::ops::parse_adamw_backend(o.adamw));
  constexpr double kLr = 1e-3, kMaxGradNorm = 1.0;

  // Every batch is drawn before the clock starts; each step slices its own (the "data" phase).
  // The generator and call match the Python twin's, so both see the same tokens.
  const int64_t hooked_end = o.warmup + o.steps + o.profile_steps;
  const int64_t total = hooked_end + o.kernel_profile_steps;
  auto gen = loom::core::make_generator(o.seed);
  const auto tokens = at::randint(o.vocab, {total, o.batch_size, o.seq_len + 1}, gen, at::kLong);

  // Phase markers cost a clock read each; the op hooks are on only for the profile steps.
  auto& profile = loom_bench::StepProfile::instance();
  enum Phase { kData, kForward, kBackward, kClip, kOptimizer, kZeroGrad, kMetrics };
  std::vector<double> step_ms;
  std::vector<at::Tensor> losses;  // read after timing; .item() on the CPU would not sync anyway
  nlohmann::ordered_json walls, kernels;
  loom::train::DeviceProfile kernel_profile(device);
  double kernel_profile_ms = 0;
  for (int64_t i = 0; i < total; ++i) {
    if (i == o.warmup) {
      profile.reset();
      if (device.is_cuda()) loom::core::reset_peak_memory(device);
    }
    if (i == o.warmup + o.steps) {
      walls = profile.phase_walls();
      profile.reset();
      profile.hook_ops(true);
    }
    if (i == hooked_end) {
      profile.hook_ops(false);
      kernel_profile.start();
    }
    const auto start = std::chrono::steady_clock::now();
    // The data phase slices this step's batch (and on a GPU copies it to the device, as a
    // training step does; only the metrics phase synchronizes the device, so on a GPU the other
    // phases' wall times are launch times).
    profile.phase(kData);
    const auto input = tokens[i].narrow(1, 0, o.seq_len).contiguous().to(device);
    const auto target = tokens[i].narrow(1, 1, o.seq_len).contiguous().to(device);
    profile.phase(kForward);
    at::Tensor loss;
    {
      loom::core::Bf16Autocast autocast(o.precision == "bf16", device.type());
      // The model's own loss: the backend --loss names (the fused kernels by default on CUDA).
      loss = model->loss(input, target);
    }
    profile.phase(kBackward);
    loss.backward();
    profile.phase(kClip);
    // On a GPU the clip's factor stays on the device (no host sync) and AdamW applies it as it
    // reads the gradients, as loom-pretrain's replicated optimizer does.
    at::Tensor clip_factor;
    if (device.is_cuda())
      clip_factor = loom::train::grad_clip_on_device(params, kMaxGradNorm).factor;
    else
      loom::train::clip_grad_norm(params, kMaxGradNorm);
    profile.phase(kOptimizer);
    optimizer.step(kLr, clip_factor);
    profile.phase(kZeroGrad);
    optimizer.zero_grad();
    profile.phase(kMetrics);
    losses.push_back(loss.detach());
    if (device.is_cuda()) torch::cuda::synchronize(device.has_index() ? device.index() : 0);
    profile.end_step();
    const auto stop = std::chrono::steady_clock::now();
    const double ms = std::chrono::duration<double, std::milli>(stop - start).count();
    if (i >= o.warmup && i < o.warmup + o.steps) step_ms.push_back(ms);
    if (i >= hooked_end) kernel_profile_ms += ms;
  }
  profile.hook_ops(false);
  if (o.kernel_profile_steps > 0) {
    kernel_profile.stop();
    kernels = kernel_profile.table(o.kernel_profile_steps, kernel_profile_ms, 30);
  }
  if (o.profile_steps == 0) walls = profile.phase_walls();

  const double med = median(step_ms);
  double sum = 0;
  for (double ms : step_ms) sum += ms;
  // Key order and names are shared with train_throughput.py; scripts/bench compares "config".
  nlohmann::ordered_json out = {
      {"impl", "loom"},
      {"tokens_per_s", static_cast<double>(o.batch_size * o.seq_len) / (med / 1000.0)},
      {"step_ms_median", med},
      {"step_ms_mean", sum / static_cast<double>(step_ms.size())},
      {"step_ms_min", *std::min_element(step_ms.begin(), step_ms.end())},
      {"params", num_params},
      {"loss_first", losses.front().item<double>()},
      {"loss_last", losses.back().item<double>()},
      {"threads_used", at::get_num_threads()},
      {"config",
       {{"preset", o.preset},
        {"d_model", config.d_model},
        {"n_layers", config.n_layers},
        {"n_heads", config.n_heads},
        {"d_ff", config.d_ff},
        {"vocab_size", config.vocab_size},
        {"max_seq_len", config.max_seq_len},
        {"seq_len", o.seq_len},
        {"batch_size", o.batch_size},
        {"steps", o.steps},
        {"warmup", o.warmup},
        {"threads", o.threads},
        {"seed", o.seed},
        {"decayed_tensors", optimizer.num_decayed()},
        {"undecayed_tensors", optimizer.num_not_decayed()}}}};
  // Llama's key/value heads, after the keys both families share.
  if (config.family == loom::models::Family::kLlama)
    out["config"]["n_kv_heads"] = config.n_kv_heads;
  out["phase_ms"] = walls;
  // Whether freed host memory is kept (every loom tool asks for it at start; asking again
  // reports the outcome).
  out["host_malloc_kept"] = loom::core::keep_freed_host_memory();
  out["peak_rss_mib"] = loom_bench::StepProfile::peak_rss_mib();
  if (o.kernel_profile_steps > 0) out["kernel_profile"] = kernels;
  if (o.profile_steps > 0) {
    out["op_self_ms"] = profile.op_tables();
    out["top_ops_ms"] = profile.top_ops(20);
  }
  if (!device.is_cpu()) {
    // Outside "config", which scripts/bench compares with the Python twin's (CPU only).
    out["device"] = loom::ops::cuda_device_name(device.has_index() ? device.index() : 0);
    out["precision"] = o.precision;
    out["attention"] = o.attention;
    out["loss"] = o.loss;
    out["loss_chunk_rows"] = o.loss_chunk_rows;
    {
      loom::core::Bf16Autocast autocast(o.precision == "bf16", device.type());
      out["loss_chunk_rows_used"] =
          model->resolved_loss_chunk_rows(o.batch_size * o.seq_len, device);
    }
    out["norm"] = o.norm;
    out["adamw"] = o.adamw;
    out["swiglu"] = o.swiglu;
    if (chooser) {
      auto& choices = out["attention_choices"];
      choices = nlohmann::ordered_json::object();
      for (const auto& [shape, e] : chooser->entries())
        choices[shape] = {{"choice", loom::ops::to_string(e.choice)},
                          {"fused_ms", e.fused_ms},
                          {"sdpa_ms", e.sdpa_ms}};
    }
    out["padded_vocab"] = model->padded_vocab();
    // The allocator's peak over the timed and profiled steps (from the first timed step on).
    out["device_peak_bytes"] = loom::core::memory_counters(device).peak_bytes;
    const double peak =
        o.peak_tflops > 0
            ? o.peak_tflops * 1e12
            : loom::train::peak_flops_for_device(out["device"].get<std::string>()).value_or(0.0);
    const double flops = loom::train::model_flops_per_token(config, o.seq_len);
    out["model_flops_per_token"] = flops;
    if (auto m = loom::train::mfu(out["tokens_per_s"].get<double>(), flops, peak)) out["mfu"] = *m;
  }
  std::printf("%s\n", out.dump().c_str());
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "Time loom GPT-2 or Llama training steps (forward, backward, clip, AdamW) on the CPU or a "
      "GPU.",
      "loom-bench-train"};
  Options o;
  app.add_option("--preset", o.preset,
                 "Model shape: gpt2-tiny, gpt2-mini, gpt2-124m, gpt2-350m, llama-tiny, "
                 "llama-mini, llama-1b")
      ->capture_default_str();
  app.add_option("--d-model", o.d_model, "Width (0: the preset's); d_ff is 4x this")
      ->capture_default_str();
  app.add_option("--layers", o.layers, "Blocks (0: the preset's)")->capture_default_str();
  app.add_option("--heads", o.heads, "Attention heads (0: the preset's)")->capture_default_str();
  app.add_option("--vocab", o.vocab, "Vocabulary size")->capture_default_str();
  app.add_option("--seq-len", o.seq_len, "Tokens per sequence")->capture_default_str();
  app.add_option("--batch-size", o.batch_size, "Sequences per step")->capture_default_str();
  app.add_option("--steps", o.steps, "Timed steps")->capture_default_str();
  app.add_option("--warmup", o.warmup, "Untimed steps before them")->capture_default_str();
  app.add_option("--threads", o.threads, "Intra-op threads")->capture_default_str();
  app.add_option("--seed", o.seed, "Seed for initialization and the token batches")
      ->capture_default_str();
  app.add_option("--profile", o.profile_steps,
                 "After the timed steps, this many steps with every op's self time recorded "
                 "(by phase and op class: benchmarks/step_profile.h)")
      ->capture_default_str();
  app.add_option("--kernel-profile", o.kernel_profile_steps,
                 "After those, this many steps under PyTorch's Kineto profiler: device time per "
                 "kernel (on the CPU, inclusive time per op) as \"kernel_profile\"")
      ->capture_default_str();
  app.add_option("--device", o.device, "cpu | cuda | cuda:N")->capture_default_str();
  app.add_option("--precision", o.precision, "fp32 | bf16 (autocast, fp32 master weights)")
      ->capture_default_str();
  app.add_option("--attention", o.attention, "auto | fused | sdpa | math")->capture_default_str();
  app.add_option("--loss", o.loss,
                 "auto | fused | math: the cross-entropy (auto: loom's fused kernels on CUDA)")
      ->capture_default_str();
  app.add_option("--loss-chunk-rows", o.loss_chunk_rows,
                 "auto | off | ROWS: the head and the loss in chunks of rows (as loom-pretrain)")
      ->capture_default_str();
  app.add_option("--pad-vocab-multiple", o.pad_vocab_multiple,
                 "Pad the vocabulary to a multiple of this (0: 128 on CUDA, 1 on the CPU, as "
                 "loom-pretrain)")
      ->capture_default_str();
  app.add_option("--norm", o.norm,
                 "auto | fused | math: the norms and residual adds (auto: loom's fused kernels "
                 "on CUDA)")
      ->capture_default_str();
  app.add_option("--swiglu", o.swiglu,
                 "auto | fused | math: Llama's SwiGLU (auto: loom's fused kernels on CUDA)")
      ->capture_default_str();
  app.add_option("--adamw", o.adamw,
                 "auto | fused | math: the optimizer's update (auto: PyTorch's fused AdamW on "
                 "CUDA, the clip's factor inside it)")
      ->capture_default_str();
  app.add_option("--peak-tflops", o.peak_tflops,
                 "Device bf16 peak for MFU (0: from the GPU's name)")
      ->capture_default_str();
  return loom::apps::run_app(app, argc, argv, [&] { run(o); });
}
