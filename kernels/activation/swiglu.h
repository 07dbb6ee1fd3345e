#pragma once
// SwiGLU, the activation of Llama's MLP, fused: one pass forward and one backward over n elements
// of the gate and up projections' outputs (one io dtype: bf16 under autocast), fp32 arithmetic,
// each result rounded once to io:
//
//   forward:   out = silu(gate) * up,            silu(g) = g * s,  s = 1 / (1 + exp(-g))
//   backward:  grad_up   = grad_out * silu(gate)
//              grad_gate = grad_out * up * s * (1 + g * (1 - s))
//
// (PyTorch's silu and silu_backward formulas; unfused, the forward is two kernels and the
// backward four, each reading or writing a full tensor.) Elementwise, so the host references
// agree with the kernels bit for bit whatever the partition (the emulation checks it); on a GPU
// expf is within 2 ulp of the host's exp, so the two differ by a few ulp there.
//
// Each thread takes packs of 16 bytes (8 bf16 or fp16 values, 4 fp32) with one vector load per
// operand where every pointer is 16-byte aligned, grid-stride; the elements past the last whole
// pack (and everything, where a pointer is not aligned) one at a time.
#include <cstdint>

#include "common/element_dtype.h"
#include "common/status.h"

struct CUstream_st;
typedef struct CUstream_st* cudaStream_t;

namespace loom::kernels {

constexpr int kSwigluThreads = 256;

struct SwigluShape {
  ElementDtype io = ElementDtype::kFloat32;
  int64_t n = 0;  // elements of each operand (contiguous)
};

struct SwigluForwardArgs {
  const void* gate;  // [n] in io
  const void* up;    // [n] in io
  void* out;         // [n] in io
};

struct SwigluBackwardArgs {
  const void* gate;      // [n] in io, as forward read it
  const void* up;        // [n] in io
  const void* grad_out;  // [n] in io
  void* grad_gate;       // [n] in io (may alias grad_out: each element is read before written)
  void* grad_up;         // [n] in io
};

// An invalid-argument Status naming the field and what is valid; the entry points run these.
Status swiglu_forward_check(const SwigluShape& shape, const SwigluForwardArgs& args);
Status swiglu_backward_check(const SwigluShape& shape, const SwigluBackwardArgs& args);

// The host references, elements [begin, end): fp32 arithmetic for fp32/fp16/bf16 io, fp64 for
// fp64 io (what fp64 runs of the models use on the CPU).
Status swiglu_forward_host(const SwigluShape& shape, const SwigluForwardArgs& args, int64_t begin,
                           int64_t end);
Status swiglu_backward_host(const SwigluShape& shape, const SwigluBackwardArgs& args, int64_t begin,
                            int64_t end);

// The CUDA kernels (fp32, fp16 and bf16 io; device pointers), at most max_blocks CUDA blocks
// (> 0; tests use a small cap to make them loop; <= 0: 65535).
Status swiglu_forward_apply(const SwigluShape& shape, const SwigluForwardArgs& args,
                            cudaStream_t stream, int64_t max_blocks = 0);
Status swiglu_backward_apply(const SwigluShape& shape, const SwigluBackwardArgs& args,
                             cudaStream_t stream, int64_t max_blocks = 0);

}  // namespace loom::kernels
