#pragma once
// Blockwise int8 quantization, what the int8 communication hook sends (parallel/data/comm_hook.h):
// each block of kInt8Block (256) consecutive values is sent as int8 codes and one fp32 scale, the
// block's largest magnitude / 127, so a value comes back as code * scale with code = x / scale
// rounded to the nearest integer (ties to even) in [-127, 127]. The error of one value is at
// most scale / 2 (plus the fp32 roundings of the scale and the division, a few units in the last
// place). CUDA tensors run loom's kernel (kernels/compression/quantize.cu), CPU tensors its host
// reference: the same operations in the same order, the same values. A block holding a NaN or an
// infinity gets a non-finite scale and codes 0, so what it dequantizes to stays non-finite, and
// its carried error is reset to 0 (the NaN does not outlive the step).
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace loom::ops {

constexpr int64_t kInt8Block = 256;

struct Int8Blocks {
  at::Tensor codes;   // int8, [n]
  at::Tensor scales;  // float32, [n / kInt8Block]
};

// x: a float32 1-D tensor whose length divides by kInt8Block; loom::Error otherwise, naming the
// values. An all-zero block gets scale 0 and codes 0.
Int8Blocks quantize_int8(const at::Tensor& x);
// code * scale, float32. `codes` may have leading dims: [..., n] with scales [..., n / kInt8Block].
at::Tensor dequantize_int8(const at::Tensor& codes, const at::Tensor& scales);
// Error feedback (Seide et al. 2014; Karimireddy et al. 2019): quantizes x + error and leaves in
// `error` (contiguous float32, x's length, on x's device, updated in place) what that
// quantization lost, to be added to the next call's x. Over calls, the dequantized results sum
// to the inputs' sum minus the last error.
Int8Blocks quantize_int8_with_feedback(const at::Tensor& x, at::Tensor& error);

}  // namespace loom::ops
