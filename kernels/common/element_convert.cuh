#pragma once
// Device-side element conversions: a stored element widened to float, a float rounded to the
// element type (to nearest, ties to even) and stored.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace loom::kernels {

__device__ __forceinline__ float widen(float v) {
  return v;
}
__device__ __forceinline__ float widen(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
__device__ __forceinline__ float widen(__half v) {
  return __half2float(v);
}
__device__ __forceinline__ void narrow(float* p, float v) {
  *p = v;
}
__device__ __forceinline__ void narrow(__nv_bfloat16* p, float v) {
  *p = __float2bfloat16_rn(v);
}
__device__ __forceinline__ void narrow(__half* p, float v) {
  *p = __float2half_rn(v);
}

}  // namespace loom::kernels
