#pragma once
// Arithmetic that rounds each operation on its own, shared by a kernel and its host reference so
// that both round the same operations in the same order. In device code the _rn intrinsics keep
// nvcc from contracting a multiply and an add into an FMA; elsewhere (the host references, the
// kernel emulation, built with -ffp-contract=off) plain operators do the same. Host versions are
// templates: the references also run in double.
#include <cmath>

namespace loom::kernels {

#if defined(__CUDACC__)
#define LOOM_ROUNDED_FN __device__ __forceinline__
LOOM_ROUNDED_FN float rn_add(float a, float b) {
  return __fadd_rn(a, b);
}
LOOM_ROUNDED_FN float rn_sub(float a, float b) {
  return __fsub_rn(a, b);
}
LOOM_ROUNDED_FN float rn_mul(float a, float b) {
  return __fmul_rn(a, b);
}
LOOM_ROUNDED_FN float rn_div(float a, float b) {
  return __fdiv_rn(a, b);
}
LOOM_ROUNDED_FN float rn_sqrt(float a) {
  return __fsqrt_rn(a);
}
// Not correctly rounded (within 2 ulp); the emulation calls the host's libm, as the reference.
LOOM_ROUNDED_FN float exp_fn(float a) {
  return expf(a);
}
#else
#define LOOM_ROUNDED_FN inline
template <typename T>
T rn_add(T a, T b) {
  return a + b;
}
template <typename T>
T rn_sub(T a, T b) {
  return a - b;
}
template <typename T>
T rn_mul(T a, T b) {
  return a * b;
}
template <typename T>
T rn_div(T a, T b) {
  return a / b;
}
template <typename T>
T rn_sqrt(T a) {
  return std::sqrt(a);
}
template <typename T>
T exp_fn(T a) {
  return std::exp(a);
}
#endif

}  // namespace loom::kernels
