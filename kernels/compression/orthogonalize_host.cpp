// The host reference of PowerSGD's orthogonalisation (orthogonalize.h): the kernel's algorithm,
// one matrix after another, its 256 threads as an array of partial sums.
#include <cmath>
#include <string>

#include "compression/orthogonalize.h"

namespace loom::kernels {
namespace {

constexpr int kWarps = kOrthoThreads / 32;

// sum over rows of P[k][i] P[k][j] in the kernel's order (orthogonalize.h).
float column_dot(const float* p, int64_t rows, int64_t rank, int64_t i, int64_t j) {
  float thread_sum[kOrthoThreads] = {};
  for (int t = 0; t < kOrthoThreads; ++t)
    for (int64_t k = t; k < rows; k += kOrthoThreads)
      thread_sum[t] = std::fma(p[k * rank + i], p[k * rank + j], thread_sum[t]);
  float warp_sum[kWarps];
  for (int w = 0; w < kWarps; ++w) {
    float* lane = thread_sum + 32 * w;
    for (int offset = 16; offset > 0; offset >>= 1) {
      float next[32];
      for (int l = 0; l < 32; ++l) next[l] = lane[l] + lane[l ^ offset];
      for (int l = 0; l < 32; ++l) lane[l] = next[l];
    }
    warp_sum[w] = lane[0];
  }
  float total = warp_sum[0];
  for (int w = 1; w < kWarps; ++w) total = total + warp_sum[w];
  return total;
}

}  // namespace

Status orthogonalize_check(int64_t rank, int64_t matrices) {
  if (rank < 1 || rank > kMaxOrthoRank)
    return Status::invalid_argument("orthogonalize: rank " + std::to_string(rank) +
                                    " is outside [1, " + std::to_string(kMaxOrthoRank) + "]");
  if (matrices < 0)
    return Status::invalid_argument("orthogonalize: " + std::to_string(matrices) +
                                    " matrices; must be >= 0");
  return Status::success();
}

void orthogonalize_host(float* data, const int64_t* offsets, const int64_t* rows, int64_t rank,
                        int64_t begin, int64_t end) {
  for (int64_t m = begin; m < end; ++m) {
    float* p = data + offsets[m];
    const int64_t n = rows[m];
    for (int64_t i = 0; i < rank; ++i) {
      const float norm2 = column_dot(p, n, rank, i, i);
      if (norm2 == 0.0f) continue;
      for (int64_t j = i + 1; j < rank; ++j) {
        const float coef = column_dot(p, n, rank, i, j) / norm2;
        for (int64_t k = 0; k < n; ++k)
          p[k * rank + j] = std::fma(-coef, p[k * rank + i], p[k * rank + j]);
      }
      const float norm = std::sqrt(norm2);
      for (int64_t k = 0; k < n; ++k) p[k * rank + i] = p[k * rank + i] / norm;
    }
  }
}

}  // namespace loom::kernels
