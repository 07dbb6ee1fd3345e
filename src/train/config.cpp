#include "loom/train/config.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>

#include "loom/core/error.h"
#include "loom/core/format.h"
#include "loom/core/json.h"
#include "loom/core/preemption.h"
#include "loom/data/sampler.h"
#include "loom/dist/backend_plan.h"
#include "loom/models/config.h"
#include "loom/models/hf_config.h"
#include "loom/ops/attention.h"
#include "loom/ops/cross_entropy.h"
#include "loom/ops/linear_cross_entropy.h"
#include "loom/ops/sparsity.h"
#include "loom/parallel/data/comm_hook.h"
#include "loom/parallel/pipeline/activation_codec.h"

namespace loom::train {

int64_t TrainConfig::first_sample(int64_t dp_rank, int64_t dp_size, int64_t k) const {
  return data::shard_batch(batch_size, dp_rank, dp_size).first + k * micro_batch_size(dp_size);
}

models::ModelConfig TrainConfig::new_model_config(int64_t tokenizer_vocab) const {
  models::ModelConfig model_config;
  if (!init_from_hf.empty()) {
    model_config = models::read_hf_config(init_from_hf);
    LOOM_CHECK(layers == 0 || layers == model_config.n_layers,
               "--layers {} with --init-from-hf: the model has the directory's {} layers", layers,
               model_config.n_layers);
    LOOM_CHECK(d_ff == 0 || d_ff == model_config.d_ff,
               "--d-ff {} with --init-from-hf: the model has the directory's MLP width {}", d_ff,
               model_config.d_ff);
  } else {
    model_config = models::ModelConfig::preset(preset);
    LOOM_CHECK(models::to_string(model_config.family) == model,
               "--preset {} is a {} preset but --model is {}", preset,
               models::to_string(model_config.family), model);
    if (layers > 0) model_config.n_layers = layers;
    if (d_ff > 0) model_config.d_ff = d_ff;
    model_config.vocab_size = vocab_size > 0 ? vocab_size : tokenizer_vocab;
  }
  model_config.dropout = dropout;
  LOOM_CHECK(ffn_blocks == 1 || init_from_hf.empty(),
             "--ffn-blocks {} with --init-from-hf: the directory holds a dense MLP, which "
             "block-diagonal weights cannot take",
             ffn_blocks);
  LOOM_CHECK(ffn_rank == 0 || init_from_hf.empty(),
             "--ffn-rank {} with --init-from-hf: the directory holds a dense MLP, which "
             "low-rank factors cannot take",
             ffn_rank);
  LOOM_CHECK(mtp == 0 || init_from_hf.empty(),
             "--mtp {} with --init-from-hf: the directory holds no multi-token heads, and "
             "starting them from nothing on a trained trunk is not supported yet",
             mtp);
  const bool shares = !share_layers.empty() && share_layers != "none";
  LOOM_CHECK(!shares || init_from_hf.empty(),
             "--share-layers '{}' with --init-from-hf: the directory holds a weight set per "
             "layer, which shared blocks cannot take",
             share_layers);
  model_config.ffn_blocks = ffn_blocks;
  model_config.ffn_rank = ffn_rank;
  model_config.mtp_heads = mtp;
  model_config.share_layers = shares ? share_layers : std::string();
  model_config.validate();
  return model_config;
}

std::pair<int64_t, int64_t> parse_profile_steps(const std::string& text, int64_t steps) {
  const auto bad = [&] {
    return fmt::format(
        "--profile-steps '{}' is not valid: A:B (steps A through B, 1 <= A <= B <= --steps {}) "
        "or A (one step)",
        text, steps);
  };
  const auto colon = text.find(':');
  const auto number = [&](const std::string& s) {
    LOOM_CHECK(
        !s.empty() && s.find_first_not_of("0123456789") == std::string::npos && s.size() < 10, "{}",
        bad());
    return std::stoll(s);
  };
  const int64_t a = number(text.substr(0, colon));
  const int64_t b = colon == std::string::npos ? a : number(text.substr(colon + 1));
  LOOM_CHECK(a >= 1 && a <= b && b <= steps, "{}", bad());
  return {a, b};
}

int64_t TrainConfig::vocab_padding_multiple() const {
  if (pad_vocab_multiple > 0) return pad_vocab_multiple;
  return device.rfind("cuda", 0) == 0 ? 128 : 1;
}

void TrainConfig::validate() const {
  LOOM_CHECK(model == "gpt2" || model == "llama", "--model '{}' is not valid: use gpt2 or llama",
             model);
  LOOM_CHECK(!data.empty(), "--data is required: a token file (llm.c .bin or raw *.u16)");
  LOOM_CHECK(seq_len > 0, "--seq-len {} must be positive", seq_len);
  LOOM_CHECK(steps > 0, "--steps {} must be positive", steps);
  LOOM_CHECK(batch_size > 0, "--batch-size {} must be positive", batch_size);
  LOOM_CHECK(grad_accum > 0, "--grad-accum {} must be positive", grad_accum);
  LOOM_CHECK(batch_size % grad_accum == 0,
             "--batch-size {} is not divisible by --grad-accum {} (micro-batches must be equal)",
             batch_size, grad_accum);
  LOOM_CHECK(precision == "fp32" || precision == "bf16" || precision == "fp64",
             "--precision '{}' is not valid: use fp32, bf16 or fp64 (fp64: a correctness "
             "instrument, see docs/testing.md)",
             precision);
  LOOM_CHECK(freeze_variance_after >= 0,
             "--freeze-variance-after {} must be >= 0 (0: AdamW's variance is never frozen)",
             freeze_variance_after);
  LOOM_CHECK(grad_clip >= 0, "--grad-clip {} must be >= 0 (0 disables clipping)", grad_clip);
  LOOM_CHECK(save_every >= 0, "--save-every {} must be >= 0", save_every);
  LOOM_CHECK(keep_checkpoints >= 0 && keep_checkpoints <= 1000000,
             "--keep-checkpoints {} must be in [0, 1000000] (0: keep all)", keep_checkpoints);
  LOOM_CHECK(save_every_s >= 0 && std::isfinite(save_every_s),
             "--save-every-s {} must be a number of seconds >= 0 (0: by steps only)", save_every_s);
  LOOM_CHECK(eval_every >= 0, "--eval-every {} must be >= 0", eval_every);
  LOOM_CHECK(lr_decay_steps >= 0, "--lr-decay-steps {} must be >= 0 (0 = --steps)", lr_decay_steps);
  LOOM_CHECK(dropout >= 0 && dropout < 1, "--dropout {} must be in [0, 1)", dropout);
  LOOM_CHECK(ffn_blocks >= 1,
             "--ffn-blocks {} must be at least 1 (1: a dense MLP; B: its linears as B "
             "block-diagonal blocks)",
             ffn_blocks);
  // Pruning selects 2-D ".weight" matrices: a structured MLP has none, and would stay dense.
  LOOM_CHECK(!prune.enabled() || (ffn_blocks == 1 && ffn_rank == 0) ||
                 prune.targets.find("mlp") == std::string::npos,
             "--prune-targets {} with --ffn-blocks {} / --ffn-rank {}: a structured MLP is not "
             "pruned (its blocks or factors are the structure); use --prune-targets attention",
             prune.targets, ffn_blocks, ffn_rank);
  LOOM_CHECK(ffn_rank >= 0,
             "--ffn-rank {} must be 0 (a dense MLP) or positive (its linears as products of two "
             "rank-r factors)",
             ffn_rank);
  LOOM_CHECK(mtp >= 0 && mtp <= models::ModelConfig::kMaxMtpHeads,
             "--mtp {} must be in [1, {}] (extra heads predicting 2, 3, ... tokens ahead), or "
             "left out",
             mtp, models::ModelConfig::kMaxMtpHeads);
  LOOM_CHECK(mtp_weights.empty() || static_cast<int64_t>(mtp_weights.size()) == mtp,
             "--mtp-weights gives {} weights for --mtp {}: give one per head (or leave it out: 1 "
             "each)",
             mtp_weights.size(), mtp);
  // A head of weight 0 would get no gradient (and take memory and time for nothing).
  for (double w : mtp_weights)
    LOOM_CHECK(std::isfinite(w) && w > 0,
               "--mtp-weights: {} must be finite and > 0 (for fewer heads, lower --mtp)", w);
  LOOM_CHECK(eval_batches > 0, "--eval-batches {} must be positive", eval_batches);
  LOOM_CHECK(log_every > 0, "--log-every {} must be positive", log_every);
  core::parse_preemption_signals(preempt_signals);  // throws naming a bad name
  dist::parse_backend_choice(dist_backend);         // likewise
  LOOM_CHECK(dp >= 0,
             "--dp {} is invalid: use a size of at least 1, or 0 for the world size "
             "divided by the other mesh dimensions",
             dp);
  LOOM_CHECK(bucket_mb > 0, "--bucket-mb {} must be positive", bucket_mb);
  // Throws naming a bad name or option.
  const auto hook = parallel::data::make_comm_hook(comm_hook);
  if (const auto* m = dynamic_cast<const parallel::data::MomentumCompressionHook*>(hook.get()))
    LOOM_CHECK(m->beta() == beta1,
               "--comm-hook {}: momentum={} must equal --beta1 {}: the optimizer's momentum "
               "update rebuilds the momentum the hook averaged only with the same decay",
               comm_hook, m->beta(), beta1);
  LOOM_CHECK(tp >= 1, "--tp {} must be at least 1", tp);
  LOOM_CHECK(pad_vocab_multiple >= 0, "--pad-vocab-multiple {} is not valid: 0 (auto) or more",
             pad_vocab_multiple);
  LOOM_CHECK(cp >= 1, "--cp {} must be at least 1", cp);
  LOOM_CHECK(cp == 1 || seq_len % (2 * cp) == 0,
             "--cp {} cuts each sequence into 2 x cp = {} chunks: --seq-len {} is not divisible "
             "by {}",
             cp, 2 * cp, seq_len, 2 * cp);
  LOOM_CHECK(
      !sequence_parallel || (seq_len / cp) % tp == 0,
      "--sequence-parallel splits the sequence across tp ranks: --seq-len {}{} is not "
      "divisible by --tp {}",
      seq_len,
      cp != 1 ? fmt::format(" (each rank's {} of it at --cp {})", seq_len / cp, cp) : std::string(),
      tp);
  LOOM_CHECK(layers >= 0, "--layers {} must be >= 0 (0: the preset's)", layers);
  LOOM_CHECK(d_ff >= 0, "--d-ff {} must be >= 0 (0: the preset's MLP width)", d_ff);
  LOOM_CHECK(pp >= 1, "--pp {} must be at least 1", pp);
  LOOM_CHECK(virtual_stages >= 1, "--virtual-stages {} must be at least 1", virtual_stages);
  LOOM_CHECK(virtual_stages == 1 || pp > 1,
             "--virtual-stages {} winds the model round the pipeline ranks: it needs --pp > 1",
             virtual_stages);
  LOOM_CHECK(pp_partition == "uniform" || pp_partition == "params" || pp_partition == "flops" ||
                 pp_partition == "measured" || pp_partition == "model",
             "--pp-partition '{}' is not valid: uniform, params, flops, measured or model",
             pp_partition);
  LOOM_CHECK(pp_partition != "model" || (!pp_devices.empty() && pp_devices != "measured"),
             "--pp-partition model splits the layers by the cost model's seconds on a machine: "
             "name it with --pp-devices PROFILE (a loom-plan --measure file, or h100-node / "
             "h200-node){}",
             pp_devices.empty() ? "" : fmt::format(", not '{}'", pp_devices));
  // Names the valid ones for a value that is not one of them.
  const auto codec = parallel::pipeline::parse_activation_codec(compress_activations);
  LOOM_CHECK(codec == parallel::pipeline::ActivationCodec::kNone || pp > 1,
             "--compress-activations {} compresses what crosses pipeline stages: it needs --pp > 1",
             compress_activations);
  LOOM_CHECK(pp_devices.empty() || pp > 1,
             "--pp-devices '{}' describes pipeline ranks: it needs --pp > 1", pp_devices);
  LOOM_CHECK(zero >= 0 && zero <= 3,
             "--zero {} is not valid: 0 (replicated), 1 (optimizer state sharded), 2 (plus "
             "gradients) or 3 (plus parameters)",
             zero);
  LOOM_CHECK(activation_checkpointing == "none" || activation_checkpointing == "full" ||
                 activation_checkpointing == "selective",
             "--activation-checkpointing '{}' is not valid: none, full or selective",
             activation_checkpointing);
  LOOM_CHECK(zero3_reshard_after_forward || zero == 3,
             "--zero3-reshard-after-forward false keeps ZeRO-3's gathered blocks across "
             "micro-batches: it needs --zero 3 (it is {})",
             zero);
  LOOM_CHECK(!offload_optimizer || zero >= 1,
             "--offload-optimizer moves the ZeRO optimizer shards to the host: it needs --zero "
             "1, 2 or 3");
  LOOM_CHECK(!offload_activations || activation_checkpointing == "full",
             "--offload-activations moves the block inputs full activation checkpointing keeps: "
             "it needs --activation-checkpointing full (it is '{}')",
             activation_checkpointing);
  LOOM_CHECK(memory_cap_mb >= 0, "--memory-cap-mb {} must be >= 0 (0: no cap)", memory_cap_mb);
  prune.validate(steps);
  LOOM_CHECK(device == "cpu" || device == "cuda" ||
                 (device.rfind("cuda:", 0) == 0 && device.size() > 5 &&
                  device.find_first_not_of("0123456789", 5) == std::string::npos),
             "--device '{}' is not valid: cpu, cuda or cuda:N (N a device index)", device);
  const auto backends = ops::attention_backend_names();
  LOOM_CHECK(std::find(backends.begin(), backends.end(), attention) != backends.end(),
             "--attention '{}' is not valid: {}", attention, fmt::join(backends, ", "));
  const auto choices = ops::fused_choice_names();
  LOOM_CHECK(std::find(choices.begin(), choices.end(), loss) != choices.end(),
             "--loss '{}' is not valid: {}", loss, fmt::join(choices, ", "));
  LOOM_CHECK(ops::parse_chunk_rows(loss_chunk_rows) <= 0 || loss != "math",
             "--loss-chunk-rows {} runs loom's fused cross-entropy passes, which --loss math "
             "turns off: use --loss auto or fused, or --loss-chunk-rows off",
             loss_chunk_rows);
  LOOM_CHECK(std::find(choices.begin(), choices.end(), norm) != choices.end(),
             "--norm '{}' is not valid: {}", norm, fmt::join(choices, ", "));
  LOOM_CHECK(sampling == "auto" || sampling == "epoch" || sampling == "random",
             "--sampling '{}' is not valid: auto (epoch for a new run, the checkpoint's for a "
             "resume), epoch (without replacement) or random (with replacement)",
             sampling);
  LOOM_CHECK(adamw != "fused" || freeze_variance_after == 0,
             "--adamw fused: PyTorch's fused AdamW cannot hold the second moment frozen "
             "(--freeze-variance-after {}); use --adamw auto or math",
             freeze_variance_after);
  LOOM_CHECK(std::find(choices.begin(), choices.end(), swiglu) != choices.end(),
             "--swiglu '{}' is not valid: {}", swiglu, fmt::join(choices, ", "));
  LOOM_CHECK(std::find(choices.begin(), choices.end(), adamw) != choices.end(),
             "--adamw '{}' is not valid: {}", adamw, fmt::join(choices, ", "));
  LOOM_CHECK(adamw != "fused" || zero == 0,
             "--adamw fused chooses the replicated optimizer's kernel; --zero {} shards the "
             "optimizer, whose engines update flat shards with loom's own pass (use --adamw auto)",
             zero);
  LOOM_CHECK(export_hf_shard_mb >= 1e-6 && export_hf_shard_mb <= 1e9,
             "--export-hf-shard-mb {} is not valid: the largest weight file in MB (10^6 bytes), "
             "from 1e-6 (one byte) to 1e9",
             export_hf_shard_mb);
  if (!profile_steps.empty()) {
    parse_profile_steps(profile_steps, steps);
    LOOM_CHECK(!profile_out.empty(),
               "--profile-steps {} needs --profile-out DIR (where the "
               "trace and the kernel table go)",
               profile_steps);
  }
  LOOM_CHECK(std::isfinite(z_loss) && z_loss >= 0,
             "--z-loss {} is not valid: a finite weight >= 0 (0: no z-loss)", z_loss);
  LOOM_CHECK(peak_tflops >= 0, "--peak-tflops {} must be >= 0 (0: from the device's name)",
             peak_tflops);
  // Shards hold uint16 ids (llm.c version 1) or uint32 ones (version 2); tokenizers give int32.
  LOOM_CHECK(vocab_size >= 0 && vocab_size <= std::numeric_limits<int32_t>::max(),
             "--vocab-size {} is not valid: 1..{} (token ids are 32-bit; 0 = from the data)",
             vocab_size, std::numeric_limits<int32_t>::max());
}

bool PruneConfig::enabled() const {
  return to > 0 || (pattern.find(':') != std::string::npos && !pattern.starts_with("block:"));
}

void PruneConfig::validate(int64_t steps) const {
  const auto p = ops::SparsityPattern::parse(pattern);
  ops::PruneSchedule{.final_sparsity = to, .start = start, .end = end_step(steps), .every = every}
      .validate();
  LOOM_CHECK(end >= 0, "--prune-end {} must be >= 0 (0: the run's last step)", end);
  LOOM_CHECK(p.kind != ops::SparsityPattern::Kind::kNofM || to == 0 ||
                 std::abs(to - p.fixed_sparsity()) < 1e-12,
             "--prune-pattern {} keeps {} of every {} weights, a sparsity of {}; --prune-to {} "
             "contradicts it (leave --prune-to out, or give {})",
             pattern, p.n, p.m, p.fixed_sparsity(), to, p.fixed_sparsity());
  LOOM_CHECK(p.kind != ops::SparsityPattern::Kind::kBlock || to > 0,
             "--prune-pattern {} drops whole tiles: give the fraction to drop with --prune-to S",
             pattern);
  LOOM_CHECK(scope == "layer" || scope == "global",
             "--prune-scope '{}' is not valid: layer (a threshold per weight) or global (one "
             "threshold over every pruned weight)",
             scope);
  LOOM_CHECK(kernels == "auto" || kernels == "off",
             "--prune-kernels '{}' is not valid: auto (a sparse kernel where the pattern has one "
             "on the device) or off (always the masked dense product)",
             kernels);
  LOOM_CHECK(!targets.empty(), "--prune-targets is empty: give mlp, attention or both");
  std::string_view rest = targets;
  while (!rest.empty()) {
    const auto comma = rest.find(',');
    const auto item = rest.substr(0, comma);
    LOOM_CHECK(item != "embedding" && item != "embeddings" && item != "lm_head",
               "--prune-targets '{}': embeddings and the output head are never pruned (a pruned "
               "row would erase a token); prune mlp and attention linears",
               targets);
    LOOM_CHECK(
        item == "mlp" || item == "attention",
        "--prune-targets '{}': '{}' is not a target; valid: mlp, attention (comma-separated)",
        targets, item);
    rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
  }
}

NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(PruneConfig, to, pattern, start, end, every, scope,
                                                targets, kernels)

// One list of fields for both directions; keys missing from older checkpoints keep defaults.
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(
    TrainConfig, model, preset, init_from_hf, vocab_size, seed, dropout, data, val_data, seq_len,
    steps, batch_size, grad_accum, lr, min_lr, warmup_steps, lr_decay_steps, weight_decay, beta1,
    beta2, grad_clip, precision, metrics_out, save_dir, save_every, resume, export_hf, log_every,
    eval_every, eval_batches, dp, bucket_mb, comm_hook, tp, sequence_parallel, pad_vocab_multiple,
    cp, zero, activation_checkpointing, offload_optimizer, offload_activations, memory_cap_mb,
    layers, pp, schedule, virtual_stages, pp_partition, pp_devices, compress_activations, device,
    attention, peak_tflops, strategies, zero3_reshard_after_forward, preempt_signals, dist_backend,
    prune, freeze_variance_after, ffn_blocks, ffn_rank, mtp, mtp_weights, d_ff, share_layers)

// Fields past the macro's limit of 64, by hand.
nlohmann::json TrainConfig::to_json() const {
  nlohmann::json j = *this;
  j["save_every_s"] = save_every_s;
  j["keep_checkpoints"] = keep_checkpoints;
  j["async_save"] = async_save;
  j["loss"] = loss;
  j["loss_chunk_rows"] = loss_chunk_rows;
  j["z_loss"] = z_loss;
  j["doc_mask"] = doc_mask;
  j["norm"] = norm;
  j["sampling"] = sampling;
  j["adamw"] = adamw;
  j["swiglu"] = swiglu;
  j["profile_steps"] = profile_steps;
  j["profile_out"] = profile_out;
  j["export_hf_shard_mb"] = export_hf_shard_mb;
  return j;
}

void TrainConfig::check_resumable_from(const TrainConfig& saved) const {
  auto same = [](const char* flag, const auto& then, const auto& now) {
    LOOM_CHECK(then == now,
               "cannot resume bit-exactly: {} was {} when the checkpoint was written and is {} "
               "now (pass the same value, or start a new run)",
               flag, then, now);
  };
  same("--seed", saved.seed, seed);
  same("--seq-len", saved.seq_len, seq_len);
  if (sampling != "auto") same("--sampling", saved.sampling, sampling);
  same("--batch-size", saved.batch_size, batch_size);
  same("--grad-accum", saved.grad_accum, grad_accum);
  same("--lr", saved.lr, lr);
  same("--min-lr", saved.min_lr, min_lr);
  same("--warmup-steps", saved.warmup_steps, warmup_steps);
  // Extending a run is allowed as long as the learning-rate schedule stays the same.
  LOOM_CHECK(saved.schedule_steps() == schedule_steps(),
             "cannot resume bit-exactly: the learning-rate schedule decayed over {} steps and "
             "would now decay over {}; pass --lr-decay-steps {} to keep it",
             saved.schedule_steps(), schedule_steps(), saved.schedule_steps());
  same("--weight-decay", saved.weight_decay, weight_decay);
  same("--beta1", saved.beta1, beta1);
  same("--beta2", saved.beta2, beta2);
  same("--freeze-variance-after", saved.freeze_variance_after, freeze_variance_after);
  same("--grad-clip", saved.grad_clip, grad_clip);
  same("--precision", saved.precision, precision);
  same("--dropout", saved.dropout, dropout);
  same("--z-loss", saved.z_loss, z_loss);
  same("--doc-mask", saved.doc_mask, doc_mask);
  same("--ffn-blocks", saved.ffn_blocks, ffn_blocks);
  same("--ffn-rank", saved.ffn_rank, ffn_rank);
  same("--mtp", saved.mtp, mtp);
  // "none" is no sharing, as the empty default is.
  auto sharing = [](const std::string& s) { return s == "none" ? std::string() : s; };
  same("--share-layers", fmt::format("'{}'", sharing(saved.share_layers)),
       fmt::format("'{}'", sharing(share_layers)));
  same("--mtp-weights", fmt::format("[{}]", fmt::join(saved.mtp_weights, ",")),
       fmt::format("[{}]", fmt::join(mtp_weights, ",")));
  // A registered strategy may change what is computed (local SGD, compression): the same list.
  same("--strategy", fmt::format("[{}]", fmt::join(saved.strategies, " ")),
       fmt::format("[{}]", fmt::join(strategies, " ")));
  LOOM_CHECK(layers == 0 || layers == saved.layers || saved.layers == 0,
             "--layers {} differs from the checkpoint's {}: the model's shape comes from the "
             "checkpoint",
             layers, saved.layers);
  // The masks follow the schedule step by step (extending --steps moves a default --prune-end),
  // so a pruned run resumes only with the same schedule.
  if (!saved.prune.enabled() && !prune.enabled()) return;
  same("--prune-to", saved.prune.to, prune.to);
  same("--prune-pattern", saved.prune.pattern, prune.pattern);
  same("--prune-start", saved.prune.start, prune.start);
  same("--prune-end", saved.prune.end_step(saved.steps), prune.end_step(steps));
  same("--prune-every", saved.prune.every, prune.every);
  same("--prune-scope", saved.prune.scope, prune.scope);
  same("--prune-targets", saved.prune.targets, prune.targets);
}

TrainConfig TrainConfig::from_json(const nlohmann::json& j) {
  // Integer fields must hold JSON integers (a float would be cast: undefined when out of range).
  core::check_json_like(j, TrainConfig{}.to_json(), "training config");
  try {
    auto c = j.get<TrainConfig>();
    c.save_every_s = j.value("save_every_s", 0.0);
    c.keep_checkpoints = j.value("keep_checkpoints", int64_t{2});
    c.async_save = j.value("async_save", false);
    c.loss = j.value("loss", std::string("auto"));
    c.loss_chunk_rows = j.value("loss_chunk_rows", std::string("auto"));
    c.z_loss = j.value("z_loss", 0.0);
    c.doc_mask = j.value("doc_mask", false);
    c.norm = j.value("norm", std::string("auto"));
    // Checkpoints written before --sampling existed drew windows with replacement.
    c.sampling = j.value("sampling", std::string("random"));
    c.adamw = j.value("adamw", std::string("auto"));
    c.swiglu = j.value("swiglu", std::string("auto"));
    c.profile_steps = j.value("profile_steps", std::string());
    c.profile_out = j.value("profile_out", std::string("loom-profile"));
    c.export_hf_shard_mb = j.value("export_hf_shard_mb", 5000.0);
    return c;
  } catch (const nlohmann::json::exception& e) {
    fail("training config JSON has a field of the wrong type: {}", e.what());
  }
}

}  // namespace loom::train
