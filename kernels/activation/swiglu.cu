// The fused SwiGLU kernels (swiglu.h). Memory-bound: forward reads gate and up once and writes
// out once (3 tensors of n elements, against 5 for silu then a product); backward reads gate, up
// and grad_out once and writes both gradients once (5, against about 10 for PyTorch's silu,
// product and silu_backward kernels).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "activation/swiglu.h"
#include "activation/swiglu_math.h"
#include "common/element_convert.cuh"
#include "common/launch.h"

namespace loom::kernels {
namespace {

// 16 bytes of elements: one vector load or store.
template <typename T>
struct alignas(16) Pack {
  T v[16 / sizeof(T)];
};

// Each kernel's one argument (the emulation launches kernels of one parameter): the shape, the
// call's pointers, and whether every pointer is 16-byte aligned (the pack loop runs only then).
template <typename Args>
struct Launch {
  SwigluShape shape;
  Args args;
  bool aligned;
};

template <typename T>
__device__ __forceinline__ void forward_one(const T* gate, const T* up, T* out, int64_t i) {
  narrow(out + i, swiglu_forward_value(widen(gate[i]), widen(up[i])));
}

template <typename T>
__global__ void __launch_bounds__(kSwigluThreads)
    swiglu_forward_kernel(const Launch<SwigluForwardArgs> launch) {
  constexpr int kPack = 16 / sizeof(T);
  const int64_t n = launch.shape.n;
  const T* gate = static_cast<const T*>(launch.args.gate);
  const T* up = static_cast<const T*>(launch.args.up);
  T* out = static_cast<T*>(launch.args.out);
  const int64_t thread = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t packs = launch.aligned ? n / kPack : 0;
  for (int64_t p = thread; p < packs; p += stride) {
    const Pack<T> g = reinterpret_cast<const Pack<T>*>(gate)[p];
    const Pack<T> u = reinterpret_cast<const Pack<T>*>(up)[p];
    Pack<T> h;
#pragma unroll
    for (int j = 0; j < kPack; ++j)
      narrow(&h.v[j], swiglu_forward_value(widen(g.v[j]), widen(u.v[j])));
    reinterpret_cast<Pack<T>*>(out)[p] = h;
  }
  for (int64_t i = packs * kPack + thread; i < n; i += stride) forward_one(gate, up, out, i);
}

template <typename T>
__device__ __forceinline__ void backward_one(const T* gate, const T* up, const T* grad_out,
                                             T* grad_gate, T* grad_up, int64_t i) {
  float dg, du;
  swiglu_backward_value(widen(gate[i]), widen(up[i]), widen(grad_out[i]), &dg, &du);
  narrow(grad_gate + i, dg);
  narrow(grad_up + i, du);
}

template <typename T>
__global__ void __launch_bounds__(kSwigluThreads)
    swiglu_backward_kernel(const Launch<SwigluBackwardArgs> launch) {
  constexpr int kPack = 16 / sizeof(T);
  const int64_t n = launch.shape.n;
  const SwigluBackwardArgs& a = launch.args;
  const T* gate = static_cast<const T*>(a.gate);
  const T* up = static_cast<const T*>(a.up);
  const T* grad_out = static_cast<const T*>(a.grad_out);
  T* grad_gate = static_cast<T*>(a.grad_gate);
  T* grad_up = static_cast<T*>(a.grad_up);
  const int64_t thread = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t packs = launch.aligned ? n / kPack : 0;
  for (int64_t p = thread; p < packs; p += stride) {
    // Every operand's pack is read before either gradient is stored (grad_gate may alias
    // grad_out).
    const Pack<T> g = reinterpret_cast<const Pack<T>*>(gate)[p];
    const Pack<T> u = reinterpret_cast<const Pack<T>*>(up)[p];
    const Pack<T> dh = reinterpret_cast<const Pack<T>*>(grad_out)[p];
    Pack<T> dg, du;
#pragma unroll
    for (int j = 0; j < kPack; ++j) {
      float dgj, duj;
      swiglu_backward_value(widen(g.v[j]), widen(u.v[j]), widen(dh.v[j]), &dgj, &duj);
      narrow(&dg.v[j], dgj);
      narrow(&du.v[j], duj);
    }
    reinterpret_cast<Pack<T>*>(grad_gate)[p] = dg;
    reinterpret_cast<Pack<T>*>(grad_up)[p] = du;
  }
  for (int64_t i = packs * kPack + thread; i < n; i += stride)
    backward_one(gate, up, grad_out, grad_gate, grad_up, i);
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// Blocks for n elements in packs of 16 bytes, at most max_blocks (<= 0: 65535), at least 1.
unsigned grid_for(int64_t n, int64_t element_bytes, int64_t max_blocks) {
  const int64_t work = (n * element_bytes + 15) / 16;
  const int64_t blocks = (work + kSwigluThreads - 1) / kSwigluThreads;
  return unsigned(
      std::max<int64_t>(1, std::min<int64_t>(blocks, max_blocks > 0 ? max_blocks : 65535)));
}

Status device_shape(const SwigluShape& s) {
  if (s.io == ElementDtype::kFloat64)
    return Status::invalid_argument(
        "swiglu kernel: takes fp32, fp16 or bf16 io; fp64 runs on the host reference");
  return Status::success();
}

}  // namespace

Status swiglu_forward_apply(const SwigluShape& s, const SwigluForwardArgs& a, cudaStream_t stream,
                            int64_t max_blocks) {
  if (Status st = device_shape(s); !st.ok()) return st;
  if (Status st = swiglu_forward_check(s, a); !st.ok()) return st;
  if (s.n == 0) return Status::success();
  const bool aligned = aligned16(a.gate) && aligned16(a.up) && aligned16(a.out);
  return by_element_type(s.io, "swiglu", [&](auto element) {
    using T = decltype(element);
    const Launch<SwigluForwardArgs> launch{s, a, aligned};
    swiglu_forward_kernel<T>
        <<<grid_for(s.n, sizeof(T), max_blocks), kSwigluThreads, 0, stream>>>(launch);
    return launch_status("swiglu_forward");
  });
}

Status swiglu_backward_apply(const SwigluShape& s, const SwigluBackwardArgs& a, cudaStream_t stream,
                             int64_t max_blocks) {
  if (Status st = device_shape(s); !st.ok()) return st;
  if (Status st = swiglu_backward_check(s, a); !st.ok()) return st;
  if (s.n == 0) return Status::success();
  const bool aligned = aligned16(a.gate) && aligned16(a.up) && aligned16(a.grad_out) &&
                       aligned16(a.grad_gate) && aligned16(a.grad_up);
  return by_element_type(s.io, "swiglu", [&](auto element) {
    using T = decltype(element);
    const Launch<SwigluBackwardArgs> launch{s, a, aligned};
    swiglu_backward_kernel<T>
        <<<grid_for(s.n, sizeof(T), max_blocks), kSwigluThreads, 0, stream>>>(launch);
    return launch_status("swiglu_backward");
  });
}

}  // namespace loom::kernels
