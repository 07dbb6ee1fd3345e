// CausalLM's losses: the next-token loss of the head's output (whole logits, or the head run in
// chunks of rows with the loss), the multi-token heads' losses, and per-row losses for
// per-source metrics.
#include <c10/util/ScopeExit.h>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <utility>

#include "loom/core/error.h"
#include "loom/core/format.h"
#include "loom/models/causal_lm.h"
#include "loom/ops/precision.h"
#include "loom/parallel/context/ring_attention.h"
#include "loom/parallel/memory/activation_checkpoint.h"
#include "loom/parallel/tensor/cross_entropy.h"
#include "loom/parallel/tensor/mappings.h"

namespace loom::models {

namespace pt = parallel::tensor;

at::Tensor CausalLM::token_loss(const at::Tensor& logits, const at::Tensor& targets) {
  const bool fused = ops::uses_fused_loss(loss_backend_, logits);
  // The z-loss is a training term: evaluation reports the cross-entropy alone.
  const double z_loss = is_training() ? z_loss_ : 0.0;
  if (!fused && z_loss == 0 && tp_->size() == 1 && logits.size(-1) == config_.vocab_size)
    return next_token_loss(logits, targets);
  pt::VocabLossOptions options;
  options.backend = fused ? ops::LossBackend::kFused : ops::LossBackend::kMath;
  options.z_loss = z_loss;
  options.overwrite_logits = own_logits_ != nullptr && logits.unsafeGetTensorImpl() == own_logits_;
  return pt::vocab_parallel_cross_entropy(logits, targets, config_.vocab_size, *tp_, options);
}

void CausalLM::set_z_loss(double weight) {
  LOOM_CHECK(std::isfinite(weight) && weight >= 0,
             "z-loss weight {} is not valid: a finite value >= 0 (0: no z-loss)", weight);
  z_loss_ = weight;
}

void CausalLM::record_row_losses(const at::Tensor& logits, const at::Tensor& local_targets) {
  if (!record_row_losses_ || !is_training()) return;
  LOOM_CHECK(local_targets.dim() == 2 && local_targets.sizes() == logits.sizes().slice(0, 2),
             "loss: targets {} must be [batch, seq] of the logits {}", local_targets.sizes(),
             logits.sizes());
  const auto losses =
      pt::vocab_parallel_token_losses(logits, local_targets, config_.vocab_size, *tp_);
  if (tp_->rank() == 0)
    row_losses_.push_back({losses.to(at::kDouble).sum(1), local_targets.size(1)});
}

at::Tensor CausalLM::loss_from_logits(const at::Tensor& logits, const at::Tensor& targets) {
  return loss_of_output(logits, 0, targets);
}

at::Tensor CausalLM::loss_of_output(const at::Tensor& out, int64_t chunk_rows,
                                    const at::Tensor& targets) {
  check_ids(targets, "target");
  // The chunked head multiplies final_norm's output inside the tp region (under sequence
  // parallelism: gathered over the sequence), as unembed does.
  const auto head_input = chunk_rows > 0 ? pt::enter_tp_region(out, *tp_, 1) : out;
  const auto main_loss = [&](const at::Tensor& local_targets) {
    if (chunk_rows > 0) return chunked_token_loss(head_input, local_targets, chunk_rows);
    record_row_losses(out, local_targets);
    return token_loss(out, local_targets);
  };
  if (!mtp_heads_.empty() && is_training()) {
    LOOM_CHECK(trunk_.defined() && trunk_logits_.lock().get() == out.unsafeGetTensorImpl(),
               "multi-token prediction: these logits did not come from this model's last "
               "forward_part while training, whose trunk the {} heads read; call forward_part "
               "and loss_from_logits in turn",
               mtp_heads_.size());
    const auto trunk = std::exchange(trunk_, at::Tensor());
    const auto first_key = std::exchange(trunk_first_key_, at::Tensor());
    trunk_logits_.reset();
    LOOM_CHECK(targets.dim() == 2 && targets.sizes() == head_input.sizes().slice(0, 2),
               "loss: targets {} must be [batch, seq] of the logits {}", targets.sizes(),
               head_input.sizes());
    // The heads first: their forwards run while the main head's cross-entropy holds nothing yet.
    const auto heads = mtp_loss(trunk, targets, first_key);
    return main_loss(targets) + heads;
  }
  if (context_parallel_size() > 1) {
    auto& group = *execution_->context;
    LOOM_CHECK(targets.dim() == 2 && targets.size(1) == head_input.size(1) * group.size(),
               "under context parallelism the targets are the whole sequences [batch, {}] for "
               "this rank's logits {}; got {}",
               head_input.size(1) * group.size(), head_input.sizes(), targets.sizes());
    // Every rank holds as many tokens: the mean of the ranks' means is the whole mean.
    return parallel::context::context_mean(main_loss(group.slice_sequence(targets, 1)), group);
  }
  return main_loss(targets);
}

at::Tensor CausalLM::chunked_token_loss(const at::Tensor& hidden, const at::Tensor& targets,
                                        int64_t chunk_rows) {
  LOOM_CHECK(targets.dim() == 2 && targets.sizes() == hidden.sizes().slice(0, 2),
             "loss: targets {} must be [batch, seq] of the head's input {}", targets.sizes(),
             hidden.sizes());
  pt::VocabLinearLossOptions options;
  options.chunk_rows = chunk_rows;
  // The z-loss is a training term: evaluation reports the cross-entropy alone.
  options.z_loss = is_training() ? z_loss_ : 0.0;
  at::Tensor rows;
  const bool record = record_row_losses_ && is_training();
  if (record) options.row_losses = &rows;
  auto loss = pt::vocab_parallel_linear_cross_entropy(hidden, unembedding_shard(), targets,
                                                      config_.vocab_size, *tp_, options);
  ++chunked_losses_;
  if (record && tp_->rank() == 0)
    row_losses_.push_back({rows.to(at::kDouble).sum(1), targets.size(1)});
  return loss;
}

void CausalLM::set_loss_chunk_rows(int64_t rows) {
  LOOM_CHECK(rows >= kAutoLossChunks,
             "loss chunk rows {} is not valid: a number of rows > 0, 0 for whole logits, or "
             "auto ({})",
             rows, kAutoLossChunks);
  LOOM_CHECK(rows <= 0 || config_.family != Family::kCustom,
             "loss chunks of {} rows: a custom model's head is its own and makes whole logits "
             "(use auto or 0)",
             rows);
  loss_chunk_rows_ = rows;
}

int64_t CausalLM::resolved_loss_chunk_rows(int64_t rows, at::Device device) {
  if (config_.family == Family::kCustom || !part_.last || loss_chunk_rows_ == 0) return 0;
  // The chunks run the fused loss's passes: --loss math asks for ATen's.
  LOOM_CHECK(loss_chunk_rows_ < 0 || loss_backend_ != ops::LossBackend::kMath,
             "loss chunks of {} rows run loom's fused cross-entropy passes; the loss backend is "
             "'math' (use --loss auto or fused with --loss-chunk-rows, or --loss-chunk-rows off)",
             loss_chunk_rows_);
  if (loss_chunk_rows_ > 0) return loss_chunk_rows_;
  const auto weight = unembedding_shard();
  if (!weight.defined() || loss_backend_ == ops::LossBackend::kMath) return 0;
  // The products' dtype: autocast's where it is on (never for fp64 weights).
  const auto dtype = weight.scalar_type() != at::kDouble &&
                             at::autocast::is_autocast_available(device.type()) &&
                             at::autocast::is_autocast_enabled(device.type())
                         ? at::autocast::get_autocast_dtype(device.type())
                         : weight.scalar_type();
  // The CUDA kernels take fp32, fp16 and bf16 (an fp64 run on a GPU keeps whole logits).
  if (device.is_cuda() && dtype == at::kDouble) return 0;
  const int64_t row_bytes = weight.size(0) * static_cast<int64_t>(c10::elementSize(dtype));
  constexpr int64_t kWholeUpTo = int64_t{2} << 30, kChunkBytes = int64_t{1} << 30;
  if (rows * row_bytes <= kWholeUpTo) return 0;
  return std::max<int64_t>(1, kChunkBytes / row_bytes);
}

at::Tensor CausalLM::part_loss(const at::Tensor& input, const at::Tensor& tokens,
                               const at::Tensor& targets) {
  LOOM_CHECK(part_.last, "part_loss needs the model's last part (its head); this one holds {}",
             part_.describe(config_.n_layers));
  const int64_t chunk_rows =
      resolved_loss_chunk_rows(targets.numel() / context_parallel_size(), input.device());
  if (chunk_rows > 0) {
    at::Tensor normed;
    {
      defer_head_ = true;
      const auto restore = c10::make_scope_exit([this] { defer_head_ = false; });
      normed = forward_part(input, tokens);
    }
    return loss_of_output(normed, chunk_rows, targets);
  }
  const auto logits = forward_part(input, tokens);
  // GPT-2's and Llama's heads end in a product, which saves its inputs, not its output; a
  // custom model's head may save its output (a soft cap's tanh), so its logits stay intact.
  if (config_.family != Family::kCustom) own_logits_ = logits.unsafeGetTensorImpl();
  const auto forget = c10::make_scope_exit([this] { own_logits_ = nullptr; });
  return loss_from_logits(logits, targets);
}

at::Tensor CausalLM::mtp_loss(const at::Tensor& trunk, const at::Tensor& targets,
                              const at::Tensor& first_key) {
  const int64_t heads = static_cast<int64_t>(mtp_heads_.size()), seq = targets.size(1);
  LOOM_CHECK(seq > heads,
             "multi-token prediction with {} heads needs sequences of more than {} tokens (head "
             "k predicts the token k + 1 places ahead); got {}",
             heads, heads, seq);
  std::vector<parallel::memory::CheckpointFn> terms;
  for (int64_t i = 0; i < heads; ++i) {
    const double weight = mtp_weights_[static_cast<size_t>(i)];
    if (weight == 0) continue;
    // Runs again in backward: holds the targets and first keys by value (the model outlives the
    // step).
    terms.push_back([this, i, weight, targets, first_key](const std::vector<at::Tensor>& in) {
      const int64_t shift = i + 1;
      const auto logits = unembed(mtp_hidden(i, in[0], first_key));
      const int64_t t = logits.size(1);
      const auto loss =
          token_loss(logits.narrow(1, 0, t - shift), targets.narrow(1, shift, t - shift));
      // Counted where forward runs it (without grad), not again in its recompute.
      if (!at::GradMode::is_enabled())
        mtp_loss_sums_.narrow(0, i, 1).add_(loss.detach().to(at::kDouble));
      return loss * weight;
    });
  }
  if (!mtp_loss_sums_.defined() || mtp_loss_sums_.device() != trunk.device())
    mtp_loss_sums_ = at::zeros({heads}, trunk.options().dtype(at::kDouble));
  ++mtp_loss_forwards_;
  if (terms.empty()) return at::zeros({}, trunk.options().dtype(at::kFloat));
  parallel::memory::CheckpointOptions options;
  if (config_.dropout > 0) options.dropout_streams.push_back(tp_->dropout_stream());
  // The heads' parameters and the shared unembedding get their gradients through the node, one
  // accumulation per backward (the unembedding's summed with the main head's use of it).
  for (const auto& head : mtp_heads_)
    for (const auto& p : head->parameters()) options.parameters.push_back(p);
  const auto params = named_parameters();
  const auto* unembedding = params.find(unembedding_weight_name());
  LOOM_CHECK(unembedding != nullptr, "multi-token prediction: the model has no parameter '{}'",
             unembedding_weight_name());
  options.parameters.push_back(*unembedding);
  return parallel::memory::checkpoint_sum(terms, {trunk}, options);
}

at::Tensor CausalLM::take_mtp_losses() {
  if (mtp_loss_forwards_ == 0) return at::Tensor();
  auto means = std::exchange(mtp_loss_sums_, at::Tensor()) /
               static_cast<double>(std::exchange(mtp_loss_forwards_, 0));
  return means;
}

void CausalLM::set_mtp_loss_weights(std::vector<double> weights) {
  LOOM_CHECK(static_cast<int64_t>(weights.size()) == config_.mtp_heads,
             "multi-token prediction loss weights: {} given for {} heads (one per head)",
             weights.size(), config_.mtp_heads);
  for (size_t i = 0; i < weights.size(); ++i)
    LOOM_CHECK(std::isfinite(weights[i]) && weights[i] >= 0,
               "multi-token prediction loss weight {} of head {} must be finite and >= 0",
               weights[i], i + 1);
  mtp_weights_ = std::move(weights);
}

at::Tensor CausalLM::loss(const at::Tensor& tokens, const at::Tensor& targets) {
  LOOM_CHECK(targets.sizes() == tokens.sizes(), "loss: targets {} must match tokens {}",
             targets.sizes(), tokens.sizes());
  LOOM_CHECK(is_whole(), "loss needs the whole model; this one holds {} (use part_loss)",
             part_.describe(config_.n_layers));
  return part_loss(tokens, tokens, targets);
}

at::Tensor next_token_loss(const at::Tensor& logits, const at::Tensor& targets) {
  LOOM_CHECK(logits.dim() == 3 && targets.dim() == 2 && logits.size(0) == targets.size(0) &&
                 logits.size(1) == targets.size(1),
             "loss: logits {} and targets {} do not match ([B, T, V] and [B, T])", logits.sizes(),
             targets.sizes());
  return at::cross_entropy_loss(ops::to_accumulation_dtype(logits.reshape({-1, logits.size(2)})),
                                targets.reshape({-1}));
}

}  // namespace loom::models
