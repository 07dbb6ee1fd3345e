#pragma once
// What each layer of a model costs, for the pipeline partitioner: its time by a chosen measure
// and its memory on the rank that holds it.
#include <cstdint>
#include <string>

#include "loom/models/config.h"
#include "loom/parallel/pipeline/partition.h"

namespace loom::models {

// How a layer's time is counted.
//   uniform  every transformer block 1, embedding and head 0 (an even split of the blocks)
//   params   its parameter count
//   flops    its forward FLOPs per token (matmuls, attention over seq_len, the head's vocabulary
//            projection and loss), proportional to forward + backward time
// (Measured times come from the trainer, which can run the layers.)
std::string to_string_cost_kinds();  // "uniform, params, flops"

struct CostShape {
  int64_t micro_batch = 1;  // sequences per micro-batch on one rank
  int64_t seq_len = 128;
  int64_t tp = 1;
  int64_t in_flight = 1;  // micro-batches whose activations a stage holds at once (<= pp for 1F1B)
};

// Per layer: time by `kind`, and bytes = parameters x 16 (fp32 weights, gradients and the two
// AdamW moments) / tp + activations of `in_flight` micro-batches (fp32, without recompute:
// 2 x seq x batch x (34 d + 5 heads seq) / tp, twice Korthikanti et al.'s 16-bit estimate).
// The first stage also holds the embedding; the last the final norm, the head (with tied
// embeddings, its own copy of the embedding) and the logits, and the multi-token heads (each a
// block, counted 1 under "uniform", plus a pass through the head; one head's activations at a
// time). An unknown kind is a loom::Error listing the valid ones.
parallel::pipeline::LayerCosts layer_costs(const ModelConfig& config, const std::string& kind,
                                           const CostShape& shape);

// Training FLOPs per token (forward + backward) of `config` at sequence length seq_len, PaLM's
// count (Chowdhery et al., 2022, appendix B): 6 N + 12 L d T, where N is the parameters that
// enter matrix products (all of them except the position embedding and, when it is not tied to
// the output head, the token embedding: lookups multiply nothing), L the layers, d the model
// width and T the sequence length. 6 N covers each weight's multiply-add in forward (2) and
// backward (4); 12 L d T the attention scores and their product with the values, counted whole
// even when causal (a causal kernel skips half of it, so its MFU reads low by that much, as
// the convention has it). What MFU (train/mfu.h) and the cost model's MFU divide by.
double model_flops_per_token(const ModelConfig& config, int64_t seq_len);

}  // namespace loom::models
