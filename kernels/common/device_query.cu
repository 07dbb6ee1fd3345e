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
