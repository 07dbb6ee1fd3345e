// sign_pack_emulated: the CUDA sign compression kernels (kernels/compression/sign_pack.cu) run on
// the CPU under the emulation in this folder, through their public entry points sign_pack_apply
// and sign_unpack_apply, against the host reference of kernels/compression. ctest runs it as
// kernels.sign_pack_emulated; a deliberately broken copy of the kernels must fail it
// (kernels.sign_pack_emulated_mutant, WILL_FAIL). Written by the loom authors.
//
// Per configuration, with and without error feedback: the words, scales and updated error of
// pack, and the values unpack decodes from them, equal the reference's bit for bit; every output
// was written (outputs start as a poison pattern), nothing outside them was (guard pages), and the
// emulator reported no error. Configurations: one block, blocks of very different magnitudes with
// an all-zero block (zero and -0 send +scale), one holding a NaN, grids of fewer warps than blocks
// (the grid-stride loop), no values; a length that is not a multiple of the block is refused.
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "compression/sign_pack.h"
#include "emulated_test_util.h"

namespace {

using loom::kernels::kSignBlock;
using loom::kernels::kSignWordsPerBlock;

struct Config {
  int64_t blocks;
  int64_t max_blocks;  // 0: the kernels' default grid
  bool nan;            // a NaN in block 1
};

std::vector<Config> configs() {
  // A grid of one CUDA block is 8 warps: 9 blocks make one warp loop; 20 on 2 CUDA blocks too.
  return {{1, 0, false}, {9, 0, false}, {9, 1, true}, {20, 2, false}, {0, 0, false}};
}

// The same bits, or both NaN (a NaN's payload may differ between host and device).
bool same_bits(float a, float b) {
  return std::memcmp(&a, &b, sizeof a) == 0 || (std::isnan(a) && std::isnan(b));
}

bool run(const Config& c, bool feedback) {
  const int64_t n = c.blocks * kSignBlock, words = n / 32;
  std::mt19937 gen(uint32_t(n + feedback));
  std::normal_distribution<float> normal;
  std::vector<float> x(static_cast<size_t>(n)), error(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const float magnitude = std::pow(10.0f, float((i / kSignBlock) % 7) - 3.0f);
    x[size_t(i)] = normal(gen) * magnitude;
    error[size_t(i)] = feedback ? normal(gen) * 0.3f * magnitude : 0.0f;
  }
  if (c.blocks > 2) {
    std::fill(x.begin() + 2 * kSignBlock, x.begin() + 3 * kSignBlock, 0.0f);
    std::fill(error.begin() + 2 * kSignBlock, error.begin() + 3 * kSignBlock, 0.0f);
    x[size_t(2 * kSignBlock + 5)] = -0.0f;
  }
  if (c.nan) x[size_t(kSignBlock + 17)] = std::numeric_limits<float>::quiet_NaN();

  std::vector<uint32_t> want_words(static_cast<size_t>(words));
  std::vector<float> want_scales(static_cast<size_t>(c.blocks)),
      want_error = error, want_values(static_cast<size_t>(n));
  loom::kernels::sign_pack_host(x.data(), feedback ? want_error.data() : nullptr, want_words.data(),
                                want_scales.data(), n, 0, c.blocks);
  loom::kernels::sign_unpack_host(want_words.data(), want_scales.data(), want_values.data(), n, 0,
                                  c.blocks);

  const size_t fb = size_t(n) * sizeof(float);
  GuardedBuffer xb(fb), eb(fb), wb(size_t(words) * 4), sb(size_t(c.blocks) * sizeof(float)), vb(fb);
  if (n > 0) {
    std::memcpy(xb.data(), x.data(), fb);
    std::memcpy(eb.data(), error.data(), fb);
    std::memset(wb.data(), 0x5a, size_t(words) * 4);
    std::memset(sb.data(), 0xff, size_t(c.blocks) * sizeof(float));
    std::memset(vb.data(), 0xff, fb);
  }
  auto* xd = static_cast<float*>(xb.data());
  auto* ed = static_cast<float*>(eb.data());
  auto* wd = static_cast<uint32_t*>(wb.data());
  auto* sd = static_cast<float*>(sb.data());
  auto* vd = static_cast<float*>(vb.data());
  const int errors_before = emulation::error_count;
  std::string problem;
  auto status =
      loom::kernels::sign_pack_apply(xd, feedback ? ed : nullptr, wd, sd, n, nullptr, c.max_blocks);
  if (!status.ok()) problem = "sign_pack_apply: " + status.message;
  int wrong = 0;
  for (int64_t w = 0; w < words && problem.empty(); ++w) wrong += wd[w] != want_words[size_t(w)];
  for (int64_t b = 0; b < c.blocks && problem.empty(); ++b)
    wrong += !same_bits(sd[b], want_scales[size_t(b)]);
  for (int64_t i = 0; feedback && i < n && problem.empty(); ++i)
    wrong += !same_bits(ed[i], want_error[size_t(i)]);
  if (wrong) problem = std::to_string(wrong) + " words, scales or errors differ from the reference";
  if (problem.empty()) {
    // Unpack what the reference packed, so that a wrong pack cannot hide a wrong unpack.
    std::memcpy(wd, want_words.data(), size_t(words) * 4);
    std::memcpy(sd, want_scales.data(), size_t(c.blocks) * sizeof(float));
    status = loom::kernels::sign_unpack_apply(wd, sd, vd, n, nullptr, c.max_blocks);
    if (!status.ok()) problem = "sign_unpack_apply: " + status.message;
    for (int64_t i = 0; i < n && problem.empty(); ++i)
      wrong += !same_bits(vd[i], want_values[size_t(i)]);
    if (wrong) problem = std::to_string(wrong) + " unpacked values differ from the reference";
  }
  if (c.nan && problem.empty() && !std::isnan(sd[1])) problem = "the NaN block's scale is finite";
  if (c.nan && feedback && problem.empty())
    for (int64_t i = kSignBlock; i < 2 * kSignBlock; ++i)
      if (ed[i] != 0.0f) problem = "the NaN block's error is not reset to 0";
  if (c.blocks > 2 && problem.empty() &&
      (wd[2 * kSignWordsPerBlock] != 0xffffffffu || sd[2] != 0.0f))
    problem = "the zero block (with a -0) does not send every sign positive with scale 0";
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
  uint32_t word = 0;
  const auto status = loom::kernels::sign_pack_apply(&dummy, nullptr, &word, &dummy, 100, nullptr);
  const bool refused = !status.ok() && status.message.find("blocks of 1024") != std::string::npos;
  std::printf("%s  100 values are refused: %s\n", refused ? "ok  " : "FAIL",
              status.message.c_str());
  failed += !refused;
  return emulated_test::finish(runs + 1, failed, start);
}
