#include <cmath>
#include <string>

#include "dropout/dropout.h"
#include "dropout/philox.h"

namespace loom::kernels {

uint32_t dropout_threshold(double p) {
  // p < 1, so p * 2^32 < 2^32 fits; floor keeps the drop probability at or just below p.
  return uint32_t(std::floor(p * 4294967296.0));
}

Status dropout_check(const DropoutParams& params) {
  static const char* const kDims[4] = {"samples", "dim 1", "dim 2", "columns"};
  for (int d = 0; d < 4; ++d) {
    if (params.size[d] < 0 || params.offset[d] < 0 ||
        params.offset[d] > params.logical[d] - params.size[d])
      return Status::invalid_argument(
          "dropout: " + std::string(kDims[d]) + ": the slice [" + std::to_string(params.offset[d]) +
          ", " + std::to_string(params.offset[d] + params.size[d]) +
          ") is not inside the logical size " + std::to_string(params.logical[d]));
  }
  constexpr int64_t kCounterWord = int64_t(1) << 32;
  if (params.logical[0] > kCounterWord)
    return Status::invalid_argument("dropout: " + std::to_string(params.logical[0]) +
                                    " samples; at most 2^32 are numbered");
  if (params.logical[2] > 0 && params.logical[1] > (kCounterWord - 1) / params.logical[2])
    return Status::invalid_argument(
        "dropout: " + std::to_string(params.logical[1]) + " x " +
        std::to_string(params.logical[2]) + " rows per sample; at most 2^32 are numbered");
  if (params.logical[3] > 4 * kCounterWord)
    return Status::invalid_argument("dropout: " + std::to_string(params.logical[3]) +
                                    " columns; at most 2^34 are numbered");
  if (!(params.scale >= 1.0) || !std::isfinite(params.scale))
    return Status::invalid_argument("dropout: scale " + std::to_string(params.scale) +
                                    " must be finite and at least 1 (1 / (1 - p))");
  return Status::success();
}

template <typename T>
void dropout_host(const T* x, T* y, const DropoutParams& params, int64_t row_begin,
                  int64_t row_end) {
  const auto& n = params.size;
  const auto& o = params.offset;
  const T scale = T(params.scale);
  for (int64_t row = row_begin; row < row_end; ++row) {
    const int64_t i2 = row % n[2], i1 = row / n[2] % n[1], i0 = row / (n[1] * n[2]);
    const auto logical_row = uint32_t((i1 + o[1]) * params.logical[2] + (i2 + o[2]));
    const auto sample = uint32_t(i0 + o[0]);
    Philox4x32 draw{};
    for (int64_t c = 0; c < n[3]; ++c) {
      const int64_t column = c + o[3];
      if (c == 0 || column % 4 == 0)
        draw = philox4x32_10({{uint32_t(column / 4), logical_row, sample, params.site}},
                             params.key[0], params.key[1]);
      const bool keep = draw.v[column % 4] >= params.drop_below;
      const int64_t i = row * n[3] + c;
      y[i] = keep ? (x ? x[i] * scale : scale) : T(0);
    }
  }
}

template void dropout_host<float>(const float*, float*, const DropoutParams&, int64_t, int64_t);
template void dropout_host<double>(const double*, double*, const DropoutParams&, int64_t,
                                   int64_t);

}  // namespace loom::kernels
