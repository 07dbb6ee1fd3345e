#pragma once
// What the CUDA side of this build can do. In a build without LOOM_WITH_CUDA they report that
// there is nothing.
#include <string>

namespace loom::ops {

// True when loom was compiled with its CUDA kernels (LOOM_WITH_CUDA=ON).
bool built_with_cuda();

// CUDA devices visible to this process (0 without a driver, a device, or a CUDA build).
int cuda_device_count();

// Compute capability of CUDA device `device` as major * 10 + minor (90: Hopper); -1 when there
// is no such device.
int cuda_compute_capability(int device);

// The device's name as the driver gives it ("NVIDIA H200"); "" when there is no such device.
std::string cuda_device_name(int device);

// Launches one of loom's own kernels on `device` and checks its result: the CUDA build works.
bool cuda_smoke_test(int device = 0);

}  // namespace loom::ops
