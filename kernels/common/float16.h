#pragma once
// bf16 and fp16 bit patterns <-> float on the host, without CUDA's headers: what the host
// references use to read their 16-bit inputs and to round their results as the kernels do
// (round to nearest, ties to even: __float2bfloat16_rn, __float2half_rn). Plain C++.
#include <cmath>
#include <cstdint>
#include <cstring>

namespace loom::kernels {

inline uint32_t float_bits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  return x;
}

inline float bits_float(uint32_t x) {
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}

inline float bf16_to_float(uint16_t h) {
  return bits_float(uint32_t(h) << 16);
}

inline uint16_t float_to_bf16(float f) {
  const uint32_t x = float_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t((x >> 16) | 0x0040u);  // quiet NaN
  return uint16_t((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24
    const float magnitude = std::ldexp(float(mantissa), -24);
    return bits_float(sign | float_bits(magnitude));
  }
  if (exponent == 31) return bits_float(sign | 0x7f800000u | (mantissa << 13));
  return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

inline uint16_t float_to_fp16(float f) {
  const uint32_t x = float_bits(f);
  const auto sign = uint16_t((x >> 16) & 0x8000u);
  const uint32_t magnitude = x & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return uint16_t(sign | 0x7e00u);   // NaN
  if (magnitude >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // >= 65520 rounds to inf
  if (magnitude < 0x38800000u) {  // below 2^-14: a subnormal in fp16, in units of 2^-24
    // The scaling is exact and nearbyint rounds ties to even (the default rounding mode); 1024
    // units is the smallest normal, which the bit pattern 0x0400 already is.
    return uint16_t(sign | uint32_t(std::nearbyint(bits_float(magnitude) * 16777216.0f)));
  }
  // Normal: drop 13 mantissa bits rounding to nearest even, then rebias the exponent 127 -> 15.
  const uint32_t rounded = magnitude + 0xfffu + ((magnitude >> 13) & 1u);
  return uint16_t(sign | ((rounded - 0x38000000u) >> 13));
}

}  // namespace loom::kernels
