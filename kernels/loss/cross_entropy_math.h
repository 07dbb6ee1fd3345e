#pragma once
// The per-element arithmetic of the fused cross-entropy (cross_entropy.h), shared by the host
// reference and the CUDA kernel so that both round the same operations in the same order. In
// device code the _rn intrinsics keep nvcc from contracting a multiply and an add into an FMA;
// elsewhere (the host reference, the kernel emulation) -ffp-contract=off does the same.
#include <cmath>
#include <cstdint>

namespace loom::kernels {

// A running softmax denominator: sum of exp(x - max) over the values seen, and their max.
// {-inf, 0} is the empty set; combining with it changes nothing, exactly.
template <typename Acc>
struct SoftmaxPartial {
  Acc max;
  Acc sum;
};

// Device code under nvcc; under a plain C++ compiler (the host reference, the emulation) the
// same functions as ordinary inline ones.
#if defined(__CUDACC__)
#define LOOM_CE_FN __device__ __forceinline__
LOOM_CE_FN float ce_add(float a, float b) {
  return __fadd_rn(a, b);
}
LOOM_CE_FN float ce_sub(float a, float b) {
  return __fsub_rn(a, b);
}
LOOM_CE_FN float ce_mul(float a, float b) {
  return __fmul_rn(a, b);
}
LOOM_CE_FN float ce_exp(float a) {
  return expf(a);
}
#else
#define LOOM_CE_FN inline
// float, and double for the host reference's fp64 logits (the kernel takes 16- and 32-bit ones).
template <typename T>
T ce_add(T a, T b) {
  return a + b;
}
template <typename T>
T ce_sub(T a, T b) {
  return a - b;
}
template <typename T>
T ce_mul(T a, T b) {
  return a * b;
}
template <typename T>
T ce_exp(T a) {
  return std::exp(a);
}
#endif

// Adds one value x. A value of -inf adds exp(-inf) = 0 (skipped, so that an empty partial's
// -inf max never meets it as -inf - -inf); a NaN makes the sum NaN, so the loss is NaN.
template <typename Acc>
LOOM_CE_FN void softmax_add(SoftmaxPartial<Acc>& p, Acc x) {
  if (x > p.max) {
    p.sum = ce_add(ce_mul(p.sum, ce_exp(ce_sub(p.max, x))), Acc(1));
    p.max = x;
  } else if (x != -INFINITY) {
    p.sum = ce_add(p.sum, ce_exp(ce_sub(x, p.max)));
  }
}

// One partial's sum rescaled to a larger max m. An empty partial (sum 0) adds 0 whatever its
// max; a NaN sum stays NaN.
template <typename Acc>
LOOM_CE_FN Acc softmax_rescaled(const SoftmaxPartial<Acc>& p, Acc m) {
  return p.sum == Acc(0) ? Acc(0) : ce_mul(p.sum, ce_exp(ce_sub(p.max, m)));
}

// The union of two partials. Commutative bit for bit (fmax and + are), so a butterfly of
// shuffles leaves the same value in every lane.
template <typename Acc>
LOOM_CE_FN SoftmaxPartial<Acc> softmax_combine(const SoftmaxPartial<Acc>& a,
                                               const SoftmaxPartial<Acc>& b) {
  const Acc m = a.max > b.max ? a.max : b.max;
  return {m, ce_add(softmax_rescaled(a, m), softmax_rescaled(b, m))};
}

// d loss / d x for one logit x of a row with log-sum-exp lse: (softmax(x) * factor - [x is the
// target]) * scale, where factor = 1 + 2 z lse carries the z-loss (z lse^2) and scale is the
// upstream gradient over the number of rows counted in the mean.
template <typename Acc>
LOOM_CE_FN Acc cross_entropy_grad_value(Acc x, Acc lse, Acc factor, bool target, Acc scale) {
  const Acc p = ce_mul(ce_exp(ce_sub(x, lse)), factor);
  return ce_mul(target ? ce_sub(p, Acc(1)) : p, scale);
}

// 1 + 2 z lse: the softmax's weight in the gradient of the cross-entropy plus z-loss.
template <typename Acc>
LOOM_CE_FN Acc cross_entropy_grad_factor(Acc lse, Acc z_loss) {
  return z_loss == Acc(0) ? Acc(1) : ce_add(Acc(1), ce_mul(ce_mul(Acc(2), z_loss), lse));
}

}  // namespace loom::kernels
