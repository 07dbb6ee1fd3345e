// The dropout kernel (dropout.h): one thread per group of four columns of a row, so that one
// Philox call serves the four elements it draws for. Memory-bound: each element is read once
// and written once; the mask itself is never stored.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "dropout/dropout.h"
#include "dropout/philox.h"

namespace loom::kernels {
namespace {

constexpr int kDropoutThreads = 256;

// Element type -> what the product is taken in, and back.
__device__ __forceinline__ float widen(float v) { return v; }
__device__ __forceinline__ double widen(double v) { return v; }
__device__ __forceinline__ float widen(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float widen(__half v) { return __half2float(v); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(double* p, double v) { *p = v; }
__device__ __forceinline__ void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16(v); }
__device__ __forceinline__ void store(__half* p, float v) { *p = __float2half(v); }

template <typename T>
using Widened = decltype(widen(T()));

template <typename T>
struct DropoutArgs {
  const T* x;  // null: write the mask
  T* y;
  DropoutParams p;
  int64_t first_group;  // the first group of four logical columns the local columns touch
  int64_t groups;       // groups per row
  int64_t rows;         // params.rows() (a host function)
};

template <typename T>
__global__ void __launch_bounds__(kDropoutThreads) dropout_kernel(const DropoutArgs<T> a) {
  using Acc = Widened<T>;
  const auto& n = a.p.size;
  const auto& o = a.p.offset;
  const Acc scale = Acc(a.p.scale);
  const int64_t total = a.rows * a.groups;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t row = i / a.groups;
    const int64_t group = a.first_group + i % a.groups;
    const int64_t i2 = row % n[2], i1 = row / n[2] % n[1], i0 = row / (n[1] * n[2]);
    const auto logical_row = uint32_t((i1 + o[1]) * a.p.logical[2] + (i2 + o[2]));
    const Philox4x32 draw = philox4x32_10(
        {{uint32_t(group), logical_row, uint32_t(i0 + o[0]), a.p.site}}, a.p.key[0], a.p.key[1]);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t c = group * 4 + j - o[3];
      if (c < 0 || c >= n[3]) continue;
      const bool keep = draw.v[j] >= a.p.drop_below;
      const int64_t e = row * n[3] + c;
      const Acc kept = a.x ? widen(a.x[e]) * scale : scale;
      store(a.y + e, keep ? kept : Acc(0));
    }
  }
}

template <typename T>
Status launch(const void* x, void* y, const DropoutParams& params, cudaStream_t stream,
              int64_t max_blocks) {
  DropoutArgs<T> a{static_cast<const T*>(x), static_cast<T*>(y), params, 0, 0, params.rows()};
  if (params.numel() == 0) return Status::success();
  a.first_group = params.offset[3] / 4;
  a.groups = (params.offset[3] + params.size[3] - 1) / 4 - a.first_group + 1;
  const int64_t threads_needed = params.rows() * a.groups;
  // Past 65535 blocks (enough to fill any GPU many times over) threads loop.
  const int64_t blocks = std::min<int64_t>((threads_needed + kDropoutThreads - 1) / kDropoutThreads,
                                           max_blocks > 0 ? max_blocks : 65535);
  dropout_kernel<T><<<unsigned(blocks), kDropoutThreads, 0, stream>>>(a);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return Status::cuda_error(std::string("dropout kernel launch: ") + cudaGetErrorString(e));
  return Status::success();
}

}  // namespace

Status dropout_apply(DropoutDtype dtype, const void* x, void* y, const DropoutParams& params,
                     cudaStream_t stream, int64_t max_blocks) {
  if (Status s = dropout_check(params); !s.ok()) return s;
  if (y == nullptr && params.numel() > 0) return Status::invalid_argument("dropout: y is null");
  switch (dtype) {
    case DropoutDtype::kFloat32:
      return launch<float>(x, y, params, stream, max_blocks);
    case DropoutDtype::kFloat64:
      return launch<double>(x, y, params, stream, max_blocks);
    case DropoutDtype::kBFloat16:
      return launch<__nv_bfloat16>(x, y, params, stream, max_blocks);
    case DropoutDtype::kFloat16:
      return launch<__half>(x, y, params, stream, max_blocks);
  }
  return Status::invalid_argument("dropout: unknown dtype " + std::to_string(int(dtype)));
}

}  // namespace loom::kernels
