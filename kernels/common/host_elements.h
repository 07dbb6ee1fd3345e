#pragma once
// Elements of an untyped buffer read and written by the host references: widened to the
// accumulation type on load, rounded to the element type (to nearest, ties to even, as the
// kernels' conversions) on store, and the butterfly a warp's __shfl_xor_sync reduction performs.
// Plain C++.
#include <cstdint>
#include <cstring>

#include "common/element_dtype.h"
#include "common/float16.h"

namespace loom::kernels {

// Element i of `base`, widened to Acc.
template <typename Acc>
Acc load_element(ElementDtype dtype, const void* base, int64_t i) {
  switch (dtype) {
    case ElementDtype::kFloat32:
      return Acc(static_cast<const float*>(base)[i]);
    case ElementDtype::kFloat64:
      return Acc(static_cast<const double*>(base)[i]);
    case ElementDtype::kFloat16:
      return Acc(fp16_to_float(static_cast<const uint16_t*>(base)[i]));
    case ElementDtype::kBFloat16:
      return Acc(bf16_to_float(static_cast<const uint16_t*>(base)[i]));
  }
  return Acc(0);
}

// Element i of `base` set to v rounded to the dtype.
template <typename Acc>
void store_element(ElementDtype dtype, void* base, int64_t i, Acc v) {
  switch (dtype) {
    case ElementDtype::kFloat32:
      static_cast<float*>(base)[i] = float(v);
      return;
    case ElementDtype::kFloat64:
      static_cast<double*>(base)[i] = double(v);
      return;
    case ElementDtype::kFloat16:
      static_cast<uint16_t*>(base)[i] = float_to_fp16(float(v));
      return;
    case ElementDtype::kBFloat16:
      static_cast<uint16_t*>(base)[i] = float_to_bf16(float(v));
      return;
  }
}

// The butterfly over 32 lane values that a loop of __shfl_xor_sync at offsets 16, 8, 4, 2, 1
// performs: at each offset every lane combines its value with its partner's (both read before
// either changes). `combine` must be commutative bit for bit, so every lane ends with the same
// value; lane 0's is returned.
template <typename V, typename Combine>
V warp_butterfly(V (&lanes)[32], Combine&& combine) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    V next[32];
    for (int l = 0; l < 32; ++l) next[l] = combine(lanes[l], lanes[l ^ offset]);
    std::memcpy(static_cast<void*>(lanes), static_cast<const void*>(next), sizeof next);
  }
  return lanes[0];
}

}  // namespace loom::kernels
