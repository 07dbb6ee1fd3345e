#pragma once
// Cross-entropy without a softmax in memory: the fused kernels (kernels/loss/cross_entropy.h)
// on CUDA, their host reference on the CPU. Forward reads the logits once (per row: an online
// softmax gives the max and the sum of exponentials, plus the target's logit); backward reads
// them once more and writes the gradient in the logits' dtype, in place over them when the
// caller gives the logits up (`overwrite_logits`). What the kernels return per row is combined
// here with a few operations on one value a row; for vocabulary-parallel shards the caller
// passes the reductions across its group (parallel/tensor/cross_entropy.h does, over tp).
#include <ATen/core/Tensor.h>

#include <functional>
#include <string>
#include <vector>

#include "loom/ops/fused_choice.h"

namespace loom::ops {

// Which implementation computes a model's loss (ops/fused_choice.h; kMath: ATen's log-softmax
// and NLL for one process, loom's vocabulary-parallel loss on ATen operations for tp > 1, in the
// accumulation dtype).
using LossBackend = FusedChoice;
// parse_fused_choice(name, "loss backend").
LossBackend parse_loss_backend(const std::string& name);
// Whether `backend` computes the loss of these logits with the fused algorithm. loom::Error
// when kFused cannot take them (fp64 on CUDA, a device other than CPU and CUDA, an integer
// dtype).
bool uses_fused_loss(LossBackend backend, const at::Tensor& logits);

// The reductions across the ranks that hold the other columns of each row (in place, on one
// value per row; element-wise max and sum). Unset: this rank holds every column.
struct RowReductions {
  std::function<void(at::Tensor&)> max;
  std::function<void(at::Tensor&)> sum;
};

struct FusedCrossEntropyOptions {
  // Columns [col_offset, col_offset + valid) of the vocabulary are this rank's; its logits'
  // columns past `valid` are padding (left out of the loss, gradient 0). valid < 0: all.
  int64_t col_offset = 0;
  int64_t valid = -1;
  // Rows whose target is this id count neither in the loss nor in the mean (gradient 0).
  int64_t ignore_index = -100;
  // Adds z_loss * lse^2 per row (PaLM's z-loss: keeps the softmax normaliser near 1).
  double z_loss = 0;
  // Backward writes the gradient over the logits' memory instead of a new buffer. The caller
  // must not read the logits after backward; the logits' version counter is bumped so that an
  // autograd node that saved them and whose backward runs after this one fails loudly (one that
  // runs before still read them intact), and a second backward through this loss (a retained
  // graph) is refused.
  bool overwrite_logits = false;
  RowReductions reduce;
};

// Mean cross-entropy (plus z-loss) of logits [..., V_local] against targets [...] (int64 ids
// or ignore_index), as a scalar in the accumulation dtype (fp32; fp64 for fp64 logits), with
// autograd through the logits. The mean is over the rows whose target is not ignored (NaN when
// none is); a row whose target no rank's columns hold gets a NaN loss. Runs the kernels on CUDA
// and their host reference on the CPU, whatever LossBackend says (choosing is the caller's).
at::Tensor fused_cross_entropy(const at::Tensor& logits, const at::Tensor& targets,
                               const FusedCrossEntropyOptions& options = {});

}  // namespace loom::ops
