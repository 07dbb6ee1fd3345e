// The int8 quantization kernel (quantize.h): one warp per block of 256 values, lane l holding
// values l, l + 32, ..., l + 224 (coalesced loads), the block's max magnitude reduced across the
// warp by butterfly shuffles. Memory-bound: each value read once (plus its error) and written
// once as a code (plus its error). The fp32 operations use the _rn intrinsics so nvcc does not
// fuse them into FMAs, which would round differently from the host reference.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "common/launch.h"
#include "compression/quantize.h"

namespace loom::kernels {
namespace {

constexpr int kQuantThreads = 256;
constexpr int kPerLane = int(kQuantBlock / 32);

struct QuantizeArgs {
  const float* x;
  float* error;  // null: no feedback
  int8_t* codes;
  float* scales;
  int64_t blocks;
};

__device__ __forceinline__ float max_keeping_nan(float a, float b) {
  return (a > b || isnan(a)) ? a : b;
}

__global__ void __launch_bounds__(kQuantThreads) quantize_int8_kernel(const QuantizeArgs a) {
  const int lane = int(threadIdx.x) & 31;
  const int64_t warps = (int64_t(gridDim.x) * blockDim.x) / 32;
  for (int64_t b = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; b < a.blocks;
       b += warps) {
    const int64_t base = b * kQuantBlock + lane;
    float v[kPerLane];
    float amax = 0.0f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int64_t i = base + 32 * j;
      v[j] = a.error != nullptr ? __fadd_rn(a.x[i], a.error[i]) : a.x[i];
      amax = max_keeping_nan(fabsf(v[j]), amax);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
      amax = max_keeping_nan(__shfl_xor_sync(0xffffffffu, amax, offset), amax);
    const float scale = __fdiv_rn(amax, 127.0f);
    const bool finite = isfinite(scale);
    const float divisor = finite && scale > 0.0f ? scale : 1.0f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int64_t i = base + 32 * j;
      const float q = rintf(__fdiv_rn(v[j], divisor));
      const float code = finite ? fminf(fmaxf(q, -127.0f), 127.0f) : 0.0f;
      a.codes[i] = int8_t(code);
      if (a.error != nullptr) a.error[i] = finite ? __fsub_rn(v[j], __fmul_rn(code, scale)) : 0.0f;
    }
    if (lane == 0) a.scales[b] = scale;
  }
}

}  // namespace

Status quantize_int8_apply(const float* x, float* error, int8_t* codes, float* scales, int64_t n,
                           cudaStream_t stream, int64_t max_blocks) {
  if (Status s = quantize_int8_check(n); !s.ok()) return s;
  const int64_t blocks = n / kQuantBlock;
  if (blocks == 0) return Status::success();
  if (x == nullptr || codes == nullptr || scales == nullptr)
    return Status::invalid_argument("quantize_int8: x, codes and scales must not be null");
  const int64_t grid = blocks_for_warps(blocks, kQuantThreads, max_blocks);
  quantize_int8_kernel<<<unsigned(grid), kQuantThreads, 0, stream>>>(
      QuantizeArgs{x, error, codes, scales, blocks});
  return launch_status("quantize_int8");
}

}  // namespace loom::kernels
