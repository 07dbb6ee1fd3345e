#pragma once
// Dropout with counter-based masks (kernels/dropout): whether an element is dropped depends only on
// the run's seed, the step, which dropout of the model it is (the site), and the element's place
// in the logical tensor: its sample's index in the global batch and its coordinates. So the same
// mask comes out on the CPU and the GPU, at any data-, tensor- or sequence-parallel split, with
// any gradient accumulation, and when a checkpointed block is recomputed; nothing is drawn from a
// generator, nothing is saved for backward, and no state needs checkpointing beyond the step.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <mutex>
#include <vector>

namespace loom::ops {

// What a model's dropouts key their masks with: the run's seed, and where in training the
// micro-batch being run is (the optimizer step, and its first sample's index in the step's
// global batch, the same index the data sampler uses).
struct DropoutPosition {
  uint64_t seed = 0;
  int64_t step = 0;
  int64_t first_sample = 0;
};

// The position a model's forwards read: the runtime sets it before each training micro-batch;
// activation checkpointing captures it at forward and restores it for the recompute. Handles are
// shared (the model's blocks hold one); thread-safe.
class DropoutStream {
 public:
  explicit DropoutStream(uint64_t seed = 0) { position_.seed = seed; }
  void reseed(uint64_t seed);
  void set_micro_batch(int64_t step, int64_t first_sample);
  DropoutPosition position() const;
  void restore(const DropoutPosition& position);

 private:
  mutable std::mutex mutex_;
  DropoutPosition position_;
};

// Which dropout of a model a mask is for, the same whichever ranks hold the layer: `layer` is the
// block's index in the whole model (-1 before the first block: the embedding), `place` which of
// the block's dropouts.
enum class DropoutPlace : uint32_t { kInput = 0, kAttentionProbs = 1, kAttention = 2, kMlp = 3 };
uint32_t dropout_site(int64_t layer, DropoutPlace place);

// How a local tensor lies in the logical one it is a slice of: per dimension the logical size and
// this tensor's offset. Dimension 0 holds samples; its offset is added to the position's
// first_sample. Empty vectors: the tensor is the whole logical tensor.
struct DropoutSlice {
  std::vector<int64_t> logical;
  std::vector<int64_t> offset;
};

// The slice of a tensor split evenly along `dim` over `parts` ranks, of which this is `index`
// (dim < 0 or parts == 1: the whole tensor).
DropoutSlice split_slice(at::IntArrayRef local_shape, int64_t dim, int64_t parts, int64_t index);

// x * mask / (1 - p) with the mask of (position, site, slice), as an autograd op whose backward
// applies the same mask to the gradient. x: 1 to 4 dimensions (dimension 0: samples), any
// floating dtype, CPU or CUDA. p must be in [0, 1); p == 0 returns x.
at::Tensor dropout(const at::Tensor& x, double p, const DropoutPosition& position, uint32_t site,
                   const DropoutSlice& slice = {});

// The mask itself, 1 / (1 - p) or 0 per element, of shape `shape` (what attention multiplies its
// probabilities by); undefined when p == 0.
at::Tensor dropout_mask(at::IntArrayRef shape, const at::TensorOptions& options, double p,
                        const DropoutPosition& position, uint32_t site,
                        const DropoutSlice& slice = {});

}  // namespace loom::ops
