#pragma once
// Threshold selection with error feedback, and the scatter-add that sums what ranks selected: the
// arithmetic of loom's top-k and threshold communication hooks (parallel/data/sparse_hook.h,
// ops/sparsify.h).
//
// For v = x + error (one fp32 addition), a value is selected when !(|v| < threshold) and v != 0:
// at or above the threshold and not zero; always when it is NaN or infinite, so that a
// non-finite gradient reaches the trainer's check instead of hiding in the error. Selection runs
// in chunks of kSelectChunk values in two passes. Pass 1 counts each chunk's selected values; the
// exclusive prefix sum of the counts (taken by the caller) is each chunk's first output slot.
// Pass 2 writes the selected values' indices and values, in ascending index order, into the slots
// below `capacity`, and sets the error: 0 for a value written, v for every other one (not
// selected, or selected past the capacity: carried to the next step). Host and device compute the
// same values in the same order, so their results are equal bit for bit.
#include <cstdint>

#include "common/status.h"

struct CUstream_st;
typedef struct CUstream_st* cudaStream_t;

namespace loom::kernels {

constexpr int64_t kSelectChunk = 256;

// n values (indices fit in int32: n <= 2^31 - 1) and a capacity >= 0.
Status select_check(int64_t n, int64_t capacity);
inline int64_t select_chunks(int64_t n) {
  return (n + kSelectChunk - 1) / kSelectChunk;
}

// The references, chunks [chunk_begin, chunk_end). counts [select_chunks(n)]; offsets likewise
// (exclusive prefix sums of the counts); indices and values [capacity].
void select_count_host(const float* x, const float* error, int64_t n, float threshold,
                       int32_t* counts, int64_t chunk_begin, int64_t chunk_end);
void select_write_host(const float* x, float* error, int64_t n, float threshold,
                       const int64_t* offsets, int64_t capacity, int32_t* indices, float* values,
                       int64_t chunk_begin, int64_t chunk_end);

// The kernels: one warp per chunk (eight values a lane, coalesced), each lane's place among the
// warp's selected values from a ballot; a grid-stride loop over the chunks, max_blocks > 0 caps
// the grid (tests use it to make warps loop). Device pointers.
Status select_count_apply(const float* x, const float* error, int64_t n, float threshold,
                          int32_t* counts, cudaStream_t stream, int64_t max_blocks = 0);
Status select_write_apply(const float* x, float* error, int64_t n, float threshold,
                          const int64_t* offsets, int64_t capacity, int32_t* indices, float* values,
                          cudaStream_t stream, int64_t max_blocks = 0);

// dense[indices[i]] += values[i] for i < m, skipping indices outside [0, n) (-1 pads a message).
// The indices of one call must be distinct (one rank's selection), so no two threads touch one
// value and the sums do not depend on their order; ranks are added one call after another.
void scatter_add_host(float* dense, int64_t n, const int32_t* indices, const float* values,
                      int64_t m);
Status scatter_add_apply(float* dense, int64_t n, const int32_t* indices, const float* values,
                         int64_t m, cudaStream_t stream, int64_t max_blocks = 0);

}  // namespace loom::kernels
