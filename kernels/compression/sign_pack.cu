// The sign compression kernels (sign_pack.h). Pack: one warp per block of 1024 values, lane l
// holding values l, l + 32, ..., l + 992 (coalesced loads), the block's magnitude sum reduced
// across the warp by butterfly shuffles; word j is the ballot of the lanes' j-th values, kept by
// lane j so that the 32 words leave in one coalesced store. Unpack: the same layout, each lane
// reading the block's words in turn (a broadcast) and writing its bit of each as a value.
// Memory-bound: pack reads each value (and its error) once and writes a bit (and the error);
// unpack reads a bit and writes a value. The fp32 operations use the _rn intrinsics so that nvcc
// fuses nothing the host reference rounds separately.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "common/launch.h"
#include "compression/sign_pack.h"

namespace loom::kernels {
namespace {

constexpr int kSignThreads = 256;
constexpr int kPerLane = int(kSignWordsPerBlock);

struct PackArgs {
  const float* x;
  float* error;  // null: no feedback
  uint32_t* words;
  float* scales;
  int64_t blocks;
};

struct UnpackArgs {
  const uint32_t* words;
  const float* scales;
  float* out;
  int64_t blocks;
};

__global__ void __launch_bounds__(kSignThreads) sign_pack_kernel(const PackArgs a) {
  const int lane = int(threadIdx.x) & 31;
  const int64_t warps = (int64_t(gridDim.x) * blockDim.x) / 32;
  for (int64_t b = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; b < a.blocks;
       b += warps) {
    const int64_t base = b * kSignBlock + lane;
    float v[kPerLane];
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int64_t i = base + 32 * j;
      v[j] = a.error != nullptr ? __fadd_rn(a.x[i], a.error[i]) : a.x[i];
      sum = __fadd_rn(sum, fabsf(v[j]));
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
      sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, offset));
    const float scale = __fdiv_rn(sum, float(kSignBlock));
    const bool finite = isfinite(scale);
    uint32_t my_word = 0;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const bool positive = !(v[j] < 0.0f);
      const uint32_t word = __ballot_sync(0xffffffffu, positive);
      if (lane == j) my_word = word;
      if (a.error != nullptr)
        a.error[base + 32 * j] = finite ? __fsub_rn(v[j], positive ? scale : -scale) : 0.0f;
    }
    a.words[b * kSignWordsPerBlock + lane] = my_word;
    if (lane == 0) a.scales[b] = scale;
  }
}

__global__ void __launch_bounds__(kSignThreads) sign_unpack_kernel(const UnpackArgs a) {
  const int lane = int(threadIdx.x) & 31;
  const int64_t warps = (int64_t(gridDim.x) * blockDim.x) / 32;
  for (int64_t b = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; b < a.blocks;
       b += warps) {
    const float scale = a.scales[b];
    const int64_t base = b * kSignBlock + lane;
#pragma unroll 4
    for (int j = 0; j < kPerLane; ++j) {
      const uint32_t word = a.words[b * kSignWordsPerBlock + j];
      a.out[base + 32 * j] = (word >> lane) & 1u ? scale : -scale;
    }
  }
}

}  // namespace

Status sign_pack_apply(const float* x, float* error, uint32_t* words, float* scales, int64_t n,
                       cudaStream_t stream, int64_t max_blocks) {
  if (Status s = sign_pack_check(n); !s.ok()) return s;
  const int64_t blocks = n / kSignBlock;
  if (blocks == 0) return Status::success();
  if (x == nullptr || words == nullptr || scales == nullptr)
    return Status::invalid_argument("sign_pack: x, words and scales must not be null");
  const auto grid = unsigned(blocks_for_warps(blocks, kSignThreads, max_blocks));
  sign_pack_kernel<<<grid, kSignThreads, 0, stream>>>(PackArgs{x, error, words, scales, blocks});
  return launch_status("sign_pack");
}

Status sign_unpack_apply(const uint32_t* words, const float* scales, float* out, int64_t n,
                         cudaStream_t stream, int64_t max_blocks) {
  if (Status s = sign_pack_check(n); !s.ok()) return s;
  const int64_t blocks = n / kSignBlock;
  if (blocks == 0) return Status::success();
  if (words == nullptr || scales == nullptr || out == nullptr)
    return Status::invalid_argument("sign_unpack: words, scales and out must not be null");
  const auto grid = unsigned(blocks_for_warps(blocks, kSignThreads, max_blocks));
  sign_unpack_kernel<<<grid, kSignThreads, 0, stream>>>(UnpackArgs{words, scales, out, blocks});
  return launch_status("sign_unpack");
}

}  // namespace loom::kernels
