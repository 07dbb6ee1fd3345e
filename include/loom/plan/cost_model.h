#pragma once
// A model of one training step: for a model, a batch, a parallel layout and a machine, the
// memory each rank holds and the time a step takes. What it adds up:
//
//   memory  parameters, gradients and optimizer state of the busiest pipeline stage, as each
//           ZeRO stage shards them over dp (zero_state_bytes); activations of the micro-batches
//           the schedule keeps in flight on that stage (the schedule simulator's count), as the
//           checkpointing mode keeps them; the last stage's logits.
//   time    compute from each stage's FLOPs (the pipeline partitioner's per-layer costs, split
//           into matmuls and attention) at the device's measured rate for each; tensor- and
//           context-parallel exchanges and pipeline sends from bytes over each mesh dimension's
//           link (ring formulas below); the pipeline bubble from the schedule simulator run with
//           those stage times; data-parallel reduction overlapped with the last backward as the
//           runtime overlaps it; the optimizer's update.
//
// It is a model, not a measurement: docs/planner.md says what it leaves out and how far its
// figures have been checked.
#include <cstdint>
#include <string>
#include <vector>

#include "loom/models/config.h"
#include "loom/plan/machine_profile.h"

namespace loom::plan {

// Bytes one parameter costs in training state.
struct StateBytes {
  double param = 4;      // the parameter itself
  double grad = 4;       // its gradient
  double optimizer = 8;  // AdamW's two moments (and a master copy, when the parameter is narrower)
};
// What loom keeps per parameter: fp32 parameters, gradients and moments for fp32 and bf16
// (autocast computes in bf16 from fp32 weights), fp64 for fp64. Other precisions: loom::Error.
StateBytes loom_state_bytes(const std::string& precision);

// Model-state bytes one rank holds for `params` parameters replicated over `dp` ranks at ZeRO
// `stage` (0: none), as the ZeRO paper counts them:
//   0: (p + g + o) Ψ    1: (p + g) Ψ + o Ψ / dp    2: p Ψ + (g + o) Ψ / dp    3: (p + g + o) Ψ / dp
double zero_state_bytes(double params, const StateBytes& bytes, int stage, int64_t dp);

// Seconds for ring collectives over `ranks` ranks of one link, `bytes` being the whole buffer
// (an all-reduce's input, a reduce-scatter's input, an all-gather's output): each step moves
// bytes / ranks and pays the link's latency.
//   all-reduce:                  2 (n - 1) / n x bytes / bandwidth + 2 (n - 1) x latency
//   reduce-scatter, all-gather:  (n - 1) / n x bytes / bandwidth + (n - 1) x latency
//   send:                        bytes / bandwidth + latency
// One rank: 0.
double all_reduce_seconds(double bytes, int64_t ranks, const Link& link);
double reduce_scatter_seconds(double bytes, int64_t ranks, const Link& link);
double all_gather_seconds(double bytes, int64_t ranks, const Link& link);
double send_seconds(double bytes, const Link& link);

// How the ranks are laid out and a step is run: loom-pretrain's --dp/--tp/--pp/--cp, --zero,
// --micro-batches (grad_accum), --virtual-stages, --schedule, --activation-checkpointing,
// --sequence-parallel.
struct Layout {
  int64_t dp = 1, tp = 1, pp = 1, cp = 1;
  int zero = 0;
  int64_t micro_batches = 1;
  int64_t virtual_stages = 1;
  std::string schedule = "1f1b";       // with pp > 1
  std::string checkpointing = "none";  // none | selective | full
  bool sequence_parallel = false;

  int64_t world() const { return dp * tp * pp * cp; }
  // "dp 2 x tp 2 x pp 2, zero 1, 8 micro-batches, 1f1b, recompute full"
  std::string describe() const;
};

// What is trained: the model, the global batch (sequences per optimizer step) and its length,
// and the precision (fp32 | bf16 | fp64).
struct Workload {
  models::ModelConfig model;
  int64_t batch_size = 8;
  int64_t seq_len = 128;
  std::string precision = "bf16";
};

// Throws loom::Error naming the value and what would be valid when `layout` cannot run
// `workload` (tp not dividing the heads, a batch that dp x micro-batches does not divide, a
// sequence cp cannot split, more stages than layers, an unknown schedule or checkpointing mode).
void check_layout(const Workload& workload, const Layout& layout);

struct Prediction {
  // Per rank, on the pipeline stage that needs the most.
  double parameter_bytes = 0, gradient_bytes = 0, optimizer_bytes = 0, activation_bytes = 0;
  double memory_bytes = 0;                // their sum
  std::vector<double> rank_memory_bytes;  // per pipeline rank, the same sum
  std::vector<int64_t> stage_bounds;      // the partition: stage s holds [b[s], b[s + 1])
  // Per step, seconds. compute: the busiest stage's forwards and backwards (recompute
  // included; with virtual stages, one chunk's); tp / cp / pp: the exchanges on its critical
  // path; dp: the reduction (and ZeRO-3's gathers) not hidden behind compute; optimizer: the
  // slowest rank's update.
  double compute_s = 0, tp_comm_s = 0, cp_comm_s = 0, pp_comm_s = 0, dp_comm_s = 0;
  double optimizer_s = 0;
  double bubble_fraction = 0;  // the schedule simulator's idle fraction with these stage times
  int64_t in_flight = 1;       // most micro-batches whose activations a stage holds at once
  double step_s = 0;
  double tokens_per_s = 0;
  // Model FLOPs utilization (models::model_flops_per_token x tokens/s over the ranks' summed
  // peak_flops); 0 when a device's peak is not known.
  double mfu = 0;
};

// The prediction for `workload` run as `layout` on `machine` (check_layout first).
Prediction predict(const Workload& workload, const Layout& layout, const MachineProfile& machine);

}  // namespace loom::plan
