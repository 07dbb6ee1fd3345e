// The host reference of threshold selection and scatter-add (sparsify.h): plain loops in the
// order the kernels produce their results.
#include <algorithm>
#include <cmath>
#include <string>

#include "compression/sparsify.h"

namespace loom::kernels {

namespace {

bool selected(float v, float threshold) {
  return !(std::fabs(v) < threshold) && v != 0.0f;
}

}  // namespace

Status select_check(int64_t n, int64_t capacity) {
  if (n < 0 || n > int64_t(INT32_MAX))
    return Status::invalid_argument("select: " + std::to_string(n) +
                                    " values; indices are int32, so at most 2^31 - 1");
  if (capacity < 0)
    return Status::invalid_argument("select: capacity " + std::to_string(capacity) +
                                    " is negative");
  return Status::success();
}

void select_count_host(const float* x, const float* error, int64_t n, float threshold,
                       int32_t* counts, int64_t chunk_begin, int64_t chunk_end) {
  for (int64_t c = chunk_begin; c < chunk_end; ++c) {
    const int64_t end = std::min(n, (c + 1) * kSelectChunk);
    int32_t count = 0;
    for (int64_t i = c * kSelectChunk; i < end; ++i) count += selected(x[i] + error[i], threshold);
    counts[c] = count;
  }
}

void select_write_host(const float* x, float* error, int64_t n, float threshold,
                       const int64_t* offsets, int64_t capacity, int32_t* indices, float* values,
                       int64_t chunk_begin, int64_t chunk_end) {
  for (int64_t c = chunk_begin; c < chunk_end; ++c) {
    const int64_t end = std::min(n, (c + 1) * kSelectChunk);
    int64_t slot = offsets[c];
    for (int64_t i = c * kSelectChunk; i < end; ++i) {
      const float v = x[i] + error[i];
      const bool take = selected(v, threshold);
      if (take && slot < capacity) {
        indices[slot] = int32_t(i);
        values[slot] = v;
        error[i] = 0.0f;
      } else {
        error[i] = v;
      }
      slot += take;
    }
  }
}

void scatter_add_host(float* dense, int64_t n, const int32_t* indices, const float* values,
                      int64_t m) {
  for (int64_t i = 0; i < m; ++i)
    if (indices[i] >= 0 && indices[i] < n) dense[indices[i]] += values[i];
}

}  // namespace loom::kernels
