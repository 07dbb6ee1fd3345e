#pragma once
// Cross-entropy over vocabulary-sharded logits, never assembling the full-vocabulary logits on
// one rank: the row maximum and the sum of exponentials are reduced across the group (plus the
// target's logit, from the rank that holds it), and the backward pass is computed locally from
// the saved softmax shard. Padded vocabulary columns (ids >= vocab) are left out of both.
#include <ATen/core/Tensor.h>

#include "loom/parallel/tensor/tp_group.h"

namespace loom::parallel::tensor {

// logits: [..., V_local], this rank's columns [rank * V_local, (rank + 1) * V_local) of the
// padded vocabulary; targets: [...] ids < vocab, the same on every rank. Returns the mean loss
// (fp32 scalar), the same on every rank. Collectives: one all-reduce (max) and one (sum) of
// 2 x targets.numel() fp32 values.
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& targets,
                                        int64_t vocab, TpGroup& tp);

}  // namespace loom::parallel::tensor
