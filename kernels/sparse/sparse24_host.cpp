// Host references of the 2:4 kernels (sparse24.h), and the checks both share.
#include <string>

#include "common/float16.h"
#include "sparse/sparse24.h"
#include "sparse/sparse24_chunk.h"

namespace loom::kernels {

namespace {

float to_float(Sparse24Dtype dtype, uint16_t bits) {
  return dtype == Sparse24Dtype::kBFloat16 ? bf16_to_float(bits) : fp16_to_float(bits);
}

uint16_t from_float(Sparse24Dtype dtype, float value) {
  return dtype == Sparse24Dtype::kBFloat16 ? float_to_bf16(value) : float_to_fp16(value);
}

}  // namespace

Status sparse24_check(const Sparse24Shape& shape) {
  if (shape.rows < 0)
    return Status::invalid_argument("sparse24: rows " + std::to_string(shape.rows) +
                                    " is negative");
  if (shape.cols < 0 || shape.cols % kSparse24Step != 0)
    return Status::invalid_argument("sparse24: cols (input features) " +
                                    std::to_string(shape.cols) +
                                    " must be a non-negative multiple of 32 (one metadata word "
                                    "covers 32 columns)");
  return Status::success();
}

Status sparse24_matmul_check(const Sparse24Shape& shape, int64_t tokens) {
  if (Status s = sparse24_check(shape); !s.ok()) return s;
  if (shape.rows % 16 != 0)
    return Status::invalid_argument("sparse24_matmul: rows (output features) " +
                                    std::to_string(shape.rows) +
                                    " must be a multiple of 16 (the tensor-core tile)");
  if (tokens < 0)
    return Status::invalid_argument("sparse24_matmul: tokens " + std::to_string(tokens) +
                                    " is negative");
  return Status::success();
}

int64_t sparse24_compress_host(const uint16_t* dense, const Sparse24Shape& shape, uint16_t* values,
                               uint32_t* meta) {
  int64_t first_violation = -1;
  const int64_t steps = shape.cols / kSparse24Step;
  for (int64_t r = 0; r < shape.rows; ++r) {
    for (int64_t s = 0; s < steps; ++s) {
      uint32_t word = 0;
      for (int j = 0; j < 8; ++j) {
        const int64_t c = s * kSparse24Step + 4 * j;
        const uint16_t* e = dense + r * shape.cols + c;
        const Sparse24Chunk chunk = sparse24_compress_chunk({e[0], e[1], e[2], e[3]});
        word |= chunk.nibble << (4 * j);
        values[r * (shape.cols / 2) + c / 2] = chunk.kept[0];
        values[r * (shape.cols / 2) + c / 2 + 1] = chunk.kept[1];
        if (chunk.over && first_violation < 0) first_violation = r * shape.cols + c;
      }
      meta[s * shape.rows + r] = word;
    }
  }
  return first_violation;
}

int64_t sparse24_decompress_host(const uint16_t* values, const uint32_t* meta,
                                 const Sparse24Shape& shape, uint16_t* dense) {
  const int64_t steps = shape.cols / kSparse24Step;
  for (int64_t r = 0; r < shape.rows; ++r) {
    for (int64_t s = 0; s < steps; ++s) {
      const uint32_t word = meta[s * shape.rows + r];
      for (int j = 0; j < 8; ++j) {
        int first = 0, second = 0;
        if (!sparse24_nibble_columns(word >> (4 * j), first, second)) return s * shape.rows + r;
        const int64_t c = s * kSparse24Step + 4 * j;
        uint16_t* out = dense + r * shape.cols + c;
        for (int i = 0; i < 4; ++i) out[i] = 0;
        out[first] = values[r * (shape.cols / 2) + c / 2];
        out[second] = values[r * (shape.cols / 2) + c / 2 + 1];
      }
    }
  }
  return -1;
}

void sparse24_matmul_host(Sparse24Dtype dtype, const uint16_t* x, int64_t tokens,
                          const uint16_t* values, const uint32_t* meta, const Sparse24Shape& shape,
                          uint16_t* y) {
  const int64_t steps = shape.cols / kSparse24Step;
  for (int64_t r = 0; r < shape.rows; ++r) {
    for (int64_t t = 0; t < tokens; ++t) {
      // As the tensor cores do in the emulation: per k-step, the running fp32 sum plus the 32
      // products over the step's dense columns (pruned ones +0) in column order, in double,
      // rounded to fp32 once.
      float sum = 0.f;
      for (int64_t s = 0; s < steps; ++s) {
        const uint32_t word = meta[s * shape.rows + r];
        float w[kSparse24Step] = {};
        for (int j = 0; j < 8; ++j) {
          int first = 0, second = 0;
          sparse24_nibble_columns(word >> (4 * j), first, second);
          const int64_t c = s * kSparse24Step + 4 * j;
          w[4 * j + first] = to_float(dtype, values[r * (shape.cols / 2) + c / 2]);
          w[4 * j + second] = to_float(dtype, values[r * (shape.cols / 2) + c / 2 + 1]);
        }
        double step_sum = sum;
        for (int k = 0; k < kSparse24Step; ++k)
          step_sum +=
              double(w[k]) * double(to_float(dtype, x[t * shape.cols + s * kSparse24Step + k]));
        sum = float(step_sum);
      }
      y[t * shape.rows + r] = from_float(dtype, sum);
    }
  }
}

}  // namespace loom::kernels
