#pragma once
// Reducing many tensors with one collective: their elements laid end to end in one buffer.
#include <ATen/core/Tensor.h>

#include <vector>

#include "loom/dist/communicator.h"

namespace loom::dist {

// Reduces every tensor of `parts` (one dtype, one device, any shapes) across `comm` in place
// with one all-reduce; a single contiguous tensor is reduced where it is, without a staging
// copy. Every rank passes parts of the same sizes in the same order; nothing happens when they
// hold no elements.
void all_reduce_coalesced(Communicator& comm, const std::vector<at::Tensor>& parts,
                          ReduceOp op = ReduceOp::Sum);

}  // namespace loom::dist
