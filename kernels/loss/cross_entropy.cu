// The fused cross-entropy kernels (cross_entropy.h): one CUDA block of 256 threads per row.
// Memory-bound: the stats pass reads each logit once, the grad pass reads it once and writes its
// gradient once (in place when the caller passes the logits as the gradient buffer); both move
// 16-byte vectors when the rows are 16-byte aligned. A row of the GPT-2 vocabulary (50257 bf16
// logits, 100 KB) gives each thread about 200 values.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "common/element_convert.cuh"
#include "common/launch.h"
#include "loss/cross_entropy.h"
#include "loss/cross_entropy_math.h"

namespace loom::kernels {
namespace {

constexpr int kWarps = kCrossEntropyThreads / 32;

// kChunk consecutive elements, moved as one 16-byte access when kChunk > 1.
template <typename T, int kChunk>
struct Chunk {
  T v[kChunk];
};

template <typename T, int kChunk>
__device__ __forceinline__ Chunk<T, kChunk> load_chunk(const T* p) {
  Chunk<T, kChunk> c;
  if constexpr (kChunk == 1) {
    c.v[0] = *p;
  } else {
    static_assert(sizeof(Chunk<T, kChunk>) == 16, "a vector chunk is 16 bytes");
    const uint4 bits = *reinterpret_cast<const uint4*>(p);
    memcpy(&c, &bits, 16);
  }
  return c;
}

template <typename T, int kChunk>
__device__ __forceinline__ void store_chunk(T* p, const Chunk<T, kChunk>& c) {
  if constexpr (kChunk == 1) {
    *p = c.v[0];
  } else {
    uint4 bits;
    memcpy(&bits, &c, 16);
    *reinterpret_cast<uint4*>(p) = bits;
  }
}

__device__ __forceinline__ SoftmaxPartial<float> warp_combine(SoftmaxPartial<float> p) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const SoftmaxPartial<float> other{__shfl_xor_sync(0xffffffffu, p.max, offset),
                                      __shfl_xor_sync(0xffffffffu, p.sum, offset)};
    p = softmax_combine(p, other);
  }
  return p;
}

// The stats kernel's one argument: the rows as the caller described them, and its outputs.
struct StatsArgs {
  CrossEntropyRows rows;
  CrossEntropyStats<float> out;
};

template <typename T, int kChunk>
__global__ void __launch_bounds__(kCrossEntropyThreads)
    cross_entropy_stats_kernel(const StatsArgs a) {
  const CrossEntropyRows& r = a.rows;
  extern __shared__ __align__(16) unsigned char stats_smem[];
  auto* warp_partials = reinterpret_cast<SoftmaxPartial<float>*>(stats_smem);
  const int lane = int(threadIdx.x) & 31, warp = int(threadIdx.x) >> 5;
  const int64_t chunks = (r.valid + kChunk - 1) / kChunk;
  for (int64_t row = blockIdx.x; row < r.rows; row += gridDim.x) {
    const T* x = static_cast<const T*>(r.logits) + row * r.ld;
    SoftmaxPartial<float> p{-INFINITY, 0.0f};
    for (int64_t k = threadIdx.x; k < chunks; k += kCrossEntropyThreads) {
      const Chunk<T, kChunk> c = load_chunk<T, kChunk>(x + k * kChunk);
#pragma unroll
      for (int j = 0; j < kChunk; ++j)
        if (k * kChunk + j < r.valid) softmax_add(p, widen(c.v[j]));
    }
    p = warp_combine(p);
    if (lane == 0) warp_partials[warp] = p;
    __syncthreads();
    if (warp == 0) {
      SoftmaxPartial<float> q =
          lane < kWarps ? warp_partials[lane] : SoftmaxPartial<float>{-INFINITY, 0.0f};
      q = warp_combine(q);
      if (lane == 0) {
        const int64_t target = r.targets[row];
        const int64_t local = target - r.col_offset;
        const bool here = target != r.ignore_index && local >= 0 && local < r.valid;
        a.out.row_max[row] = q.max;
        a.out.row_sum[row] = q.sum;
        a.out.target_logit[row] = here ? widen(x[local]) : 0.0f;
        a.out.target_found[row] = here ? 1.0f : 0.0f;
      }
    }
    // The next row's partials overwrite warp_partials only after warp 0 has read them.
    __syncthreads();
  }
}

template <typename T>
struct GradArgs {
  const T* logits;
  T* grad;
  const int64_t* targets;
  int64_t rows, ld, valid, col_offset, ignore_index;
  const float* lse;
  const float* scale;
  float z_loss;
};

template <typename T, int kChunk>
__global__ void __launch_bounds__(kCrossEntropyThreads)
    cross_entropy_grad_kernel(const GradArgs<T> a) {
  const float scale = *a.scale;
  const int64_t chunks = a.ld / kChunk;  // the launch checks kChunk divides ld
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const T* x = a.logits + row * a.ld;
    T* g = a.grad + row * a.ld;
    const int64_t target = a.targets[row];
    const bool ignored = target == a.ignore_index;
    const float lse = ignored ? 0.0f : a.lse[row];
    const float factor = cross_entropy_grad_factor(lse, a.z_loss);
    const int64_t local = target - a.col_offset;
    for (int64_t k = threadIdx.x; k < chunks; k += kCrossEntropyThreads) {
      Chunk<T, kChunk> c = load_chunk<T, kChunk>(x + k * kChunk);
#pragma unroll
      for (int j = 0; j < kChunk; ++j) {
        const int64_t col = k * kChunk + j;
        const float v =
            !ignored && col < a.valid
                ? cross_entropy_grad_value(widen(c.v[j]), lse, factor, col == local, scale)
                : 0.0f;
        narrow(&c.v[j], v);
      }
      store_chunk<T, kChunk>(g + k * kChunk, c);
    }
  }
}

int64_t grid_for(int64_t rows, int64_t max_blocks) {
  return std::max<int64_t>(1, std::min<int64_t>(rows, max_blocks > 0 ? max_blocks : 65535));
}

template <typename T>
Status launch_stats(const CrossEntropyRows& r, const CrossEntropyStats<float>& out,
                    cudaStream_t stream, int64_t max_blocks) {
  const StatsArgs a{r, out};
  const unsigned grid = unsigned(grid_for(r.rows, max_blocks));
  const size_t smem = kWarps * sizeof(SoftmaxPartial<float>);
  constexpr int kVector = int(16 / sizeof(T));
  if (cross_entropy_chunk(r) > 1)
    cross_entropy_stats_kernel<T, kVector><<<grid, kCrossEntropyThreads, smem, stream>>>(a);
  else
    cross_entropy_stats_kernel<T, 1><<<grid, kCrossEntropyThreads, smem, stream>>>(a);
  return launch_status("cross_entropy_stats");
}

template <typename T>
Status launch_grad(const CrossEntropyRows& r, const CrossEntropyGradArgs<float>& args,
                   cudaStream_t stream, int64_t max_blocks) {
  const GradArgs<T> a{static_cast<const T*>(r.logits),
                      static_cast<T*>(args.grad),
                      r.targets,
                      r.rows,
                      r.ld,
                      r.valid,
                      r.col_offset,
                      r.ignore_index,
                      args.lse,
                      args.scale,
                      args.z_loss};
  const unsigned grid = unsigned(grid_for(r.rows, max_blocks));
  // Vector accesses need the gradient buffer aligned as well as the logits.
  const bool vector =
      cross_entropy_chunk(r) > 1 && reinterpret_cast<uintptr_t>(args.grad) % 16 == 0;
  constexpr int kVector = int(16 / sizeof(T));
  if (vector)
    cross_entropy_grad_kernel<T, kVector><<<grid, kCrossEntropyThreads, 0, stream>>>(a);
  else
    cross_entropy_grad_kernel<T, 1><<<grid, kCrossEntropyThreads, 0, stream>>>(a);
  return launch_status("cross_entropy_grad");
}

Status device_dtype(const CrossEntropyRows& r) {
  if (r.dtype == LogitsDtype::kFloat64)
    return Status::invalid_argument(
        "cross_entropy kernel: takes fp32, fp16 or bf16 logits; fp64 runs on the host reference");
  return cross_entropy_check(r);
}

}  // namespace

Status cross_entropy_stats_apply(const CrossEntropyRows& r, const CrossEntropyStats<float>& out,
                                 cudaStream_t stream, int64_t max_blocks) {
  if (Status s = device_dtype(r); !s.ok()) return s;
  if (r.rows == 0) return Status::success();
  if (!out.row_max || !out.row_sum || !out.target_logit || !out.target_found)
    return Status::invalid_argument("cross_entropy stats: an output pointer is null");
  return by_element_type(r.dtype, "cross_entropy", [&](auto element) {
    return launch_stats<decltype(element)>(r, out, stream, max_blocks);
  });
}

Status cross_entropy_grad_apply(const CrossEntropyRows& r, const CrossEntropyGradArgs<float>& args,
                                cudaStream_t stream, int64_t max_blocks) {
  if (Status s = device_dtype(r); !s.ok()) return s;
  if (r.rows == 0) return Status::success();
  if (!args.lse || !args.scale || !args.grad)
    return Status::invalid_argument("cross_entropy grad: lse, scale and grad must not be null");
  return by_element_type(r.dtype, "cross_entropy", [&](auto element) {
    return launch_grad<decltype(element)>(r, args, stream, max_blocks);
  });
}

}  // namespace loom::kernels
