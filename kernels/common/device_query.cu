#include <cuda_runtime.h>

#include "device_query.h"

namespace loom::kernels {

namespace {
__global__ void write_answer(int* out) {
  *out = 42;
}
}  // namespace

int device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return count;
}

int device_compute_capability(int device) {
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return major * 10 + minor;
}

std::string device_name(int device) {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    cudaGetLastError();
    return "";
  }
  return prop.name;
}

bool launch_smoke_test(int device) {
  if (cudaSetDevice(device) != cudaSuccess) return false;
  int* d_out = nullptr;
  if (cudaMalloc(&d_out, sizeof(int)) != cudaSuccess) return false;
  write_answer<<<1, 1>>>(d_out);
  int h_out = 0;
  const bool ok = cudaMemcpy(&h_out, d_out, sizeof(int), cudaMemcpyDeviceToHost) == cudaSuccess;
  cudaFree(d_out);
  return ok && h_out == 42;
}

}  // namespace loom::kernels
