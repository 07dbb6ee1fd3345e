#pragma once
// Cross-entropy over vocabulary-sharded logits, never assembling the full-vocabulary logits on
// one rank: the row maximum and the sum of exponentials are reduced across the group (plus the
// target's logit, from the rank that holds it), and the backward pass is computed locally from
// the saved softmax shard. Padded vocabulary columns (ids >= vocab) are left out of both.
#include <ATen/core/Tensor.h>

#include "loom/ops/cross_entropy.h"
#include "loom/ops/linear_cross_entropy.h"
#include "loom/parallel/tensor/tp_group.h"

namespace loom::parallel::tensor {

struct VocabLossOptions {
  // kFused: ops::fused_cross_entropy on each shard, with the group's reductions between its
  // passes; kMath: the ATen operations below; kAuto: as ops::uses_fused_loss decides.
  ops::LossBackend backend = ops::LossBackend::kAuto;
  double z_loss = 0;  // adds z_loss * mean(lse^2) (PaLM's z-loss)
  // The fused backend's backward writes the gradient over the logits (ops/cross_entropy.h).
  bool overwrite_logits = false;
};

// logits: [..., V_local], this rank's columns [rank * V_local, (rank + 1) * V_local) of the
// padded vocabulary; targets: [...] ids < vocab, the same on every rank. Returns the mean loss
// (fp32 scalar; fp64 for fp64 logits), the same on every rank. Collectives: one all-reduce
// (max) of targets.numel() values and one (sum) of 2 (math) or 3 (fused: the rescaled sums,
// target logits and found flags) x targets.numel().
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& targets,
                                        int64_t vocab, TpGroup& tp,
                                        const VocabLossOptions& options = {});

// Each token's cross-entropy (the z-loss left out) of logits [..., V_local] (as above) against
// targets [...], without gradient: [...] in the accumulation dtype (fp32; fp64 for fp64 logits),
// the same on every rank. The math path's arithmetic, run over rows in chunks so that at most
// ~2^24 exponentials exist at once, with the group's reductions per chunk. What per-source
// training losses are measured with (CausalLM::set_record_row_losses).
at::Tensor vocab_parallel_token_losses(const at::Tensor& logits, const at::Tensor& targets,
                                       int64_t vocab, TpGroup& tp);

struct VocabLinearLossOptions {
  int64_t chunk_rows = 4096;  // rows of logits at a time (ops/linear_cross_entropy.h)
  double z_loss = 0;          // adds z_loss * mean(lse^2)
  // When set: each row's cross-entropy (z-loss left out), [...] like targets, without gradient.
  at::Tensor* row_losses = nullptr;
};

// The head's product and the loss in one, in chunks of rows, so that the logits are never
// whole (ops::linear_cross_entropy on this rank's vocabulary rows, the group's max and sum
// between its passes, per chunk). hidden: [..., d] inside the tp region (every rank the same
// rows); weight: this rank's rows [V_local, d] of the padded vocabulary's head; targets [...]
// ids < vocab. Returns the mean loss, the same on every rank, equal to
// vocab_parallel_cross_entropy(hidden · weightᵀ, ...) with the fused backend up to the order of
// the weight gradient's sums. Collectives: two all-reduces per chunk (max of its rows; sum of 3 x
// its rows).
at::Tensor vocab_parallel_linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight,
                                               const at::Tensor& targets, int64_t vocab,
                                               TpGroup& tp,
                                               const VocabLinearLossOptions& options = {});

}  // namespace loom::parallel::tensor
