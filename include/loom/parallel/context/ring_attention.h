#pragma once
// Ring attention over a context-parallel group (context_group.h): each rank holds the queries,
// keys and values of its two chunks of every sequence; the key/value blocks travel once around
// the ring while each rank attends its queries to the block it holds (the next block's transfer
// runs while it computes), merging partial results with the online-softmax rescaling
// (ops/attention_partial.h). Backward travels the ring again with the key/value blocks and the
// gradients of the keys and values, which arrive back at their owner after one more hop.
#include <ATen/core/Tensor.h>

#include <optional>

#include "loom/parallel/context/context_group.h"

namespace loom::parallel::context {

// Causal attention of this rank's tokens against every token of their sequences at or before
// them: q [B, Hq, T, D], k, v [B, Hkv, T, D] (Hkv dividing Hq), T = seq_len / cp holding this
// rank's two chunks in the group's order. Returns [B, Hq, T, D] in q's dtype. Collective over
// the group, in forward and in backward; scale defaults to 1/sqrt(D).
at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          ContextGroup& group, std::optional<double> scale = std::nullopt);

// The mean over the group of each rank's mean over its own tokens (equal counts per rank): the
// mean over the whole sequences, on every rank. Its backward hands each rank 1/cp of the
// gradient, so the gradients the ranks compute are parts of one gradient that the
// context-parallel strategy sums over the group. Collective over the group.
at::Tensor context_mean(const at::Tensor& local_mean, ContextGroup& group);

}  // namespace loom::parallel::context
