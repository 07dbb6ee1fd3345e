#include "loom/parallel/tensor/random.h"

#include <ATen/ATen.h>

#include "loom/core/error.h"
#include "loom/ops/precision.h"

namespace loom::parallel::tensor {

at::Tensor sharded_dropout_mask(at::IntArrayRef local_shape, const at::TensorOptions& options,
                                double p, TpGroup& tp, int64_t dim) {
  LOOM_CHECK(p >= 0 && p < 1, "dropout probability {} must be in [0, 1)", p);
  if (p == 0) return {};
  auto shape = local_shape.vec();
  const bool sliced = dim >= 0 && tp.size() > 1;
  if (sliced) shape.at(static_cast<size_t>(dim)) *= tp.size();
  // Drawn in fp32 on the CPU whatever x is, so the draws are the same for every dtype.
  auto keep = at::empty(shape, at::kFloat).bernoulli_(1.0 - p, tp.generator());
  if (sliced) keep = keep.narrow(dim, tp.rank() * local_shape[dim], local_shape[dim]);
  // Scaled in at least fp32 (fp64 for fp64 runs), then cast to what x is.
  const auto scale_dtype = ops::accumulation_dtype(c10::typeMetaToScalarType(options.dtype()));
  return keep.to(scale_dtype).div_(1.0 - p).to(options);
}

at::Tensor sharded_dropout(const at::Tensor& x, double p, bool training, TpGroup& tp, int64_t dim) {
  if (!training || p == 0) return x;
  return x * sharded_dropout_mask(x.sizes(), x.options(), p, tp, dim);
}

}  // namespace loom::parallel::tensor
