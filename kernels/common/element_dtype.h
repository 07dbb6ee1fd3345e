#pragma once
// The element types kernels read and write through untyped pointers, and their sizes. Plain C++:
// the host references and the CUDA launchers both name them.
#include <cstdint>

namespace loom::kernels {

enum class ElementDtype { kFloat32, kFloat16, kBFloat16, kFloat64 };  // kFloat64: host references

// Bytes per element; 0 for a value outside the enum.
inline int64_t element_size(ElementDtype dtype) {
  switch (dtype) {
    case ElementDtype::kFloat32:
      return 4;
    case ElementDtype::kFloat64:
      return 8;
    case ElementDtype::kFloat16:
    case ElementDtype::kBFloat16:
      return 2;
  }
  return 0;
}

inline const char* element_dtype_name(ElementDtype dtype) {
  switch (dtype) {
    case ElementDtype::kFloat32:
      return "fp32";
    case ElementDtype::kFloat64:
      return "fp64";
    case ElementDtype::kFloat16:
      return "fp16";
    case ElementDtype::kBFloat16:
      return "bf16";
  }
  return "unknown";
}

}  // namespace loom::kernels
