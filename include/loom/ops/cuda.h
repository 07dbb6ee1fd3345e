#pragma once
// What the CUDA side of this build can do. In a build without LOOM_WITH_CUDA they report that
// there is nothing.
#include <cstdint>
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

// Makes `device` this thread's current CUDA device (and LibTorch's): what is allocated on "cuda"
// without an index lands there. loom::Error when there is no such device.
void set_current_cuda_device(int device);

// Limits LibTorch's CUDA caching allocator on `device` to `bytes` (0: no limit): an allocation
// that would make it reserve more fails with LibTorch's out-of-memory error. The limit covers
// what the allocator reserves (its rounding and cached free blocks included), so it bites a
// little before a cap on allocated bytes would. loom::Error when there is no such device or
// `bytes` is more than the device has.
void set_cuda_memory_cap(int device, int64_t bytes);

// Bytes of memory CUDA device `device` has in all; loom::Error when there is no such device.
int64_t cuda_total_memory(int device);

// Launches one of loom's own kernels on `device` and checks its result: the CUDA build works.
bool cuda_smoke_test(int device = 0);

}  // namespace loom::ops
