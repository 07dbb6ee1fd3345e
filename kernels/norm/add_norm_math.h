#pragma once
// The per-element arithmetic of the fused add + norm (add_norm.h), shared by the host references
// and the CUDA kernels so that both round the same operations in the same order
// (common/rounded_math.h).
#include "common/rounded_math.h"
#include "norm/add_norm.h"

namespace loom::kernels {

// The normalised value of one element of a row with statistics mean (0 for RMSNorm) and rstd.
template <typename Acc>
LOOM_ROUNDED_FN Acc norm_xhat(NormKind kind, Acc value, Acc mean, Acc rstd) {
  return rn_mul(kind == NormKind::kLayerNorm ? rn_sub(value, mean) : value, rstd);
}

// 1 / sqrt(moment / width + eps), moment the row's sum of squares (of deviations from the mean
// for LayerNorm).
template <typename Acc>
LOOM_ROUNDED_FN Acc norm_rstd(Acc moment, Acc width, Acc eps) {
  return rn_div(Acc(1), rn_sqrt(rn_add(rn_div(moment, width), eps)));
}

// xhat * weight (+ bias).
template <typename Acc>
LOOM_ROUNDED_FN Acc norm_output(Acc xhat, Acc weight, bool has_bias, Acc bias) {
  const Acc scaled = rn_mul(xhat, weight);
  return has_bias ? rn_add(scaled, bias) : scaled;
}

// d norm / d input for one element, from gw = grad_normed * weight, the element's xhat and the
// row's means of gw (LayerNorm only) and of gw * xhat:
//   LayerNorm  rstd * (gw - mean(gw) - xhat * mean(gw xhat))
//   RMSNorm    rstd * (gw - xhat * mean(gw xhat))
template <typename Acc>
LOOM_ROUNDED_FN Acc norm_input_grad(NormKind kind, Acc gw, Acc xhat, Acc rstd, Acc mean_gw,
                                    Acc mean_gw_xhat) {
  const Acc centered = kind == NormKind::kLayerNorm ? rn_sub(gw, mean_gw) : gw;
  return rn_mul(rstd, rn_sub(centered, rn_mul(xhat, mean_gw_xhat)));
}

}  // namespace loom::kernels
