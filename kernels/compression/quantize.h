#pragma once
// Blockwise int8 quantization with error feedback, the arithmetic of loom's int8 communication
// hook (parallel/data/comm_hook.h, ops/quantize.h). For each block of kQuantBlock consecutive
// values: v = x + error (error may be null: no feedback), scale = max |v| / 127 (fp32), code =
// v / scale rounded to the nearest integer, ties to even, in [-127, 127] (a zero block divides by
// 1: codes 0), and the new error = v - code * scale. Every operation is one fp32 rounding in this
// order, on the host and in the kernel, so both give the same values. A block holding a NaN or an
// infinity gets a non-finite scale (the max keeps NaN), codes 0 and a new error of 0: it
// dequantizes to non-finite values (0 * inf and 0 * NaN are NaN), which the trainer's non-finite
// check sees, and its error does not carry the NaN into later steps. NaN bit patterns may differ
// between host and device. A block whose scale is subnormal (max |v| below about 1.5e-36) can
// clip its largest codes; error feedback carries what is clipped.
#include <cstdint>

#include "common/status.h"

struct CUstream_st;
typedef struct CUstream_st* cudaStream_t;

namespace loom::kernels {

constexpr int64_t kQuantBlock = 256;

// n must be a multiple of kQuantBlock; codes [n], scales [n / kQuantBlock]; error [n] or null.
Status quantize_int8_check(int64_t n);

// The reference, blocks [block_begin, block_end).
void quantize_int8_host(const float* x, float* error, int8_t* codes, float* scales, int64_t n,
                        int64_t block_begin, int64_t block_end);

// The kernel: one warp per block (eight values a lane), a grid-stride loop over the blocks;
// max_blocks > 0 caps the grid (tests use it to make warps loop). Device pointers.
Status quantize_int8_apply(const float* x, float* error, int8_t* codes, float* scales, int64_t n,
                           cudaStream_t stream, int64_t max_blocks = 0);

}  // namespace loom::kernels
