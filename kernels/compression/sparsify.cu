// The threshold-selection and scatter-add kernels (sparsify.h). Selection: one warp per chunk of
// 256 values, lane l holding values l, l + 32, ..., l + 224 (coalesced); for each group of 32 a
// ballot says which lanes selected, and a lane's slot is the chunk's offset plus the selected
// lanes below it, so the output is in ascending index order as on the host. Memory-bound: pass 1
// reads x and the error, pass 2 reads them again and writes the error and the few selected
// values. The sum uses __fadd_rn so that nvcc fuses nothing the host would round differently.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "common/launch.h"
#include "compression/sparsify.h"

namespace loom::kernels {
namespace {

constexpr int kSelectThreads = 256;
constexpr int kPerLane = int(kSelectChunk / 32);

struct SelectArgs {
  const float* x;
  float* error;
  int64_t n;
  float threshold;
  int32_t* counts;         // pass 1
  const int64_t* offsets;  // pass 2
  int64_t capacity;
  int32_t* indices;
  float* values;
  int64_t chunks;
};

__device__ __forceinline__ bool selected(float v, float threshold) {
  return !(fabsf(v) < threshold) && v != 0.0f;
}

__global__ void __launch_bounds__(kSelectThreads) select_count_kernel(const SelectArgs a) {
  const int lane = int(threadIdx.x) & 31;
  const int64_t warps = (int64_t(gridDim.x) * blockDim.x) / 32;
  for (int64_t c = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; c < a.chunks;
       c += warps) {
    int count = 0;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int64_t i = c * kSelectChunk + 32 * j + lane;
      const bool take = i < a.n && selected(__fadd_rn(a.x[i], a.error[i]), a.threshold);
      count += __popc(__ballot_sync(0xffffffffu, take));
    }
    if (lane == 0) a.counts[c] = count;
  }
}

__global__ void __launch_bounds__(kSelectThreads) select_write_kernel(const SelectArgs a) {
  const int lane = int(threadIdx.x) & 31;
  const unsigned lanes_below = (1u << lane) - 1u;
  const int64_t warps = (int64_t(gridDim.x) * blockDim.x) / 32;
  for (int64_t c = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; c < a.chunks;
       c += warps) {
    int64_t slot = a.offsets[c];
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int64_t i = c * kSelectChunk + 32 * j + lane;
      const bool inside = i < a.n;
      const float v = inside ? __fadd_rn(a.x[i], a.error[i]) : 0.0f;
      const bool take = inside && selected(v, a.threshold);
      const unsigned ballot = __ballot_sync(0xffffffffu, take);
      const int64_t mine = slot + __popc(ballot & lanes_below);
      if (inside) {
        if (take && mine < a.capacity) {
          a.indices[mine] = int32_t(i);
          a.values[mine] = v;
          a.error[i] = 0.0f;
        } else {
          a.error[i] = v;
        }
      }
      slot += __popc(ballot);
    }
  }
}

struct ScatterArgs {
  float* dense;
  int64_t n;
  const int32_t* indices;
  const float* values;
  int64_t m;
};

__global__ void __launch_bounds__(kSelectThreads) scatter_add_kernel(const ScatterArgs a) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < a.m; i += stride) {
    const int32_t at = a.indices[i];
    if (at >= 0 && at < a.n) a.dense[at] = __fadd_rn(a.dense[at], a.values[i]);
  }
}

}  // namespace

Status select_count_apply(const float* x, const float* error, int64_t n, float threshold,
                          int32_t* counts, cudaStream_t stream, int64_t max_blocks) {
  if (Status s = select_check(n, 0); !s.ok()) return s;
  const int64_t chunks = select_chunks(n);
  if (chunks == 0) return Status::success();
  if (x == nullptr || error == nullptr || counts == nullptr)
    return Status::invalid_argument("select_count: x, error and counts must not be null");
  const auto grid = unsigned(blocks_for_warps(chunks, kSelectThreads, max_blocks));
  select_count_kernel<<<grid, kSelectThreads, 0, stream>>>(SelectArgs{
      x, const_cast<float*>(error), n, threshold, counts, nullptr, 0, nullptr, nullptr, chunks});
  return launch_status("select_count");
}

Status select_write_apply(const float* x, float* error, int64_t n, float threshold,
                          const int64_t* offsets, int64_t capacity, int32_t* indices, float* values,
                          cudaStream_t stream, int64_t max_blocks) {
  if (Status s = select_check(n, capacity); !s.ok()) return s;
  const int64_t chunks = select_chunks(n);
  if (chunks == 0) return Status::success();
  if (x == nullptr || error == nullptr || offsets == nullptr ||
      (capacity > 0 && (indices == nullptr || values == nullptr)))
    return Status::invalid_argument(
        "select_write: x, error, offsets (and with a capacity, indices and values) must not be "
        "null");
  const auto grid = unsigned(blocks_for_warps(chunks, kSelectThreads, max_blocks));
  select_write_kernel<<<grid, kSelectThreads, 0, stream>>>(
      SelectArgs{x, error, n, threshold, nullptr, offsets, capacity, indices, values, chunks});
  return launch_status("select_write");
}

Status scatter_add_apply(float* dense, int64_t n, const int32_t* indices, const float* values,
                         int64_t m, cudaStream_t stream, int64_t max_blocks) {
  if (m == 0) return Status::success();
  if (dense == nullptr || indices == nullptr || values == nullptr)
    return Status::invalid_argument("scatter_add: dense, indices and values must not be null");
  const int64_t threads = kSelectThreads;
  const int64_t grid =
      std::min<int64_t>((m + threads - 1) / threads, max_blocks > 0 ? max_blocks : 65535);
  scatter_add_kernel<<<unsigned(grid), kSelectThreads, 0, stream>>>(
      ScatterArgs{dense, n, indices, values, m});
  return launch_status("scatter_add");
}

}  // namespace loom::kernels
