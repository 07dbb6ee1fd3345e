// quantize_emulated: the CUDA int8 quantization kernel (kernels/compression/quantize.cu) run on
// the CPU under the emulation in this folder, through its public entry point quantize_int8_apply,
// against the host reference of kernels/compression. ctest runs it as kernels.quantize_emulated;
// a deliberately broken copy of the kernel must fail it (kernels.quantize_emulated_mutant,
// WILL_FAIL). Written by the loom authors.
//
// Per configuration, with and without error feedback: codes, scales and the updated error equal
// the reference's bit for bit, every output was written (outputs start as a poison pattern),
// nothing outside them was (guard pages), and the emulator reported no error. Configurations:
// one block, blocks of very different magnitudes with an all-zero block and one holding a NaN,
// grids smaller than the work (the grid-stride loop), no values; a length that is not a multiple
// of the block is refused.
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "compression/quantize.h"
#include "emulated_test_util.h"

namespace {

using loom::kernels::kQuantBlock;

struct Config {
  int64_t blocks;
  int64_t max_blocks;  // 0: the kernel's default grid
  bool nan;            // a NaN in block 1
};

std::vector<Config> configs() {
  return {{1, 0, false}, {9, 0, false}, {9, 1, true}, {40, 2, false}, {0, 0, false}};
}

// The same bits, or both NaN (a NaN's payload may differ between host and device).
bool same_bits(float a, float b) {
  return std::memcmp(&a, &b, sizeof a) == 0 || (std::isnan(a) && std::isnan(b));
}

bool run(const Config& c, bool feedback) {
  const int64_t n = c.blocks * kQuantBlock;
  std::mt19937 gen(uint32_t(n + feedback));
  std::normal_distribution<float> normal;
  std::vector<float> x(static_cast<size_t>(n)), error(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t b = i / kQuantBlock;
    x[size_t(i)] = normal(gen) * std::pow(10.0f, float(b % 7) - 3.0f);
    error[size_t(i)] = feedback ? normal(gen) * 1e-3f * std::pow(10.0f, float(b % 7) - 3.0f) : 0;
  }
  if (c.blocks > 2) std::fill(x.begin() + 2 * kQuantBlock, x.begin() + 3 * kQuantBlock, 0.0f);
  if (c.blocks > 2 && feedback)
    std::fill(error.begin() + 2 * kQuantBlock, error.begin() + 3 * kQuantBlock, 0.0f);
  if (c.nan) x[size_t(kQuantBlock + 17)] = std::numeric_limits<float>::quiet_NaN();
  // Ties: values exactly halfway between two codes of the block's step.
  if (c.blocks > 3 && !feedback) {
    x[size_t(3 * kQuantBlock)] = 127.0f;
    x[size_t(3 * kQuantBlock + 1)] = 2.5f;
    x[size_t(3 * kQuantBlock + 2)] = -3.5f;
  }

  std::vector<int8_t> want_codes(static_cast<size_t>(n));
  std::vector<float> want_scales(static_cast<size_t>(c.blocks)), want_error = error;
  loom::kernels::quantize_int8_host(x.data(), feedback ? want_error.data() : nullptr,
                                    want_codes.data(), want_scales.data(), n, 0, c.blocks);

  const size_t fb = size_t(n) * sizeof(float);
  GuardedBuffer xb(fb), eb(fb), cb(static_cast<size_t>(n)),
      sb(static_cast<size_t>(c.blocks) * sizeof(float));
  if (n > 0) {
    std::memcpy(xb.data(), x.data(), fb);
    std::memcpy(eb.data(), error.data(), fb);
    std::memset(cb.data(), 0x5a, size_t(n));
    std::memset(sb.data(), 0xff, size_t(c.blocks) * sizeof(float));
  }
  auto* xd = static_cast<float*>(xb.data());
  auto* ed = static_cast<float*>(eb.data());
  auto* cd = static_cast<int8_t*>(cb.data());
  auto* sd = static_cast<float*>(sb.data());
  const int errors_before = emulation::error_count;
  const auto status = loom::kernels::quantize_int8_apply(xd, feedback ? ed : nullptr, cd, sd, n,
                                                         nullptr, c.max_blocks);
  std::string problem;
  if (!status.ok()) problem = "quantize_int8_apply: " + status.message;
  int wrong = 0;
  for (int64_t i = 0; i < n && problem.empty(); ++i) {
    wrong += cd[i] != want_codes[size_t(i)];
    if (feedback) wrong += !same_bits(ed[i], want_error[size_t(i)]);
  }
  for (int64_t b = 0; b < c.blocks && problem.empty(); ++b)
    wrong += !same_bits(sd[b], want_scales[size_t(b)]);
  if (wrong) problem = std::to_string(wrong) + " codes, scales or errors differ from the reference";
  if (c.nan && problem.empty() && !std::isnan(sd[1])) problem = "the NaN block's scale is finite";
  if (c.nan && feedback && problem.empty())
    for (int64_t i = kQuantBlock; i < 2 * kQuantBlock; ++i)
      if (ed[i] != 0.0f) problem = "the NaN block's error is not reset to 0";
  if (emulation::error_count != errors_before) problem += " (emulation errors)";
  std::printf("%s  %lld blocks, grid cap %lld%s%s%s\n", problem.empty() ? "ok  " : "FAIL",
              (long long)c.blocks, (long long)c.max_blocks, c.nan ? ", a NaN" : "",
              feedback ? ", error feedback" : "", problem.empty() ? "" : (": " + problem).c_str());
  return problem.empty();
}

}  // namespace

int main() {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const auto start = std::chrono::steady_clock::now();
  int failed = 0, runs = 0;
  for (const Config& c : configs())
    for (const bool feedback : {false, true}) {
      failed += !run(c, feedback);
      ++runs;
    }
  // Refused, not launched: a length that is not whole blocks.
  float dummy = 0;
  int8_t code = 0;
  const auto status =
      loom::kernels::quantize_int8_apply(&dummy, nullptr, &code, &dummy, 100, nullptr);
  const bool refused = !status.ok() && status.message.find("blocks of 256") != std::string::npos;
  std::printf("%s  100 values are refused: %s\n", refused ? "ok  " : "FAIL",
              status.message.c_str());
  failed += !refused;
  return emulated_test::finish(runs + 1, failed, start);
}
