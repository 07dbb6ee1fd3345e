// sparse24_emulated: the 2:4 sparse kernels (kernels/sparse/sparse24.cu: compression and the
// mma.sp product) run on the CPU under the emulation in this folder (emulated_cuda_runtime.h,
// emulated_ptx_mma.h for mma.sp, transform.py, docs/gpu.md), through their public entry points,
// against the host references of kernels/sparse. ctest runs it as kernels.sparse24_emulated; a
// deliberately broken copy of the kernel must fail it (kernels.sparse24_emulated_mutant,
// WILL_FAIL). Written by the loom authors.
//
// Compression: values and metadata equal the reference's bit for bit, on weights whose chunks have
// 0, 1 and 2 nonzeros (and -0), and the first chunk with three or four nonzeros is reported as the
// reference reports it. Product, bf16 and fp16, on shapes with partial row and token blocks, one
// k-step and many, and no tokens: y equals the reference's bit for bit (the reference sums in the
// emulated tensor cores' order), every element of y is written (y starts as NaN), nothing outside
// it is (guard pages), and y is within the stated bound of the fp64 product; the emulator reports
// no error (which includes metadata that is not an ordered pair reaching mma.sp).
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "emulated_test_util.h"
#include "sparse/sparse24.h"

namespace {

namespace k = loom::kernels;
using k::Sparse24Dtype;
using k::Sparse24Shape;

using emulated_test::guarded_copy;
using emulated_test::kNaN16;

uint16_t from_float(Sparse24Dtype dtype, float v) {
  return emulated_test::from_float(dtype == Sparse24Dtype::kBFloat16, v);
}

// A 2:4 weight: per chunk 0, 1 or 2 nonzeros at random columns (mostly 2), a few -0 zeros; with
// `violations`, that many chunks get a third nonzero.
std::vector<uint16_t> random_weight(Sparse24Dtype dtype, const Sparse24Shape& s, uint32_t seed,
                                    int violations = 0) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal;
  std::vector<uint16_t> w(size_t(s.rows * s.cols), 0);
  for (int64_t chunk = 0; chunk < s.rows * s.cols / 4; ++chunk) {
    const int kept = int(gen() % 8) < 6 ? 2 : int(gen() % 2);
    int taken = 0;
    while (taken < kept) {
      const int c = int(gen() % 4);
      uint16_t& e = w[size_t(chunk * 4 + c)];
      if (e != 0) continue;
      e = from_float(dtype, normal(gen));
      if ((e & 0x7fff) == 0) e = from_float(dtype, 0.5f);
      ++taken;
    }
    for (int c = 0; c < 4; ++c)
      if (w[size_t(chunk * 4 + c)] == 0 && gen() % 5 == 0) w[size_t(chunk * 4 + c)] = 0x8000;
  }
  for (int v = 0; v < violations; ++v) {
    const int64_t chunk = int64_t(gen() % uint32_t(s.rows * s.cols / 4));
    for (int c = 0; c < 3; ++c) w[size_t(chunk * 4 + c)] = from_float(dtype, 1.0f + c);
  }
  return w;
}

bool report(const std::string& what, const std::string& problem, int errors_before) {
  std::string p = problem;
  if (emulation::error_count != errors_before) p += " (emulation errors)";
  std::printf("%s  %s%s\n", p.empty() ? "ok  " : "FAIL", what.c_str(),
              p.empty() ? "" : (": " + p).c_str());
  return p.empty();
}

bool compress_case(const Sparse24Shape& s, int violations, uint32_t seed) {
  const int errors_before = emulation::error_count;
  const auto dense = random_weight(Sparse24Dtype::kBFloat16, s, seed, violations);
  std::vector<uint16_t> want_values(size_t(k::sparse24_values_size(s)));
  std::vector<uint32_t> want_meta(size_t(k::sparse24_meta_size(s)));
  const int64_t want_violation =
      k::sparse24_compress_host(dense.data(), s, want_values.data(), want_meta.data());

  GuardedBuffer dense_buffer, values_buffer, meta_buffer, violation_buffer;
  const uint16_t* dense_d = guarded_copy(dense_buffer, dense);
  uint16_t* values_d =
      guarded_copy(values_buffer, std::vector<uint16_t>(want_values.size(), kNaN16));
  uint32_t* meta_d = guarded_copy(meta_buffer, std::vector<uint32_t>(want_meta.size(), ~0u));
  int64_t* violation_d = guarded_copy(violation_buffer, std::vector<int64_t>{-1});
  *violation_d = s.rows * s.cols;  // the caller's "none yet"
  const auto status = k::sparse24_compress(dense_d, s, values_d, meta_d, violation_d, nullptr);
  std::string problem;
  if (!status.ok()) problem = "sparse24_compress: " + status.message;
  const int64_t got_violation = *violation_d == s.rows * s.cols ? -1 : *violation_d;
  if (problem.empty() && (std::memcmp(values_d, want_values.data(), want_values.size() * 2) != 0 ||
                          std::memcmp(meta_d, want_meta.data(), want_meta.size() * 4) != 0))
    problem = "values or metadata differ from the reference";
  if (problem.empty() && got_violation != want_violation)
    problem = "first violation " + std::to_string(got_violation) + ", the reference says " +
              std::to_string(want_violation);
  if (problem.empty() && (violations > 0) != (want_violation >= 0))
    problem = "the reference missed the planted violations";
  // Round trip: decompressing gives the dense weight back (2:4 weights only; -0 may come back +0).
  if (problem.empty() && violations == 0) {
    std::vector<uint16_t> back(dense.size());
    if (k::sparse24_decompress_host(want_values.data(), want_meta.data(), s, back.data()) != -1)
      problem = "decompress refused the metadata";
    for (size_t i = 0; i < back.size() && problem.empty(); ++i)
      if ((back[i] & 0x7fff) != 0 || (dense[i] & 0x7fff) != 0)
        if (back[i] != dense[i]) problem = "decompress differs at " + std::to_string(i);
  }
  return report("compress [" + std::to_string(s.rows) + " x " + std::to_string(s.cols) + "], " +
                    std::to_string(violations) + " planted violations",
                problem, errors_before);
}

bool matmul_case(Sparse24Dtype dtype, const Sparse24Shape& s, int64_t tokens, uint32_t seed) {
  const int errors_before = emulation::error_count;
  const auto dense = random_weight(dtype, s, seed);
  std::vector<uint16_t> values(size_t(k::sparse24_values_size(s)));
  std::vector<uint32_t> meta(size_t(k::sparse24_meta_size(s)));
  k::sparse24_compress_host(dense.data(), s, values.data(), meta.data());
  std::mt19937 gen(seed + 1);
  std::normal_distribution<float> normal;
  std::vector<uint16_t> x(size_t(tokens * s.cols));
  for (auto& e : x) e = from_float(dtype, normal(gen));
  std::vector<uint16_t> want(size_t(tokens * s.rows));
  k::sparse24_matmul_host(dtype, x.data(), tokens, values.data(), meta.data(), s, want.data());

  GuardedBuffer x_buffer, values_buffer, meta_buffer, y_buffer;
  const uint16_t* x_d = guarded_copy(x_buffer, x);
  const uint16_t* values_d = guarded_copy(values_buffer, values);
  const uint32_t* meta_d = guarded_copy(meta_buffer, meta);
  uint16_t* y_d = guarded_copy(y_buffer, std::vector<uint16_t>(want.size(), kNaN16));
  const auto status = k::sparse24_matmul(dtype, x_d, tokens, values_d, meta_d, s, y_d, nullptr);
  std::string problem;
  if (!status.ok()) problem = "sparse24_matmul: " + status.message;
  // One fp32 rounding of the running sum per 32-column k-step.
  double worst = 0;
  if (problem.empty())
    problem =
        emulated_test::check_product(dtype == Sparse24Dtype::kBFloat16, y_d, want, x, dense, tokens,
                                     s.rows, s.cols, s.cols / k::kSparse24Step, &worst);
  char what[160];
  std::snprintf(what, sizeof what,
                "matmul %s: [%lld tokens x %lld] x [%lld x %lld]^T (worst "
                "|y - exact| / sum|w x| %.2e)",
                dtype == Sparse24Dtype::kBFloat16 ? "bf16" : "fp16", (long long)tokens,
                (long long)s.cols, (long long)s.rows, (long long)s.cols, worst);
  return report(what, problem, errors_before);
}

}  // namespace

int main() {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const auto start = std::chrono::steady_clock::now();
  int failed = 0, runs = 0;
  const Sparse24Shape compress_shapes[] = {{16, 32}, {37, 96}, {300, 64}, {5, 0}};
  for (const auto& s : compress_shapes)
    for (const int violations : {0, 3}) {
      if (violations > 0 && s.cols == 0) continue;
      failed += !compress_case(s, violations, uint32_t(s.rows * 31 + s.cols + violations));
      ++runs;
    }
  struct MatmulCase {
    Sparse24Shape shape;
    int64_t tokens;
  };
  // Partial row blocks (144, 48 of 128), partial token blocks (130, 7), one k-step and ten, one
  // row tile of 16, no tokens, no columns.
  const MatmulCase cases[] = {{{16, 32}, 1},    {{128, 64}, 128}, {{144, 96}, 130}, {{48, 320}, 7},
                              {{256, 32}, 200}, {{32, 64}, 0},    {{32, 0}, 5}};
  for (const auto& c : cases)
    for (const auto dtype : {Sparse24Dtype::kBFloat16, Sparse24Dtype::kFloat16}) {
      failed += !matmul_case(dtype, c.shape, c.tokens,
                             uint32_t(c.shape.rows * 131 + c.shape.cols * 7 + c.tokens));
      ++runs;
    }
  // Refused before any launch, with the value named.
  const auto bad_rows = k::sparse24_matmul(Sparse24Dtype::kBFloat16, nullptr, 4, nullptr, nullptr,
                                           {24, 32}, nullptr, nullptr);
  const auto bad_cols = k::sparse24_compress(nullptr, {16, 48}, nullptr, nullptr, nullptr, nullptr);
  const bool refused = !bad_rows.ok() && bad_rows.message.find("24") != std::string::npos &&
                       !bad_cols.ok() && bad_cols.message.find("48") != std::string::npos;
  std::printf("%s  rows 24 and cols 48 are refused: %s / %s\n", refused ? "ok  " : "FAIL",
              bad_rows.message.c_str(), bad_cols.message.c_str());
  failed += !refused;
  return emulated_test::finish(runs + 1, failed, start);
}
