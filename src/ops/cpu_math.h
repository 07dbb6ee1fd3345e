#pragma once
// Scalar math for loom's vectorised CPU kernels (src/ops/activation.cpp, cpu_attention_kernel.h):
// written as plain arithmetic on bits so that the loops calling it vectorise at every
// LOOM_CPU_CLONES level.
#include <cstdint>
#include <cstring>

#include "cpu_vectorize.h"

namespace loom::ops::cpu {

// 2^f for |f| <= 0.5, fp32: the Taylor coefficients (ln 2)^k / k!, k = 7 down to 0. A template
// so that a scalar and a GCC vector of floats (src/ops/cpu_attention_kernel.h) share it.
template <typename F>
inline F exp2_fraction_fp32(F f) {
  F p = f * 1.5252734e-5f + 1.5403530e-4f;
  p = p * f + 1.3333558e-3f;
  p = p * f + 9.6181291e-3f;
  p = p * f + 5.5504109e-2f;
  p = p * f + 2.4022651e-1f;
  p = p * f + 6.9314718e-1f;
  return p * f + 1.0f;
}

// 2^t for t in [-126, 126]: round t to n (the add/subtract of 1.5 * 2^23 rounds to nearest in
// fp32 and fp64 alike at these magnitudes), 2^(t - n) by a polynomial on [-0.5, 0.5], 2^n by
// writing the exponent bits. The Taylor series is cut after the term whose successor is below
// half an ulp at |f| = 0.5: degree 7 for fp32 (next term 6e-9), 12 for fp64 (next 1.7e-16).
inline float exp2_bounded(float t) {
  const float rounder = 12582912.0f;  // 1.5 * 2^23
  const float n = (t + rounder) - rounder;
  const float p = exp2_fraction_fp32(t - n);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

inline double exp2_bounded(double t) {
  const double rounder = 6755399441055744.0;  // 1.5 * 2^52
  const double n = (t + rounder) - rounder;
  const double f = t - n;
  // Taylor coefficients of 2^f = e^(f ln 2): (ln 2)^k / k!, k = 12 down to 0.
  constexpr double c[13] = {1.0,
                            0.69314718055994530942,
                            0.24022650695910071233,
                            0.05550410866482157995,
                            0.00961812910762847716,
                            0.00133335581464284434,
                            0.00015403530393381609,
                            1.5252733804059840e-05,
                            1.3215486790144307e-06,
                            1.0178086009239699e-07,
                            7.0549116208011233e-09,
                            4.4455382718708114e-10,
                            2.5678435993488202e-11};
  double p = c[12];
  for (int k = 11; k >= 0; --k) p = p * f + c[k];
  const int64_t bits = (static_cast<int64_t>(n) + 1023) << 52;
  double scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace loom::ops::cpu
