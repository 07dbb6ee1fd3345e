// bsr_emulated: the block-sparse product (kernels/sparse/bsr.cu, mma.sync on the kept tiles) run
// on the CPU under the emulation in this folder (emulated_cuda_runtime.h, emulated_ptx.h,
// transform.py, docs/gpu.md), through bsr_matmul, against the host reference of kernels/sparse.
// ctest runs it as kernels.bsr_emulated; a deliberately broken copy must fail it
// (kernels.bsr_emulated_mutant, WILL_FAIL). Written by the loom authors.
//
// Per block size (32, 64), dtype (bf16, fp16) and shape: weights with a random subset of tiles
// kept (some tile rows empty, one fully dense), token counts that leave partial blocks, no tokens.
// y equals the reference bit for bit (the reference sums in the emulated tensor cores' order),
// every element of y is written (y starts as NaN), nothing outside it is (guard pages), y is within
// the stated bound of the fp64 product, and the emulator reports no error.
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "emulated_test_util.h"
#include "sparse/bsr.h"

namespace {

namespace k = loom::kernels;
using k::BsrDtype;
using k::BsrShape;

using emulated_test::guarded_copy;
using emulated_test::kNaN16;

// `kept` of every tile kept at random; tile row 1 (when there is one) empty, the last one full.
bool run(BsrDtype dtype, const BsrShape& s, int64_t tokens, double kept, uint32_t seed) {
  const int errors_before = emulation::error_count;
  const bool bf16 = dtype == BsrDtype::kBFloat16;
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<double> uniform;
  const int64_t b = s.block, tile_rows = s.rows / b, tile_cols = s.cols / b;
  std::vector<uint16_t> dense(size_t(s.rows * s.cols), 0);
  for (int64_t r = 0; r < tile_rows; ++r)
    for (int64_t c = 0; c < tile_cols; ++c) {
      const bool keep = r == tile_rows - 1 || (r != 1 && uniform(gen) < kept);
      if (!keep) continue;
      for (int64_t i = 0; i < b; ++i)
        for (int64_t j = 0; j < b; ++j)
          dense[size_t((r * b + i) * s.cols + c * b + j)] =
              emulated_test::from_float(bf16, normal(gen));
    }
  const auto bsr = k::bsr_from_dense_host(dense.data(), s);
  std::vector<uint16_t> x(size_t(tokens * s.cols));
  for (auto& e : x) e = emulated_test::from_float(bf16, normal(gen));
  std::vector<uint16_t> want(size_t(tokens * s.rows));
  k::bsr_matmul_host(dtype, x.data(), tokens, bsr.row_start.data(), bsr.tile_col.data(),
                     bsr.values.data(), s, want.data());

  GuardedBuffer xb, rb, cb, vb, yb;
  const uint16_t* x_d = guarded_copy(xb, x);
  const int32_t* rows_d = guarded_copy(rb, bsr.row_start);
  const int32_t* cols_d = guarded_copy(cb, bsr.tile_col);
  const uint16_t* values_d = guarded_copy(vb, bsr.values);
  uint16_t* y_d = guarded_copy(yb, std::vector<uint16_t>(want.size(), kNaN16));
  const auto status = k::bsr_matmul(dtype, x_d, tokens, rows_d, cols_d, values_d, s, y_d, nullptr);
  std::string problem;
  if (!status.ok()) problem = "bsr_matmul: " + status.message;
  // One fp32 rounding of the running sum per 16 columns (each mma).
  double worst = 0;
  if (problem.empty())
    problem = emulated_test::check_product(bf16, y_d, want, x, dense, tokens, s.rows, s.cols,
                                           s.cols / 16, &worst);
  if (emulation::error_count != errors_before) problem += " (emulation errors)";
  std::printf(
      "%s  %s block %lld: [%lld tokens x %lld] x [%lld x %lld]^T, %zu of %lld tiles kept "
      "(worst |y - exact| / sum|w x| %.2e)%s\n",
      problem.empty() ? "ok  " : "FAIL", bf16 ? "bf16" : "fp16", (long long)b, (long long)tokens,
      (long long)s.cols, (long long)s.rows, (long long)s.cols, bsr.tile_col.size(),
      (long long)(tile_rows * tile_cols), worst, problem.empty() ? "" : (": " + problem).c_str());
  return problem.empty();
}

}  // namespace

int main() {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const auto start = std::chrono::steady_clock::now();
  struct Case {
    BsrShape shape;
    int64_t tokens;
    double kept;
  };
  const Case cases[] = {
      {{32, 32, 32}, 1, 1.0},   {{96, 128, 32}, 130, 0.4}, {{128, 64, 32}, 0, 0.5},
      {{64, 128, 64}, 70, 0.5}, {{192, 192, 64}, 64, 0.3}, {{64, 64, 64}, 5, 1.0},
  };
  int failed = 0, runs = 0;
  for (const auto& c : cases)
    for (const auto dtype : {BsrDtype::kBFloat16, BsrDtype::kFloat16}) {
      failed += !run(dtype, c.shape, c.tokens, c.kept,
                     uint32_t(c.shape.rows * 7 + c.shape.cols + c.shape.block + c.tokens));
      ++runs;
    }
  const auto bad_block = k::bsr_matmul(BsrDtype::kBFloat16, nullptr, 4, nullptr, nullptr, nullptr,
                                       {48, 48, 48}, nullptr, nullptr);
  const auto bad_shape = k::bsr_matmul(BsrDtype::kBFloat16, nullptr, 4, nullptr, nullptr, nullptr,
                                       {96, 80, 32}, nullptr, nullptr);
  const bool refused = !bad_block.ok() && bad_block.message.find("48") != std::string::npos &&
                       !bad_shape.ok() && bad_shape.message.find("96 x 80") != std::string::npos;
  std::printf("%s  block 48 and a weight of 96 x 80 in 32-blocks are refused: %s / %s\n",
              refused ? "ok  " : "FAIL", bad_block.message.c_str(), bad_shape.message.c_str());
  failed += !refused;
  return emulated_test::finish(runs + 1, failed, start);
}
