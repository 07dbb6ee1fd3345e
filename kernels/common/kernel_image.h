#pragma once
// Whether this build holds an image of a kernel for a CUDA device: a binary built for other
// architectures has none, and cudaFuncGetAttributes says so without launching anything. For
// the .cu files of kernels/; include it after <cuda_runtime.h> (in the kernel emulation, after the
// emulated runtime that stands in for it, which provides the same calls).
#include <string>

#include "common/status.h"

namespace loom::kernels {

template <typename Kernel>
Status kernel_image_check(Kernel kernel, int device, const std::string& what) {
  // The question is asked of the current device: switch to `device` for it and back.
  int previous = 0;
  if (cudaGetDevice(&previous) != cudaSuccess || cudaSetDevice(device) != cudaSuccess) {
    cudaGetLastError();
    return Status::cuda_error(what + ": CUDA device " + std::to_string(device) +
                              " cannot be selected");
  }
  cudaFuncAttributes attributes{};
  const cudaError_t e = cudaFuncGetAttributes(&attributes, kernel);
  cudaSetDevice(previous);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return Status::cuda_error(what + ": this build has no kernel image for CUDA device " +
                              std::to_string(device) + " (" + cudaGetErrorString(e) +
                              "); rebuild with its architecture in CMAKE_CUDA_ARCHITECTURES");
  }
  return Status::success();
}

}  // namespace loom::kernels
