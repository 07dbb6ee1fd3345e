#include "loom/parallel/pipeline/activation_codec.h"

#include <ATen/ATen.h>

#include "loom/core/error.h"
#include "loom/ops/quantize.h"

namespace loom::parallel::pipeline {

namespace {

int64_t padded_to_blocks(int64_t numel) {
  return (numel + ops::kInt8Block - 1) / ops::kInt8Block * ops::kInt8Block;
}

}  // namespace

ActivationCodec parse_activation_codec(const std::string& name) {
  if (name == "none") return ActivationCodec::kNone;
  if (name == "bf16") return ActivationCodec::kBf16;
  if (name == "int8") return ActivationCodec::kInt8;
  fail("--compress-activations '{}' is not valid: none, bf16 or int8", name);
}

std::string to_string(ActivationCodec codec) {
  switch (codec) {
    case ActivationCodec::kNone:
      return "none";
    case ActivationCodec::kBf16:
      return "bf16";
    case ActivationCodec::kInt8:
      return "int8";
  }
  return "?";
}

ActivationCodec codec_for(at::ScalarType dtype, ActivationCodec codec) {
  if (!at::isFloatingType(dtype)) return ActivationCodec::kNone;
  if (codec == ActivationCodec::kBf16 && dtype == at::kBFloat16) return ActivationCodec::kNone;
  return codec;
}

std::vector<at::Tensor> encode_activation(const at::Tensor& t, ActivationCodec codec) {
  switch (codec_for(t.scalar_type(), codec)) {
    case ActivationCodec::kNone:
      return {t.detach().contiguous()};
    case ActivationCodec::kBf16:
      return {t.detach().to(at::kBFloat16).contiguous()};
    case ActivationCodec::kInt8: {
      // Whole blocks: the tail padded with zeros (a zero changes no block's largest magnitude).
      auto flat = t.detach().reshape({-1}).to(at::kFloat);
      const int64_t pad = padded_to_blocks(flat.numel()) - flat.numel();
      if (pad > 0) flat = at::constant_pad_nd(flat, {0, pad}, 0.0);
      auto blocks = ops::quantize_int8(flat.contiguous());
      // As bytes: the communicators move uint8, not int8 (the same bits either way).
      return {blocks.codes.view(at::kByte), blocks.scales};
    }
  }
  return {};
}

std::vector<at::Tensor> activation_parts(at::IntArrayRef sizes, at::ScalarType dtype,
                                         ActivationCodec codec, at::Device device) {
  const auto on = at::TensorOptions(device);
  switch (codec) {
    case ActivationCodec::kNone:
      return {at::empty(sizes, on.dtype(dtype))};
    case ActivationCodec::kBf16:
      return {at::empty(sizes, on.dtype(at::kBFloat16))};
    case ActivationCodec::kInt8: {
      const int64_t padded = padded_to_blocks(c10::multiply_integers(sizes));
      return {at::empty({padded}, on.dtype(at::kByte)),
              at::empty({padded / ops::kInt8Block}, on.dtype(at::kFloat))};
    }
  }
  return {};
}

at::Tensor decode_activation(const std::vector<at::Tensor>& parts, at::IntArrayRef sizes,
                             at::ScalarType dtype, ActivationCodec codec) {
  switch (codec) {
    case ActivationCodec::kNone:
      LOOM_CHECK(parts.size() == 1, "an uncompressed activation arrives as 1 part, not {}",
                 parts.size());
      return parts[0];
    case ActivationCodec::kBf16:
      LOOM_CHECK(parts.size() == 1, "a bf16 activation arrives as 1 part, not {}", parts.size());
      return parts[0].to(dtype);
    case ActivationCodec::kInt8: {
      LOOM_CHECK(parts.size() == 2, "an int8 activation arrives as codes and scales, not {} parts",
                 parts.size());
      const int64_t numel = c10::multiply_integers(sizes);
      // A tensor of its own (copy = true even for float32): the receiver may mark it as
      // requiring a gradient, which a view of the dequantized blocks could not take.
      return ops::dequantize_int8(parts[0].view(at::kChar), parts[1])
          .narrow(0, 0, numel)
          .reshape(sizes)
          .to(dtype, /*non_blocking=*/false, /*copy=*/true);
    }
  }
  return {};
}

int64_t encoded_bytes(int64_t numel, at::ScalarType dtype, ActivationCodec codec) {
  switch (codec_for(dtype, codec)) {
    case ActivationCodec::kNone:
      return numel * static_cast<int64_t>(c10::elementSize(dtype));
    case ActivationCodec::kBf16:
      return numel * 2;
    case ActivationCodec::kInt8: {
      const int64_t padded = padded_to_blocks(numel);
      return padded + padded / ops::kInt8Block * 4;
    }
  }
  return 0;
}

}  // namespace loom::parallel::pipeline
