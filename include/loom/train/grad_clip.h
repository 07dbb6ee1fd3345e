#pragma once
#include <ATen/core/Tensor.h>

#include <vector>

namespace loom::train {

// Global L2 norm of all gradients (accumulated in fp32). If max_norm > 0 and the norm exceeds
// it, scales every gradient by max_norm / (norm + 1e-6), as torch.nn.utils.clip_grad_norm_.
// Returns the norm before clipping.
double clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm);

}  // namespace loom::train
