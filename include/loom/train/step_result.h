#pragma once
#include <cstdint>
#include <optional>
#include <vector>

namespace loom::train {

// What one optimizer step did, as the Trainer returns it and the metrics line reports it.
struct StepResult {
  int64_t step = 0;  // optimizer steps completed, this one included
  double loss = 0;   // mean over the whole batch (all micro-batches)
  // With multi-token heads (--mtp): each extra head's own loss, the batch's mean (loss above is
  // the next-token loss plus these, weighted).
  std::vector<double> mtp_losses;
  // With a mixture of data sources: each source's training loss in the step, in the sampler's
  // source order — the cross-entropy (z-loss and heads left out) over the step's tokens drawn
  // from it; NaN for a source the step drew nothing from.
  std::vector<double> source_losses;
  double grad_norm = 0;
  double lr = 0;
  double seconds = 0;
  double comm_wait_s = 0;  // time the step blocked on gradient communication (dp > 1)
  // Bytes this rank sent over the mesh's communicators during the step, counted per op as
  // dist::wire_bytes says (docs/compression.md).
  double comm_bytes = 0;
  // Peak bytes allocated during the step's forwards and backwards above what was allocated
  // when it began (activations, temporaries, and at ZeRO-3 the gathered units).
  int64_t peak_activation_bytes = 0;
  // Model FLOPs utilization of the step (mfu.h), when the device's peak is known (a GPU in
  // the table, or --peak-tflops).
  std::optional<double> mfu;
};

}  // namespace loom::train
