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

}  // namespace loom::models
