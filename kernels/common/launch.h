#pragma once
// What the kernels' launches share (CUDA sources only): a grid of CUDA blocks for a number of
// warps, the launch's status, and the element type a dtype names.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "common/element_dtype.h"
#include "common/status.h"

namespace loom::kernels {

// CUDA blocks of `threads_per_block` threads that hold `warps` warps, at most `max_blocks`
// (<= 0: 65535). A small `max_blocks` makes the kernels' grid-stride loops take several turns,
// which the emulation tests use.
inline int64_t blocks_for_warps(int64_t warps, int64_t threads_per_block, int64_t max_blocks) {
  const int64_t per_block = threads_per_block / 32;
  return std::min<int64_t>((warps + per_block - 1) / per_block,
                           max_blocks > 0 ? max_blocks : 65535);
}

// The last launch's error, as a Status naming the kernel.
inline Status launch_status(const char* kernel) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return Status::cuda_error(std::string(kernel) + " kernel launch: " + cudaGetErrorString(e));
  return Status::success();
}

// launch(T()) with T the device element type of `dtype` (float, __half, __nv_bfloat16). fp64
// (the host references' only) and unknown values are an invalid-argument Status naming `kernel`.
template <typename Launch>
Status by_element_type(ElementDtype dtype, const char* kernel, Launch&& launch) {
  switch (dtype) {
    case ElementDtype::kFloat32:
      return launch(float());
    case ElementDtype::kFloat16:
      return launch(__half());
    case ElementDtype::kBFloat16:
      return launch(__nv_bfloat16());
    case ElementDtype::kFloat64:
      break;
  }
  return Status::invalid_argument(std::string(kernel) +
                                  " kernel: no device element type for dtype " +
                                  std::to_string(int(dtype)));
}

}  // namespace loom::kernels
