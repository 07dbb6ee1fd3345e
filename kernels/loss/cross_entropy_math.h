#pragma once
// The per-element arithmetic of the fused cross-entropy (cross_entropy.h), shared by the host
// reference and the CUDA kernel so that both round the same operations in the same order
// (common/rounded_math.h).
#include <cmath>
#include <cstdint>

#include "common/rounded_math.h"

namespace loom::kernels {

// A running softmax denominator: sum of exp(x - max) over the values seen, and their max.
// {-inf, 0} is the empty set; combining with it changes nothing, exactly.
template <typename Acc>
struct SoftmaxPartial {
  Acc max;
  Acc sum;
};

// Adds one value x. A value of -inf adds exp(-inf) = 0 (skipped, so that an empty partial's
// -inf max never meets it as -inf - -inf); a NaN makes the sum NaN, so the loss is NaN.
template <typename Acc>
LOOM_ROUNDED_FN void softmax_add(SoftmaxPartial<Acc>& p, Acc x) {
  if (x > p.max) {
    p.sum = rn_add(rn_mul(p.sum, exp_fn(rn_sub(p.max, x))), Acc(1));
    p.max = x;
  } else if (x != -INFINITY) {
    p.sum = rn_add(p.sum, exp_fn(rn_sub(x, p.max)));
  }
}

// One partial's sum rescaled to a larger max m. An empty partial (sum 0) adds 0 whatever its
// max; a NaN sum stays NaN.
template <typename Acc>
LOOM_ROUNDED_FN Acc softmax_rescaled(const SoftmaxPartial<Acc>& p, Acc m) {
  return p.sum == Acc(0) ? Acc(0) : rn_mul(p.sum, exp_fn(rn_sub(p.max, m)));
}

// The union of two partials. Commutative bit for bit (fmax and + are), so a butterfly of
// shuffles leaves the same value in every lane.
template <typename Acc>
LOOM_ROUNDED_FN SoftmaxPartial<Acc> softmax_combine(const SoftmaxPartial<Acc>& a,
                                                    const SoftmaxPartial<Acc>& b) {
  const Acc m = a.max > b.max ? a.max : b.max;
  return {m, rn_add(softmax_rescaled(a, m), softmax_rescaled(b, m))};
}

// d loss / d x for one logit x of a row with log-sum-exp lse: (softmax(x) * factor - [x is the
// target]) * scale, where factor = 1 + 2 z lse carries the z-loss (z lse^2) and scale is the
// upstream gradient over the number of rows counted in the mean.
template <typename Acc>
LOOM_ROUNDED_FN Acc cross_entropy_grad_value(Acc x, Acc lse, Acc factor, bool target, Acc scale) {
  const Acc p = rn_mul(exp_fn(rn_sub(x, lse)), factor);
  return rn_mul(target ? rn_sub(p, Acc(1)) : p, scale);
}

// 1 + 2 z lse: the softmax's weight in the gradient of the cross-entropy plus z-loss.
template <typename Acc>
LOOM_ROUNDED_FN Acc cross_entropy_grad_factor(Acc lse, Acc z_loss) {
  return z_loss == Acc(0) ? Acc(1) : rn_add(Acc(1), rn_mul(rn_mul(Acc(2), z_loss), lse));
}

}  // namespace loom::kernels
