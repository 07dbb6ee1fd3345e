#pragma once
// What the CUDA runtime can see. No LibTorch here (kernels layer).
#include <string>
namespace loom::kernels {

// Number of CUDA devices visible to this process; 0 when there is no driver or no device.
int device_count();

// Compute capability of `device` as major * 10 + minor (90 for Hopper), or -1 when the device
// cannot be queried.
int device_compute_capability(int device);

// Name of `device` as the driver reports it ("NVIDIA H200"), or "" when it cannot be queried.
std::string device_name(int device);

// Runs a one-thread kernel on `device` that writes 42 and reads it back: true when kernels
// launch and complete on that device. Used as a smoke test of the CUDA build.
bool launch_smoke_test(int device);

}  // namespace loom::kernels
