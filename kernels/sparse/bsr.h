#pragma once
// Block-sparse (BSR) weights and their product with dense activations on tensor cores (kernels
// layer: raw pointers and a stream, no LibTorch).
//
// A weight W [rows, cols] (row-major, bf16 or fp16) of which only some B x B tiles are kept
// (--prune-pattern block:B) is held as block-sparse rows:
//   row_start [rows / B + 1] int32: the kept tiles of tile row r are numbers row_start[r] ..
//             row_start[r + 1] - 1, in increasing tile column;
//   tile_col  [kept] int32: each kept tile's tile column;
//   values    [kept, B, B]: each kept tile, row-major.
// The product (bsr_matmul): y [tokens, rows] = x [tokens, cols] W^T with x row-major, summed in
// fp32 over the kept tiles in order and rounded once to the element type; a tile row with no kept
// tile gives zeros. B is 32 or 64; rows and cols are multiples of B; any number of tokens.
//
// Host references (bsr_*_host) beside the CUDA kernel (bsr.cu, LOOM_WITH_CUDA); the
// kernel-emulation test runs the kernel's source on the CPU against them
// (tests/kernel_emulation/bsr_emulated.cpp). The reference sums in the order of the kernel's
// tensor-core products in the emulation: per kept tile and per 16 columns of it, the products in
// double added to the fp32 running sum and rounded once. Plain C++ can include this header.
#include <cstdint>
#include <vector>

#include "common/status.h"

struct CUstream_st;
typedef struct CUstream_st* cudaStream_t;

namespace loom::kernels {

enum class BsrDtype { kBFloat16, kFloat16 };

struct BsrShape {
  int64_t rows = 0, cols = 0;  // output, input features: multiples of block
  int64_t block = 0;           // 32 or 64
};

// The checks every entry point makes: block 32 or 64, rows and cols non-negative multiples of it,
// tokens >= 0; the message names the value and what is valid.
Status bsr_check(const BsrShape& shape, int64_t tokens = 0);

// A host BSR matrix: the tiles of `dense` [rows, cols] that hold a nonzero (+0 and -0 are zero).
struct BsrHost {
  std::vector<int32_t> row_start, tile_col;
  std::vector<uint16_t> values;
};
BsrHost bsr_from_dense_host(const uint16_t* dense, const BsrShape& shape);

// y = x W^T on the host, in the kernel's summation order (above); y in the element type.
void bsr_matmul_host(BsrDtype dtype, const uint16_t* x, int64_t tokens, const int32_t* row_start,
                     const int32_t* tile_col, const uint16_t* values, const BsrShape& shape,
                     uint16_t* y);

// The same on the GPU: device pointers (x, values and y 16-byte aligned), asynchronous on
// `stream`.
Status bsr_matmul(BsrDtype dtype, const void* x, int64_t tokens, const int32_t* row_start,
                  const int32_t* tile_col, const void* values, const BsrShape& shape, void* y,
                  cudaStream_t stream);

// Whether this build has the kernel for CUDA device `device` (no launch).
Status bsr_device_check(int device);

}  // namespace loom::kernels
