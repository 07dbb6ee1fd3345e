#pragma once
// What the CUDA runtime can see. No LibTorch here (kernels layer).
namespace loom::kernels {

// Number of CUDA devices visible to this process; 0 when there is no driver or no device.
int device_count();

// Runs a one-thread kernel on `device` that writes 42 and reads it back: true when kernels
// launch and complete on that device. Used as a smoke test of the CUDA build.
bool launch_smoke_test(int device);

}  // namespace loom::kernels
