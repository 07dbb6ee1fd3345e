#pragma once
// Sign compression, what the onebit communication hook sends (parallel/data/quantized_hook.h):
// each block of kSignBlock (1024) consecutive values is sent as 1024 sign bits (32 int32 words)
// and one fp32 scale, the block's mean magnitude, so a value comes back as +scale or -scale
// (zero counts as positive). 132 bytes for 4096 of fp32: 31.03 times fewer. CUDA tensors run
// loom's kernels (kernels/compression/sign_pack.cu), CPU tensors their host reference: the same
// operations in the same order, the same values. A block holding a NaN or an infinity gets a
// non-finite scale, so it decodes to non-finite values, and its carried error is reset to 0.
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace loom::ops {

constexpr int64_t kSignBlock = 1024;

struct SignBlocks {
  at::Tensor words;   // int32, [n / 32]: bit l of word j is value 32 j + l, set when >= 0
  at::Tensor scales;  // float32, [n / kSignBlock]
};

// Error feedback: compresses x + error and leaves in `error` (contiguous float32, x's length, on
// x's device, updated in place) what the compression lost, to be added to the next call's x.
// x: a float32 1-D tensor whose length divides by kSignBlock; loom::Error otherwise, naming the
// values.
SignBlocks pack_signs_with_feedback(const at::Tensor& x, at::Tensor& error);
// The decoded values, float32: `words` [..., n / 32] and `scales` [..., n / kSignBlock] of one
// device, with the same leading dims; the result is [..., n].
at::Tensor unpack_signs(const at::Tensor& words, const at::Tensor& scales);

}  // namespace loom::ops
