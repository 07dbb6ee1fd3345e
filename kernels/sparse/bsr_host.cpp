// Host reference of the block-sparse product (bsr.h), and the checks both share.
#include <string>

#include "common/float16.h"
#include "sparse/bsr.h"

namespace loom::kernels {

Status bsr_check(const BsrShape& shape, int64_t tokens) {
  if (shape.block != 32 && shape.block != 64)
    return Status::invalid_argument("bsr: block " + std::to_string(shape.block) +
                                    " is not one the kernel has: 32 or 64");
  if (shape.rows < 0 || shape.rows % shape.block != 0 || shape.cols < 0 ||
      shape.cols % shape.block != 0)
    return Status::invalid_argument("bsr: a weight of " + std::to_string(shape.rows) + " x " +
                                    std::to_string(shape.cols) + " is not tiled by " +
                                    std::to_string(shape.block) + " x " +
                                    std::to_string(shape.block) + " blocks");
  if (tokens < 0)
    return Status::invalid_argument("bsr: tokens " + std::to_string(tokens) + " is negative");
  return Status::success();
}

BsrHost bsr_from_dense_host(const uint16_t* dense, const BsrShape& s) {
  BsrHost out;
  const int64_t b = s.block, tile_rows = s.rows / b, tile_cols = s.cols / b;
  out.row_start.push_back(0);
  for (int64_t r = 0; r < tile_rows; ++r) {
    for (int64_t c = 0; c < tile_cols; ++c) {
      bool kept = false;
      for (int64_t i = 0; i < b && !kept; ++i)
        for (int64_t j = 0; j < b && !kept; ++j)
          kept = (dense[(r * b + i) * s.cols + c * b + j] & 0x7fffu) != 0;
      if (!kept) continue;
      out.tile_col.push_back(static_cast<int32_t>(c));
      for (int64_t i = 0; i < b; ++i)
        for (int64_t j = 0; j < b; ++j)
          out.values.push_back(dense[(r * b + i) * s.cols + c * b + j]);
    }
    out.row_start.push_back(static_cast<int32_t>(out.tile_col.size()));
  }
  return out;
}

void bsr_matmul_host(BsrDtype dtype, const uint16_t* x, int64_t tokens, const int32_t* row_start,
                     const int32_t* tile_col, const uint16_t* values, const BsrShape& s,
                     uint16_t* y) {
  const bool bf16 = dtype == BsrDtype::kBFloat16;
  auto widen = [bf16](uint16_t v) { return bf16 ? bf16_to_float(v) : fp16_to_float(v); };
  const int64_t b = s.block;
  for (int64_t row = 0; row < s.rows; ++row) {
    const int64_t r = row / b, i = row % b;
    for (int64_t t = 0; t < tokens; ++t) {
      float sum = 0.f;
      for (int32_t k = row_start[r]; k < row_start[r + 1]; ++k) {
        const uint16_t* tile = values + int64_t(k) * b * b + i * b;
        const uint16_t* xs = x + t * s.cols + int64_t(tile_col[k]) * b;
        // As the emulated tensor cores do: per 16 columns, the running fp32 sum plus the 16
        // products in column order, in double, rounded to fp32 once.
        for (int64_t k16 = 0; k16 < b; k16 += 16) {
          double step = sum;
          for (int64_t j = k16; j < k16 + 16; ++j)
            step += double(widen(tile[j])) * double(widen(xs[j]));
          sum = float(step);
        }
      }
      y[t * s.rows + row] = bf16 ? float_to_bf16(sum) : float_to_fp16(sum);
    }
  }
}

}  // namespace loom::kernels
