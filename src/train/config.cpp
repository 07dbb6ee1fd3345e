#include "loom/train/config.h"

#include <nlohmann/json.hpp>

#include "loom/core/error.h"

namespace loom::train {

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
  LOOM_CHECK(precision == "fp32" || precision == "bf16",
             "--precision '{}' is not valid: use fp32 or bf16", precision);
  LOOM_CHECK(grad_clip >= 0, "--grad-clip {} must be >= 0 (0 disables clipping)", grad_clip);
  LOOM_CHECK(save_every >= 0, "--save-every {} must be >= 0", save_every);
  LOOM_CHECK(eval_every >= 0, "--eval-every {} must be >= 0", eval_every);
  LOOM_CHECK(lr_decay_steps >= 0, "--lr-decay-steps {} must be >= 0 (0 = --steps)", lr_decay_steps);
  LOOM_CHECK(dropout >= 0 && dropout < 1, "--dropout {} must be in [0, 1)", dropout);
  LOOM_CHECK(eval_batches > 0, "--eval-batches {} must be positive", eval_batches);
  LOOM_CHECK(log_every > 0, "--log-every {} must be positive", log_every);
  LOOM_CHECK(vocab_size >= 0 && vocab_size <= 65536,
             "--vocab-size {} is not valid: token files hold uint16 ids, so 1..65536 (0 = from "
             "the data)",
             vocab_size);
}

nlohmann::json TrainConfig::to_json() const {
  return {{"model", model},
          {"preset", preset},
          {"init_from_hf", init_from_hf},
          {"vocab_size", vocab_size},
          {"seed", seed},
          {"dropout", dropout},
          {"data", data},
          {"val_data", val_data},
          {"seq_len", seq_len},
          {"steps", steps},
          {"batch_size", batch_size},
          {"grad_accum", grad_accum},
          {"lr", lr},
          {"min_lr", min_lr},
          {"warmup_steps", warmup_steps},
          {"lr_decay_steps", lr_decay_steps},
          {"weight_decay", weight_decay},
          {"beta1", beta1},
          {"beta2", beta2},
          {"grad_clip", grad_clip},
          {"precision", precision},
          {"metrics_out", metrics_out},
          {"save_dir", save_dir},
          {"save_every", save_every},
          {"resume", resume},
          {"export_hf", export_hf},
          {"log_every", log_every},
          {"eval_every", eval_every},
          {"eval_batches", eval_batches}};
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
  same("--grad-clip", saved.grad_clip, grad_clip);
  same("--precision", saved.precision, precision);
  same("--dropout", saved.dropout, dropout);
}

TrainConfig TrainConfig::from_json(const nlohmann::json& j) {
  TrainConfig c;
  // Missing keys keep their defaults, so older checkpoints stay readable.
  c.model = j.value("model", c.model);
  c.preset = j.value("preset", c.preset);
  c.init_from_hf = j.value("init_from_hf", c.init_from_hf);
  c.vocab_size = j.value("vocab_size", c.vocab_size);
  c.seed = j.value("seed", c.seed);
  c.dropout = j.value("dropout", c.dropout);
  c.data = j.value("data", c.data);
  c.val_data = j.value("val_data", c.val_data);
  c.seq_len = j.value("seq_len", c.seq_len);
  c.steps = j.value("steps", c.steps);
  c.batch_size = j.value("batch_size", c.batch_size);
  c.grad_accum = j.value("grad_accum", c.grad_accum);
  c.lr = j.value("lr", c.lr);
  c.min_lr = j.value("min_lr", c.min_lr);
  c.warmup_steps = j.value("warmup_steps", c.warmup_steps);
  c.lr_decay_steps = j.value("lr_decay_steps", c.lr_decay_steps);
  c.weight_decay = j.value("weight_decay", c.weight_decay);
  c.beta1 = j.value("beta1", c.beta1);
  c.beta2 = j.value("beta2", c.beta2);
  c.grad_clip = j.value("grad_clip", c.grad_clip);
  c.precision = j.value("precision", c.precision);
  c.metrics_out = j.value("metrics_out", c.metrics_out);
  c.save_dir = j.value("save_dir", c.save_dir);
  c.save_every = j.value("save_every", c.save_every);
  c.resume = j.value("resume", c.resume);
  c.export_hf = j.value("export_hf", c.export_hf);
  c.log_every = j.value("log_every", c.log_every);
  c.eval_every = j.value("eval_every", c.eval_every);
  c.eval_batches = j.value("eval_batches", c.eval_batches);
  return c;
}

}  // namespace loom::train
