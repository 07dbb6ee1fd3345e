// The host reference of sign compression with error feedback (sign_pack.h): the kernel's
// algorithm, one block after another, the warp's lanes as an array.
#include <cmath>
#include <string>

#include "compression/sign_pack.h"

namespace loom::kernels {

Status sign_pack_check(int64_t n) {
  if (n < 0 || n % kSignBlock != 0)
    return Status::invalid_argument("sign_pack: " + std::to_string(n) +
                                    " values do not split into blocks of " +
                                    std::to_string(kSignBlock));
  return Status::success();
}

void sign_pack_host(const float* x, float* error, uint32_t* words, float* scales, int64_t n,
                    int64_t block_begin, int64_t block_end) {
  (void)n;
  float v[kSignBlock];
  for (int64_t b = block_begin; b < block_end; ++b) {
    const int64_t base = b * kSignBlock;
    float lane_sum[32] = {};
    for (int64_t j = 0; j < kSignWordsPerBlock; ++j)
      for (int lane = 0; lane < 32; ++lane) {
        const int64_t i = base + 32 * j + lane;
        v[32 * j + lane] = error != nullptr ? x[i] + error[i] : x[i];
        lane_sum[lane] = lane_sum[lane] + std::fabs(v[32 * j + lane]);
      }
    for (int offset = 16; offset > 0; offset >>= 1) {
      float next[32];
      for (int lane = 0; lane < 32; ++lane) next[lane] = lane_sum[lane] + lane_sum[lane ^ offset];
      for (int lane = 0; lane < 32; ++lane) lane_sum[lane] = next[lane];
    }
    const float scale = lane_sum[0] / static_cast<float>(kSignBlock);
    const bool finite = std::isfinite(scale);
    for (int64_t j = 0; j < kSignWordsPerBlock; ++j) {
      uint32_t word = 0;
      for (int lane = 0; lane < 32; ++lane) {
        const float value = v[32 * j + lane];
        const bool positive = !(value < 0.0f);
        word |= uint32_t(positive) << lane;
        if (error != nullptr)
          error[base + 32 * j + lane] = finite ? value - (positive ? scale : -scale) : 0.0f;
      }
      words[b * kSignWordsPerBlock + j] = word;
    }
    scales[b] = scale;
  }
}

void sign_unpack_host(const uint32_t* words, const float* scales, float* out, int64_t n,
                      int64_t block_begin, int64_t block_end) {
  (void)n;
  for (int64_t b = block_begin; b < block_end; ++b) {
    const float scale = scales[b];
    for (int64_t j = 0; j < kSignWordsPerBlock; ++j) {
      const uint32_t word = words[b * kSignWordsPerBlock + j];
      for (int lane = 0; lane < 32; ++lane) {
        out[b * kSignBlock + 32 * j + lane] = (word >> lane) & 1u ? scale : -scale;
      }
    }
  }
}

}  // namespace loom::kernels
