// The fused add + norm kernels (add_norm.h). Memory-bound: forward reads the residual and the
// branch once and writes the sum and the normed activation once (the statistics passes re-read
// the row this warp just wrote, from L1/L2); backward reads the sum, grad_normed and grad_sum and
// writes grad_input (and grad_branch); the weight kernel reads the sum and grad_normed once more.
// One warp a row: GPT-2's 768 columns are 24 per lane, Llama 3 8B's 4096 are 128.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "common/element_convert.cuh"
#include "common/launch.h"
#include "norm/add_norm.h"
#include "norm/add_norm_math.h"

namespace loom::kernels {
namespace {

constexpr int kWarpsPerBlock = kAddNormThreads / 32;

// The sum over the warp's lanes, left in every lane (each step adds the partner's value: the
// same two operands in every pair, so every lane rounds the same sum).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    v = rn_add(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Each kernel's one argument (the emulation launches kernels of one parameter): the rows and the
// call's pointers, as the caller gave them.
template <typename Args>
struct Launch {
  NormRows rows;
  Args args;
};

template <typename T>
__global__ void __launch_bounds__(kAddNormThreads)
    add_norm_forward_kernel(const Launch<AddNormForwardArgs<float>> launch) {
  const NormRows& r = launch.rows;
  const AddNormForwardArgs<float>& a = launch.args;
  const int lane = int(threadIdx.x) & 31;
  const bool layer = r.kind == NormKind::kLayerNorm;
  const float width = float(r.width);
  const int64_t stride = int64_t(gridDim.x) * kWarpsPerBlock;
  for (int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5); row < r.rows;
       row += stride) {
    const int64_t base = row * r.width;
    const T* branch = a.branch ? static_cast<const T*>(a.branch) + base : nullptr;
    // The norm's input: the sum this warp writes, or the residual when nothing is added.
    const float* in = branch ? a.sum + base : a.residual + base;
    float first = 0.0f;
    for (int64_t j = lane; j < r.width; j += 32) {
      float v = a.residual[base + j];
      if (branch) {
        v = rn_add(v, widen(branch[j]));
        a.sum[base + j] = v;
      }
      first = rn_add(first, layer ? v : rn_mul(v, v));
    }
    first = warp_sum(first);
    float mean = 0.0f, moment = first;
    if (layer) {
      mean = rn_div(first, width);
      moment = 0.0f;
      for (int64_t j = lane; j < r.width; j += 32) {
        const float d = rn_sub(in[j], mean);
        moment = rn_add(moment, rn_mul(d, d));
      }
      moment = warp_sum(moment);
    }
    const float rstd = norm_rstd(moment, width, a.eps);
    T* normed = static_cast<T*>(a.normed) + base;
    for (int64_t j = lane; j < r.width; j += 32)
      narrow(&normed[j], norm_output(norm_xhat(r.kind, in[j], mean, rstd), a.weight[j],
                                     a.bias != nullptr, a.bias ? a.bias[j] : 0.0f));
    if (lane == 0) {
      if (a.mean) a.mean[row] = mean;
      a.rstd[row] = rstd;
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kAddNormThreads)
    add_norm_backward_kernel(const Launch<AddNormBackwardArgs<float>> launch) {
  const NormRows& r = launch.rows;
  const AddNormBackwardArgs<float>& a = launch.args;
  const int lane = int(threadIdx.x) & 31;
  const bool layer = r.kind == NormKind::kLayerNorm;
  const float width = float(r.width);
  const int64_t stride = int64_t(gridDim.x) * kWarpsPerBlock;
  for (int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5); row < r.rows;
       row += stride) {
    const int64_t base = row * r.width;
    const float* in = a.sum + base;
    const T* g = static_cast<const T*>(a.grad_normed) + base;
    const float mean = layer ? a.mean[row] : 0.0f, rstd = a.rstd[row];
    float sum_gw = 0.0f, sum_gw_xhat = 0.0f;
    for (int64_t j = lane; j < r.width; j += 32) {
      const float gw = rn_mul(widen(g[j]), a.weight[j]);
      sum_gw = rn_add(sum_gw, gw);
      sum_gw_xhat = rn_add(sum_gw_xhat, rn_mul(gw, norm_xhat(r.kind, in[j], mean, rstd)));
    }
    const float mean_gw = layer ? rn_div(warp_sum(sum_gw), width) : 0.0f;
    const float mean_gw_xhat = rn_div(warp_sum(sum_gw_xhat), width);
    T* grad_branch = a.grad_branch ? static_cast<T*>(a.grad_branch) + base : nullptr;
    for (int64_t j = lane; j < r.width; j += 32) {
      const float gw = rn_mul(widen(g[j]), a.weight[j]);
      float dx = norm_input_grad(r.kind, gw, norm_xhat(r.kind, in[j], mean, rstd), rstd, mean_gw,
                                 mean_gw_xhat);
      if (a.grad_sum) dx = rn_add(a.grad_sum[base + j], dx);
      a.grad_input[base + j] = dx;
      if (grad_branch) narrow(&grad_branch[j], dx);
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kAddNormThreads)
    norm_weight_grad_kernel(const Launch<NormWeightGradArgs<float>> launch) {
  const NormRows& r = launch.rows;
  const NormWeightGradArgs<float>& a = launch.args;
  const int64_t col = int64_t(blockIdx.x) * kAddNormThreads + threadIdx.x;
  if (col >= r.width) return;  // no barrier below
  const bool layer = r.kind == NormKind::kLayerNorm;
  const int64_t per = (r.rows + a.slices - 1) / a.slices;
  const T* g = static_cast<const T*>(a.grad_normed);
  for (int64_t slice = blockIdx.y; slice < a.slices; slice += gridDim.y) {
    const int64_t end = (slice + 1) * per < r.rows ? (slice + 1) * per : r.rows;
    float gw = 0.0f, gb = 0.0f;
    for (int64_t row = slice * per; row < end; ++row) {
      const int64_t i = row * r.width + col;
      const float gn = widen(g[i]);
      const float xhat = norm_xhat(r.kind, a.sum[i], layer ? a.mean[row] : 0.0f, a.rstd[row]);
      gw = rn_add(gw, rn_mul(gn, xhat));
      gb = rn_add(gb, gn);
    }
    a.weight_partial[slice * r.width + col] = gw;
    if (a.bias_partial) a.bias_partial[slice * r.width + col] = gb;
  }
}

unsigned row_grid(int64_t rows, int64_t max_blocks) {
  const int64_t blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  return unsigned(
      std::max<int64_t>(1, std::min<int64_t>(blocks, max_blocks > 0 ? max_blocks : 65535)));
}

Status device_rows(const NormRows& r) {
  if (r.io == ElementDtype::kFloat64)
    return Status::invalid_argument(
        "add_norm kernel: takes fp32, fp16 or bf16 io; fp64 runs on the host reference");
  return norm_rows_check(r);
}

}  // namespace

Status add_norm_forward_apply(const NormRows& r, const AddNormForwardArgs<float>& a,
                              cudaStream_t stream, int64_t max_blocks) {
  if (Status s = device_rows(r); !s.ok()) return s;
  if (Status s = add_norm_forward_check(r, a); !s.ok()) return s;
  if (r.rows == 0) return Status::success();
  return by_element_type(r.io, "add_norm", [&](auto element) {
    using T = decltype(element);
    const Launch<AddNormForwardArgs<float>> launch{r, a};
    add_norm_forward_kernel<T>
        <<<row_grid(r.rows, max_blocks), kAddNormThreads, 0, stream>>>(launch);
    return launch_status("add_norm_forward");
  });
}

Status add_norm_backward_apply(const NormRows& r, const AddNormBackwardArgs<float>& a,
                               cudaStream_t stream, int64_t max_blocks) {
  if (Status s = device_rows(r); !s.ok()) return s;
  if (Status s = add_norm_backward_check(r, a); !s.ok()) return s;
  if (r.rows == 0) return Status::success();
  return by_element_type(r.io, "add_norm", [&](auto element) {
    using T = decltype(element);
    const Launch<AddNormBackwardArgs<float>> launch{r, a};
    add_norm_backward_kernel<T>
        <<<row_grid(r.rows, max_blocks), kAddNormThreads, 0, stream>>>(launch);
    return launch_status("add_norm_backward");
  });
}

Status norm_weight_grad_apply(const NormRows& r, const NormWeightGradArgs<float>& a,
                              cudaStream_t stream) {
  if (Status s = device_rows(r); !s.ok()) return s;
  if (Status s = norm_weight_grad_check(r, a); !s.ok()) return s;
  const dim3 grid(unsigned((r.width + kAddNormThreads - 1) / kAddNormThreads),
                  unsigned(std::min<int64_t>(a.slices, 65535)));
  return by_element_type(r.io, "add_norm", [&](auto element) {
    using T = decltype(element);
    const Launch<NormWeightGradArgs<float>> launch{r, a};
    norm_weight_grad_kernel<T><<<grid, kAddNormThreads, 0, stream>>>(launch);
    return launch_status("norm_weight_grad");
  });
}

}  // namespace loom::kernels
