#pragma once
// What the tensor-parallel tests share: a tp group over the whole world and the small GPT-2 /
// Llama shapes every tp size splits.
#include <memory>

#include "dist_util.h"
#include "loom/models/config.h"
#include "loom/parallel/tensor/tp_group.h"

namespace loom::testing {

inline parallel::tensor::TpGroupPtr world_group(bool sequence_parallel = false,
                                                int64_t pad_multiple = 1) {
  return std::make_shared<parallel::tensor::TpGroup>(
      runtime().world(), parallel::tensor::TpOptions{sequence_parallel, pad_multiple});
}

inline loom::models::ModelConfig small_config(loom::models::Family family, int64_t world_size) {
  loom::models::ModelConfig c;
  c.family = family;
  c.vocab_size = 101;  // prime: padded for every tp > 1
  c.max_seq_len = 24;
  c.d_model = 48;
  c.n_layers = 2;
  c.n_heads = 12;
  c.d_ff = 96;
  if (family == loom::models::Family::kLlama) {
    // Grouped-query attention: 2 kv heads are split at tp 2 and replicated at tp 4; tp 3 needs
    // a count it divides or that divides it.
    c.n_kv_heads = world_size == 3 ? 3 : 2;
    c.tie_embeddings = false;
  } else {
    c.n_kv_heads = c.n_heads;
  }
  return c;
}

}  // namespace loom::testing
