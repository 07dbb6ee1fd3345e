// PowerSGD's orthogonalisation kernel (orthogonalize.h): one CUDA block per matrix, thread t
// owning rows t, t + 256, ... For each column i the block first forms every dot product of column
// i with the columns j >= i (each thread's partial sums, a butterfly within each warp, the warps'
// sums through shared memory), then each thread updates its own rows: the projections removed
// from the later columns, column i divided by its norm. A thread touches only its own rows of
// the matrix, so the two barriers per column guard the shared sums alone. The matrices are small
// (PowerSGD's P: rows x rank, rank <= 32), so this favours a simple order of summation that the
// host reference repeats over coalescing; the fp32 operations use the _rn intrinsics so that
// nvcc fuses nothing the reference rounds separately.
#include <cuda_runtime.h>

#include <algorithm>

#include "common/launch.h"
#include "compression/orthogonalize.h"

namespace loom::kernels {
namespace {

constexpr int kWarps = kOrthoThreads / 32;

struct OrthoArgs {
  float* data;
  const int64_t* offsets;
  const int64_t* rows;
  int rank;
  int64_t matrices;
};

// The sum of the 8 warps' partial sums of column j, in warp order.
__device__ __forceinline__ float block_total(const float* partial, int j) {
  float total = partial[j];
  for (int w = 1; w < kWarps; ++w) total = __fadd_rn(total, partial[w * kMaxOrthoRank + j]);
  return total;
}

__global__ void __launch_bounds__(kOrthoThreads) orthogonalize_kernel(const OrthoArgs a) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* partial = reinterpret_cast<float*>(smem_raw);  // [kWarps][kMaxOrthoRank]
  const int tid = int(threadIdx.x), lane = tid & 31, warp = tid >> 5;
  const int r = a.rank;
  for (int64_t m = blockIdx.x; m < a.matrices; m += gridDim.x) {
    float* p = a.data + a.offsets[m];
    const int64_t n = a.rows[m];
    for (int i = 0; i < r; ++i) {
      for (int j = i; j < r; ++j) {
        float sum = 0.0f;
        for (int64_t k = tid; k < n; k += kOrthoThreads)
          sum = __fmaf_rn(p[k * r + i], p[k * r + j], sum);
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1)
          sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, offset));
        if (lane == 0) partial[warp * kMaxOrthoRank + j] = sum;
      }
      __syncthreads();
      const float norm2 = block_total(partial, i);
      if (norm2 != 0.0f) {
        for (int j = i + 1; j < r; ++j) {
          const float coef = __fdiv_rn(block_total(partial, j), norm2);
          for (int64_t k = tid; k < n; k += kOrthoThreads)
            p[k * r + j] = __fmaf_rn(-coef, p[k * r + i], p[k * r + j]);
        }
        const float norm = __fsqrt_rn(norm2);
        for (int64_t k = tid; k < n; k += kOrthoThreads)
          p[k * r + i] = __fdiv_rn(p[k * r + i], norm);
      }
      // The next column's sums overwrite `partial`: every thread must have read it.
      __syncthreads();
    }
  }
}

}  // namespace

Status orthogonalize_apply(float* data, const int64_t* offsets, const int64_t* rows, int64_t rank,
                           int64_t matrices, cudaStream_t stream, int64_t max_blocks) {
  if (Status s = orthogonalize_check(rank, matrices); !s.ok()) return s;
  if (matrices == 0) return Status::success();
  if (data == nullptr || offsets == nullptr || rows == nullptr)
    return Status::invalid_argument("orthogonalize: data, offsets and rows must not be null");
  const auto grid =
      unsigned(std::min<int64_t>(matrices, max_blocks > 0 ? max_blocks : int64_t(65535)));
  const size_t smem = size_t(kWarps) * kMaxOrthoRank * sizeof(float);
  orthogonalize_kernel<<<grid, kOrthoThreads, smem, stream>>>(
      OrthoArgs{data, offsets, rows, int(rank), matrices});
  return launch_status("orthogonalize");
}

}  // namespace loom::kernels
