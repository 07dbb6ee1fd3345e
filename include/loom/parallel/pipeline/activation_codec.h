#pragma once
// What crosses a pipeline boundary (--compress-activations): each stage's output activation and,
// in the backward, the gradient of that activation, sent as they are ("none"), rounded to bf16
// ("bf16": half of fp32's bytes) or blockwise int8 ("int8": ops/quantize.h, 256 values to a block
// with one fp32 scale, about a quarter of fp32's bytes). The receiver gets the tensor back in its
// own dtype and shape. As in SWARM (Ryabinin et al. 2023), the backward differentiates through
// the rounding as if it were not there (straight-through) and keeps no error feedback: an
// activation is used once, so nothing would carry the lost part to a later step. Only
// floating-point tensors are compressed; others go as they are.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace loom::parallel::pipeline {

enum class ActivationCodec : int64_t { kNone = 0, kBf16 = 1, kInt8 = 2 };

// "none" | "bf16" | "int8"; loom::Error naming the value and the valid ones otherwise.
ActivationCodec parse_activation_codec(const std::string& name);
std::string to_string(ActivationCodec codec);

// The codec a tensor of `dtype` is actually sent with: `codec` for floating-point dtypes (other
// than bf16 under "bf16", which is already that), kNone for the rest.
ActivationCodec codec_for(at::ScalarType dtype, ActivationCodec codec);

// The parts that go on the wire for `t` under codec_for(t's dtype, codec), in sending order.
std::vector<at::Tensor> encode_activation(const at::Tensor& t, ActivationCodec codec);
// Empty tensors the receiver fills, in the same order, for a tensor of `sizes` and `dtype` sent
// with `codec` (as codec_for gave it), on `device`.
std::vector<at::Tensor> activation_parts(at::IntArrayRef sizes, at::ScalarType dtype,
                                         ActivationCodec codec, at::Device device);
// The received parts back as a tensor of `sizes` and `dtype`.
at::Tensor decode_activation(const std::vector<at::Tensor>& parts, at::IntArrayRef sizes,
                             at::ScalarType dtype, ActivationCodec codec);

// Bytes on the wire for `numel` values of `dtype` under `codec` (codec_for applied), without the
// message header: numel x the element size; numel x 2 for bf16; for int8 numel rounded up to
// whole blocks of 256, plus 4 bytes of scale a block.
int64_t encoded_bytes(int64_t numel, at::ScalarType dtype, ActivationCodec codec);

}  // namespace loom::parallel::pipeline
