#include "loom/parallel/tensor/random.h"

#include "loom/core/error.h"

namespace loom::parallel::tensor {

at::Tensor sharded_dropout_mask(at::IntArrayRef local_shape, const at::TensorOptions& options,
                                double p, const TpGroup& tp, int64_t dim, uint32_t site) {
  return ops::dropout_mask(local_shape, options, p, tp.dropout().position(), site,
                           ops::split_slice(local_shape, dim, tp.size(), tp.rank()));
}

at::Tensor sharded_dropout(const at::Tensor& x, double p, bool training, const TpGroup& tp,
                           int64_t dim, uint32_t site) {
  LOOM_CHECK(p >= 0 && p < 1, "dropout probability {} must be in [0, 1)", p);
  if (!training || p == 0) return x;
  return ops::dropout(x, p, tp.dropout().position(), site,
                      ops::split_slice(x.sizes(), dim, tp.size(), tp.rank()));
}

}  // namespace loom::parallel::tensor
