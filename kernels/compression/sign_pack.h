#pragma once
// Sign compression with error feedback, the arithmetic of loom's onebit communication hook
// (parallel/data/quantized_hook.h, ops/sign_pack.h): each block of kSignBlock (1024) consecutive
// values is sent as 1024 sign bits (32 words) and one fp32 scale, the block's mean magnitude, so a
// value comes back as +scale or -scale. For v = x + error (error may be null: no feedback):
//   sum    = the |v| of the block added up in a fixed order: per lane l (0..31) the values
//            l, l + 32, ..., l + 992 in turn, then the 32 lane sums by a butterfly (at step
//            o = 16, 8, 4, 2, 1 each lane adds the sum of lane l xor o to its own);
//   scale  = sum / 1024 (exact: a power of two);
//   bit i  = !(v_i < 0)          (bit l of word j is value 32 j + l; zero and -0 send +scale);
//   error  = v - (bit ? scale : -scale).
// The mean magnitude is the scale that minimizes the squared error of the block (Bernstein et al.
// 2018; Seide et al. 2014 used per-column means). Each operation is one fp32 rounding in this
// order on the host and in the kernel, so both give the same values. A block whose sum is not
// finite (a NaN, an infinity, or magnitudes summing past fp32's range) keeps its non-finite scale
// and gets an error of 0: it decodes to non-finite values, which the trainer's non-finite check
// sees, and no NaN outlives the step in the error.
#include <cstdint>

#include "common/status.h"

struct CUstream_st;
typedef struct CUstream_st* cudaStream_t;

namespace loom::kernels {

constexpr int64_t kSignBlock = 1024;
constexpr int64_t kSignWordsPerBlock = kSignBlock / 32;

// n must be a multiple of kSignBlock; words [n / 32], scales [n / kSignBlock]; error [n] or null.
Status sign_pack_check(int64_t n);

// The references, blocks [block_begin, block_end).
void sign_pack_host(const float* x, float* error, uint32_t* words, float* scales, int64_t n,
                    int64_t block_begin, int64_t block_end);
// out = the decoded values: +scale where the bit is set, -scale elsewhere.
void sign_unpack_host(const uint32_t* words, const float* scales, float* out, int64_t n,
                      int64_t block_begin, int64_t block_end);

// The kernels: one warp per block (32 values a lane, coalesced), a grid-stride loop over the
// blocks; each word from one ballot. max_blocks > 0 caps the grid (tests use it to make warps
// loop). Device pointers.
Status sign_pack_apply(const float* x, float* error, uint32_t* words, float* scales, int64_t n,
                       cudaStream_t stream, int64_t max_blocks = 0);
Status sign_unpack_apply(const uint32_t* words, const float* scales, float* out, int64_t n,
                         cudaStream_t stream, int64_t max_blocks = 0);

}  // namespace loom::kernels
