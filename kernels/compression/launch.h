#pragma once
// What the compression kernels' launches share (CUDA sources only): a grid of CUDA blocks for a
// number of warps, one warp per block of values, and the launch's status.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

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

}  // namespace loom::kernels
