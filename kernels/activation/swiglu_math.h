#pragma once
// The per-element arithmetic of the fused SwiGLU (swiglu.h), shared by the host references and
// the CUDA kernels so that both round the same operations in the same order
// (common/rounded_math.h).
#include "common/rounded_math.h"

namespace loom::kernels {

// s = 1 / (1 + exp(-g)): 0 for g far below 0 (exp overflows to inf), 1 far above.
template <typename Acc>
LOOM_ROUNDED_FN Acc swiglu_sigmoid(Acc g) {
  return rn_div(Acc(1), rn_add(Acc(1), exp_fn(-g)));
}

// silu(g) * u.
template <typename Acc>
LOOM_ROUNDED_FN Acc swiglu_forward_value(Acc g, Acc u) {
  return rn_mul(rn_mul(g, swiglu_sigmoid(g)), u);
}

// grad_up = dh * silu(g); grad_gate = dh * u * s * (1 + g * (1 - s)).
template <typename Acc>
LOOM_ROUNDED_FN void swiglu_backward_value(Acc g, Acc u, Acc dh, Acc* grad_gate, Acc* grad_up) {
  const Acc s = swiglu_sigmoid(g);
  *grad_up = rn_mul(dh, rn_mul(g, s));
  const Acc dsilu = rn_mul(s, rn_add(Acc(1), rn_mul(g, rn_sub(Acc(1), s))));
  *grad_gate = rn_mul(rn_mul(dh, u), dsilu);
}

}  // namespace loom::kernels
