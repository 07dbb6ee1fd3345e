// dropout_emulated: the CUDA dropout kernel (kernels/dropout/dropout.cu) run on the CPU under the
// emulation in this folder (emulated_cuda_runtime.h, transform.py, docs/gpu.md), through its
// public entry point dropout_apply, against the host reference of kernels/dropout. ctest runs it
// as kernels.dropout_emulated; a deliberately broken copy of the kernel must fail it
// (kernels.dropout_emulated_mutant, WILL_FAIL). Written by the loom authors.
//
// Per configuration and dtype (fp32, fp64, bf16, fp16), out of place and in place, with and
// without x (the mask itself): every element equals the reference's (bf16 and fp16: the fp32
// product rounded once), every output element was written (outputs start as NaN), nothing
// outside the output was (guard pages), and the emulator reported no error. Configurations:
// slices with offsets in every dimension, column offsets and widths that are no multiple of 4,
// one element, an empty tensor, and grids smaller than the work (the grid-stride loop).
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "dropout/dropout.h"
#include "emulated_test_util.h"

namespace {

using loom::kernels::DropoutDtype;
using loom::kernels::DropoutParams;

struct Config {
  int64_t size[4], offset[4], logical[4];
  double p;
  int64_t max_blocks;  // 0: the kernel's default
};

std::vector<Config> configs() {
  return {
      {{2, 3, 5, 17}, {0, 0, 0, 0}, {2, 3, 5, 17}, 0.1, 0},
      {{3, 2, 4, 10}, {5, 1, 2, 3}, {9, 4, 7, 15}, 0.5, 0},
      {{1, 1, 3, 6}, {2, 0, 1, 1}, {4, 1, 5, 9}, 0.3, 0},
      {{1, 1, 1, 1}, {7, 0, 0, 6}, {8, 1, 1, 8}, 0.25, 0},
      {{3, 2, 8, 33}, {0, 0, 8, 31}, {3, 2, 16, 70}, 0.9, 1},  // 432 groups, 256 threads loop
      {{4, 4, 4, 4}, {0, 0, 0, 0}, {4, 4, 4, 4}, 0.0, 1},
      {{2, 0, 3, 5}, {0, 0, 0, 0}, {2, 0, 3, 5}, 0.5, 0},  // empty
  };
}

DropoutParams params_of(const Config& c) {
  DropoutParams k;
  k.key[0] = 0xdeadbeefu;
  k.key[1] = 0x0badf00du;
  k.site = 13;
  k.drop_below = loom::kernels::dropout_threshold(c.p);
  k.scale = 1.0 / (1.0 - c.p);
  for (int d = 0; d < 4; ++d) {
    k.size[d] = c.size[d];
    k.offset[d] = c.offset[d];
    k.logical[d] = c.logical[d];
  }
  return k;
}

template <typename T>
constexpr DropoutDtype dtype_of() {
  if constexpr (std::is_same_v<T, float>) return DropoutDtype::kFloat32;
  if constexpr (std::is_same_v<T, double>) return DropoutDtype::kFloat64;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return DropoutDtype::kBFloat16;
  return DropoutDtype::kFloat16;
}

template <typename T>
const char* name_of() {
  if constexpr (std::is_same_v<T, float>) return "fp32";
  if constexpr (std::is_same_v<T, double>) return "fp64";
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return "bf16";
  return "fp16";
}

template <typename T>
double widen(T v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __bfloat162float(v);
  if constexpr (std::is_same_v<T, __half>) return __half2float(v);
  return double(v);
}

template <typename T>
T narrow(double v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __float2bfloat16_rn(float(v));
  if constexpr (std::is_same_v<T, __half>) return __float2half_rn(float(v));
  return T(v);
}

// What the kernel must write: the reference's mask (in the product's type: fp64 for fp64, fp32
// otherwise) times x, rounded to T once.
template <typename T>
std::vector<double> expected(const DropoutParams& k, const std::vector<T>& x, bool with_x) {
  const size_t n = size_t(k.numel());
  std::vector<double> want(n);
  if constexpr (std::is_same_v<T, double>) {
    loom::kernels::dropout_host<double>(with_x ? x.data() : nullptr, want.data(), k, 0, k.rows());
  } else {
    std::vector<float> xf(n), yf(n);
    for (size_t i = 0; i < n; ++i) xf[i] = float(widen(x[i]));
    loom::kernels::dropout_host<float>(with_x ? xf.data() : nullptr, yf.data(), k, 0, k.rows());
    for (size_t i = 0; i < n; ++i) want[i] = widen(narrow<T>(yf[i]));
  }
  return want;
}

template <typename T>
bool run(const Config& c, bool with_x, bool in_place) {
  const DropoutParams k = params_of(c);
  const size_t n = size_t(k.numel());
  std::mt19937 gen(uint32_t(n * 7 + (with_x ? 1 : 0)));
  std::normal_distribution<double> normal;
  std::vector<T> x(n);
  for (auto& v : x) v = narrow<T>(normal(gen));
  const auto want = expected<T>(k, x, with_x);

  GuardedBuffer x_buffer(n * sizeof(T)), y_buffer(n * sizeof(T));
  T* xd = static_cast<T*>(x_buffer.data());
  T* yd = in_place ? xd : static_cast<T*>(y_buffer.data());
  if (n > 0) std::memcpy(xd, x.data(), n * sizeof(T));
  if (!in_place)
    for (size_t i = 0; i < n; ++i) yd[i] = narrow<T>(std::nan(""));
  const int errors_before = emulation::error_count;
  const auto status = loom::kernels::dropout_apply(dtype_of<T>(), with_x ? xd : nullptr, yd, k,
                                                   nullptr, c.max_blocks);
  std::string problem;
  if (!status.ok()) problem = "dropout_apply: " + status.message;
  int wrong = 0, unwritten = 0;
  for (size_t i = 0; i < n && problem.empty(); ++i) {
    const double got = widen(yd[i]);
    if (std::isnan(got))
      ++unwritten;
    else if (got != want[i])
      ++wrong;
  }
  if (wrong || unwritten)
    problem = std::to_string(wrong) + " elements differ from the reference, " +
              std::to_string(unwritten) + " not written";
  if (emulation::error_count != errors_before) problem += " (emulation errors)";
  std::printf("%s  %s [%lld %lld %lld %lld] at [%lld %lld %lld %lld] of [%lld %lld %lld %lld] p %.2f"
              "%s%s%s\n",
              problem.empty() ? "ok  " : "FAIL", name_of<T>(), (long long)c.size[0],
              (long long)c.size[1], (long long)c.size[2], (long long)c.size[3],
              (long long)c.offset[0], (long long)c.offset[1], (long long)c.offset[2],
              (long long)c.offset[3], (long long)c.logical[0], (long long)c.logical[1],
              (long long)c.logical[2], (long long)c.logical[3], c.p, with_x ? "" : ", mask",
              in_place ? ", in place" : "", problem.empty() ? "" : (": " + problem).c_str());
  return problem.empty();
}

}  // namespace

int main() {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const auto start = std::chrono::steady_clock::now();
  int failed = 0, runs = 0;
  for (const Config& c : configs())
    for (const bool with_x : {true, false})
      for (const bool in_place : {false, true}) {
        if (in_place && !with_x) continue;  // in place needs an x
        failed += !run<float>(c, with_x, in_place);
        failed += !run<double>(c, with_x, in_place);
        failed += !run<__nv_bfloat16>(c, with_x, in_place);
        failed += !run<__half>(c, with_x, in_place);
        runs += 4;
      }
  // Refused, not launched: a slice outside its logical tensor.
  Config bad = configs()[0];
  bad.offset[3] = 1;
  const auto status = loom::kernels::dropout_apply(DropoutDtype::kFloat32, nullptr, &bad, params_of(bad),
                                                   nullptr);
  const bool refused = !status.ok() && status.message.find("columns") != std::string::npos;
  std::printf("%s  a slice outside the logical tensor is refused: %s\n", refused ? "ok  " : "FAIL",
              status.message.c_str());
  failed += !refused;
  return emulated_test::finish(runs + 1, failed, start);
}
