#include "loom/ops/cuda.h"

#include "loom/core/error.h"
#include "loom/core/format.h"

#ifdef LOOM_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>

#include "common/device_query.h"
#endif

namespace loom::ops {

#ifdef LOOM_WITH_CUDA
bool built_with_cuda() {
  return true;
}
int cuda_device_count() {
  return kernels::device_count();
}
int cuda_compute_capability(int device) {
  return kernels::device_compute_capability(device);
}
std::string cuda_device_name(int device) {
  return kernels::device_name(device);
}
bool cuda_smoke_test(int device) {
  return kernels::launch_smoke_test(device);
}
void set_current_cuda_device(int device) {
  LOOM_CHECK(device >= 0 && device < cuda_device_count(),
             "CUDA device {} does not exist ({} visible)", device, cuda_device_count());
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(device));
}
int64_t cuda_total_memory(int device) {
  LOOM_CHECK(device >= 0 && device < cuda_device_count(),
             "CUDA device {} does not exist ({} visible)", device, cuda_device_count());
  cudaDeviceProp prop{};
  LOOM_CHECK(cudaGetDeviceProperties(&prop, device) == cudaSuccess,
             "cannot read the properties of CUDA device {}", device);
  return static_cast<int64_t>(prop.totalGlobalMem);
}
void set_cuda_memory_cap(int device, int64_t bytes) {
  LOOM_CHECK(bytes >= 0, "CUDA memory cap: {} bytes is negative (0 means no cap)", bytes);
  const auto total = cuda_total_memory(device);
  LOOM_CHECK(bytes <= total, "CUDA memory cap {} is more than device {} has ({})",
             core::format_bytes(bytes), device, core::format_bytes(total));
  const double fraction =
      bytes == 0 ? 1.0 : static_cast<double>(bytes) / static_cast<double>(total);
  c10::cuda::CUDACachingAllocator::setMemoryFraction(fraction,
                                                     static_cast<c10::DeviceIndex>(device));
}
#else
bool built_with_cuda() {
  return false;
}
int cuda_device_count() {
  return 0;
}
int cuda_compute_capability(int) {
  return -1;
}
std::string cuda_device_name(int) {
  return "";
}
bool cuda_smoke_test(int) {
  return false;
}
void set_current_cuda_device(int device) {
  fail("CUDA device {}: this loom was built without CUDA", device);
}
int64_t cuda_total_memory(int device) {
  fail("CUDA device {}: this loom was built without CUDA", device);
}
void set_cuda_memory_cap(int device, int64_t) {
  fail("CUDA memory cap on device {}: this loom was built without CUDA", device);
}
#endif

}  // namespace loom::ops
