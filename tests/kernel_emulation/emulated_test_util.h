#pragma once
// What the kernel-emulation test programs share (tests/kernel_emulation): 16-bit element bits,
// buffers compared bit for bit,
// guarded copies of host data, the check of a product y = x W^T against its host reference and
// fp64 value, and the closing summary line. Written by the loom authors.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "common/float16.h"
#include "common/host_elements.h"
#include "common/status.h"
#include "emulated_cuda_runtime.h"
#include "guarded_buffer.h"

namespace emulated_test {

// Elements of two buffers of `n` elements of `dtype` whose bits differ (a NaN in both counts as
// equal: the emulated kernel and the host reference may carry different NaN payloads).
inline int64_t count_differ(loom::kernels::ElementDtype dtype, const void* got, const void* want,
                            int64_t n) {
  int64_t differ = 0;
  const size_t size = size_t(loom::kernels::element_size(dtype));
  for (int64_t i = 0; i < n; ++i) {
    const auto* g = static_cast<const unsigned char*>(got) + size_t(i) * size;
    const auto* w = static_cast<const unsigned char*>(want) + size_t(i) * size;
    const bool nan = std::isnan(loom::kernels::load_element<double>(dtype, got, i)) &&
                     std::isnan(loom::kernels::load_element<double>(dtype, want, i));
    differ += !(std::memcmp(g, w, size) == 0 || nan);
  }
  return differ;
}

inline constexpr uint16_t kNaN16 = 0x7FFF;  // a NaN in both bf16 and fp16

inline float to_float(bool bf16, uint16_t bits) {
  return bf16 ? loom::kernels::bf16_to_float(bits) : loom::kernels::fp16_to_float(bits);
}

inline uint16_t from_float(bool bf16, float v) {
  return bf16 ? loom::kernels::float_to_bf16(v) : loom::kernels::float_to_fp16(v);
}

// A copy of `v` in a fresh guarded buffer (at least one element, so a pointer exists).
template <typename T>
T* guarded_copy(GuardedBuffer& buffer, const std::vector<T>& v) {
  buffer = GuardedBuffer(std::max<size_t>(v.size(), 1) * sizeof(T));
  T* p = static_cast<T*>(buffer.data());
  if (!v.empty()) std::memcpy(p, v.data(), v.size() * sizeof(T));
  return p;
}

// y [tokens, rows] (the kernel's) against want (the host reference's, bit for bit) and against
// the fp64 product of x [tokens, cols] and the dense w [rows, cols]: within one rounding to the
// element type (2^-8 of |y| in bf16, 2^-11 in fp16, with 1% for the fp32 error under it) plus
// `roundings` fp32 roundings of the running sum (each 2^-24 of sum |w x|) and the double sums
// (2^-53 per term). Every element must be written (y starts as NaN). Returns "" or what failed;
// *worst gets the largest |y - exact| / sum |w x|.
inline std::string check_product(bool bf16, const uint16_t* y, const std::vector<uint16_t>& want,
                                 const std::vector<uint16_t>& x, const std::vector<uint16_t>& w,
                                 int64_t tokens, int64_t rows, int64_t cols, int64_t roundings,
                                 double* worst) {
  int64_t differ = 0, unwritten = 0, out_of_bound = 0;
  *worst = 0;
  const double unit = bf16 ? 0x1p-8 : 0x1p-11;
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t r = 0; r < rows; ++r) {
      const uint16_t got = y[t * rows + r];
      if (std::isnan(to_float(bf16, got))) ++unwritten;
      if (got != want[size_t(t * rows + r)]) ++differ;
      double exact = 0, magnitude = 0;
      for (int64_t c = 0; c < cols; ++c) {
        const double p = double(to_float(bf16, w[size_t(r * cols + c)])) *
                         double(to_float(bf16, x[size_t(t * cols + c)]));
        exact += p;
        magnitude += std::fabs(p);
      }
      // |y - exact| <= u |exact| + (1 + u) E, with 1% on each term.
      const double bound =
          unit * std::fabs(exact) * 1.01 +
          1.01 * (double(roundings) * 0x1p-24 + double(cols) * 0x1p-53) * magnitude + 1e-30;
      const double error = std::fabs(double(to_float(bf16, got)) - exact);
      if (error > bound) ++out_of_bound;
      if (magnitude > 0) *worst = std::max(*worst, error / magnitude);
    }
  if (!differ && !unwritten && !out_of_bound) return "";
  return std::to_string(differ) + " elements differ from the reference, " +
         std::to_string(unwritten) + " not written, " + std::to_string(out_of_bound) +
         " outside the fp64 bound";
}

// Whether `s` refuses a call with a message containing `needle`; prints the line either way.
inline bool refused(const loom::kernels::Status& s, const char* needle, const char* what) {
  const bool ok = !s.ok() && s.message.find(needle) != std::string::npos;
  std::printf("%s  %s is refused: %s\n", ok ? "ok  " : "FAIL", what, s.message.c_str());
  return ok;
}

// How many runs a program made and how many failed, for finish().
struct Tally {
  int runs = 0;
  int failed = 0;
};

// run(config) for each configuration.
template <typename Config, typename Run>
Tally run_each(const std::vector<Config>& configs, Run&& run) {
  Tally t;
  for (const Config& c : configs) {
    t.failed += !run(c);
    ++t.runs;
  }
  return t;
}

// The closing line, and the exit status: 0 when nothing failed and the emulator saw no error.
inline int finish(int runs, int failed, std::chrono::steady_clock::time_point start) {
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("%d runs, %d failed, %d emulation errors; %ld blocks emulated in %.1f s\n", runs,
              failed, emulation::error_count, emulation::blocks_run, seconds);
  return failed > 0 || emulation::error_count > 0 ? 1 : 0;
}

}  // namespace emulated_test
