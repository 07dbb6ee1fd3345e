// orthogonalize_emulated: PowerSGD's orthogonalisation kernel (kernels/compression/
// orthogonalize.cu) run on the CPU under the emulation in this folder, through its public entry
// point orthogonalize_apply, against the host reference of kernels/compression. ctest runs it as
// kernels.orthogonalize_emulated; a deliberately broken copy of the kernel must fail it
// (kernels.orthogonalize_emulated_mutant, WILL_FAIL). Written by the loom authors.
//
// Per configuration: the matrices the kernel leaves equal the reference's bit for bit; the values
// between and around the matrices are untouched (a sentinel, and guard pages around the buffer);
// the emulator reported no error (its barrier and shared-memory race checks included).
// Configurations: ranks 1 to 32, matrices of 1 to 1000 rows (fewer rows than threads, a partial
// last turn of the row loop, several turns), a zero column, a column that depends on the ones
// before it, a NaN, a grid of fewer CUDA blocks than matrices (the grid-stride loop), no
// matrices; a rank of 0 or 33 is refused.
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "compression/orthogonalize.h"
#include "emulated_test_util.h"

namespace {

struct Config {
  std::vector<int64_t> rows;
  int64_t rank;
  int64_t max_blocks;  // 0: the kernel's default grid
  bool special;        // matrix 0: column 1 zero, column 2 = 3 x column 0; the last: a NaN
};

std::vector<Config> configs() {
  return {{{5}, 1, 0, false},    {{300, 1, 257}, 4, 0, true}, {{1000, 64, 200, 31}, 7, 2, true},
          {{100}, 32, 0, false}, {{40, 40, 40}, 3, 1, false}, {{}, 2, 0, false}};
}

bool same_bits(float a, float b) {
  return std::memcmp(&a, &b, sizeof a) == 0 || (std::isnan(a) && std::isnan(b));
}

constexpr int64_t kGap = 3;  // sentinel values between matrices
constexpr float kSentinel = 12345.5f;

bool run(const Config& c) {
  const int64_t r = c.rank, matrices = int64_t(c.rows.size());
  std::vector<int64_t> offsets;
  int64_t total = kGap;
  for (const int64_t n : c.rows) {
    offsets.push_back(total);
    total += n * r + kGap;
  }
  std::mt19937 gen(uint32_t(total * 31 + r));
  std::normal_distribution<float> normal;
  std::vector<float> data(size_t(total), kSentinel);
  for (int64_t m = 0; m < matrices; ++m)
    for (int64_t k = 0; k < c.rows[size_t(m)] * r; ++k)
      data[size_t(offsets[size_t(m)] + k)] = normal(gen) * std::pow(10.0f, float(m % 3) - 1.0f);
  if (c.special && matrices > 0 && r >= 3) {
    float* p = data.data() + offsets[0];
    for (int64_t k = 0; k < c.rows[0]; ++k) {
      p[k * r + 1] = 0.0f;
      p[k * r + 2] = 3.0f * p[k * r];
    }
  }
  if (c.special && matrices > 1)
    data[size_t(offsets.back() + r / 2)] = std::numeric_limits<float>::quiet_NaN();

  std::vector<float> want = data;
  loom::kernels::orthogonalize_host(want.data(), offsets.data(), c.rows.data(), r, 0, matrices);

  GuardedBuffer db, ob, rb;
  float* d = emulated_test::guarded_copy(db, data);
  const int64_t* od = emulated_test::guarded_copy(ob, offsets);
  const int64_t* rd = emulated_test::guarded_copy(rb, c.rows);
  const int errors_before = emulation::error_count;
  std::string problem;
  const auto status =
      loom::kernels::orthogonalize_apply(d, od, rd, r, matrices, nullptr, c.max_blocks);
  if (!status.ok()) problem = "orthogonalize_apply: " + status.message;
  int64_t wrong = 0;
  for (int64_t i = 0; i < total && problem.empty(); ++i) wrong += !same_bits(d[i], want[size_t(i)]);
  if (wrong) problem = std::to_string(wrong) + " values differ from the reference";
  // The reference itself: column 1 of the special matrix stays zero (the kernel equals it, so
  // this checks both). The sentinels between the matrices are part of the bit-for-bit comparison.
  if (problem.empty() && c.special && matrices > 0 && r >= 3)
    for (int64_t k = 0; k < c.rows[0]; ++k)
      if (want[size_t(offsets[0] + k * r + 1)] != 0.0f) problem = "the zero column changed";
  if (emulation::error_count != errors_before) problem += " (emulation errors)";
  std::printf("%s  %lld matrices, rank %lld, grid cap %lld%s%s\n",
              problem.empty() ? "ok  " : "FAIL", (long long)matrices, (long long)r,
              (long long)c.max_blocks, c.special ? ", a zero and a dependent column, a NaN" : "",
              problem.empty() ? "" : (": " + problem).c_str());
  return problem.empty();
}

}  // namespace

int main() {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const auto start = std::chrono::steady_clock::now();
  auto [runs, failed] = emulated_test::run_each(configs(), run);
  float dummy = 0;
  const int64_t zero = 0;
  for (const int64_t rank : {int64_t(0), int64_t(33)}) {
    const auto status = loom::kernels::orthogonalize_apply(&dummy, &zero, &zero, rank, 1, nullptr);
    const bool refused =
        !status.ok() && status.message.find("outside [1, 32]") != std::string::npos;
    std::printf("%s  rank %lld is refused: %s\n", refused ? "ok  " : "FAIL", (long long)rank,
                status.message.c_str());
    failed += !refused;
    ++runs;
  }
  return emulated_test::finish(runs, failed, start);
}
