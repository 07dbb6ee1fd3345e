#pragma once
// An fp32 value rounded to a 16-bit element type (round to nearest even), as the bits a kernel
// stores: the overload is chosen by a null pointer of the element type. For device code; the
// host compiler (the kernel emulation) takes the same functions from cuda_bf16.h / cuda_fp16.h.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace loom::kernels {

__device__ __forceinline__ uint16_t round_to(float v, __nv_bfloat16*) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(v));
}
__device__ __forceinline__ uint16_t round_to(float v, __half*) {
  return __half_as_ushort(__float2half_rn(v));
}

}  // namespace loom::kernels
