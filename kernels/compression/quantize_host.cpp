// The host reference of the int8 quantization with error feedback (quantize.h): the kernel's
// algorithm, one block after another.
#include <cmath>

#include "compression/quantize.h"

namespace loom::kernels {

Status quantize_int8_check(int64_t n) {
  if (n < 0 || n % kQuantBlock != 0)
    return Status::invalid_argument("quantize_int8: " + std::to_string(n) +
                                    " values do not split into blocks of " +
                                    std::to_string(kQuantBlock));
  return Status::success();
}

void quantize_int8_host(const float* x, float* error, int8_t* codes, float* scales, int64_t n,
                        int64_t block_begin, int64_t block_end) {
  (void)n;
  float v[kQuantBlock];
  for (int64_t b = block_begin; b < block_end; ++b) {
    const int64_t base = b * kQuantBlock;
    float amax = 0.0f;
    for (int64_t j = 0; j < kQuantBlock; ++j) {
      v[j] = error != nullptr ? x[base + j] + error[base + j] : x[base + j];
      const float a = std::fabs(v[j]);
      amax = (a > amax || std::isnan(a)) ? a : amax;  // a max that keeps NaN
    }
    const float scale = amax / 127.0f;
    const bool finite = std::isfinite(scale);
    const float divisor = finite && scale > 0.0f ? scale : 1.0f;
    for (int64_t j = 0; j < kQuantBlock; ++j) {
      const float q = std::nearbyint(v[j] / divisor);  // ties to even (default rounding mode)
      const float code = finite ? std::fmin(std::fmax(q, -127.0f), 127.0f) : 0.0f;
      codes[base + j] = static_cast<int8_t>(code);
      if (error != nullptr) error[base + j] = finite ? v[j] - code * scale : 0.0f;
    }
    scales[b] = scale;
  }
}

}  // namespace loom::kernels
