#include "loom/ops/cuda.h"

#ifdef LOOM_WITH_CUDA
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
#endif

}  // namespace loom::ops
