#pragma once
// The cost model's per-layer pieces: what one block, the embedding and the head cost beyond
// their FLOPs (elementwise ops, per-op time), what a block keeps for backward, and from these
// the seconds and bytes of each layer that the pipeline partitioner balances. predict()
// partitions and times its stages with pipeline_costs; so does training with
// --pp-partition model, which is how the planner and the partitioner use one model.
#include <cstdint>
#include <string>
#include <vector>

#include "loom/models/config.h"
#include "loom/parallel/pipeline/partition.h"
#include "loom/plan/cost_model.h"
#include "loom/plan/machine_profile.h"

namespace loom::plan {

// What a stage's matmuls and attention leave out, per token of one micro-batch on one tp rank:
// elements through each class of elementwise op (forward and backward counted once: the
// profile times them together), and the number of ops. Counted from the blocks as loom writes
// them (models/gpt2.cpp, models/llama.cpp): residual adds, norms, activations, the attention
// output's copy back to [B, T, D], bias gradients, RoPE, the loss's log-softmax.
struct Elementwise {
  double pointwise = 0, activation = 0, norm = 0, ops = 0;

  Elementwise& operator+=(const Elementwise& o);
  // Seconds for `tokens` tokens, forward and backward.
  double seconds(const DeviceProfile& dev, double tokens) const;
};

// Per token: one block, the embedding (first stage), the final norm, head and loss (last).
// Residual-stream tensors are [tokens, d] on every tp rank, or [tokens / tp, d] with sequence
// parallelism; the rest are split by tp.
Elementwise block_elementwise(const models::ModelConfig& m, double tp, bool sp);
Elementwise embedding_elementwise(const models::ModelConfig& m, double tp, bool sp);
Elementwise head_elementwise(const models::ModelConfig& m, double tp, bool sp);

// Key (or value) elements per token on a tp rank: split by tp only down to one head each (more
// tp ranks replicate them).
double kv_elements(const models::ModelConfig& m, double tp);

// Elements per token one block keeps for its backward (docs/planner.md lists them); under
// context parallelism (cp > 1) ring attention's own output too. `acc`: bytes of the accumulation
// dtype over the run's element bytes (accumulation_per_element).
double block_saved_elements(const models::ModelConfig& m, double tp, bool sp, int64_t cp,
                            double acc);

// Elements per token a block's backward holds at its peak beside what is saved: the gradients of
// its MLP's hidden activations; under context parallelism ring attention's buffers when they are
// more (the gradients carried round the ring, the blocks in flight).
double block_backward_peak_elements(const models::ModelConfig& m, double tp, int64_t cp,
                                    double acc);

// The accumulation dtype's bytes over the run's element bytes: 2 under bf16 (fp32 partial
// results and gradients), else 1.
double accumulation_per_element(const std::string& precision);

// Bytes per element of the activations and the messages they make (bf16 2, fp64 8, else 4).
double activation_element_bytes(const std::string& precision);

// One layer's compute for one micro-batch on one rank, seconds: forward, backward (with what
// the checkpointing mode recomputes) and the attention inside forward (what context
// parallelism's exchanges hide behind).
struct LayerSeconds {
  double forward = 0, backward = 0, attention = 0;
};

struct PipelineCosts {
  // What partition_layers takes: per layer forward + backward seconds on the reference device
  // (the fastest pipeline rank's), and the bytes it adds to its rank (training state as the
  // ZeRO stage shards it, activations of `in_flight` micro-batches).
  parallel::pipeline::LayerCosts costs;
  std::vector<LayerSeconds> layers;  // the same seconds, split
  LayerSeconds first, last;          // the embedding; the final norm, head, loss (and MTP heads)
  // Per pipeline rank: speed relative to the reference for one block, and its memory.
  std::vector<parallel::pipeline::DeviceSpec> devices;
};

// The layout's per-layer costs and devices (check_layout first). Matmuls at the device's rate
// for the model's width, attention at its rate for the rank's sequence and the head dim,
// elementwise ops and per-op costs, times compute_scale; backward twice forward.
PipelineCosts pipeline_costs(const Workload& workload, const Layout& layout,
                             const MachineProfile& machine, int64_t in_flight);

}  // namespace loom::plan
