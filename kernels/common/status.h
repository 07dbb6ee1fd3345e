#pragma once
// The result of a kernel-layer call: no exceptions cross the kernels layer (docs/architecture.md), so each
// entry point returns what went wrong as a code and a message naming the field, the value and
// what would be valid. Plain C++: usable by host references built without CUDA.
#include <string>
#include <utility>

namespace loom::kernels {

enum class StatusCode {
  kOk,
  kInvalidArgument,  // a shape, stride, dtype or pointer the kernel does not accept
  kCudaError,        // the CUDA runtime refused a launch or an attribute
};

struct Status {
  StatusCode code = StatusCode::kOk;
  std::string message;  // empty when ok

  bool ok() const { return code == StatusCode::kOk; }
  static Status success() { return {}; }
  static Status invalid_argument(std::string message) {
    return {StatusCode::kInvalidArgument, std::move(message)};
  }
  static Status cuda_error(std::string message) {
    return {StatusCode::kCudaError, std::move(message)};
  }
};

}  // namespace loom::kernels
